"""The recorder: gives each event its place in the journal.

A :class:`Recorder` stamps an event with the next ``seq``, the caller's
``step`` and a monotonic ``ts``, and appends it to a sink: a
:class:`journal.JournalWriter` (which encodes and writes on its own thread)
and/or an in-memory list. That is all the hot path does; no encoding and no
disk I/O happen on the caller's thread.

The first record of every journal is the ``journal_opened`` header, written
by the recorder itself when it is created.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from journal import Journal, JournalWriter, ProcessWriter

from .batches import encode_batch
from .codec import Entry, to_row
from .events import EVENT_TYPES, JournalOpened
from .events import Event as _Event

# Entry is a NamedTuple; tuple.__new__ builds one without the generated
# __new__ and _make's length check (this runs once per recorded event).
_tuple_new = tuple.__new__


def journal_views() -> dict[str, tuple[str, ...]]:
    """Field names per kind, for the journal's per-kind SQL views."""
    views: dict[str, tuple[str, ...]] = {}
    for kind, cls in EVENT_TYPES.items():
        views[kind] = cls.payload_fields
    return views


class Recorder:
    """Numbers events and hands them to the journal writer.

    Thread-safe: the scheduler and every rank of one process may share a
    recorder; ``seq`` order is then the order in which they recorded.
    """

    def __init__(
        self,
        header: JournalOpened,
        writer: JournalWriter[Entry] | ProcessWriter[Entry] | None = None,
        *,
        keep: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.writer = writer
        #: every entry recorded, when ``keep`` (tests, tools, small runs)
        self.entries: list[Entry] | None = [] if keep else None
        self._clock = clock
        self._lock = threading.Lock()
        self._next_seq = 1
        # Chosen once, so the hot path makes no None checks.
        sinks: list[Callable[[Entry], None]] = []
        if writer is not None:
            sinks.append(writer.append)
        if self.entries is not None:
            sinks.append(self.entries.append)
        self._sinks = tuple(sinks)
        self.header = self.record(header, 0)

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        block_size: int,
        world_size: int,
        background: bool = True,
        process: bool = False,
        keep: bool = False,
        clock: Callable[[], int] = time.monotonic_ns,
        synchronous: str = "NORMAL",
        policy: str | None = None,
        engine: str | None = None,
        created: str | None = None,
    ) -> Recorder:
        """A recorder writing a new journal database at ``path``.

        ``synchronous`` is the journal's durability level: ``NORMAL`` (a
        committed step survives the process being killed) or ``FULL`` (it
        also survives a power loss); see :mod:`journal.database`.
        ``policy``, ``engine`` and ``created`` are descriptive fields of the
        ``journal_opened`` header.

        Where the journal is written: with ``process`` by a writer process
        (:class:`journal.ProcessWriter`: the engine's thread encodes one blob
        per commit and writes it to a pipe, nothing else); otherwise by a
        thread of this process (``background``, the default) or, without
        it, on the committing thread (tests, small tools).
        """
        journal = Journal(path, synchronous=synchronous)
        if len(journal):
            journal.close()
            raise FileExistsError(f"{os.fspath(path)}: journal already has records")
        journal.create_views(journal_views())
        writer: JournalWriter[Entry] | ProcessWriter[Entry]
        if process:
            journal.close()
            writer = ProcessWriter(
                path, encode_batch, "kvstate.batches:BatchCodec", synchronous=synchronous
            )
        else:
            writer = JournalWriter(journal, to_row, background=background)
        header = JournalOpened(
            version=1,
            block_size=block_size,
            world_size=world_size,
            policy=policy,
            engine=engine,
            created=created,
        )
        return cls(header, writer, keep=keep, clock=clock)

    @classmethod
    def in_memory(cls, *, block_size: int, world_size: int, policy: str | None = None) -> Recorder:
        """A recorder that keeps entries in :attr:`entries` only."""
        header = JournalOpened(
            version=1, block_size=block_size, world_size=world_size, policy=policy
        )
        return cls(header, None, keep=True)

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

    @property
    def recorded(self) -> int:
        """How many events were recorded, the header included."""
        return self._next_seq - 1

    def commit(self, *, wait: bool = True) -> None:
        """End a group commit (an engine step): the batch goes to disk as one transaction.

        Returns once the batch is durable (see :meth:`journal.JournalWriter.commit`);
        ``wait=False`` hands it to the writer thread without waiting.
        """
        if self.writer is not None:
            self.writer.commit(wait=wait)

    def flush(self) -> None:
        """Commit and wait until the journal holds every recorded event."""
        if self.writer is not None:
            self.writer.flush()

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

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
