"""Reading journals for replay: databases or JSON Lines, one or several.

Several paths are one run written by several processes (the scheduler and
one per rank). They are merged by ``ts`` when every file's records carry it,
ties broken by the protocol's causality (:mod:`replay.interleave`), else
concatenated in the order given. A merged stream is renumbered 1..N in
merged order so that seqs stay unique; :class:`Origin` maps each position
back to its file and own seq.

Three ways to read, one reader: :func:`open_stream` streams a journal
once, in order (replay, export, fleet-check, ``inspect --once``);
:func:`open_records` reads it by seq on demand (time travel and the
inspector); a :class:`Follower` reads a journal database as its writer
appends to it, across segments and retention (``kvstate watch``). All
three read rows and checkpoints the same way (:mod:`replay._stored`),
decode through :mod:`kvstate.codec` and parse JSON Lines with
:class:`journal.jsonl.JsonlReader`, so a bad file gets the same error
whichever tool reads it.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator, Sequence

from journal import RecordError, is_journal_file, read_jsonl_lines, segments
from journal.database import BEFORE_FIRST
from kvstate import events as ev
from kvstate.checkpoint import Resumed
from kvstate.codec import Entry, Located, from_record

from ._by_seq import DatabaseRecords, InMemory, LineRecords, Records
from ._follow import Follower, Gone
from ._stored import existing, resumed, rows
from .interleave import interleave

__all__ = [
    "Follower",
    "Gone",
    "Located",
    "Origin",
    "Records",
    "Sized",
    "checked",
    "collect",
    "entries",
    "open_records",
    "open_stream",
    "read_path",
    "resumed",
]


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
    name = existing(path)
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
            for item in rows(journal, journal.path, BEFORE_FIRST, None):
                if pending is not None:
                    yield pending  # its checkpoint is verified: the commit linking to it was
                    pending = None
                yield item
    if pending is not None:
        yield pending


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


# -- by seq, on demand: time travel and the inspector --------------------------------


def open_records(paths: Sequence[str]) -> Records:
    """``paths`` read by seq: a database on demand, JSON Lines and merges in memory."""
    if len(paths) > 1:
        merged = InMemory(", ".join(paths))
        stream, _origin = open_stream(list(paths))
        for item in stream:
            merged.add(item)  # several journals of one run, merged as replay merges them
        return merged
    name = existing(paths[0])
    if not os.path.exists(name) or is_journal_file(name):
        return DatabaseRecords(name)
    return LineRecords(name)
