"""Time travel through a journal: the ledger as of any seq, fast.

A background pass folds the journal once, collecting what the overview needs
(counts by kind, violations) and a bounded number of ledger snapshots.
:meth:`TimeTravel.ledger_at` then starts from the nearest snapshot at or
before the asked seq, or from the current cursor when moving forward, and
folds only the records in between: no full refold per keypress.

Records come from the one reader, :func:`replay.sources.open_records` (by
seq from a journal database, opened read-only; from memory for JSON Lines
and merged journals), and are folded by the one fold loop,
:meth:`kvstate.folder.Folder.located`. In follow mode new records are picked up as
another process appends them.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from typing import overload

from journal import RecordError
from journal.database import BEFORE_FIRST
from kvstate.archive import Archive
from kvstate.codec import Entry
from kvstate.folder import Folder
from kvstate.ledger import PARK_AFTER, SWEEP_EVERY, Ledger
from kvstate.violations import CODE_ORDER, Code, Violation

from .sources import open_records

#: records between two checks of a fold's ``cancel``
_CANCEL_EVERY = 256


class TimeTravel:
    """The ledger at any seq of a journal (or of several merged), with an overview
    built in the background."""

    def __init__(
        self,
        path: str | list[str],
        *,
        snapshot_every: int = 2000,
        max_snapshots: int = 256,
        park_after: int = PARK_AFTER,
        sweep_every: int = SWEEP_EVERY,
    ) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        self.path = ", ".join(paths)
        self.records = open_records(paths)
        self.last_seq = self.records.last_seq()
        self.kinds: Counter[str] = Counter()
        #: every violation found so far, in seq order (the fold goes forward)
        self.violations: list[Violation] = []
        self.warnings: list[Violation] = []
        # The seqs of ``violations`` (for bisect) and per code its count and
        # first seq, kept as the index grows: a view asks for the few
        # violations it shows, never rescans them all.
        self._violation_seqs = array("q")
        self._codes: dict[Code, list[int]] = {}
        self.indexed_seq = BEFORE_FIRST
        self.error: Exception | None = None
        # A snapshot costs what is live (parked state is shared, see
        # kvstate.archive): take about ``max_snapshots / 2`` over the journal,
        # and never more than ``max_snapshots``, so going back folds a few
        # thousand records at most.
        self._every = max(snapshot_every, self.last_seq // max(1, max_snapshots // 2))
        self._max_snapshots = max_snapshots
        # Both park settled state in memory (snapshots copy it packed), so a
        # snapshot costs what is live, not the whole history.
        first = Ledger(archive=Archive(), park_after=park_after, sweep_every=sweep_every)
        #: the seq the records begin after: where retention removed the head
        #: (journal.retention), the checkpoint's, which the first ledger is
        self.first_seq = BEFORE_FIRST
        resumed = getattr(self.records, "resumed", None)
        if resumed is not None:
            for v in Folder(first).resume(resumed):
                (self.warnings.append(v) if v.is_warning else self._add_violation(v))
            self.first_seq = self.indexed_seq = resumed.seq
        self._snapshots: list[tuple[int, Ledger]] = [(self.first_seq, first)]
        self._index_ledger = first.snapshot()
        self._cursor: tuple[int, Ledger] | None = None
        #: a ledger folded in advance, behind the cursor (see :meth:`prepare`)
        self._spare: tuple[int, Ledger] | None = None
        #: one fold at a time: ``_cursor`` is folded forward in place
        self._fold_lock = threading.Lock()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the background pass ---------------------------------------------------------

    def index(self, limit: int | None = None) -> int:
        """Fold up to ``limit`` more records into the overview; returns how many."""
        done = 0
        upto = self.last_seq
        try:
            ledger = self._index_ledger
            items = self.records.between(self.indexed_seq, upto)
            for entry, found in Folder(ledger).located(items):
                with self._lock:
                    self.kinds[entry.event.kind] += 1
                    for v in found:
                        if v.is_warning:
                            self.warnings.append(v)
                        else:
                            self._add_violation(v)
                    self.indexed_seq = entry.seq
                if self._index_ledger.records % self._every == 0:
                    snapshot = self._index_ledger.snapshot()  # outside the lock: it takes a while
                    with self._lock:
                        self._keep_snapshot(entry.seq, snapshot)
                done += 1
                if (limit is not None and done >= limit) or self._stop.is_set():
                    break
        except RecordError as exc:
            self.error = exc if exc.path is not None else exc.located(path=self.path)
        except OSError as exc:
            self.error = exc
        return done

    def _add_violation(self, v: Violation) -> None:
        seqs = self._violation_seqs
        if seqs and v.seq < seqs[-1]:
            # Findings come at the record that causes them, so in seq order;
            # kept sorted regardless, since every lookup bisects.
            at = bisect.bisect_right(seqs, v.seq)
            self.violations.insert(at, v)
            seqs.insert(at, v.seq)
        else:
            self.violations.append(v)
            seqs.append(v.seq)
        counted = self._codes.get(v.code)
        if counted is None:
            self._codes[v.code] = [1, v.seq]
        else:
            counted[0] += 1

    def _keep_snapshot(self, seq: int, ledger: Ledger) -> None:
        self._snapshots.append((seq, ledger))
        if len(self._snapshots) > self._max_snapshots:
            # Thin out: keep every other snapshot, take them half as often.
            self._snapshots = self._snapshots[::2]
            self._every *= 2

    def start(self, *, follow: bool = False, poll_interval: float = 0.25) -> None:
        """Index in a background thread; with ``follow``, keep picking up new records."""

        def run() -> None:
            while not self._stop.is_set():
                self.index()
                if not follow or self.error is not None:
                    return
                self._stop.wait(poll_interval)
                self.refresh()

        self._thread = threading.Thread(target=run, name="journal-index", daemon=True)
        self._thread.start()

    def refresh(self) -> bool:
        """Look for records appended since; True if there are new ones."""
        try:
            last = self.records.last_seq()
        except (RecordError, OSError) as exc:
            self.error = exc
            return False
        grew = last > self.last_seq
        self.last_seq = max(last, self.last_seq)
        return grew

    @property
    def indexed(self) -> bool:
        return self.indexed_seq >= self.last_seq

    @property
    def indexing(self) -> bool:
        """The background pass is still running (it will index further)."""
        return self._thread is not None and self._thread.is_alive() and not self.indexed

    @property
    def empty(self) -> bool:
        """Indexed to the end without finding a journal_opened record."""
        return self.indexed and self._index_ledger.header is None

    @property
    def unfinished(self) -> bool:
        """Indexed to the end, and the journal ends before engine_idle
        (docs/events.md, "Complete and incomplete journals")."""
        return self.indexed and bool(self._index_ledger.end())

    def stop(self, *, wait: bool = True) -> None:
        """Stop the background pass; with ``wait``, join it and close the journal."""
        self._stop.set()
        if not wait:
            return
        if self._thread is not None:
            # No deadline: the pass notices the stop within a few hundred
            # records, and a thread still reading when the journal closes fails.
            self._thread.join()
        self.records.close()

    # -- time travel -------------------------------------------------------------------

    @overload
    def ledger_at(self, seq: int) -> Ledger: ...
    @overload
    def ledger_at(self, seq: int, cancel: Callable[[], bool]) -> Ledger | None: ...

    def ledger_at(self, seq: int, cancel: Callable[[], bool] | None = None) -> Ledger | None:
        """The ledger as it stood after record ``seq`` (replay --at SEQ).

        With ``cancel``, the fold stops early and returns None once it
        returns true (checked every few hundred records); what was folded so
        far is kept as the starting point of the next call.
        """
        with self._fold_lock:
            seq = max(self.first_seq, min(seq, self.last_seq))
            base_seq, ledger = self._start_for(seq, self._cursor, self._spare)
            reached = self._fold(ledger, base_seq, seq, cancel)
            # what was folded so far is the start of the next call
            self._cursor = (reached, ledger)
            return ledger if reached == seq else None

    def prepare(self, seq: int, cancel: Callable[[], bool] | None = None) -> None:
        """Fold a spare ledger to ``seq`` in advance, for a later :meth:`ledger_at`.

        The inspector calls this on its fold thread when it has nothing else
        to do, with the start of the step before the cursor: a key that goes
        back (left, PgUp) then folds a few records forward from here instead
        of thousands from the snapshot before. What was folded when
        ``cancel`` stops it is kept: it is still a nearer start.
        """
        with self._fold_lock:
            seq = max(self.first_seq, min(seq, self.last_seq))
            for held in (self._cursor, self._spare):
                if held is not None and held[0] == seq:
                    return
            # never the cursor's ledger: the spare must be a ledger of its own
            base_seq, ledger = self._start_for(seq, self._spare)
            self._spare = (self._fold(ledger, base_seq, seq, cancel), ledger)

    def _start_for(self, seq: int, *held: tuple[int, Ledger] | None) -> tuple[int, Ledger]:
        """The nearest ledger at or before ``seq`` to fold forward, and its seq.

        A ``held`` ledger (the cursor's, the spare) is folded on in place:
        it belongs to this object, and whoever held it lets go of it here. A
        stored snapshot is copied, since it must stay as it was.
        """
        with self._lock:
            i = bisect.bisect_right([s for s, _ in self._snapshots], seq) - 1
            base_seq, stored = self._snapshots[i]
        near = [h for h in held if h is not None and base_seq <= h[0] <= seq]
        if not near:
            return base_seq, stored.snapshot()
        best = max(near, key=lambda h: h[0])
        if best is self._spare:
            self._spare = None
        return best

    def _fold(
        self, ledger: Ledger, after: int, upto: int, cancel: Callable[[], bool] | None
    ) -> int:
        """Apply the records ``after < seq <= upto``; returns ``upto``, or the
        last seq applied when ``cancel`` stopped it first."""
        items = self.records.between(after, upto)
        for n, (entry, _found) in enumerate(Folder(ledger).located(items)):
            if cancel is not None and n % _CANCEL_EVERY == 0 and cancel():
                return entry.seq
        return upto

    def entries(self, after: int, upto: int) -> list[Entry]:
        """The entries with ``after < seq <= upto``, in order."""
        return [item.entry for item in self.records.between(after, upto)]

    def stream(self, after: int, upto: int) -> Iterator[Entry]:
        """:meth:`entries` one at a time, for a scan that must not hold them all."""
        return (item.entry for item in self.records.between(after, upto))

    def violations_between(self, after: int, upto: int) -> list[Violation]:
        """The violations of records with ``after < seq <= upto``, in order."""
        with self._lock:
            lo = bisect.bisect_right(self._violation_seqs, after)
            hi = bisect.bisect_right(self._violation_seqs, upto)
            return self.violations[lo:hi]

    def violations_upto(self, seq: int) -> list[Violation]:
        return self.violations_between(BEFORE_FIRST, seq)

    def violations_around(self, seq: int, before: int, after: int) -> tuple[int, list[Violation]]:
        """At most ``before`` violations at or before ``seq`` and ``after`` past it,
        with the index of the first one returned (a page of the Violations view)."""
        with self._lock:
            here = bisect.bisect_right(self._violation_seqs, seq)
            start = max(0, here - before)
            return start, self.violations[start : here + after]

    def codes(self) -> list[tuple[Code, int, int]]:
        """``(code, count, first seq)`` of the violations found so far, in report order."""
        with self._lock:
            counted = [(code, n, first) for code, (n, first) in self._codes.items()]
        return sorted(counted, key=lambda c: CODE_ORDER[c[0]])

    def next_violation(self, seq: int) -> Violation | None:
        with self._lock:
            i = bisect.bisect_right(self._violation_seqs, seq)
            return self.violations[i] if i < len(self.violations) else None

    def previous_violation(self, seq: int) -> Violation | None:
        with self._lock:
            i = bisect.bisect_left(self._violation_seqs, seq)
            return self.violations[i - 1] if i > 0 else None

    def step_start(self, seq: int, direction: int) -> int:
        """The first record of the next step (``+1``) or of the previous one (``-1``)."""
        here = next(iter(self.entries(seq - 1, seq)), None)
        step = here.step if here is not None else 0
        if direction > 0:
            for entry in (item.entry for item in self.records.between(seq, self.last_seq)):
                if entry.step > step:
                    return entry.seq
            return self.last_seq
        # Look back in growing windows: a step is usually a few records, and
        # every record read here is decoded on the caller's (the UI's) thread.
        for span in (64, 512, 5000):
            window = self.entries(max(0, seq - span), seq - 1)
            earlier = [e for e in window if e.step < step]
            if seq - span <= 0 or (earlier and earlier[0].step < earlier[-1].step):
                break  # the previous step starts inside the window
        if not earlier:
            return window[0].seq if window else seq
        target = earlier[-1].step
        return next(e.seq for e in window if e.step == target)
