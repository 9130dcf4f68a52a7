"""When an observed process commits its journal.

Once per engine step would be one SQLite transaction per step, a few
hundred microseconds of the writer thread each, competing with the engine
for the GIL. Steps are a few milliseconds on a small model, so records are
committed in groups instead: when ``interval`` seconds have passed since the
last commit, or ``max_records`` are waiting. The engine never waits for the
disk (``wait=False``). A process killed between two commits loses at most
that window, and its journal then ends before ``engine_idle``: replay says
``UNFINISHED``, never clean.
"""

from __future__ import annotations

import time

from kvstate.recorder import Recorder

INTERVAL = 0.05
MAX_RECORDS = 1024


class GroupCommit:
    """Decides, at each step boundary, whether the waiting records go to the writer now."""

    __slots__ = ("_committed", "_last", "recorder")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._committed = recorder.recorded
        self._last = time.monotonic()

    def step_ended(self) -> None:
        waiting = self.recorder.recorded - self._committed
        if not waiting:
            return  # an engine step that changed nothing writes nothing
        now = time.monotonic()
        if waiting >= MAX_RECORDS or now - self._last >= INTERVAL:
            self._committed += waiting
            self._last = now
            self.recorder.commit(wait=False)
