"""The vLLM runs' watchdogs watch progress: a slow run is never ended, a
stalled one always is (kvstate/harness/vllm_engine/watchdog.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from kvstate.harness.vllm_engine.watchdog import Progress, Stall, Watchdog, count_steps, wait


def test_a_run_that_keeps_moving_is_never_stalled_however_long_it_takes() -> None:
    stall = Stall(30.0, mark=0, now=0.0)
    # a day of moving slowly (a change every 29 s) is never a stall
    for i in range(1, 3000):
        assert not stall.stalled(i, now=29.0 * i)
    t = 29.0 * 2999
    assert not stall.stalled(2999, now=t + 30.0)  # exactly the window: not yet
    assert stall.stalled(2999, now=t + 30.5)  # longer: standing still


def test_only_steps_with_output_count() -> None:
    class Engine:
        def __init__(self) -> None:
            self.outputs: list[list[str]] = [[], ["a", "b"], []]

        def step(self) -> list[str]:
            return self.outputs.pop(0)

    engine, progress = Engine(), Progress()
    count_steps(engine, progress)
    assert [engine.step() for _ in range(3)] == [[], ["a", "b"], []]
    assert progress.outputs == 2  # the two empty steps (a starved pool) are no progress


def test_the_watchdog_waits_out_startup_then_ends_a_stalled_engine(tmp_path: Path) -> None:
    progress, fired = Progress(), threading.Event()
    reasons: list[str] = []

    def on_stall(why: str) -> None:
        reasons.append(why)
        fired.set()

    beat = tmp_path / "beat"
    dog = Watchdog(progress, 0.05, on_stall, beat, poll_s=0.01)
    dog.start()
    # not armed while the engine starts, however long that takes
    assert not fired.wait(0.5)
    assert "starting" in beat.read_text()
    progress.phase, progress.outputs, progress.puts = "round 1", 5, 2
    assert fired.wait(120), "a stalled engine was not ended"
    assert reasons == ["no progress for 0.05 s (so far 5 outputs, 2 puts, round 1)"]
    assert beat.read_text() == "5 outputs, 2 puts, round 1\n"
    dog.join(120)


def test_the_parent_kills_only_a_child_that_shows_nothing(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.touch()
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    assert wait(frozen, 1.0, log) is None  # killed, not waited 600 s
    assert frozen.returncode is not None
    # a child that finishes is waited for, and its status returned
    done = subprocess.Popen(
        [sys.executable, "-c", f"open({str(log)!r}, 'a').write('x'); raise SystemExit(7)"]
    )
    assert wait(done, 600.0, log) == 7 and log.read_text() == "x"
