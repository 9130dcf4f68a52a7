"""When an observed process commits its journal, and which thread hands it over.

Once per engine step would be one SQLite transaction per step, a few
hundred microseconds of the writer thread each, competing with the engine
for the GIL. Steps are a few milliseconds on a small model, so records are
committed in groups instead: every ``INTERVAL`` seconds, or at once when
``MAX_RECORDS`` are waiting. The engine never waits for the disk
(``wait=False``). A process killed between two commits loses at most that
window, and its journal then ends before ``engine_idle``: replay says
``UNFINISHED``, never clean.

Handing a group over (encoding the batch, the pipe write to the writer
process, the signal mask around it) is done by one thread of this process,
:class:`Committer`, which wakes every ``INTERVAL`` and sends what each
journal's writer buffers. The engine's thread only records, and at each
step boundary checks whether a burst needs the committer now. It never
wakes that thread on an ordinary step: in vLLM's engine here, the queue
put that woke it cost the engine's thread a median of 28 us of CPU, as
much as the rest of kvstate's step (the cost row in docs/offloading.md;
the same put in a bare loop costs about 1 us, so it is what the wake-up
sets off in a busy engine, not the put). The records are in the writer's buffer in seq order,
and the committer takes whatever is there, so a group is never reordered,
and a journal closed meanwhile (``finish()``) has flushed them itself. A
hand-over that fails is raised at that journal's next step boundary, on the
engine's thread, inside the observation that ends the journal (see
:meth:`ObservedProcess.observe`).
"""

from __future__ import annotations

import logging
import os
import threading

from kvstate.recorder import Recorder

INTERVAL = 0.2
MAX_RECORDS = 1024

_log = logging.getLogger("kvstate.vllm")


class GroupCommit:
    """One journal's group commits: recorded on the engine's thread, sent by the committer's."""

    __slots__ = ("_sent", "failed", "recorder")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        #: records handed over so far (moved by the committer's thread only)
        self._sent = recorder.recorded
        #: why the committer could not hand a group over (raised at the next step)
        self.failed: Exception | None = None
        COMMITTER.follow(self)

    def step_ended(self) -> None:
        """On the engine's thread, at a step boundary: an earlier failure, or a burst."""
        failed = self.failed
        if failed is not None:
            self.failed = None
            raise failed
        if self.recorder.recorded - self._sent >= MAX_RECORDS:
            COMMITTER.wake()  # a burst: not left to grow until the next tick

    def send(self) -> None:
        """On the committer's thread: hand what the writer buffers to its process."""
        recorder = self.recorder
        recorded = recorder.recorded
        if recorder.closed or recorded == self._sent:
            return  # closing flushed it; or nothing new (an idle engine)
        try:
            # Takes the whole buffer: records the engine adds meanwhile go
            # too, and the next tick finds an empty batch (sent as nothing).
            recorder.commit(wait=False)
            self._sent = recorded
        except Exception as exc:
            if not recorder.closed:  # else finish() closed it meanwhile, flushing it
                self.failed = exc


class Committer:
    """The one thread of a process that hands each journal's groups to its writer process.

    Started with the first journal it follows (again in a forked child, by
    the first journal the child opens); a daemon, so it never holds an
    exiting process: at exit every writer still open is flushed and closed
    (``kvstate.process_writer``), whatever this thread had not sent yet.
    """

    def __init__(self) -> None:
        self._groups: list[GroupCommit] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pid = 0
        #: rounds done (each sends every journal's waiting records once)
        self.rounds = 0
        self._round_done = threading.Condition()

    def follow(self, group: GroupCommit) -> None:
        with self._lock:
            self._groups.append(group)
            if self._pid != os.getpid():
                self._start()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="kvstate-commit", daemon=True).start()

    def _forked(self) -> None:
        """In a forked child: its own locks, and none of its parent's journals.

        Their writer processes are the parent's, and so are the records in
        their buffers (copied by the fork): handed over from here too, they
        would reach the writer twice. A journal the child opens starts the
        child's own thread.
        """
        self._lock = threading.Lock()
        self._round_done = threading.Condition()
        self._groups = []
        self._pid = 0

    def wake(self) -> None:
        """Send now rather than at the next tick (costs the caller a thread wake-up)."""
        if not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        wake = self._wake
        while True:
            wake.wait(INTERVAL)
            wake.clear()
            self.round()

    def round(self) -> None:
        """Send every followed journal's waiting records; forget the closed ones."""
        with self._lock:
            self._groups = [g for g in self._groups if not g.recorder.closed]
            groups = tuple(self._groups)
        for group in groups:
            try:
                group.send()
            except Exception:  # a bug of ours: never let it end the thread
                _log.exception("kvstate could not hand a journal's records over")
        with self._round_done:
            self.rounds += 1
            self._round_done.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until what every journal recorded before this call is handed
        over (two rounds: one begun earlier may have read a journal just
        before its records came); False if ``timeout`` passed first."""
        if self._pid != os.getpid():
            return True  # no journal followed in this process: nothing to hand over
        with self._round_done:
            done = self.rounds + 2
            while self.rounds < done:
                self.wake()
                if not self._round_done.wait(timeout):
                    return False
        return True


COMMITTER = Committer()
os.register_at_fork(after_in_child=COMMITTER._forked)
