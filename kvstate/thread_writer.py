"""Group commit from a background thread.

The producer appends items to an in-memory batch (a list append under a
lock). :meth:`JournalWriter.commit` ends the batch, typically once per
engine step; the writer thread encodes the items to :class:`Record` and
writes the batch in one transaction.

``commit()`` returns once its batch is durable at the journal's
``synchronous`` level (see :mod:`journal.database`): a process killed right
after ``commit()`` returned has that batch on disk. ``commit(wait=False)``
only hands the batch over, for callers that would rather not wait; such a
batch is written shortly after, and at the latest by :meth:`flush`,
:meth:`close` or when the interpreter exits.

A writer that was never closed is flushed when the interpreter exits
normally (also after an uncaught exception): nothing recorded before a
normal exit is lost, even though the writer thread is a daemon thread.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from journal.database import Journal, NewRow
from journal.errors import JournalError
from journal.record import Record
from journal.rotation import Rotation
from journal.segments import Rotating

from .writer_protocol import Buffered

T = TypeVar("T")
_STOP = object()

#: writers still open, flushed at interpreter exit
_OPEN: weakref.WeakSet[JournalWriter[Any]] = weakref.WeakSet()


@atexit.register
def _flush_open_writers() -> None:
    # Exiting: a write error was raised from commit already; nothing to add.
    for writer in list(_OPEN):
        with contextlib.suppress(Exception):
            writer.flush()


class JournalWriter(Buffered[T], Generic[T]):
    """Buffers items and writes them to a :class:`Journal` in batches (a
    :class:`kvstate.writer_protocol.Writer`).

    ``after_write`` is called with each batch once it is written, on the
    thread that wrote it (an application's audit of what it committed).
    ``encode`` turns one buffered item into a :class:`Record`, or into a row
    ``(seq, kind, step, rank, ts, payload)`` (cheaper: see
    :meth:`Journal.append_rows`). With
    ``background=False`` each commit writes on the caller's thread (tests,
    tools). A failure to write is raised from the ``commit`` that waited for
    it, or from the next ``commit``, ``flush`` or ``close``; batches that
    could not be written stay in :attr:`unwritten` so nothing is silently
    lost.
    """

    def __init__(
        self,
        journal: Journal,
        encode: Callable[[T], Record | NewRow],
        *,
        background: bool = True,
        after_write: Callable[[list[T]], object] | None = None,
        rotation: Rotation | None = None,
    ) -> None:
        super().__init__()
        #: the segment written now (journal.segments; the journal itself without rotation)
        self._segment = Rotating(journal, rotation, synchronous=journal.synchronous)
        self.journal = journal  # the first segment (tests read its head while it is one)
        self.path = journal.path
        self._encode = encode
        #: called with each batch once it is written, on the thread that wrote it
        self._after_write = after_write
        self._error: BaseException | None = None
        self.unwritten: list[list[T]] = []
        self._queue: queue.SimpleQueue[object] | None = None
        self._thread: threading.Thread | None = None
        # Each batch handed over carries a ticket, and the writer thread
        # publishes the ticket of the last batch it wrote, so a commit can
        # wait for exactly its own batch.
        self._submitted = 0
        self._written = 0
        # Locks held by waiting commits, released after every batch. Not a
        # threading.Condition: its __exit__ is Python code, and a signal
        # handler raising on entry to it leaves the lock held, so the writer
        # thread blocks on it for good and the caller's cleanup flush waits
        # forever (a SIGTERM'd `kvstate run` hung that way). Every lock the
        # caller's thread takes here is a C lock, released by its `with`.
        self._waiting: list[threading.Lock] = []
        self._waiting_lock = threading.Lock()
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
            self._thread.start()
        _OPEN.add(self)

    def commit(self, *, wait: bool = True, settle: bool = False) -> None:
        """End the current batch: it is written as one transaction.

        With ``wait`` (the default) this returns once the batch is on disk at
        the journal's durability level, and raises if it could not be written.
        ``settle`` asks for ``after_write`` to be done with it as well, which
        a waiting commit always is: the writer publishes a batch's ticket
        only after its ``after_write`` returned.
        """
        self._raise_if_failed()
        if self._closed:
            raise self._closed_error()
        wait = wait or settle
        # The batch is always written by the writer thread (when there is one),
        # even when the caller waits for it, though writing it here would save
        # two thread switches: signals arrive on the main thread, and a
        # KeyboardInterrupt in the middle of a write there would be taken for
        # a failed write and swallowed (a run would not stop on Ctrl-C).
        with self._lock:
            batch = self._buffer
            ticket = self._submitted
            if batch:
                ticket += 1
                self._buffer = []
                if self._queue is None:
                    self._submitted = ticket
                    self._write(ticket, batch)
                else:
                    # A signal handler may raise here (a CLI turns SIGTERM
                    # into an exception) and the caller then flushes in its
                    # cleanup. SimpleQueue.put is one C call that cannot
                    # fail, so such an exception comes after the batch was
                    # queued: the ticket is counted all the same. With a
                    # ticket counted but no batch queued, that flush would
                    # wait forever; with a batch queued twice, its records
                    # would be written twice.
                    try:
                        # Under the lock: batches are written in commit order.
                        self._queue.put((ticket, batch))
                    finally:
                        self._submitted = ticket
        if wait:
            self._wait_for(ticket)
            self._raise_if_failed()

    def _wait_for(self, ticket: int) -> None:
        thread = self._thread
        while self._written < ticket:
            woken = threading.Lock()
            woken.acquire()
            with self._waiting_lock:
                self._waiting.append(woken)
            # Registered before this check, and the writer publishes its
            # ticket before it wakes the registered: no wake-up is missed.
            if self._written >= ticket:
                return
            if thread is not None and not thread.is_alive():
                # The interpreter is shutting down and took the thread:
                # write what is left from here.
                self._drain_here()
                return
            woken.acquire(timeout=0.1)

    def _drain_here(self) -> None:
        q = self._queue
        if q is None:
            return
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._write(*cast("tuple[int, list[T]]", item))

    def _close(self) -> None:
        """Flush, stop the writer thread and close the journal."""
        try:
            self.flush()
        finally:
            self._closed = True
            _OPEN.discard(self)
            if self._thread is not None and self._queue is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None
            self._segment.journal.close()

    # -- writer thread -------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        if q is None:
            raise JournalError("writer thread started without a queue")
        while True:
            item = q.get()
            if item is _STOP:
                return
            self._write(*cast("tuple[int, list[T]]", item))

    def _write(self, ticket: int, batch: list[T]) -> None:
        try:
            if self._error is not None:
                self.unwritten.append(batch)
                return
            if not batch:
                return
            try:
                encode = self._encode
                first = encode(batch[0])
                rest = map(encode, itertools.islice(batch, 1, None))
                journal = self._segment.journal
                if type(first) is tuple:
                    # encoded as the journal takes them (see Journal.append_rows)
                    journal.append_rows(itertools.chain((first,), rest))  # type: ignore[arg-type]
                else:
                    journal.append([first, *rest])  # type: ignore[list-item]
                self._segment.committed()  # the next segment, if this one is full or old
            except BaseException as exc:
                self._error = exc
                self.unwritten.append(batch)
            else:
                if self._after_write is not None:
                    try:
                        self._after_write(batch)
                    except BaseException as exc:  # written; raised from the next commit
                        self._error = exc
        finally:
            self._written = ticket
            with self._waiting_lock:
                waiting, self._waiting = self._waiting, []
            for woken in waiting:
                woken.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise JournalError(f"journal writer failed: {self._error}") from self._error
