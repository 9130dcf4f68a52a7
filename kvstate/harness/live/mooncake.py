"""A :class:`~kvstate.harness.sim.store.Store` over Mooncake's ``MooncakeDistributedStore``.

One client per rank; each client contributes a segment to the store and puts
its keys there (``preferred_segment``). Puts and gets are zero-copy from and
into caller memory (the staging area registered with :meth:`register`, or
any host memory over TCP). Whole-call failures (master unreachable, -900)
raise :class:`~kvstate.harness.sim.store.StoreError`; per-key codes come back as
Mooncake returns them (0, a byte count, or a negative code such as -200 for
a full store).

The client kills the process (SIGSEGV) if used after ``close()``; this class
refuses with :class:`~kvstate.harness.sim.store.StoreClosed` instead.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from kvstate.harness.sim import store as st

from .master import MasterAddress


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class MooncakeStore:
    """One rank's client of a Mooncake store."""

    def __init__(
        self,
        master: MasterAddress,
        *,
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 0,
        protocol: str = "tcp",
    ) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self._client: Any = MooncakeDistributedStore()
        rc = self._client.setup(
            "localhost",
            master.metadata_url,
            segment_bytes,
            local_buffer_bytes,
            protocol,
            "",
            master.rpc_address,
        )
        if rc != 0:
            raise st.StoreError(rc, f"Mooncake client setup against {master.rpc_address}")
        self._config = ReplicateConfig()
        # Each rank puts into its own segment (it stays local and survives
        # other ranks closing).
        self._config.preferred_segment = self._client.get_hostname()
        self._lock = threading.Lock()
        self._closed = False
        self._registered: list[int] = []

    def _live(self) -> Any:
        if self._closed:
            raise st.StoreClosed("Mooncake store used after close()")
        return self._client

    def register(self, view: memoryview) -> None:
        """Register a staging area so puts from it need no copy."""
        with self._lock:
            ptr = address_of(view)
            rc = self._live().register_buffer(ptr, len(view))
            if rc != 0:
                raise st.StoreError(rc, "register_buffer")
            self._registered.append(ptr)

    def batch_exist(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            codes = self._live().batch_is_exist(list(keys))
        bad = [c for c in codes if c < 0]
        if bad:
            raise st.StoreError(bad[0], "batch_is_exist")
        return [c == 1 for c in codes]

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        ptrs = [address_of(b) for b in buffers]
        sizes = [len(b) for b in buffers]
        with self._lock:
            return list(self._live().batch_put_from(list(keys), ptrs, sizes, self._config))

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        ptrs = [address_of(b) for b in buffers]
        sizes = [len(b) for b in buffers]
        with self._lock:
            return list(self._live().batch_get_into(list(keys), ptrs, sizes))

    def remove(self, key: str) -> int:
        with self._lock:
            return int(self._live().remove(key))

    def close(self) -> None:
        """Close the client (takes a second or two); later calls raise StoreClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for ptr in self._registered:
                self._client.unregister_buffer(ptr)
            self._client.close()
            # Drop the native object now: its destructor logs and tears down
            # at this point, not at interpreter exit after everything else.
            self._client = None
