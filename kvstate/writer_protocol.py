"""What every journal writer is: the :class:`Writer` protocol and the buffer all writers share.

A writer takes items one at a time (:meth:`Writer.append`, a list append
under a lock: the caller's hot path) and writes each batch of them as one
transaction when the caller ends it (:meth:`Writer.commit`, typically once
per engine step). The promise every writer keeps, checked for each of them
by ``tests/test_writers.py``:

* ``commit()`` (``wait=True``) returns only once its batch is durable at the
  journal's ``synchronous`` level: a process killed right after it returned
  has the batch on disk;
* with ``settle=True`` it returns only once the writer's work after the
  write is done too (the application's audit of the batch: a thread's
  ``after_write``, a writer process's codec), so what that work found is
  known when the call returns;
* batches are written in commit order, each whole or not at all;
* ``flush()`` commits and waits; ``close()`` flushes and ends the writer
  (idempotent); ``append`` after ``close`` is refused;
* a failure to write is raised from the ``commit`` that waited for it, or
  from the next ``commit``, ``flush`` or ``close``.

:class:`kvstate.thread_writer.JournalWriter` writes from a thread of this
process, :class:`kvstate.process_writer.ProcessWriter` from a writer
process. Both are kvstate's, not the journal's: each calls the journal once
per batch (:meth:`journal.Journal.append_rows` through
:class:`journal.segments.Rotating`), so a record crosses from kvstate into
the journal once on its way to disk, and what kvstate's work after a commit
finds never passes through the journal on its way back.
"""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar

from journal.errors import JournalError

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class Writer(Protocol[T_contra]):
    """The interface of every journal writer (see the module's promises)."""

    @property
    def path(self) -> str:
        """The journal's file."""
        ...

    def append(self, item: T_contra) -> None: ...

    def commit(self, *, wait: bool = True, settle: bool = False) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class Buffered(Generic[T]):
    """The batch being built, shared by every writer: ``append`` and the closed check.

    A subclass sets :attr:`path`, implements :meth:`commit` and
    :meth:`_close` (which must leave the writer closed even when it raises).
    """

    path: str

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer: list[T] = []
        self._closed = False

    def append(self, item: T) -> None:
        """Add one item to the current batch (no I/O); refused once the writer is closed."""
        if self._closed:
            raise self._closed_error()
        with self._lock:
            self._buffer.append(item)

    def commit(self, *, wait: bool = True, settle: bool = False) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Commit and wait until everything handed over is in the journal."""
        self.commit(wait=True)

    def close(self) -> None:
        """Flush and end the writer (idempotent)."""
        if not self._closed:
            self._close()

    def _close(self) -> None:
        raise NotImplementedError

    def _closed_error(self) -> JournalError:
        return JournalError(f"{self.path}: the journal writer is closed")

    def __enter__(self) -> Buffered[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
