"""Group commit from a background thread, so the caller never waits on disk.

The producer appends items to an in-memory batch (a list append under a
lock); :meth:`JournalWriter.commit` hands the batch over, typically once per
engine step. The writer thread encodes the items to :class:`Record` and
writes each batch in one transaction. Encoding happens on the writer thread
too: the caller's hot path only appends a reference.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from .database import Journal
from .errors import JournalError
from .record import Record

T = TypeVar("T")
_STOP = object()


class JournalWriter(Generic[T]):
    """Buffers items and writes them to a :class:`Journal` in batches.

    ``encode`` turns one buffered item into a :class:`Record`. With
    ``background=False`` each commit writes synchronously (tests, tools).
    A failure in the writer thread is raised from the next ``commit``,
    ``flush`` or ``close``; batches that could not be written stay in
    :attr:`unwritten` so nothing is silently lost.
    """

    def __init__(
        self, journal: Journal, encode: Callable[[T], Record], *, background: bool = True
    ) -> None:
        self.journal = journal
        self._encode = encode
        self._lock = threading.Lock()
        self._buffer: list[T] = []
        self._error: BaseException | None = None
        self.unwritten: list[list[T]] = []
        self._queue: queue.Queue[object] | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
            self._thread.start()

    def append(self, item: T) -> None:
        """Add one item to the current batch (no I/O)."""
        with self._lock:
            self._buffer.append(item)

    def commit(self) -> None:
        """End the current batch: it is written as one transaction."""
        self._raise_if_failed()
        with self._lock:
            batch, self._buffer = self._buffer, []
        if not batch:
            return
        if self._queue is None:
            self._write(batch)
            self._raise_if_failed()
        else:
            self._queue.put(batch)

    def flush(self) -> None:
        """Commit and wait until everything handed over is on disk."""
        self.commit()
        if self._queue is not None:
            self._queue.join()
        self._raise_if_failed()

    def close(self) -> None:
        """Flush, stop the writer thread and close the journal."""
        try:
            self.flush()
        finally:
            if self._thread is not None and self._queue is not None:
                self._queue.put(_STOP)
                self._thread.join()
                self._thread = None
            self.journal.close()

    def __enter__(self) -> JournalWriter[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer thread -------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        if q is None:
            raise JournalError("writer thread started without a queue")
        while True:
            batch = q.get()
            try:
                if batch is _STOP:
                    return
                self._write(batch)  # type: ignore[arg-type]
            finally:
                q.task_done()

    def _write(self, batch: list[T]) -> None:
        if self._error is not None:
            self.unwritten.append(batch)
            return
        try:
            self.journal.append([self._encode(item) for item in batch])
        except BaseException as exc:
            self._error = exc
            self.unwritten.append(batch)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise JournalError(f"journal writer failed: {self._error}") from self._error
