"""Durability that holds: what was committed survives SIGKILL, a breaching
record is on disk before strict mode's exception escapes, and a process that
exits without close() loses nothing it recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from journal import Journal, JournalError
from replay import replay
from tests import crashsim

ROOT = Path(__file__).resolve().parent.parent


def run_script(body: str, path: Path) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(body).format(path=str(path))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def wait_until_gone(pid: int) -> None:
    """Until process ``pid`` has ended (it ends by itself: it was handed EOF)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)


def kinds(path: Path) -> list[str]:
    with Journal(path, readonly=True) as journal:
        return [r.kind for r in journal.records()]


def test_hundreds_of_sigkills_lose_no_committed_record(tmp_path: Path) -> None:
    records = 0
    for seed in range(200):
        committed, found = crashsim.kill_once(str(tmp_path), seed)
        assert found >= committed
        records += found
    assert records > 10_000  # the kills landed mid-run, not before the first step


def test_sigkills_of_an_engine_with_a_writer_process(tmp_path: Path) -> None:
    """The default writer: the killed engine's journal keeps every commit
    that returned and more (what was handed over), and the writer process
    ends it with engine_crashed, replayed as the run's one CRASH."""
    records = 0
    for seed in range(30):
        committed, found = crashsim.kill_once(str(tmp_path), seed, writer="process")
        assert found > committed  # engine_crashed at least
        records += found
    assert records > 1_000


def test_sigkills_with_synchronous_full(tmp_path: Path) -> None:
    for seed in range(20):
        committed, found = crashsim.kill_once(str(tmp_path), seed, "FULL")
        assert found >= committed


def test_a_strict_raise_leaves_the_breaching_record_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    done = run_script(
        """
        import os
        from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger
        from kvstate.violations import DoubleReportError
        rec = Recorder.open({path!r}, block_size=4, world_size=1)
        sched = SchedulerLedger(rec)
        worker = WorkerLedger(0, rec)
        sched.admit("r", 8)
        sched.assign_blocks("r", [0, 1], resumed=False)
        job = sched.enqueue_store_job("r", 0, 8, ["a", "b"])
        worker.register(JobSpec(job, "r", 0, ("a", "b")))
        with worker.run(job):
            pass
        try:
            worker.report(job)  # a second report: DOUBLE_REPORT
        except DoubleReportError:
            print(rec.writer.pid, flush=True)
            os._exit(0)  # no atexit, no close: only what was flushed before the raise
        os._exit(3)  # the strict ledger did not raise at the call
        """,
        path,
    )
    assert done.returncode == 0, done.stderr
    wait_until_gone(int(done.stdout.split()[0]))  # the orphaned writer finishes the journal
    # the breaching record, then what the writer process appends for an
    # engine that died without closing its journal
    assert kinds(path)[-3:] == ["job_reported", "job_reported", "engine_crashed"]
    result = replay([str(path)])
    assert [v.code.value for v in result.violations] == ["DOUBLE_REPORT", "CRASH"]


def test_an_uncaught_strict_raise_is_journaled_and_not_clean(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    done = run_script(
        """
        from kvstate import Recorder, SchedulerLedger
        rec = Recorder.open({path!r}, block_size=4, world_size=1)
        sched = SchedulerLedger(rec)
        sched.admit("r", 8)
        sched.assign_blocks("r", [0], resumed=False)
        job = sched.enqueue_store_job("r", 0, 4, ["a"])
        sched.release_pins(job)  # no completion yet: EARLY_RELEASE
        # The audit runs in the writer process, after the batch is durable:
        # its finding comes back with the next commit's answer, and the call
        # after that raises it, killing the process.
        sched.begin_step()
        sched.begin_step()
        sched.admit("s", 8)
        raise SystemExit("not raised")
        """,
        path,
    )
    assert done.returncode == 1 and "EarlyReleaseError" in done.stderr
    result = replay([str(path)])
    assert result.verdict == "violations"
    assert [v.code.value for v in result.violations] == ["EARLY_RELEASE"]


def test_an_exception_right_after_begin_step_keeps_the_step(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    done = run_script(
        """
        from kvstate import Recorder, SchedulerLedger
        rec = Recorder.open({path!r}, block_size=4, world_size=1)
        sched = SchedulerLedger(rec)
        sched.begin_step()
        sched.admit("r", 8)
        sched.begin_step()
        sched.admit("s", 8)
        raise RuntimeError("the engine failed")
        """,
        path,
    )
    assert "RuntimeError" in done.stderr
    assert kinds(path) == ["journal_opened", "request_admitted", "request_admitted"]


def test_exiting_without_close_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    done = run_script(
        """
        from kvstate import Recorder, SchedulerLedger
        rec = Recorder.open({path!r}, block_size=4, world_size=1)
        sched = SchedulerLedger(rec)
        for i in range(50):
            sched.admit(f"r{{i}}", 8)
        """,
        path,
    )
    assert done.returncode == 0, done.stderr
    assert len(kinds(path)) == 51


def test_commit_returns_after_the_batch_is_on_disk(tmp_path: Path) -> None:
    from kvstate import Recorder, SchedulerLedger

    path = tmp_path / "j.db"
    rec = Recorder.open(path, block_size=4, world_size=1)
    sched = SchedulerLedger(rec)
    sched.admit("r", 8)
    rec.commit()
    # Another connection sees the batch at once: it is in the WAL, not in a queue.
    assert len(kinds(path)) == 2
    rec.close()


def test_synchronous_level_is_validated_and_applied(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="NORMAL or FULL"):
        Journal(tmp_path / "x.db", synchronous="OFF")
    with Journal(tmp_path / "full.db", synchronous="FULL") as journal:
        level = journal._conn.execute("PRAGMA synchronous").fetchone()[0]
    assert level == 2  # FULL


def _interrupt_at_call(n: int) -> Callable[..., Any]:
    """A trace function raising KeyboardInterrupt at the ``n``-th Python call
    this thread makes: where CPython runs a signal handler that raises (a CLI
    turns SIGTERM into an exception) is the start of a function, among others."""
    calls = 0

    def trace(_frame: FrameType, event: str, _arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1
            if calls == n:
                raise KeyboardInterrupt(f"at call {n}")

    return trace


def test_an_interrupted_commit_neither_hangs_the_flush_nor_loses_a_record(
    tmp_path: Path,
) -> None:
    from kvstate import thread_writer as writer_module
    from kvstate.thread_writer import JournalWriter

    def row(seq: int) -> tuple[int, str, int, int, int, dict[str, int]]:
        return (seq, "k", 0, 0, 0, {"v": seq})

    n = 0
    while True:
        n += 1
        path = tmp_path / f"j{n}.db"
        writer = JournalWriter(Journal(path), row)
        for seq in (1, 2, 3):
            writer.append(seq)
        interrupted = False
        sys.settrace(_interrupt_at_call(n))
        try:
            writer.commit()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        # The cleanup of an interrupted run: more records, then close. A
        # batch counted but never queued made this wait forever.
        writer.append(4)
        closing = threading.Thread(target=writer.close, daemon=True)
        closing.start()
        closing.join(20)
        if closing.is_alive():
            # Forget the stuck writer, or the interpreter's exit would wait on it too.
            writer_module._OPEN.discard(writer)
            pytest.fail(f"close() hangs after an interrupt at call {n}")
        with Journal(path, readonly=True) as journal:
            assert [r.seq for r in journal.records()] == [1, 2, 3, 4], f"call {n}"
        if not interrupted:
            break  # commit made fewer than n calls: every point was tried
    assert n > 3
