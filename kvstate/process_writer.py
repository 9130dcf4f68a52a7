"""Group commit through a writer process: the engine only hands bytes over.

:class:`ProcessWriter` has the interface of
:class:`kvstate.thread_writer.JournalWriter` (``append``, ``commit``,
``flush``, ``close``), but the engine's process does no SQLite, no hashing
and no per-record encoding: at each commit it encodes the batch in one call
of :func:`kvstate.writer_codec.encode_batch` and writes one frame to a pipe.
A separate Python process (:mod:`kvstate._writer_program`, started fresh,
never forked, so it is safe beside CUDA) turns the frame into rows, hands
them to the journal (:mod:`journal`, which chains and inserts them as one
transaction), and answers when the engine waits, with what its audit found.

Durability is the journal's (see :mod:`journal.database`): ``commit()``
returns once the writer process has committed the batch;
``commit(wait=False)`` returns once the frame is in the pipe. A batch in the
pipe survives the engine: if the engine process is killed, the writer
process reads everything it was handed, appends ``engine_crashed`` and
exits. It never
outlives the engine.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable

from journal.errors import JournalError
from journal.rotation import Rotation

from ._frames import ANSWER, CLOSE, FRAME, SETTLE, WAIT
from .codec import Entry
from .violations import Violation
from .writer_codec import CodecSettings, decode_report, encode_batch
from .writer_protocol import Buffered

#: writers still open, closed (so flushed) at interpreter exit
_OPEN: weakref.WeakSet[ProcessWriter] = weakref.WeakSet()
#: signals held back while a batch is handed over, so a handler that raises
#: (Ctrl-C; a CLI turns SIGTERM and SIGHUP into exceptions) cannot interrupt
#: the write of a frame in this thread. With other threads in the process (a
#: BLAS pool, an engine's own) a signal they take still raises here at the
#: next call: the hand-over is ordered so that no such point loses a batch.
_HELD = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
#: most bytes taken from the answer pipe at once
_READ_SIZE = 1 << 16
#: the pipe to the writer process, asked for (Linux's default ceiling for a user)
PIPE_BYTES = 1 << 20


@atexit.register
def _close_open_writers() -> None:
    for writer in list(_OPEN):
        with contextlib.suppress(Exception):
            writer.close()


class ProcessWriter(Buffered[Entry]):
    """Buffers entries and hands each batch to a writer process as one frame
    (a :class:`kvstate.writer_protocol.Writer`).

    ``path`` is a journal that already exists (created with its schema).
    ``settings`` says what the writer process does after each commit (the
    fold, the figures, the checkpoints); it may be a function, called when
    the process starts, at the first commit. ``on_found`` gets what the
    writer process's audit found, with each answer that carries any: the one
    way findings come back. A write failure in the writer process is raised
    from the next ``commit`` that waits, ``flush`` or ``close``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        synchronous: str = "NORMAL",
        settings: CodecSettings | Callable[[], CodecSettings] = CodecSettings,
        on_found: Callable[[list[Violation]], None] | None = None,
        rotation: Rotation | None = None,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._settings = settings
        self._synchronous = synchronous
        self._on_found = on_found
        #: when the writer process closes a segment and begins the next (journal.segments)
        self._rotation = "" if rotation is None else rotation.spec()
        #: one reader of the answer pipe at a time (the engine's thread waits
        #: for its step while a sending thread flushes before it raises)
        self._reading = threading.Lock()
        self._submitted = 0
        self._written = 0
        #: answer bytes read but not yet acted on (an answer arrives in pieces)
        self._inbox = bytearray()
        self._error: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        _OPEN.add(self)

    def start(self) -> None:
        """Start the writer process now rather than at the first commit, and
        wait until it is ready (it answers an empty frame): its start-up, an
        interpreter and its imports (about 0.3 s of CPU), then falls where
        the caller chooses, not beside its first commits. The batch being
        built is not sent."""
        if self._closed:
            raise self._closed_error()
        with self._lock:
            if self._process is not None:
                return
        self._wait_for(self._send(WAIT, batch=False))

    def _start(self) -> subprocess.Popen[bytes]:
        """Start the writer process (at the first frame, unless :meth:`start` did)."""
        given = self._settings
        settings = given if isinstance(given, CodecSettings) else given()
        env = dict(os.environ)
        # the writer imports kvstate from where the engine found it
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        process = self._process = subprocess.Popen(
            [sys.executable, "-m", "kvstate._writer_program", self.path, self._synchronous,
             settings.encode(), str(os.getpid()), self._rotation],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            # its own session: a terminal's Ctrl-C or hang-up reaches the
            # engine, which then closes the writer; it never kills it mid-batch
            start_new_session=True,
        )  # fmt: skip
        stdin, stdout = process.stdin, process.stdout
        if stdin is None or stdout is None:
            raise JournalError(f"{self.path}: the journal writer process has no pipes")
        self._out = stdin.fileno()
        self._in = stdout.fileno()
        # A roomy pipe (Linux: up to 1 MiB): an engine that commits without
        # waiting goes on writing frames while the writer is busy a moment
        # (a rotation writing its checkpoint) instead of blocking in write.
        with contextlib.suppress(AttributeError, OSError):
            fcntl.fcntl(self._out, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        return process

    @property
    def pid(self) -> int | None:
        """The writer process's id (None until the first commit starts it)."""
        return None if self._process is None else self._process.pid

    def commit(self, *, wait: bool = True, settle: bool = False) -> None:
        """End the current batch: it is written as one transaction.

        With ``wait`` (the default) this returns once the batch is committed
        at the journal's durability level, and raises if it could not be.
        With ``settle`` the writer process answers only once its codec is
        done with the batch too (``committed()``), so the answer carries the
        codec's report of this very batch; otherwise that report comes with
        the next answer, and the engine does not wait for the codec's work.
        """
        if self._closed:
            raise self._closed_error()
        ticket = self._send(WAIT | SETTLE if settle else WAIT if wait else 0)
        if wait or settle:
            self._wait_for(ticket)

    def _close(self) -> None:
        """Flush, let the writer process finish the journal, and wait for it."""
        try:
            ticket = self._send(CLOSE)
            self._wait_for(ticket)
        finally:
            self._closed = True
            _OPEN.discard(self)
            process = self._process
            if process is not None:
                for pipe in (process.stdin, process.stdout):
                    with contextlib.suppress(OSError):
                        pipe.close()  # type: ignore[union-attr]
                process.wait()

    # -- the pipe ----------------------------------------------------------------

    def _send(self, flags: int, *, batch: bool = True) -> int:
        """Hand the current batch over as one frame (an empty frame where
        ``batch`` is false); returns its ticket.

        A signal handler may raise at any call in here (see ``_HELD``). All
        that can be interrupted, encoding included, happens while the batch
        is still in the buffer, so an exception there leaves it for the next
        commit. Then, with no call in between, the batch leaves the buffer
        and its ticket is counted; the frame is written with the signals
        held, and a blocking write to a pipe returns only when the whole
        frame is in it. (Taking the batch first lost it to a Ctrl-C that
        landed in the encoder: a gap in the journal's seqs.)
        """
        with self._lock:
            items = self._buffer if batch else []
            if not items and not flags:
                return self._submitted
            process = self._process if self._process is not None else self._start()
            blob = encode_batch(items) if items else b""
            ticket = self._submitted + 1
            frame = memoryview(FRAME.pack(ticket, len(blob), flags) + blob)
            before = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the caller's mask
            try:
                signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
                if batch:
                    self._buffer = []
                self._submitted = ticket
                while frame:
                    frame = frame[os.write(self._out, frame) :]
            except OSError as exc:
                raise JournalError(
                    f"{self.path}: the journal writer process is gone "
                    f"(exit status {process.poll()}): {exc}"
                ) from exc
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
            return ticket

    def _wait_for(self, ticket: int) -> None:
        """Read answers until the writer has processed ``ticket``.

        Bytes are read as they come into :attr:`_inbox`, and an answer is
        acted on only once it is there whole: a Ctrl-C between two reads
        leaves a half-read answer for the next wait, where reading its rest
        as a new header would lose the protocol for good. (A signal that
        interrupts the read raises before it takes anything; only one landing
        in the instant between the read's return and the append drops bytes.)
        """
        with self._reading:
            while self._written < ticket:
                if not self._take_answer():
                    self._receive()
        if self._error is not None:
            raise JournalError(f"{self.path}: journal writer failed: {self._error}")

    def _take_answer(self) -> bool:
        """Act on the first whole answer in the inbox; False if there is none yet."""
        inbox = self._inbox
        if len(inbox) < ANSWER.size:
            return False
        written, error, report = ANSWER.unpack_from(inbox)
        end = ANSWER.size + error + report
        if len(inbox) < end:
            return False
        if error or report:  # copied out only when there is any (the usual answer is a ticket)
            message = bytes(inbox[ANSWER.size : ANSWER.size + error])
            data = bytes(inbox[ANSWER.size + error : end])
        # Taken off first: an interrupt after this drops one report (the
        # journal and replay still have every record), never repeats it.
        del inbox[:end]
        self._written = max(self._written, written)
        if error:
            self._error = message.decode("utf-8", "replace")
        if report and self._on_found is not None:
            self._on_found(decode_report(data))
        return True

    def _receive(self) -> None:
        """Read what the writer has answered so far (blocking until something is there)."""
        chunk = os.read(self._in, _READ_SIZE)
        if not chunk:
            status = self._process.wait() if self._process is not None else None
            raise JournalError(
                f"{self.path}: the journal writer process ended "
                f"(exit status {status}) before it answered"
            )
        self._inbox += chunk
