"""Reading KV-cache bytes where they live, for the fingerprint audit.

vLLM's Mooncake token database hands the store raw addresses: a KV cache
tensor's ``data_ptr()`` plus a block's offset. On a CPU engine those point
into this process's memory and the audit hashes them in place, without a
copy. On a CUDA engine they are device pointers: read from the CPU, the
process dies of a fault no ``try`` can catch, and vLLM's worker with it.

So the audit reads through :class:`KvMemory`, built from the KV cache
tensors the worker registered: a segment in a host tensor is read in place;
a segment in a tensor on another device is read through torch, on that
device, into a host copy; a segment that lies in no registered tensor is
never read (:class:`UnreadableMemory`). The observer then turns its
fingerprints off, with the reason in the log, and journals on.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Iterable, Iterator, Sequence
from typing import Any


class UnreadableMemory(Exception):
    """Bytes the audit was asked to read lie in no KV cache tensor it can read."""


class KvMemory:
    """The KV cache tensors of one rank: where each one's storage lies, on which device."""

    def __init__(self, tensors: Iterable[Any]) -> None:
        regions: dict[int, tuple[int, Any]] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            start = int(storage.data_ptr())
            regions.setdefault(start, (start + int(storage.nbytes()), storage))
        self._starts = sorted(regions)
        self._regions = [(start, *regions[start]) for start in self._starts]
        #: every tensor in this process's memory: the audit reads in place
        self.on_host = all(storage.device.type == "cpu" for _, _, storage in self._regions)

    @classmethod
    def of(cls, kv_caches: Any) -> KvMemory:
        """From what vLLM registers: a mapping of layer names to a tensor, or
        to a list of tensors sharing one storage (Mamba layers)."""
        values = kv_caches.values() if hasattr(kv_caches, "values") else kv_caches
        tensors: list[Any] = []
        for value in values:
            tensors.extend(value if isinstance(value, list | tuple) else [value])
        return cls(tensors)

    def devices(self) -> list[str]:
        return sorted({str(storage.device) for _, _, storage in self._regions})

    def segments(self, addrs: Sequence[int], sizes: Sequence[int]) -> Iterator[Any]:
        """The bytes at each of ``addrs`` (``sizes`` long), in order: a buffer
        over host memory, or a host copy of device memory.

        Raises :class:`UnreadableMemory` for a segment outside every tensor,
        or one torch cannot copy to the host; nothing is read raw then.
        """
        for addr, size in zip(addrs, sizes, strict=True):
            at = bisect.bisect_right(self._starts, addr) - 1
            if at < 0 or addr + size > self._regions[at][1]:
                raise UnreadableMemory(
                    f"{size} bytes at {addr:#x} lie in no KV cache tensor this rank registered"
                )
            start, _, storage = self._regions[at]
            if storage.device.type == "cpu":
                yield (ctypes.c_char * size).from_address(addr)
                continue
            try:
                yield _copied(storage, addr - start, size)
            except Exception as exc:  # torch's own error: a device it cannot copy from
                raise UnreadableMemory(
                    f"{size} bytes at {addr:#x} on {storage.device}: {type(exc).__name__}: {exc}"
                ) from None


def _copied(storage: Any, offset: int, size: int) -> bytes:
    """``size`` bytes of ``storage`` from ``offset``, copied to the host by torch
    on the storage's own device."""
    import torch

    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    view.set_(storage, offset, (size,), (1,))
    return bytes(view.cpu().numpy().tobytes())
