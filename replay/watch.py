"""Follow every journal under a folder as processes write them, and fold each.

``kvstate watch DIR`` (see :mod:`replay.cli.watch`) polls the folder: a
journal that appears is followed, and each poll reads what was committed
since the last one through the one reader in follow mode
(:class:`replay.sources.Follower`: chain-verified, across segments, from a
checkpoint where retention removed what was not read yet), and folds it
through the one fold loop (:class:`kvstate.folder.Folder`). A journal one
process writes for every side is folded as replay folds it; a scheduler's
journal as the writer process's audit folds it (its ranks' reports are in
other files: completions are checked against the world size); a rank's
journal is counted, and judged with its scheduler's by ``kvstate replay``. Each journal's figures
(:class:`kvstate.figures.Figures`) are what ``/metrics`` publishes.

Left on for months beside the engines, the watcher must never change what
it reads, nor keep it from becoming what its writer makes of it:

- it holds no journal open between two polls (see :mod:`replay._follow`);
- a journal whose closing record it has read is let go of for good;
- where the writer's retention removed a segment before the watcher read
  it, the watcher goes on from the oldest segment left, from its
  checkpoint, and counts how often it had to (``overtaken``);
- a journal whose files are all gone is forgotten: its series go.

What it tells an operator goes to the ``kvstate.watch`` logger, one line
each: every finding in a record written since the watcher began (the ones
it finds already written when it starts are counted, not said again), a
journal it cannot read on, a file it skips and why, a journal gone.

Nothing here waits on the clock for correctness: a poll reads what is
there. The seconds of audit lag and of silence are wall time, for alerts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import attrs

from journal import JournalError, RecordError, is_journal_file, segments
from journal.segments import file_bytes
from kvstate import events as ev
from kvstate.checkpoint import Resumed
from kvstate.codec import Located
from kvstate.errors import TemporaryStorageError
from kvstate.figures import Figures
from kvstate.folder import Folder
from kvstate.ledger import Ledger
from kvstate.spill import SpillArchive
from kvstate.violations import Code, Violation

from .sources import Follower, Gone

log = logging.getLogger("kvstate.watch")

#: rows folded per journal per poll at most (the others' turn comes in between)
CHUNK = 20_000

#: new findings said in the log per journal; the rest are counted on /metrics
LOGGED_FINDINGS = 1_000
#: what a poll may fail with on one journal: that journal's line says it
_UNREADABLE = (RecordError, JournalError, OSError, TemporaryStorageError)
#: the records that end a journal
_CLOSING = frozenset({"engine_idle", "engine_crashed"})


class _Followed:
    """One journal being followed (read by a :class:`replay.sources.Follower`)
    and folded.

    ``baseline``: the findings at seqs up to it were written before the
    watcher began, and are not new (see :attr:`Figures.new_violations`).
    """

    def __init__(self, path: str, *, found_at_start: bool) -> None:
        self.reader = Follower(path)
        self.path = self.reader.path
        # one label for the journal's series, whichever segment it is found by
        self.figures = Figures(journal=self.path)
        self.ledger: Ledger | None = None
        self._folder: Folder | None = None
        #: the closing record was read and nothing follows it: let go of for good
        self.ended = False
        self._logged = 0
        self.baseline = self.reader.last_written() if found_at_start else 0

    def read(self) -> bool:
        """Fold what was committed since the last read; whether anything was.

        Raises :class:`Gone` once every file of the journal is gone.
        """
        f = self.figures
        if self.ended and os.path.exists(self.reader.segment):
            # let go of: its files no longer change; a folder of weeks of
            # finished runs is not listed again for each of them every poll
            return False
        self._measure()
        if f.segments == f.segments_removed:
            raise Gone  # no file of it left: deleted or moved away
        if f.error is not None or self.ended:
            return False
        kinds: list[str] = []
        try:
            kinds = self._fold()
        except Gone:
            raise
        except _UNREADABLE as exc:
            # one journal that cannot be read on is said on its line (and its
            # kvstate_journal_readable gauge); the others are followed on
            f.error = str(exc)
            log.error("%s: cannot be read on: %s", self.path, exc)
        if f.closed and f.folded >= f.written:
            self.ended = True  # nothing follows engine_idle or engine_crashed
            log.info(
                "%s: ended with %s at seq %d; let go of", self.path, f.closed, self.reader.last
            )
        return bool(kinds)

    def _fold(self) -> list[str]:
        f = self.figures
        kinds: list[str] = []
        found: list[Violation] = []
        try:
            with contextlib.closing(self.reader.read(CHUNK)) as items:
                for item in items:
                    event = item.entry.event
                    if type(event) is Resumed:
                        found += self._restart(item, folded=f.folded + len(kinds))
                        continue
                    if item.seq == 1 and isinstance(event, ev.JournalOpened):
                        f.header(event)
                        if f.audited:
                            # settled state parks on disk: a watch runs for weeks
                            self.ledger = Ledger(
                                observes_workers=not f.role, archive=SpillArchive()
                            )
                            self._folder = Folder(self.ledger)
                    kinds.append(event.kind)
                    if self._folder is not None:
                        for _entry, got in self._folder.located((item,)):
                            found += got  # a record it refuses is named by file and seq
        finally:
            f.written = self.reader.written
            f.fold(kinds, [], self.ledger)
            self._found(found)
            if f.folded >= f.written:
                f.caught_up_at = time.monotonic()
        return kinds

    def _restart(self, item: Located, *, folded: int) -> list[Violation]:
        """Go on from a checkpoint: the records before it are gone. ``folded``:
        the records read before it. Returns the findings it lists that are
        not counted yet."""
        event: Resumed = item.entry.event  # type: ignore[assignment]
        f = self.figures
        f.header(event.header)
        if folded:
            f.overtaken += 1  # retention removed what this reader had not read yet
            log.warning(
                "%s: retention removed records %d..%d before they were read; going on from "
                "the checkpoint of %s",
                self.path, folded + 1, event.seq, event.path,
            )  # fmt: skip
        f.folded += event.seq - folded  # counted as folded: the checkpoint holds them
        if not f.audited:
            return []
        self.ledger = Ledger(archive=SpillArchive())
        self._folder = Folder(self.ledger)
        listed = self._folder.resume(item)
        self.ledger.observes_workers = not f.role  # as the live audit judges it
        if self.ledger.last_kind in _CLOSING:
            f.closed = self.ledger.last_kind  # the closing record was among those removed
        # the checkpoint lists the findings before it: those not counted yet
        return [v for v in listed if v.code is not Code.FROM_CHECKPOINT and v.seq > folded]

    def _found(self, found: list[Violation]) -> None:
        """Count findings, and say each new one in the log (up to LOGGED_FINDINGS)."""
        f = self.figures
        f.fold([], found, None, new_after=self.baseline)
        for v in found:
            if v.is_warning or v.seq <= self.baseline:
                continue
            self._logged += 1
            if self._logged <= LOGGED_FINDINGS:
                log.warning(
                    "%s: %s at seq %d: %s; explain it with: kvstate replay %s",
                    self.path, v.code.value, v.seq, v.message, self.path,
                )  # fmt: skip
            elif self._logged == LOGGED_FINDINGS + 1:
                log.warning(
                    "%s: more than %d new findings; the rest are counted on /metrics "
                    "(kvstate_violations_new_total), not said here",
                    self.path, LOGGED_FINDINGS,
                )  # fmt: skip

    def _measure(self) -> None:
        """The journal's files on disk: segments left and removed, bytes (each
        with its log: what the disk holds), and when it was last written."""
        f = self.figures
        on_disk = segments.present(self.path)
        index = self.reader.index
        f.segments = max(index, on_disk[-1][0]) if on_disk else index
        f.segments_removed = f.segments - len(on_disk)
        f.bytes = sum(file_bytes(name) for _, name in on_disk)
        times = []
        for file in [name for _, name in on_disk[-1:]] + [
            name + "-wal" for _, name in on_disk[-1:]
        ]:
            with contextlib.suppress(OSError):
                times.append(os.path.getmtime(file))
        if times:
            f.last_write = max(times)


class Watcher:
    """The journals under ``folder``, followed (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise JournalError(f"{self.folder}: not a folder")
        self._followed: dict[str, _Followed] = {}
        #: files in the folder that are not (yet) journals this reader can open, and why
        self.skipped: dict[str, str] = {}
        #: every file not (yet) opened, and why, as the last poll found it
        self._sighted: dict[str, str] = {}
        self._lock = threading.Lock()
        self._polls = 0

    def poll(self) -> bool:
        """One pass: pick up new journals, fold what each committed, forget the
        ones gone; whether anything new was read."""
        self._discover(found_at_start=self._polls == 0)
        self._polls += 1
        progressed = False
        for name, followed in list(self._followed.items()):
            with self._lock:
                try:
                    progressed |= followed.read()
                except Gone:
                    del self._followed[name]
                    log.warning(
                        "%s: gone (deleted or moved away); no longer followed", followed.path
                    )
        return progressed

    def _discover(self, *, found_at_start: bool) -> None:
        seen = set()
        for file in sorted(self.folder.rglob("*")):
            name = str(file)
            hidden = any(p.startswith(".") for p in file.relative_to(self.folder).parts)
            if hidden or name in self._followed or not file.is_file():
                continue
            if not is_journal_file(name):
                if name.endswith(".db"):
                    seen.add(name)
                    self._skip(name, "not an SQLite database (empty, or another kind of file)")
                continue
            seen.add(name)
            if not segments.is_start(name):
                continue  # followed through its first segment (or its oldest one left)
            if any(f.path == segments.head_name(name) for f in self._followed.values()):
                continue  # followed since before retention removed its head
            try:
                followed = _Followed(name, found_at_start=found_at_start)
            except (JournalError, RecordError, OSError) as exc:
                # not a kvstate journal, or one whose writer has not made its schema yet
                self._skip(name, str(exc))
                continue
            self._sighted.pop(name, None)
            if self.skipped.pop(name, None) is not None:
                log.info("%s: now a journal; followed", name)
            with self._lock:
                self._followed[name] = followed
        for name in set(self._sighted) - seen:
            self._sighted.pop(name)  # gone, or followed
            self.skipped.pop(name, None)

    def _skip(self, name: str, why: str) -> None:
        why = why.removeprefix(f"{name}: ")  # the line names the file once
        if any(os.path.exists(name + log) for log in ("-wal", "-journal")):
            # A database a connection has open for writing (another
            # application's: kvstate's journals appear whole, their tables
            # made under a hidden name): judged once its writer lets go of it.
            self._sighted.pop(name, None)
            self.skipped.pop(name, None)
            return
        # One line per file and reason, said the second poll it is found so:
        # another application may be making it, between creating the file and
        # opening its log.
        if self._sighted.get(name) == why and self.skipped.get(name) != why:
            log.warning("%s: skipped: %s", name, why)
            self.skipped[name] = why
        self._sighted[name] = why

    def figures(self) -> list[Figures]:
        """Every journal's figures (copies: safe to read while the watcher folds)."""
        with self._lock:
            return [
                attrs.evolve(
                    f.figures,
                    violations=f.figures.violations.copy(),
                    new_violations=f.figures.new_violations.copy(),
                )
                for f in self._followed.values()
            ]

    def close(self) -> None:
        """Forget every journal (none is held open between two polls)."""
        with self._lock:
            self._followed.clear()
