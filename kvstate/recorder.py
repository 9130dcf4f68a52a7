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

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable

from journal import Journal, JournalWriter, ProcessWriter

from .audit import Auditor
from .batches import decode_report, encode_batch
from .codec import Entry, to_row
from .events import EVENT_TYPES, JournalOpened
from .events import Event as _Event
from .violations import Violation

# Entry is a NamedTuple; tuple.__new__ builds one without the generated
# __new__ and _make's length check (this runs once per recorded event).
_tuple_new = tuple.__new__
_NONE: list[Violation] = []


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

    ``audit`` is where the fold runs: ``inline`` (each record as it is
    recorded, on the caller's thread), ``commit`` (each committed batch,
    where the journal is written: the writer thread or process, or the
    committing thread without a writer) or ``off``.
    """

    def __init__(
        self,
        header: JournalOpened,
        writer: JournalWriter[Entry] | ProcessWriter[Entry] | None = None,
        *,
        keep: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
        audit: str = "inline",
    ) -> None:
        self.writer = writer
        self.auditor = Auditor(audit)
        self._inline = audit == "inline"
        #: every entry recorded, when ``keep`` (tests, tools, small runs)
        self.entries: list[Entry] | None = [] if keep else None
        self._clock = clock
        self._lock = threading.Lock()
        self._next_seq = 1
        #: records of this commit still to fold here (``commit`` audit with
        #: no writer to fold them)
        self._unaudited: list[Entry] | None = None
        if audit == "commit" and not isinstance(writer, JournalWriter):
            self._unaudited = []
        # Chosen once, so the hot path makes no None checks.
        sinks: list[Callable[[Entry], None]] = []
        if writer is not None:
            sinks.append(writer.append)
        if self.entries is not None:
            sinks.append(self.entries.append)
        if self._unaudited is not None:
            sinks.append(self._unaudited.append)
        self._sinks = tuple(sinks)
        self.header = self.record(header, 0)
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
    ) -> Recorder:
        """A recorder writing a new journal database at ``path``.

        ``synchronous`` is the journal's durability level: ``NORMAL`` (a
        committed step survives the process being killed) or ``FULL`` (it
        also survives a power loss); see :mod:`journal.database`.
        ``policy``, ``engine`` and ``created`` are descriptive fields of the
        ``journal_opened`` header. ``run`` names the engine run; give every
        process of one run the same (a fresh random one when omitted), and
        each its ``role`` ("scheduler", "worker-0", ...): readers merge only
        journals of one run, each role once.

        Where the journal is written: by default, by a writer process
        (:class:`journal.ProcessWriter`: the engine's thread encodes one blob
        per commit and writes it to a pipe, nothing else), which with
        ``audit="commit"`` (the default) also runs the fold, so the caller
        pays for its guards and the hand-over only and gets the audit's
        findings within one commit. With ``process=False`` the journal is
        written by a thread of this process (``background``) or, without
        it, on the committing thread: for tests and small tools, where the
        start of a second interpreter costs more than it saves.
        """
        journal = Journal(path, synchronous=synchronous)
        if len(journal):
            journal.close()
            raise FileExistsError(f"{os.fspath(path)}: journal already has records")
        journal.create_views(journal_views())
        header = JournalOpened(
            version=1,
            block_size=block_size,
            world_size=world_size,
            policy=policy,
            engine=engine,
            created=created,
            run=run if run is not None else uuid.uuid4().hex,
            role=role,
        )
        writer: JournalWriter[Entry] | ProcessWriter[Entry]
        auditor: list[Auditor] = []  # the recorder's, once it exists
        if process:
            journal.close()
            writer = ProcessWriter(
                path,
                encode_batch,
                "kvstate.batches:BatchCodec",
                synchronous=synchronous,
                # read when the writer starts (at the first commit), once the
                # ledgers that record here are attached
                codec_arg=lambda: auditor[0].remote_config() or "",
                on_report=lambda report: auditor[0].add_found(decode_report(report)),
            )
        else:
            after = None
            if audit == "commit":

                def after(batch: list[Entry]) -> None:
                    auditor[0].apply_entries(batch)

            writer = JournalWriter(journal, to_row, background=background, after_write=after)
        recorder = cls(header, writer, keep=keep, clock=clock, audit=audit)
        auditor.append(recorder.auditor)
        return recorder

    @classmethod
    def in_memory(
        cls, *, block_size: int, world_size: int, policy: str | None = None, audit: str = "inline"
    ) -> Recorder:
        """A recorder that keeps entries in :attr:`entries` only."""
        header = JournalOpened(
            version=1, block_size=block_size, world_size=world_size, policy=policy
        )
        return cls(header, None, keep=True, audit=audit)

    def record(self, event: _Event, step: int) -> Entry:
        """Append one event; returns its entry (with its seq).

        The lock makes seq order equal to append order when several threads
        record; it is held for a counter increment and a list append only.
        """
        with self._lock:
            seq = self._next_seq
            self._next_seq = seq + 1
            entry: Entry = _tuple_new(Entry, (seq, step, self._clock(), event))
            for sink in self._sinks:
                sink(entry)
        return entry

    def emit(self, event: _Event, step: int) -> list[Violation]:
        """:meth:`record` one event and return the findings its ledger acts on.

        Inline, the record's own (folded now); otherwise whatever the audit
        found in committed batches since the last call, usually nothing.
        """
        seq, step, _ts, event = self.record(event, step)
        auditor = self.auditor
        if self._inline:
            return auditor.apply(seq, step, event)
        if auditor.untaken:
            return auditor.take_new()
        return _NONE

    @property
    def recorded(self) -> int:
        """How many events were recorded, the header included."""
        return self._next_seq - 1

    @property
    def violations(self) -> list[Violation]:
        """Every finding of the audit so far (see :mod:`kvstate.audit`)."""
        return self.auditor.violations

    def commit(self, *, wait: bool = True) -> None:
        """End a group commit (an engine step): the batch goes to disk as one transaction.

        Returns once the batch is durable (see :meth:`journal.JournalWriter.commit`);
        ``wait=False`` hands it to the writer without waiting.
        """
        if self.writer is not None:
            self.writer.commit(wait=wait)
        if self._unaudited:
            with self._lock:
                batch, self._unaudited[:] = list(self._unaudited), []
            # A writer process folds what it is given, unless the recorder
            # carries ranks alone: their job specs never reach the journal.
            if not (isinstance(self.writer, ProcessWriter) and self.auditor.remote_config()):
                self.auditor.apply_entries(batch)

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

    def close(self) -> None:
        """Flush and close the journal."""
        if self.writer is not None:
            self.writer.close()
        elif self._unaudited:
            self.commit()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
