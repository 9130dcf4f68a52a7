"""Replay: fold a journal into the reference ledger and collect the verdict."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from journal import RecordError, is_journal_file, segments
from journal.database import wal_state
from kvstate.archive import Archive
from kvstate.checkpoint import Resumed
from kvstate.codec import Entry
from kvstate.folder import Folder
from kvstate.ledger import Ledger
from kvstate.spill import SpillArchive
from kvstate.violations import Code, Violation

from .sources import Located, Origin, Sized, open_stream


@attrs.define
class ReplayResult:
    """What replay found. ``ledger`` is the state after the last record folded."""

    paths: list[str]
    #: the fold's own ledger, settled state parked (see :mod:`kvstate.archive`)
    folded: Ledger
    events: int
    violations: list[Violation]
    warnings: list[Violation]
    at: int | None = None
    origin: Origin | None = None
    #: ``--require-idle``: a journal that ends before the engine did is a failure
    require_idle: bool = False
    #: the records the report tells about (the first violation and its chain),
    #: kept during the fold; None when the journal was too long to keep them
    #: while reading it, and they must be read again (:func:`replay.sources.collect`)
    story: dict[int, Entry] | None = None
    _whole: Ledger | None = attrs.field(default=None, init=False, repr=False)

    @property
    def ledger(self) -> Ledger:
        """The whole ledger, parked jobs and requests back in place (built on first use)."""
        if self._whole is None:
            self._whole = self.folded.whole()
        return self._whole

    @property
    def unfinished(self) -> bool:
        """The journal ends without ``engine_idle`` or ``engine_crashed``
        (docs/events.md, "Complete and incomplete journals")."""
        return any(w.code is Code.UNFINISHED for w in self.warnings)

    @property
    def from_checkpoint(self) -> Violation | None:
        """The ``FROM_CHECKPOINT`` warning when the journal's head was removed
        by retention (the verdict covers those records as its checkpoint tells)."""
        return next((w for w in self.warnings if w.code is Code.FROM_CHECKPOINT), None)

    @property
    def verdict(self) -> str:
        return "violations" if self.violations else "clean"

    @property
    def exit_status(self) -> int:
        if self.violations or (self.require_idle and self.unfinished):
            return 1
        return 0

    def where(self, seq: int) -> dict[str, Any]:
        """File and own seq of a position, for merged journals (empty otherwise)."""
        if self.origin is None:
            return {}
        path, own = self.origin.of(seq)
        return {"file": path, "file_seq": own}

    def finding_dict(self, violation: Violation) -> dict[str, Any]:
        return {**violation.to_dict(), **self.where(violation.seq)}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of docs/events.md, "The command line" (plus ``at`` and
        ``ledger`` with ``--at``)."""
        out: dict[str, Any] = {
            "verdict": self.verdict,
            "events": self.events,
            "violations": [self.finding_dict(v) for v in self.violations],
            "warnings": [self.finding_dict(w) for w in self.warnings],
        }
        if self.at is None:
            out["unfinished"] = self.unfinished
        resumed = self.from_checkpoint
        if resumed is not None:
            out["from_checkpoint"] = {"after_seq": resumed.seq, "message": resumed.message}
        if len(self.paths) > 1:
            out["merged"] = list(self.paths)
        if self.at is not None:
            out["at"] = self.at
            out["ledger"] = self.ledger.to_dict()
        return out


#: how many records between two calls of a replay's progress callback
PROGRESS_EVERY = 16384
#: records kept while folding until the first violation, for its story: a
#: journal read once where memory allows (some 50 MB of entries at most)
STORY_WINDOW = 100_000


def story_of(first: Violation) -> set[int]:
    """The seqs a report tells about for its first violation: it, its chain, the record before."""
    return {*first.chain, first.seq, first.seq - 1}


class _Story:
    """Keeps the records read so far, until the first violation names its story."""

    def __init__(self) -> None:
        self.kept: list[Entry] | None = []
        self.story: dict[int, Entry] | None = None

    def see(self, entry: Entry, found: list[Violation]) -> None:
        kept = self.kept
        if kept is None:
            return
        kept.append(entry)
        first = next((v for v in found if not v.is_warning), None)
        if first is not None:
            wanted = story_of(first)
            self.story = {e.seq: e for e in kept if e.seq in wanted}
            self.kept = None
        elif len(kept) > STORY_WINDOW:
            self.kept = None  # too long to keep: the report reads its records again

    def result(self) -> dict[int, Entry] | None:
        if self.story is not None:
            return self.story
        return {} if self.kept is not None else None  # clean and kept whole: no story


def _known_at(items: Iterable[Located], at: int) -> Iterator[Located]:
    """``items``, refused when ``at`` is before the checkpoint they begin with."""
    for item in items:
        if type(item.entry.event) is Resumed and at < item.seq:
            raise RecordError(
                f"--at {at}: records 1..{item.seq} were removed by retention; the ledger "
                f"is known from seq {item.seq} on",
                path=item.path,
            )
        yield item


def fold_located(
    items: Iterable[Located],
    *,
    at: int | None = None,
    progress: Callable[[int], None] | None = None,
    archive: Archive | None = None,
    story: _Story | None = None,
) -> tuple[Ledger, int, list[Violation], list[Violation]]:
    """Fold records in order, stopping after seq ``at`` when given.

    Settled jobs and requests are parked in ``archive`` (a new in-memory one
    when not given), so memory follows live state; verdicts do not change.

    ``progress`` is called with the number of records folded so far, every
    :data:`PROGRESS_EVERY` records.
    """
    ledger = Ledger(archive=archive if archive is not None else Archive())
    violations: list[Violation] = []
    warnings: list[Violation] = []
    events = 0
    if at is not None:
        items = itertools.takewhile(lambda item: item.entry.seq <= at, _known_at(items, at))
    for entry, found in Folder(ledger).located(items):
        if type(entry.event) is Resumed:
            warnings += [v for v in found if v.is_warning]
            violations += [v for v in found if not v.is_warning]
            continue  # not a record: the removed records' findings
        if progress is not None and events % PROGRESS_EVERY == 0:
            progress(events)
        events += 1
        if story is not None:
            story.see(entry, found)
        for v in found:
            (warnings if v.is_warning else violations).append(v)
    # An empty journal, or one without its header, is refused by the reader
    # (replay.sources.checked), the one place every reader shares; here the
    # ledger may still have no header: ``--at 0`` asks for it before record 1.
    if at is None:
        warnings.extend(ledger.end())
    return ledger, events, violations, warnings


def replay(
    paths: Sequence[str],
    *,
    at: int | None = None,
    require_idle: bool = False,
    progress: Callable[[int], None] | None = None,
    sized: Sized | None = None,
) -> ReplayResult:
    """Replay one journal, or several merged, and return the verdict.

    Raises :class:`journal.RecordError` / :class:`journal.JournalError` (and
    ``OSError``) for unusable input; the CLI maps them to exit status 2.
    """
    if not paths:
        raise RecordError("no journal given")
    stream, origin = open_stream(list(paths), sized=sized)
    story = _Story()
    try:
        ledger, events, violations, warnings = fold_located(
            stream, at=at, progress=progress, archive=SpillArchive(), story=story
        )
    except RecordError as exc:
        if exc.path is None:
            raise exc.located(path=", ".join(paths)) from None
        raise
    if at is None:
        finished = not any(w.code is Code.UNFINISHED for w in warnings)
        warnings += wal_left(paths, finished, ledger.last_seq or 0)
    return ReplayResult(
        list(paths), ledger, events, violations, warnings, at, origin, require_idle,
        story=story.result(),
    )  # fmt: skip


def wal_left(paths: Sequence[str], finished: bool, seq: int) -> list[Violation]:
    """``WAL_LEFT`` for each file of a finished journal that is not one file
    as a finished journal must be (docs/events.md, "A journal left in WAL mode").

    A writer takes its file out of WAL mode as it closes; a reader that had
    it open all the while leaves its header saying WAL (the records are all
    in the file: the writer folded its log in first). A journal that did
    not end is not named: a live one is in WAL mode, and so may be one whose
    writer was killed, every committed record in its file.
    """
    if not finished:
        return []
    found = []
    for path in paths:
        if not os.path.exists(path) and not segments.is_removed_head(path):
            continue
        if os.path.exists(path) and not is_journal_file(path):
            continue  # JSON Lines
        for _, name in segments.present(segments.head_name(path)):
            wal, log = wal_state(name)
            if wal:
                why = (
                    f"{name}: the journal ended, but its file is still in SQLite's WAL mode "
                    "(a reader had it open as its writer closed); every record is in the file"
                    + (f", and {os.path.basename(name)}-wal beside it goes with it" if log else "")
                )
                found.append(Violation(Code.WAL_LEFT, seq, why))
    return found
