"""Reading journals for replay: databases or JSON Lines, one or several.

Several paths are one run written by several processes (the scheduler and
one per rank). They are merged by ``ts`` when every file's records carry it,
ties broken by the protocol's causality (:mod:`replay.interleave`), else
concatenated in the order given. A merged stream is renumbered 1..N in
merged order so that seqs stay unique; :class:`Origin` maps each position
back to its file and own seq.

Two ways to read, one reader: :func:`open_stream` streams a journal once,
in order (replay, export, fleet-check, ``inspect --once``), and
:func:`open_records` reads it by seq on demand (time travel and the
inspector). Both decode through :mod:`kvstate.codec` and parse JSON Lines
with :class:`journal.jsonl.JsonlReader`, so a bad file gets the same error
whichever tool reads it.
"""

from __future__ import annotations

import bisect
import os
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from journal import Journal, RecordError, is_journal_file, read_jsonl_lines, segments
from journal.database import BEFORE_FIRST
from journal.jsonl import JsonlReader
from kvstate import events as ev
from kvstate.checkpoint import Resumed, resumed_at
from kvstate.codec import Entry, Located, from_record, from_stored

from .interleave import interleave


def _existing(path: str | os.PathLike[str]) -> str:
    name = os.fspath(path)
    if not os.path.exists(name) and not segments.is_removed_head(name):
        raise RecordError("no such file", path=name)
    if os.path.isdir(name):
        raise RecordError("is a directory, not a journal", path=name)
    return name


def _rows(journal: Journal, name: str, after: int, upto: int | None) -> Iterator[Located]:
    for seq, kind, step, rank, ts, payload in journal.stored_rows(after=after, upto=upto):
        yield Located(from_stored(seq, kind, step, rank, ts, payload, name), name, seq, None)


def read_path(
    path: str | os.PathLike[str], *, sized: Callable[[int], None] | None = None
) -> Iterator[Located]:
    """Stream and decode one journal file (database or JSON Lines).

    ``sized`` is told a journal database's record count when it is opened
    (a progress bar's total, read on the same connection as the records).

    A journal whose head retention removed (:mod:`journal.retention`)
    begins with an item whose event is a :class:`kvstate.checkpoint.Resumed`:
    the fold restores its ledger from it (:meth:`kvstate.folder.Folder.located`),
    other readers take its header or pass it by. It comes once the chain
    has checked the first commit after it, which links to the checkpoint.
    """
    name = _existing(path)
    if not os.path.exists(name) or is_journal_file(name):
        yield from _read_segments(name, sized)
    else:
        for line, record in read_jsonl_lines(name):
            yield Located(from_record(record, path=name, line=line), name, record.seq, line)


def _read_segments(name: str, sized: Callable[[int], None] | None) -> Iterator[Located]:
    # A rotated journal is its segments, each following the one before
    # (journal.segments); one that never rotated is its one file.
    pending: Located | None = None
    for index, journal in enumerate(segments.segments(name)):
        with journal:
            if index == 0:
                if sized is not None:
                    # seqs run on across segments: the last less the first's base is the count
                    sized(max(0, segments.last_seq(journal) - max(0, segments.base_seq(journal))))
                pending = resumed(journal)
            for item in _rows(journal, journal.path, BEFORE_FIRST, None):
                if pending is not None:
                    yield pending  # its checkpoint is verified: the commit linking to it was
                    pending = None
                yield item
    if pending is not None:
        yield pending


def resumed(journal: Journal) -> Located | None:
    """The checkpoint the first remaining segment of a journal begins with,
    when the segments before it were removed."""
    found = resumed_at(journal)
    if found is None:
        return None
    return Located(Entry(found.seq, 0, None, found), journal.path, found.seq, None)  # type: ignore[arg-type]


class Origin:
    """For a merged stream: position -> (file, own seq), kept compactly."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self._file = array("l")
        self._seq = array("q")

    def add(self, file_index: int, seq: int) -> None:
        self._file.append(file_index)
        self._seq.append(seq)

    def of(self, position: int) -> tuple[str, int]:
        """File and own seq of a 1-based merged position."""
        return self.paths[self._file[position - 1]], self._seq[position - 1]


def _first(path: str) -> Located | None:
    for item in read_path(path):
        return item
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # a removed head (journal.retention): compared by name
        return os.path.abspath(a) == os.path.abspath(b)


def _one_run(paths: Sequence[str], firsts: Sequence[Located | None], mixed_runs: bool) -> None:
    """Refuse to merge what is not one run's journals, each once.

    Merged, two runs' job ids, requests and blocks would collide and read as
    ID_REUSED, DOUBLE_REPORT and worse: a verdict about a run that never
    happened. A file named twice, or two journals of one process of one run
    (a copy), would do the same. Headers without ``run`` (journals of other
    writers) are taken as the user gives them.
    """
    for i, path in enumerate(paths):
        for earlier in paths[:i]:
            if _same_file(path, earlier):
                raise RecordError(
                    f"named twice (also as {earlier}): a journal merges once", path=path
                )
    for path, first in zip(paths, firsts, strict=True):
        if first is not None and isinstance(first.entry.event, Resumed):
            raise RecordError(
                f"its records 1..{first.seq} were removed by retention, and its checkpoint is "
                "the fold of this journal alone: it is not merged with others (replay it by "
                "itself)",
                path=path,
            )
    seen_run: tuple[str, object] | None = None
    seen_role: dict[tuple[object, object], str] = {}
    for path, first in zip(paths, firsts, strict=True):
        header = first.entry.event if first is not None else None
        if not isinstance(header, ev.JournalOpened) or header.run is None:
            continue
        if seen_run is not None and header.run != seen_run[1] and not mixed_runs:
            raise RecordError(
                f"a journal of run {header.run!r}, and {seen_run[0]} is of run {seen_run[1]!r}: "
                "journals of different runs are not merged (kvstate replay --by-run, or of "
                "their folder, replays each run by itself; kvstate pd-check PREFILL DECODE "
                "reads a prefill/decode pair's two; kvstate convert --mixed-runs merges them "
                "on purpose)",
                path=path,
            )
        seen_run = seen_run or (path, header.run)
        if header.role is not None:
            other = seen_role.setdefault((header.run, header.role), path)
            if other != path:
                raise RecordError(
                    f"the {header.role} journal of run {header.run!r}, and so is {other}: "
                    "one process's journal twice (a copy?) is not merged",
                    path=path,
                )


def checked(items: Iterator[Located], what: str) -> Iterator[Located]:
    """The structural checks every reader applies, whatever it does next.

    A journal starts with ``journal_opened``, later headers agree with it,
    and it is not empty. Replay's fold makes the same checks; doing them
    here too means export, convert and timeline refuse the same journals.
    """
    header: ev.JournalOpened | None = None
    for item in items:
        event = item.entry.event
        if header is None and type(event) is Resumed:
            header = event.header  # the head was removed: the checkpoint holds it
        elif header is None or type(event) is ev.JournalOpened:
            problem = ev.header_problem(header, event)
            if problem is not None:
                raise RecordError(problem, path=item.path, line=item.line, seq=item.seq)
            if header is None and isinstance(event, ev.JournalOpened):
                header = event
        yield item
    if header is None:
        raise RecordError("journal is empty: no journal_opened record", path=what)


class Sized:
    """The records a stream will read, as its journal databases say when opened."""

    def __init__(self) -> None:
        self.total: int | None = None

    def __call__(self, count: int) -> None:
        self.total = count + (self.total or 0)


def open_stream(
    paths: Sequence[str], *, mixed_runs: bool = False, sized: Sized | None = None
) -> tuple[Iterator[Located], Origin | None]:
    """The records of ``paths`` in replay order, and the origin map when merged.

    Several paths must be one run's journals, each once, unless
    ``mixed_runs`` (an explicit merge of different runs). ``sized`` learns
    how many records the journal databases hold as they are opened.
    """
    if len(paths) == 1:
        return checked(read_path(paths[0], sized=sized), paths[0]), None
    origin = Origin(paths)
    firsts = [_first(p) for p in paths]
    _one_run(paths, firsts, mixed_runs)
    by_ts = all(f is not None and f.entry.ts is not None for f in firsts)

    def merged() -> Iterator[Located]:
        streams = [checked(read_path(p, sized=sized), p) for p in paths]
        if by_ts:
            pairs: Iterator[tuple[int, Located]] = interleave(streams)  # type: ignore[assignment]
        else:
            pairs = ((i, item) for i, s in enumerate(streams) for item in s)
        for position, (index, item) in enumerate(pairs, 1):
            origin.add(index, item.seq)
            entry = item.entry._replace(seq=position)
            yield Located(entry, item.path, item.seq, item.line)

    return checked(merged(), ", ".join(paths)), origin


def entries(
    paths: Sequence[str], *, mixed_runs: bool = False, resumed: bool = False
) -> Iterator[Entry]:
    """The entries of ``paths`` in replay order (merged positions when several).

    A journal whose head retention removed is refused (what is written from
    these is a journal of its own, which would lack the checkpoint), unless
    ``resumed``: then its records are given without it (a listing).
    """
    stream, _ = open_stream(list(paths), mixed_runs=mixed_runs)
    for item in stream:
        if type(item.entry.event) is Resumed:
            if resumed:
                continue
            raise RecordError(
                f"its records 1..{item.seq} were removed by retention: what remains begins "
                "with a checkpoint, not a record, and is not written out as a journal of "
                "its own (kvstate replay and export read it as it is)",
                path=item.path,
            )
        yield item.entry


def collect(paths: Sequence[str], seqs: set[int]) -> dict[int, Entry]:
    """The entries at ``seqs`` (merged positions when several paths), by a second pass.

    Replay keeps no records while folding, so memory stays flat; the few a
    report needs are read again.
    """
    found: dict[int, Entry] = {}
    if not seqs:
        return found
    last = max(seqs)
    stream, _ = open_stream(list(paths))
    for entry in (item.entry for item in stream if type(item.entry.event) is not Resumed):
        if entry.seq in seqs:
            found[entry.seq] = entry
        if entry.seq >= last:
            break
    return found


# -- by seq, on demand: time travel -------------------------------------------------


class Records(Protocol):
    """A journal read by seq (merged positions when several are merged)."""

    path: str

    def last_seq(self) -> int: ...
    def between(self, after: int, upto: int) -> Iterator[Located]: ...
    def close(self) -> None: ...


class _DatabaseRecords:
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
                    chunk += list(_rows(journal, journal.path, max(after, base), min(end, head)))
            yield from chunk
            after = end

    def close(self) -> None:
        with self._lock:
            for _, journal in self._parts:
                journal.close()


class _InMemory:
    """Records held in memory, looked up by seq."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._items: list[Located] = []
        self._seqs = array("q")

    def _add(self, item: Located) -> None:
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


class _LineRecords(_InMemory):
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
                self._add(Located(entry, self.path, record.seq, line))
        return super().last_seq()


class _MergedRecords(_InMemory):
    """Several journals of one run, merged as replay merges them, in memory."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__(", ".join(paths))
        stream, _origin = open_stream(paths)
        for item in stream:
            self._add(item)


def open_records(paths: Sequence[str]) -> Records:
    """``paths`` read by seq: a database on demand, JSON Lines and merges in memory."""
    if len(paths) > 1:
        return _MergedRecords(list(paths))
    name = _existing(paths[0])
    if not os.path.exists(name) or is_journal_file(name):
        return _DatabaseRecords(name)
    return _LineRecords(name)
