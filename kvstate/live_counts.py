"""The writer process's audit counts, readable by the engine at any moment.

A recorder's writer process folds each committed batch, and sends its
findings back only when the engine waits for an answer. An engine that
never waits (vLLM's observer commits without waiting) would learn of a
violation only at the end. So a recorder opened with
``Recorder.open(..., live_counts=True)`` shares a small memory-mapped file
with its writer process: after each fold the writer stores the records
folded, the first finding's seq and the findings by code there; the engine
reads them when it likes (vLLM's stats path, once per step), a few loads
from memory, with no call into the writer and no wait.

Each figure is one aligned 8-byte word, so a read sees each whole; the
figures of one fold are not read as one (a count may be a fold ahead of
another), which is fine for counters read again at the next step.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile

from .violations import Code

#: the codes in file order (appended to, never reordered: the layout is the code's index)
CODES = tuple(Code)
_HEAD = struct.Struct("<qq")  # records folded, first finding's seq (-1: none)
_COUNTS = struct.Struct(f"<{len(CODES)}q")
SIZE = _HEAD.size + _COUNTS.size


class LiveCounts:
    """One recorder's shared counts (see the module docstring)."""

    def __init__(self, path: str, *, owner: bool) -> None:
        self.path = path
        self.owner = owner
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)
        #: what :meth:`read` last returned (what it returns once closed)
        self._last: tuple[int, int | None, dict[str, int]] = (0, None, {})

    @classmethod
    def create(cls) -> LiveCounts:
        """A new, zeroed file (the engine's; removed by :meth:`close`)."""
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="kvstate-counts-", dir=where)
        with os.fdopen(fd, "wb") as f:
            f.write(_HEAD.pack(0, -1) + bytes(_COUNTS.size))
        return cls(path, owner=True)

    def store(self, folded: int, first_seq: int | None, by_code: dict[str, int]) -> None:
        """The writer's figures after a fold."""
        counts = [by_code.get(code.value, 0) for code in CODES]
        _COUNTS.pack_into(self._map, _HEAD.size, *counts)
        _HEAD.pack_into(self._map, 0, folded, -1 if first_seq is None else first_seq)

    def read(self) -> tuple[int, int | None, dict[str, int]]:
        """(records folded, the first finding's seq or None, findings by code).

        Never raises: once :meth:`close` unmapped the file (``finish()`` on
        another thread, a watchdog's, while vLLM's engine thread still asks
        for its stats), the figures last read.
        """
        try:
            folded, first = _HEAD.unpack_from(self._map, 0)
            counts = _COUNTS.unpack_from(self._map, _HEAD.size)
        except ValueError:  # "mmap closed or invalid"
            return self._last
        by_code = {code.value: n for code, n in zip(CODES, counts, strict=True) if n}
        self._last = (folded, None if first < 0 else first, by_code)
        return self._last

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        if self.owner:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
