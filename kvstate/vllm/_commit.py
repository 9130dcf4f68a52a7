"""When an observed process commits its journal, and which thread hands it over.

Once per engine step would be one SQLite transaction per step, a few
hundred microseconds of the writer thread each, competing with the engine
for the GIL. Steps are a few milliseconds on a small model, so records are
committed in groups instead: when ``interval`` seconds have passed since the
last commit, or ``max_records`` are waiting. The engine never waits for the
disk (``wait=False``). A process killed between two commits loses at most
that window, and its journal then ends before ``engine_idle``: replay says
``UNFINISHED``, never clean.

The engine's thread only decides that a group is due. Handing it over
(encoding the batch, the pipe write to the writer process, the signal mask
around it) is done by one thread of this process, :class:`Committer`, so
that none of it is on the engine's clock: the engine thread pays for the
decisions and a queue put. The records themselves are already in the
writer's buffer, in seq order; the thread takes whatever is there, so a
group handed over late is never reordered, and a journal closed meanwhile
(``finish()``) has flushed them itself. A hand-over that fails is raised at
that journal's next step boundary, on the engine's thread, inside the
observation that ends the journal (see :meth:`ObservedProcess.observe`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from kvstate.recorder import Recorder

INTERVAL = 0.05
MAX_RECORDS = 1024

_log = logging.getLogger("kvstate.vllm")


class GroupCommit:
    """Decides, at each step boundary, whether the waiting records go to the writer now."""

    __slots__ = ("_committed", "_last", "failed", "recorder")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._committed = recorder.recorded
        self._last = time.monotonic()
        #: why the committer could not hand a group over (raised at the next step)
        self.failed: Exception | None = None

    def step_ended(self) -> None:
        failed = self.failed
        if failed is not None:
            self.failed = None
            raise failed
        waiting = self.recorder.recorded - self._committed
        if not waiting:
            return  # an engine step that changed nothing writes nothing
        now = time.monotonic()
        if waiting >= MAX_RECORDS or now - self._last >= INTERVAL:
            self._committed += waiting
            self._last = now
            COMMITTER.hand_over(self)

    def send(self) -> None:
        """On the committer's thread: hand what the writer buffers to its process."""
        recorder = self.recorder
        if recorder.closed:
            return  # closing flushed it
        try:
            recorder.commit(wait=False)
        except Exception as exc:
            if not recorder.closed:  # else finish() closed it meanwhile, flushing it
                self.failed = exc


class Committer:
    """The one thread of a process that hands due groups to their writer processes.

    Started at the first group (again in a forked child, which has no
    thread of its parent's); a daemon, so it never holds an exiting
    process: at exit every writer still open is flushed and closed
    (``journal.process_writer``), whatever this thread had not sent yet.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[GroupCommit] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0

    def hand_over(self, group: GroupCommit) -> None:
        if self._pid != os.getpid():
            self._start()
        self._queue.put(group)

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._queue = queue.SimpleQueue()
            threading.Thread(target=self._run, name="kvstate-commit", daemon=True).start()
            self._pid = os.getpid()

    def _run(self) -> None:
        get = self._queue.get
        while True:
            group = get()
            try:
                group.send()
            except Exception:  # a bug of ours: never let it end the thread
                _log.exception("kvstate could not hand a journal's records over")


COMMITTER = Committer()
