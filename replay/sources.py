"""Reading journals for replay: databases or JSON Lines, one or several.

Several paths are one run written by several processes (the scheduler and
one per rank). They are merged by ``ts`` when every file's records carry it,
ties broken by the protocol's causality (:mod:`replay.interleave`), else
concatenated in the order given. A merged stream is renumbered 1..N in
merged order so that seqs stay unique; :class:`Origin` maps each position
back to its file and own seq.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from journal import Journal, RecordError, is_journal_file, read_jsonl_lines
from kvstate import events as ev
from kvstate.codec import Entry, from_record, from_stored

from .interleave import interleave


class Located(NamedTuple):
    """An entry and where it was read: file, own seq, and line for JSON Lines.

    A named tuple rather than an attrs class: one is made per record read.
    """

    entry: Entry
    path: str
    seq: int
    line: int | None


def read_path(path: str | os.PathLike[str]) -> Iterator[Located]:
    """Stream and decode one journal file (database or JSON Lines)."""
    name = os.fspath(path)
    if not os.path.exists(name):
        raise RecordError("no such file", path=name)
    if os.path.isdir(name):
        raise RecordError("is a directory, not a journal", path=name)
    if is_journal_file(name):
        with Journal(name, readonly=True) as journal:
            for seq, kind, step, rank, ts, payload in journal.stored_rows():
                entry = from_stored(seq, kind, step, rank, ts, payload, name)
                yield Located(entry, name, seq, None)
    else:
        for line, record in read_jsonl_lines(name):
            yield Located(from_record(record, path=name, line=line), name, record.seq, line)


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
            if os.path.samefile(path, earlier):
                raise RecordError(
                    f"named twice (also as {earlier}): a journal merges once", path=path
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
                "their folder, replays each run by itself; kvstate convert --mixed-runs "
                "merges them on purpose)",
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
        if header is None or type(event) is ev.JournalOpened:
            problem = ev.header_problem(header, event)
            if problem is not None:
                raise RecordError(problem, path=item.path, line=item.line, seq=item.seq)
            if header is None and isinstance(event, ev.JournalOpened):
                header = event
        yield item
    if header is None:
        raise RecordError("journal is empty: no journal_opened record", path=what)


def open_stream(
    paths: Sequence[str], *, mixed_runs: bool = False
) -> tuple[Iterator[Located], Origin | None]:
    """The records of ``paths`` in replay order, and the origin map when merged.

    Several paths must be one run's journals, each once, unless
    ``mixed_runs`` (an explicit merge of different runs).
    """
    if len(paths) == 1:
        return checked(read_path(paths[0]), paths[0]), None
    origin = Origin(paths)
    firsts = [_first(p) for p in paths]
    _one_run(paths, firsts, mixed_runs)
    by_ts = all(f is not None and f.entry.ts is not None for f in firsts)

    def merged() -> Iterator[Located]:
        streams = [checked(read_path(p), p) for p in paths]
        if by_ts:
            pairs: Iterator[tuple[int, Located]] = interleave(streams)  # type: ignore[assignment]
        else:
            pairs = ((i, item) for i, s in enumerate(streams) for item in s)
        for position, (index, item) in enumerate(pairs, 1):
            origin.add(index, item.seq)
            entry = item.entry._replace(seq=position)
            yield Located(entry, item.path, item.seq, item.line)

    return checked(merged(), ", ".join(paths)), origin


def entries(paths: Sequence[str], *, mixed_runs: bool = False) -> Iterator[Entry]:
    """The entries of ``paths`` in replay order (merged positions when several)."""
    stream, _ = open_stream(list(paths), mixed_runs=mixed_runs)
    return (item.entry for item in stream)


def collect(paths: Sequence[str], seqs: set[int]) -> dict[int, Entry]:
    """The entries at ``seqs`` (merged positions when several paths), by a second pass.

    Replay keeps no records while folding, so memory stays flat; the few a
    report needs are read again.
    """
    found: dict[int, Entry] = {}
    if not seqs:
        return found
    last = max(seqs)
    for entry in entries(paths):
        if entry.seq in seqs:
            found[entry.seq] = entry
        if entry.seq >= last:
            break
    return found
