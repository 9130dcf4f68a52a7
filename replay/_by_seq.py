"""Journals read by seq, on demand: what time travel and the inspector use
(see :func:`replay.sources.open_records`)."""

from __future__ import annotations

import bisect
import threading
from array import array
from collections.abc import Iterator
from typing import Protocol

from journal import Journal, segments
from journal.database import BEFORE_FIRST
from journal.jsonl import JsonlReader
from kvstate.codec import Located, from_record

from ._stored import resumed, rows


class Records(Protocol):
    """A journal read by seq (merged positions when several are merged)."""

    path: str

    def last_seq(self) -> int: ...
    def between(self, after: int, upto: int) -> Iterator[Located]: ...
    def close(self) -> None: ...


class DatabaseRecords:
    """Records of a journal database, by seq, read in chunks; read-only.

    A rotated journal is read across its segments (each checked to follow
    the one before by :func:`journal.segments.segments`); a segment that
    appears while the journal is followed joins at the next :meth:`last_seq`.
    """

    CHUNK = 4096

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection per segment, several threads
        first = segments.open_first(path)
        #: each segment's journal and the last seq before its first record, in order
        self._parts: list[tuple[int, Journal]] = [(segments.base_seq(first), first)]
        # where the head was removed (journal.retention), the oldest segment left
        row = first.segment()
        self._head = segments.head_name(first.path)
        self._index = 1 if row is None else row[0]
        self._ident: str | None = None if row is None else row[1]
        #: the checkpoint the records begin after (None: they begin at the header)
        self.resumed = resumed(first)

    def _open_next(self) -> bool:
        """Open the next segment, if it exists now (a rotation while followed)."""
        journal = self._parts[-1][1]
        # the id from an open segment: retention may have removed the first
        self._ident = self._ident or segments.id_of_open(self._parts[0][1])
        nxt = segments.open_next(
            self._head, self._index + len(self._parts), journal.head(), journal.path, self._ident
        )
        if nxt is None:
            return False
        self._parts.append((segments.base_seq(nxt), nxt))
        return True

    def last_seq(self) -> int:
        with self._lock:
            while self._open_next():
                pass
            return self._parts[-1][1].head()[0]

    def between(self, after: int, upto: int) -> Iterator[Located]:
        """Records with ``after < seq <= upto``, in order."""
        while after < upto:
            end = min(upto, after + self.CHUNK)
            # a chunk at a time under the lock: the inspector's threads share it
            with self._lock:
                chunk = []
                for base, journal in self._parts:
                    if end <= base:
                        break
                    head = journal.head()[0]
                    if head <= after:
                        continue
                    chunk += list(rows(journal, journal.path, max(after, base), min(end, head)))
            yield from chunk
            after = end

    def close(self) -> None:
        with self._lock:
            for _, journal in self._parts:
                journal.close()


class InMemory:
    """Records held in memory, looked up by seq."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._items: list[Located] = []
        self._seqs = array("q")

    def add(self, item: Located) -> None:
        self._items.append(item)
        self._seqs.append(item.entry.seq)

    def last_seq(self) -> int:
        return self._seqs[-1] if self._seqs else BEFORE_FIRST

    def between(self, after: int, upto: int) -> Iterator[Located]:
        start = bisect.bisect_right(self._seqs, after)
        end = bisect.bisect_right(self._seqs, upto)
        return iter(self._items[start:end])

    def close(self) -> None:
        pass


class LineRecords(InMemory):
    """Records of a JSON Lines file, kept in memory; lines appended since are
    read at each :meth:`last_seq` (a journal another process is writing)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._reader = JsonlReader(path)
        self._lock = threading.Lock()

    def last_seq(self) -> int:
        with self._lock:
            for line, record in self._reader.read(complete=False):
                entry = from_record(record, path=self.path, line=line)
                self.add(Located(entry, self.path, record.seq, line))
        return super().last_seq()
