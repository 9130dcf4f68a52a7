"""The store interface the connector uses, and an in-memory store.

The interface is the part of Mooncake's that a KV connector needs: batch
existence checks, batch puts from buffers, batch gets into buffers, remove,
close. Return codes follow Mooncake's: 0 or a byte count for success, a
negative code otherwise. :class:`MemoryStore` copies the behaviour that
matters: a put of an existing key succeeds and keeps the *first* value (so a
poisoned value never heals); a full store fails puts with
``NO_AVAILABLE_HANDLE``; a call after ``close()`` raises instead of crashing
the process the way the real client does.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

OK = 0
NO_AVAILABLE_HANDLE = -200  # out of space
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900

CODE_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL (master unreachable)",
}


class StoreClosed(RuntimeError):
    """A call on a store after ``close()``."""


class StoreError(RuntimeError):
    """A store call failed as a whole (for example: the master is unreachable)."""

    def __init__(self, code: int, what: str) -> None:
        self.code = code
        super().__init__(f"{what}: {describe(code)}")


class Store(Protocol):
    """What the connector needs from a KV store."""

    def batch_exist(self, keys: Sequence[str]) -> list[bool]: ...

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]: ...

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]: ...

    def remove(self, key: str) -> int: ...

    def close(self) -> None: ...


def describe(code: int) -> str:
    return CODE_NAMES.get(code, f"error {code}")


def describe_missing(code: int) -> str:
    """Why a read found nothing: ``evicted`` when the store no longer has the key."""
    return "evicted" if code == OBJECT_NOT_FOUND else describe(code)


class MemoryStore:
    """A thread-safe in-memory store with Mooncake's put and capacity semantics."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._values: dict[str, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._closed = False

    def _check(self) -> None:
        if self._closed:
            raise StoreClosed("store used after close()")

    def batch_exist(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self._check()
            return [key in self._values for key in keys]

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        if len(keys) != len(buffers):
            return [INVALID_PARAMS] * len(keys)
        with self._lock:
            self._check()
            codes = []
            for key, buffer in zip(keys, buffers, strict=True):
                if key in self._values:
                    codes.append(OK)  # the first value is kept, as in Mooncake
                    continue
                size = len(buffer)
                if self.capacity_bytes is not None and self._used + size > self.capacity_bytes:
                    codes.append(NO_AVAILABLE_HANDLE)
                    continue
                self._values[key] = bytes(buffer)
                self._used += size
                codes.append(OK)
            return codes

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        with self._lock:
            self._check()
            out = []
            for key, buffer in zip(keys, buffers, strict=True):
                value = self._values.get(key)
                if value is None:
                    out.append(OBJECT_NOT_FOUND)
                elif len(buffer) < len(value):
                    out.append(INVALID_PARAMS)
                else:
                    buffer[: len(value)] = value
                    out.append(len(value))
            return out

    def remove(self, key: str) -> int:
        with self._lock:
            self._check()
            value = self._values.pop(key, None)
            if value is None:
                return OBJECT_NOT_FOUND
            self._used -= len(value)
            return OK

    def keys(self) -> list[str]:
        with self._lock:
            self._check()
            return sorted(self._values)

    def close(self) -> None:
        with self._lock:
            self._closed = True
