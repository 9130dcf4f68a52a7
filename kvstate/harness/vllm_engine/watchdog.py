"""Watchdogs that watch the engine's progress, never the time it takes.

A loaded machine makes every run slower; only a run that stopped moving
must be ended. Progress is an engine step that produced output, or a put
the store accepted (while the engine waits for its store work to drain it
steps without output). Two watchdogs:

* :class:`Watchdog`, in the engine's process: armed once the engine is up,
  it calls ``on_stall`` when nothing moved for ``stall_s`` seconds, and it
  writes each change to a heartbeat file;
* :func:`wait`, in the process that started the engine: it ends a child whose
  heartbeat and log both stopped changing (a frozen process, whose own
  watchdog cannot run) and otherwise waits as long as the child moves.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: how often both watchdogs look (the only fixed interval: a poll, not a limit)
POLL_S = 1.0


class Progress:
    """Counters the engine's hooks bump; read by the watchdog thread.

    Plain ints: one writer each (the engine thread, the sending thread), and
    a stale read only delays the watchdog by one poll.
    """

    def __init__(self) -> None:
        self.phase = "starting"
        self.outputs = 0
        self.puts = 0

    def snapshot(self) -> tuple[str, int, int]:
        return self.phase, self.outputs, self.puts

    def describe(self) -> str:
        return f"{self.outputs} outputs, {self.puts} puts, {self.phase}"


def count_steps(engine: object, progress: Progress) -> None:
    """Count each ``engine.step()`` that returned output (vLLM's ``LLM``
    calls ``self.llm_engine.step()``, so an instance attribute takes it)."""
    step = engine.step  # type: ignore[attr-defined]

    def counted() -> object:
        outputs = step()
        if outputs:
            progress.outputs += len(outputs)
        return outputs

    engine.step = counted  # type: ignore[attr-defined]


class Stall:
    """One definition of standing still, for both watchdogs: the mark (what
    is watched) has not changed for more than ``stall_s`` seconds of ``now``
    (a clock the caller reads, so a test can give its own)."""

    def __init__(self, stall_s: float, mark: object, now: float) -> None:
        self.stall_s = stall_s
        self.mark = mark
        self.since = now

    def stalled(self, mark: object, now: float) -> bool:
        """Record ``mark`` seen at ``now``; whether it has stood still too long."""
        if mark != self.mark:
            self.mark, self.since = mark, now
            return False
        return now - self.since > self.stall_s


def cpu_ticks(pid: int) -> int | None:
    """A process's CPU ticks so far (user + system), a mark for :class:`Stall`
    when the process says nothing of its own progress; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


class Watchdog(threading.Thread):
    """Calls ``on_stall`` once nothing moved for ``stall_s`` seconds after the
    engine was up (``progress.phase`` left ``starting``)."""

    def __init__(
        self,
        progress: Progress,
        stall_s: float,
        on_stall: Callable[[str], None],
        heartbeat: Path | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        super().__init__(name="kvstate-watchdog", daemon=True)
        self.poll_s = poll_s
        self.progress = progress
        self.stall_s = stall_s
        self.on_stall = on_stall
        self.heartbeat = heartbeat
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        stall = Stall(self.stall_s, self.progress.snapshot(), time.monotonic())
        beat = self._beat("")
        while not self._halt.wait(self.poll_s):
            now = self.progress.snapshot()
            if now[0] == "starting":
                # Not armed: vLLM loading says little. Its CPU time tells the
                # parent that it is working, not frozen.
                beat = self._beat(f", {int(time.process_time())} s of CPU", beat)
                stall = Stall(self.stall_s, now, time.monotonic())
                continue
            beat = self._beat("", beat)
            if stall.stalled(now, time.monotonic()):
                self.on_stall(
                    f"no progress for {self.stall_s:g} s (so far {self.progress.describe()})"
                )
                return

    def _beat(self, extra: str, previous: str = "") -> str:
        line = self.progress.describe() + extra
        if self.heartbeat is not None and line != previous:
            # One short line; replaced whole, so the parent never reads half.
            partial = self.heartbeat.with_name(self.heartbeat.name + ".tmp")
            partial.write_text(line + "\n")
            os.replace(partial, self.heartbeat)
        return line


def _mark(paths: tuple[Path, ...]) -> tuple[object, ...]:
    marks: list[object] = []
    for path in paths:
        try:
            stat = path.stat()
            marks.append((stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:
            marks.append(None)
    return tuple(marks)


def wait(
    process: subprocess.Popen[bytes],
    stall_s: float,
    *watched: Path,
    until: Callable[[], bool] | None = None,
) -> int | None:
    """Wait for ``process``; end it if none of ``watched`` (its heartbeat and
    log) changed for ``stall_s`` seconds. Returns its exit status, or None
    when it was ended for standing still. With ``until``, stop waiting as
    soon as ``until()`` holds (the process goes on; returns 0)."""
    stall = Stall(stall_s, _mark(watched), time.monotonic())
    while True:
        try:
            return process.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if until is not None and until():
            return 0
        if stall.stalled(_mark(watched), time.monotonic()):
            process.kill()
            process.wait()
            return None
