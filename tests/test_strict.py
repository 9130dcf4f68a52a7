"""Strict mode keeps its promise wherever the audit runs.

A breach that a ledger's guard can decide from its own state raises from
the call that made the breaching record, once that record is durable, with
every placement of the audit: the writer process (the default), a writer
thread, the committing thread, inline. A finding no call raised (the fold's
alone: a poisoned key read back by the runtime) raises from ``close()``;
a recorder never closed prints it at interpreter exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from journal import Journal
from kvstate import Recorder, SchedulerLedger, WorkerLedger
from kvstate.events import KeyVerified
from kvstate.violations import (
    CrashError,
    DoubleReportError,
    EarlyReleaseError,
    HeldForeverError,
    InvariantViolation,
    PhantomCompletionError,
    PoisonedKeyError,
    TableOverrunError,
)

ROOT = Path(__file__).resolve().parent.parent

PLACEMENTS: dict[str, Callable[[Path], Recorder]] = {
    "writer process": lambda p: Recorder.open(p, block_size=16, world_size=1),
    "writer thread": lambda p: Recorder.open(p, block_size=16, world_size=1, process=False),
    "committing thread": lambda p: Recorder.open(
        p, block_size=16, world_size=1, process=False, background=False
    ),
    "inline": lambda p: Recorder.open(p, block_size=16, world_size=1, audit="inline"),
}


def _overrun(s: SchedulerLedger, w: WorkerLedger) -> None:
    s.enqueue_store_job("r", 0, 64, ["k0", "k1", "k2", "k3"])  # 64 tokens over one block


def _early_release(s: SchedulerLedger, w: WorkerLedger) -> None:
    job = s.enqueue_store_job("r", 0, 16, ["k0"])
    s.release_pins(job)  # no rank has reported it


def _phantom(s: SchedulerLedger, w: WorkerLedger) -> None:
    job = s.enqueue_store_job("r", 0, 16, ["k0"])
    s.update_connector_output({job: 2})  # two reports of a one-rank job


def _double_report(s: SchedulerLedger, w: WorkerLedger) -> None:
    from kvstate import JobSpec

    job = s.enqueue_store_job("r", 0, 16, ["k0"])
    w.register(JobSpec(job, "r", 0, ["k0"]))
    with w.run(job):
        pass
    w.report(job)  # the connector's own bookkeeping reports it a second time


def _crash(s: SchedulerLedger, w: WorkerLedger) -> None:
    s.crashed("CUDA error: an illegal memory access")


def _held_forever(s: SchedulerLedger, w: WorkerLedger) -> None:
    s.request_finished("r", hold=True)
    s.idle()


BREACHES: dict[str, tuple[Callable[[SchedulerLedger, WorkerLedger], None], type, str]] = {
    "table overrun": (_overrun, TableOverrunError, "job_enqueued"),
    "early release": (_early_release, EarlyReleaseError, "pins_released"),
    "phantom completion": (_phantom, PhantomCompletionError, "completions_received"),
    "double report": (_double_report, DoubleReportError, "job_reported"),
    "crash": (_crash, CrashError, "engine_crashed"),
    "held forever": (_held_forever, HeldForeverError, "engine_idle"),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("breach", sorted(BREACHES))
def test_a_breach_the_guards_decide_raises_at_the_call_with_its_record_on_disk(
    tmp_path: Path, placement: str, breach: str
) -> None:
    call, error, kind = BREACHES[breach]
    path = tmp_path / "strict.db"
    rec = PLACEMENTS[placement](path)
    s, w = SchedulerLedger(rec), WorkerLedger(0, rec)
    s.begin_step()
    s.admit("r", 64)
    s.assign_blocks("r", [1], resumed=False)
    with pytest.raises(error) as raised:
        call(s, w)
    seq = raised.value.violation.seq
    # durable before the raise: another connection reads the record now
    with Journal(path, readonly=True) as journal:
        kinds = {r.seq: r.kind for r in journal.records()}
    assert kinds[seq] == kind
    rec.close(raise_found=False)


def test_the_issues_script_raises_table_overrun(tmp_path: Path) -> None:
    """As a new user writes it, with the defaults: it used to exit 0."""
    script = textwrap.dedent(
        """
        from kvstate import Recorder, SchedulerLedger
        rec = Recorder.open("strict.db", block_size=16, world_size=1)
        s = SchedulerLedger(rec)
        s.begin_step(); s.admit("r", 64); s.assign_blocks("r", [1], resumed=False)
        s.enqueue_store_job("r", 0, 64, ["k0", "k1", "k2", "k3"])
        print("not raised")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1 and "not raised" not in done.stdout
    assert "TableOverrunError: TABLE_OVERRUN at seq 4" in done.stderr
    with Journal(tmp_path / "strict.db", readonly=True) as journal:
        assert [r.kind for r in journal.records()][-1] == "job_enqueued"


def _poisoned_key(rec: Recorder) -> None:
    s = SchedulerLedger(rec)
    s.begin_step()
    # the runtime's audit records: no ledger call sees them
    rec.record(KeyVerified(key="k0", ok=False, expected="aa", actual="bb"), 1)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_finding_no_call_raised_raises_from_close(tmp_path: Path, placement: str) -> None:
    rec = PLACEMENTS[placement](tmp_path / "strict.db")
    _poisoned_key(rec)
    with pytest.raises(PoisonedKeyError):
        rec.close()
    rec.close()  # closed: nothing more to say


def test_close_lets_an_exception_already_unwinding_win(tmp_path: Path) -> None:
    with pytest.raises(KeyError), PLACEMENTS["writer process"](tmp_path / "strict.db") as rec:
        _poisoned_key(rec)
        raise KeyError("the connector's own error")


def test_a_lenient_ledger_leaves_findings_to_its_violations(tmp_path: Path) -> None:
    rec = PLACEMENTS["writer process"](tmp_path / "lenient.db")
    s = SchedulerLedger(rec, strict=False)
    s.begin_step()
    rec.record(KeyVerified(key="k0", ok=False), 1)
    rec.close()
    assert [v.code.value for v in rec.violations] == ["POISONED_KEY"]


def test_a_recorder_never_closed_prints_its_findings_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        from kvstate import Recorder, SchedulerLedger
        from kvstate.events import KeyVerified
        rec = Recorder.open("strict.db", block_size=16, world_size=1)
        s = SchedulerLedger(rec)
        s.begin_step()
        rec.record(KeyVerified(key="k0", ok=False), 1)
        print("done")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "done"
    assert "strict.db was never closed" in done.stderr
    assert "POISONED_KEY at seq 2" in done.stderr
    assert "Traceback" not in done.stderr
    with Journal(tmp_path / "strict.db", readonly=True) as journal:
        assert [r.kind for r in journal.records()] == ["journal_opened", "key_verified"]


def test_every_exception_class_is_an_invariant_violation() -> None:
    for cls in (TableOverrunError, EarlyReleaseError, PoisonedKeyError):
        assert issubclass(cls, InvariantViolation)
