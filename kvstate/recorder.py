"""The recorder: gives each event its place in the journal, and its audit.

A :class:`Recorder` stamps an event with the next ``seq``, the caller's
``step`` and a monotonic ``ts``, and appends it to a sink: a journal writer
(a thread of this process, or a writer process) and/or an in-memory list.
That and a list append for the audit are all the hot path does.

Every recorder has an :class:`~kvstate.audit.Auditor`: the fold, with every
invariant, run on what the recorder records (see :mod:`kvstate.audit` for
where it runs). The ledgers that record here call :meth:`Recorder.emit`,
which records and returns the findings each ledger must act on.

The first record of every journal is the ``journal_opened`` header, written
by the recorder itself when it is created.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable

from journal import Journal, segments
from journal.rotation import Rotation
from kvstate.writer_protocol import Writer

from . import build
from .audit import Auditor
from .codec import Entry, refusal
from .errors import RefusedValueError
from .events import EVENT_TYPES, JournalOpened
from .events import Event as _Event
from .extras import require_metrics_extra
from .figures import metrics_address
from .live_counts import LiveCounts
from .placement import Placement, given, place
from .violations import Violation, raise_for

# Entry is a NamedTuple; tuple.__new__ builds one without the generated
# __new__ and _make's length check (this runs once per recorded event).
_tuple_new = tuple.__new__
_NONE: list[Violation] = []

#: recorders with a strict ledger and a journal, not yet closed (see _close_at_exit)
_OPEN: weakref.WeakSet[Recorder] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A strict recorder never closed: close it, and print what its audit found.

    Registered after the journal writers' own exit hooks, so it runs before
    them (atexit is last in, first out): the journal is still open here, and
    closing it brings the writer process's last findings back. Nothing is
    raised at exit; the findings go to stderr so they are never silent.
    """
    for recorder in list(_OPEN):
        with contextlib.suppress(Exception):
            recorder.close(raise_found=False)
        pending = [v for v in recorder.auditor.take_new() if not v.is_warning]
        if pending:
            path = getattr(recorder.writer, "path", "the journal")
            print(
                f"kvstate: {path} was never closed; its audit found "
                f"{len(pending)} violation(s) no call raised:",
                file=sys.stderr,
            )
            for v in pending:
                print(f"kvstate:   {v.code} at seq {v.seq}: {v.message}", file=sys.stderr)


def _log_first(log: logging.Logger, path: str, v: Violation) -> None:
    """The first violation of a journal, said once where the host logs."""
    who = ", ".join(
        f"{name} {value}"
        for name, value in (("job", v.job), ("request", v.req), ("rank", v.rank))
        if value is not None
    )
    log.warning(
        "first violation in %s: %s at seq %d%s: %s; explain it with: kvstate replay %s",
        path,
        v.code.value,
        v.seq,
        f" ({who})" if who else "",
        v.message,
        path,
    )


def journal_views() -> dict[str, tuple[str, ...]]:
    """Field names per kind, for the journal's per-kind SQL views."""
    views: dict[str, tuple[str, ...]] = {}
    for kind, cls in EVENT_TYPES.items():
        views[kind] = cls.payload_fields
    return views


class Recorder:
    """Numbers events, hands them to the journal writer, and audits them.

    Thread-safe: the scheduler and every rank of one process may share a
    recorder; ``seq`` order is then the order in which they recorded.

    ``audit`` is the audit's mode: ``inline`` (each record as it is
    recorded, on the caller's thread), ``commit`` (each committed batch,
    where the journal is written) or ``off``. ``writer`` is a journal writer
    of the caller's (None: entries in memory only); :meth:`open` passes a
    ``placement`` instead, the writer and where the fold runs
    (:mod:`kvstate.placement`).
    """

    def __init__(
        self,
        header: JournalOpened,
        writer: Writer[Entry] | None = None,
        *,
        keep: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
        audit: str = "inline",
        placement: Placement | None = None,
    ) -> None:
        if placement is None:
            placement = given(Auditor(audit), writer)
        elif writer is not None:
            raise ValueError("a recorder takes a writer or a placement, not both")
        self.placement = placement
        self.writer = placement.writer
        self.auditor = placement.auditor
        #: the fold of each record as it is recorded, where it runs on the caller's thread
        self._fold_now = placement.fold_now
        #: a ledger in strict mode records here: close() raises what no call raised
        self.strict = False
        #: the writer process's audit counts, shared as it folds (``live_counts``)
        self.live_counts: LiveCounts | None = None
        #: every entry recorded, when ``keep`` (tests, tools, small runs)
        self.entries: list[Entry] | None = [] if keep else None
        #: with ``keep``, the seqs a guard suspected of a breach (see :meth:`emit`)
        self.suspected: list[int] | None = [] if keep else None
        self._clock = clock
        #: the contract's check of each record's values, on the caller's
        #: thread, unless the writer checks them (a writer process, which
        #: writes a ``record_refused`` in place of a refused record)
        self._check = placement.check
        self._lock = threading.Lock()
        self._next_seq = 1
        self._closed = False
        #: records of this commit still to fold on the committing thread
        #: (where the placement says so)
        self._unaudited: list[Entry] | None = [] if placement.keeps_batches else None
        # Chosen once, so the hot path makes no None checks.
        sinks: list[Callable[[Entry], None]] = []
        if self.writer is not None:
            sinks.append(self.writer.append)
        if self.entries is not None:
            sinks.append(self.entries.append)
        if self._unaudited is not None:
            sinks.append(self._unaudited.append)
        self._sinks = tuple(sinks)
        problem = refusal(header)  # a journal must start with a header it can read
        if problem is not None:
            raise RefusedValueError(problem)
        self.header = self._append(header, 0)
        self.auditor.header(self.header)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        block_size: int,
        world_size: int,
        background: bool = True,
        process: bool = True,
        audit: str = "commit",
        keep: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
        synchronous: str = "NORMAL",
        policy: str | None = None,
        engine: str | None = None,
        created: str | None = None,
        run: str | None = None,
        role: str | None = None,
        protocol: str | None = None,
        metrics: str | None = None,
        logger: logging.Logger | None = None,
        live_counts: bool = False,
        rotate_bytes: int | None = None,
        rotate_seconds: float | None = None,
        retain_bytes: int | None = None,
        retain_seconds: float | None = None,
    ) -> Recorder:
        """A recorder writing a new journal database at ``path``.

        ``synchronous`` is the journal's durability level: ``NORMAL`` (a
        committed step survives the process being killed) or ``FULL`` (it
        also survives a power loss); see :mod:`journal.database`.
        ``policy``, ``engine`` and ``created`` are descriptive fields of the
        ``journal_opened`` header. ``run`` names the engine run; give every
        process of one run the same (a fresh random one when omitted), and
        each its ``role`` ("scheduler", "worker-0", ...): readers merge only
        journals of one run, each role once. ``protocol`` names the
        connector protocol the journal follows (``"offloading"``: see
        :mod:`kvstate.tier_events`).

        Where the journal is written: by default, by a writer process
        (:class:`kvstate.process_writer.ProcessWriter`: the engine's thread encodes one blob
        per commit and writes it to a pipe, nothing else), which with
        ``audit="commit"`` (the default) also runs the fold, so the caller
        pays for its guards and the hand-over only and gets the audit's
        findings within one commit. With ``process=False`` the journal is
        written by a thread of this process (``background``) or, without
        it, on the committing thread: for tests and small tools, where the
        start of a second interpreter costs more than it saves.

        ``metrics`` (``HOST:PORT``) has the writer process serve the
        journal's live figures on ``/metrics`` (docs/ops.md; the ``metrics``
        extra: without it, :class:`~kvstate.extras.MissingExtra` before a
        file exists). The first violation the audit finds is logged once, at
        warning level, on ``logger`` (``logging.getLogger("kvstate")`` by
        default), with the ``kvstate replay`` command that explains it.
        ``live_counts`` shares the writer's audit counts with this process
        as it folds (:attr:`live_counts`, :mod:`kvstate.live_counts`).
        ``rotate_bytes`` and ``rotate_seconds`` rotate the journal into
        segments (``path``, then ``NAME.000002.db``, ...: see
        :mod:`journal.segments`) when the current one reaches that size or
        age; every reader takes the first segment as the whole journal.
        ``retain_bytes`` and ``retain_seconds`` keep the rotated journal
        within that many bytes or that age (:mod:`journal.retention`): each
        new segment begins with a checkpoint of the fold, and the oldest
        segments are removed; replay goes on from the checkpoint and says so.
        """
        rotation = None
        if rotate_bytes is not None or rotate_seconds is not None or retain_bytes or retain_seconds:
            rotation = Rotation(
                max_bytes=rotate_bytes,
                max_seconds=rotate_seconds,
                keep_bytes=retain_bytes,
                keep_seconds=retain_seconds,
            )
        if metrics is not None:
            metrics_address(metrics)  # refused before a file exists
            # so is a missing extra: the writer process would only say so on its stderr
            require_metrics_extra("Recorder.open(metrics=...)")
        header = build.journal_opened(
            version=1,
            block_size=block_size,
            world_size=world_size,
            policy=policy,
            engine=engine,
            created=created,
            run=run if run is not None else uuid.uuid4().hex,
            role=role,
            protocol=protocol,
        )
        problem = refusal(header)  # before there is a file: nothing to clean up
        if problem is not None:
            raise RefusedValueError(problem)
        if segments.later_segments(os.fspath(path)):
            # its head removed by retention, or a stray segment: either is evidence
            raise FileExistsError(
                f"{os.fspath(path)}: later segments of a journal of this name exist; "
                "a new journal is written under a name of its own"
            )
        journal = Journal(path, synchronous=synchronous)
        if len(journal):
            journal.close()
            raise FileExistsError(f"{os.fspath(path)}: journal already has records")
        journal.create_views(journal_views())
        auditor = Auditor(audit)
        counts = LiveCounts.create() if live_counts and process else None
        placed = place(
            path,
            journal,
            auditor,
            process=process,
            background=background,
            synchronous=synchronous,
            metrics=metrics,
            counts=None if counts is None else counts.path,
            rotation=rotation,
        )
        recorder = cls(header, keep=keep, clock=clock, placement=placed)
        recorder.live_counts = counts
        log = logger if logger is not None else logging.getLogger("kvstate")
        auditor.on_first = functools.partial(_log_first, log, os.fspath(path))
        return recorder

    @classmethod
    def in_memory(
        cls, *, block_size: int, world_size: int, policy: str | None = None, audit: str = "inline"
    ) -> Recorder:
        """A recorder that keeps entries in :attr:`entries` only."""
        header = build.journal_opened(
            version=1, block_size=block_size, world_size=world_size, policy=policy
        )
        return cls(header, keep=True, audit=audit)

    def record(self, event: _Event, step: int) -> Entry:
        """Append one event no ledger acts on (the runtime's audit records); returns its entry.

        An inline audit folds it now; what it finds is for :attr:`violations`
        and, with a strict ledger here, for :meth:`close` to raise.
        """
        entry = self._append(event, step)
        if self._fold_now is not None:
            self.auditor.add_found(self._fold_now(entry.seq, step, event), folded=True)
        return entry

    def _append(self, event: _Event, step: int) -> Entry:
        """Stamp one event with its seq and hand it to every sink.

        The lock makes seq order equal to append order when several threads
        record; it is held for a counter increment and a list append only.
        A value the contract refuses is refused here, before it has a seq,
        unless the writer checks (see ``_check``).
        """
        check = self._check
        if check is not None:
            problem = check(event)
            if problem is not None:
                raise RefusedValueError(problem)
        with self._lock:
            seq = self._next_seq
            self._next_seq = seq + 1
            entry: Entry = _tuple_new(Entry, (seq, step, self._clock(), event))
            for sink in self._sinks:
                sink(entry)
        return entry

    def emit(self, event: _Event, step: int, suspect: bool = False) -> list[Violation]:
        """:meth:`record` one event and return the findings its ledger acts on.

        Inline, the record's own (folded now); otherwise whatever the audit
        found in committed batches since the last call, usually nothing.
        ``suspect``: the ledger's guard decided from its own state that this
        record breaks an invariant (a table overrun, an effect of a job that
        is not live, ...). The guard only says when to look; the fold
        decides: with a strict ledger recording here the batch is committed
        and folded before this returns (:meth:`settle`), so the record's own
        findings come back now.
        """
        seq, step, _ts, event = self._append(event, step)
        auditor = self.auditor
        fold_now = self._fold_now
        if suspect:
            if self.suspected is not None:
                self.suspected.append(seq)
            if self.strict and fold_now is None:
                self.settle()
        if fold_now is not None:
            found = fold_now(seq, step, event)
            if auditor.untaken:  # what records no ledger made were found to break
                return auditor.take_new() + found
            return found
        if auditor.untaken:
            return auditor.take_new()
        return _NONE

    def settle(self) -> None:
        """Commit, and return once the audit has folded everything recorded so far."""
        if self.placement.settles:
            self.commit(settle=True)

    @property
    def recorded(self) -> int:
        """How many events were recorded, the header included."""
        return self._next_seq - 1

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the journal is then flushed and ended)."""
        return self._closed

    @property
    def violations(self) -> list[Violation]:
        """The audit's findings so far, the first :data:`~kvstate.violations.LISTED_FINDINGS`
        of them (``auditor.omitted`` counts the rest; replay lists them all)."""
        return self.auditor.violations

    def start_writer(self) -> None:
        """Start the writer process now, where there is one (see
        :meth:`kvstate.process_writer.ProcessWriter.start`); else nothing. Call it once the
        ledgers that record here are attached: the process learns at its start
        whether it folds."""
        start = getattr(self.writer, "start", None)
        if start is not None:
            start()

    def commit(self, *, wait: bool = True, settle: bool = False) -> None:
        """End a group commit (an engine step): the batch goes to disk as one transaction.

        Returns once the batch is durable (see :mod:`kvstate.writer_protocol`);
        ``wait=False`` hands it to the writer without waiting; ``settle``
        also waits for the writer's audit of it.
        """
        if self.writer is not None:
            self.writer.commit(wait=wait, settle=settle)
        if self._unaudited:
            with self._lock:
                batch, self._unaudited[:] = list(self._unaudited), []
            self.placement.committed(batch)

    def flush(self) -> None:
        """Commit and wait until the journal holds every recorded event."""
        if self.writer is not None:
            self.writer.flush()
        elif self._unaudited:
            self.commit()

    def flush_before_raising(self) -> None:
        """Put everything recorded on disk because the caller is about to raise.

        Used on every error path of the ledgers, so the records up to and
        including the one that broke an invariant survive whatever the
        exception does to the process. A failing journal must not hide the
        original error, so a write failure here is left to the next commit.
        """
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.flush()

    def close(self, *, raise_found: bool = True) -> None:
        """Flush and close the journal.

        With a strict ledger recording here, a finding of the audit that no
        ledger call raised yet (the writer's audit of the last batches)
        raises now, once the journal is closed, unless ``raise_found`` is
        False. Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            if self.writer is not None:
                self.writer.close()
            elif self._unaudited:
                self.commit()
        finally:
            if self.live_counts is not None:
                self.live_counts.close()
        if raise_found and self.strict and self.auditor.untaken:
            raise_for(self.auditor.take_new())

    def attach_strict(self) -> None:
        """A strict ledger records here (see :meth:`close`)."""
        self.strict = True
        if self.writer is not None and not self._closed:
            _OPEN.add(self)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # An exception already unwinding wins over what the audit found.
        self.close(raise_found=kind is None)
