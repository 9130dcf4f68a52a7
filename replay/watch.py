"""Follow every journal under a folder as processes write them, and fold each.

``kvstate watch DIR`` (see :mod:`replay.cli.watch`) polls the folder: a
journal that appears is opened, and each poll reads what was committed
since the last one, chain-verified (:meth:`journal.Journal.stored_rows`),
and folds it. A journal one process writes for every side is folded as
replay folds it; a scheduler's journal as the writer process's audit folds
it (its ranks' reports are in other files: completions are checked against
the world size); a rank's journal is counted, and judged with its
scheduler's by ``kvstate replay``. Each journal's figures
(:class:`kvstate.figures.Figures`) are what ``/metrics`` publishes.

Nothing here waits on the clock for correctness: a poll reads what is
there. The seconds of audit lag are wall time, for an alert.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import attrs

from journal import JournalError, RecordError, is_journal_file, segments
from kvstate import events as ev
from kvstate.checkpoint import Resumed
from kvstate.codec import from_stored
from kvstate.errors import TemporaryStorageError
from kvstate.figures import Figures
from kvstate.ledger import Ledger
from kvstate.spill import SpillArchive
from kvstate.violations import Code

from .sources import resumed
from .verdict import resume

#: rows folded per journal per poll at most (the others' turn comes in between)
CHUNK = 20_000


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:  # the files are the engine's: retention removes the oldest
        return 0


class _Followed:
    """One journal being followed: its first segment's file, then each later
    segment as the writer rotates into it (journal.segments)."""

    def __init__(self, path: str) -> None:
        self.journal = segments.open_first(path)
        # the first segment's name, even where retention removed it
        self.path = segments.head_name(self.journal.path)
        row = self.journal.segment()
        self._ident: str | None = None if row is None else row[1]
        self.index = 1 if row is None else row[0]
        #: the oldest segment that may still be on disk: retention removes
        #: whole segments, oldest first, never the one being written
        self._oldest = 1
        self.last = 0
        self.ledger: Ledger | None = None
        self.figures = Figures(journal=path)
        self.figures.segments = self.index
        self._resume()

    def _resume(self) -> None:
        """Where the head was removed (journal.retention): go on from the checkpoint."""
        item = resumed(self.journal)
        if item is None:
            return
        event: Resumed = item.entry.event  # type: ignore[assignment]
        f = self.figures
        f.header(event.header)
        self.last = f.folded = f.written = event.seq  # what the checkpoint folded
        if f.audited:
            self.ledger = Ledger(archive=SpillArchive())
            found = resume(self.ledger, item)
            self.ledger.observes_workers = not f.role  # as the live audit judges it
            f.fold([], [v for v in found if v.code is not Code.FROM_CHECKPOINT], self.ledger)

    def _next_segment(self) -> bool:
        """Go on to the next segment once the writer began it (the current one is whole)."""
        # the id from the open segment: retention may have removed the first
        self._ident = self._ident or segments.id_of_open(self.journal)
        nxt = segments.open_next(
            self.path, self.index + 1, self.journal.head(), self.journal.path, self._ident
        )
        if nxt is None:
            return False
        self.journal.close()
        self.journal, self.index = nxt, self.index + 1
        self.figures.segments = self.index
        return True

    def read(self) -> bool:
        """Fold what was committed since the last read; whether anything was."""
        f = self.figures
        if f.error is not None:
            return False
        kinds: list[str] = []
        found = []
        try:
            if self.last >= self.journal.head()[0]:
                self._next_segment()
            f.written = max(0, self.journal.head()[0])
            while self._oldest < self.index and not os.path.exists(
                segments.segment_path(self.path, self._oldest)
            ):
                self._oldest += 1
            f.segments_removed = self._oldest - 1
            f.bytes = sum(
                _size(segments.segment_path(self.path, i))
                for i in range(self._oldest, self.index + 1)
            )
            for seq, kind, step, rank, ts, payload in self.journal.stored_rows(
                after=self.last, upto=self.last + CHUNK
            ):
                entry = from_stored(seq, kind, step, rank, ts, payload, self.path)
                self.last = seq
                if seq == 1 and isinstance(entry.event, ev.JournalOpened):
                    f.header(entry.event)
                    if f.audited:
                        # settled state parks on disk: a watch runs for weeks
                        self.ledger = Ledger(observes_workers=not f.role, archive=SpillArchive())
                kinds.append(kind)
                if self.ledger is not None:
                    found += self.ledger.apply(seq, entry.step, entry.event)
        except (RecordError, JournalError, OSError, TemporaryStorageError) as exc:
            # one journal that cannot be read on is said on its line (and its
            # kvstate_journal_readable gauge); the others are followed on
            f.error = str(exc)
        f.fold(kinds, found, self.ledger)
        if f.folded >= f.written:
            f.caught_up_at = time.monotonic()
        return bool(kinds)

    def close(self) -> None:
        self.journal.close()


class Watcher:
    """The journals under ``folder``, followed (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise JournalError(f"{self.folder}: not a folder")
        self._followed: dict[str, _Followed] = {}
        #: files that are not (yet) journals this reader can open, and why
        self.unopened: dict[str, str] = {}
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """One pass: pick up new journals, fold what each committed; whether
        anything new was read."""
        self._discover()
        progressed = False
        for followed in list(self._followed.values()):
            with self._lock:
                progressed |= followed.read()
        return progressed

    def _discover(self) -> None:
        for file in sorted(self.folder.rglob("*")):
            name = str(file)
            hidden = any(p.startswith(".") for p in file.relative_to(self.folder).parts)
            if hidden or name in self._followed or not file.is_file():
                continue
            if not is_journal_file(name):
                continue
            if not segments.is_start(name):
                continue  # followed through its first segment (or its oldest one left)
            if any(f.path == segments.head_name(name) for f in self._followed.values()):
                continue  # followed since before retention removed its head
            try:
                followed = _Followed(name)
            except (JournalError, RecordError, OSError) as exc:
                # a database whose writer has not made its schema yet
                self.unopened[name] = str(exc)
                continue
            self.unopened.pop(name, None)
            with self._lock:
                self._followed[name] = followed

    def figures(self) -> list[Figures]:
        """Every journal's figures (copies: safe to read while the watcher folds)."""
        with self._lock:
            return [
                attrs.evolve(f.figures, violations=f.figures.violations.copy())
                for f in self._followed.values()
            ]

    def close(self) -> None:
        with self._lock:
            for followed in self._followed.values():
                followed.close()
            self._followed.clear()
