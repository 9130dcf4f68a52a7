"""Findings kept on disk for ``kvstate inspect --once``, which prints them all."""

from __future__ import annotations

from collections.abc import Iterator

from kvstate.tempdb import BATCH as _BATCH
from kvstate.tempdb import insert as _insert
from kvstate.tempdb import open_temp as _open
from kvstate.tempdb import read as _read


class ViolationSpool:
    """Findings kept on disk in the order found, for reports that print them all.

    Holds ``(seq, code, message)`` rows in a private temporary SQLite database
    (deleted when closed), so printing every violation of a journal full of
    them costs no memory per violation; if the database cannot be written,
    the rest are kept in memory.
    """

    def __init__(self) -> None:
        self._db = _open("CREATE TABLE found (seq INTEGER, code TEXT, message TEXT);")
        self._pending: list[tuple[int, str, str]] = []
        self._stuck = self._db is None
        self._count = 0

    def add(self, seq: int, code: str, message: str) -> None:
        self._pending.append((seq, code, message))
        self._count += 1
        if len(self._pending) >= _BATCH and not self._stuck:
            self._flush()

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[int, str, str]]:
        """Every row in the order added: those on disk in pages, then those in memory."""
        self._flush()
        last = 0
        while True:
            page = _read(
                self._db,
                "SELECT rowid, seq, code, message FROM found WHERE rowid > ? ORDER BY rowid "
                "LIMIT 4096",
                (last,),
            )
            if not page:
                break
            for _rowid, seq, code, message in page:
                yield seq, code, message
            last = page[-1][0]
        yield from self._pending

    def _flush(self) -> None:
        if not self._pending or self._stuck:
            return
        if _insert(self._db, "INSERT INTO found VALUES (?, ?, ?)", self._pending):
            self._pending = []
        else:
            self._stuck = True

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
