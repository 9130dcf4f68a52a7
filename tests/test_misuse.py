"""The embedding API fails clearly: kvstate's own errors naming the id and
the hook, a job reported on every path (its own preamble included), the live
code for an unregistered job equal to replay's, double registration refused."""

from __future__ import annotations

import pytest

from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger
from kvstate.errors import (
    DuplicateJobError,
    LedgerUsageError,
    UnknownJobError,
    UnknownRequestError,
)
from kvstate.folder import fold_all
from kvstate.policy import WorkerPolicy
from kvstate.violations import Code, UnledgeredJobError


def make(strict: bool = True) -> tuple[Recorder, SchedulerLedger, WorkerLedger]:
    rec = Recorder.in_memory(block_size=4, world_size=1)
    return rec, SchedulerLedger(rec, strict=strict), WorkerLedger(0, rec, strict=strict)


@pytest.mark.parametrize(
    ("hook", "call"),
    [
        ("assign_blocks", lambda s: s.assign_blocks("ghost", [1], resumed=False)),
        ("enqueue_store_job", lambda s: s.enqueue_store_job("ghost", 0, 4, ["k"])),
        ("preempt", lambda s: s.preempt("ghost")),
        ("request_finished", lambda s: s.request_finished("ghost")),
        ("resume", lambda s: s.resume("ghost")),
        ("release_held", lambda s: s.release_held("ghost")),
        ("table", lambda s: s.table("ghost")),
        ("current_gen", lambda s: s.current_gen("ghost")),
    ],
)
def test_unknown_request_names_the_id_and_the_hook(hook: str, call) -> None:  # type: ignore[no-untyped-def]
    rec, sched, _ = make()
    before = rec.recorded
    with pytest.raises(UnknownRequestError) as caught:
        call(sched)
    assert str(caught.value) == f"{hook}: request 'ghost' was never admitted"
    assert isinstance(caught.value, LedgerUsageError) and isinstance(caught.value, KeyError)
    assert rec.recorded == before  # nothing recorded for a call that was refused


@pytest.mark.parametrize(
    ("hook", "call"),
    [("job", lambda s: s.job(7)), ("job", lambda s: s.release_pins(7))],
)
def test_unknown_job_names_the_id(hook: str, call) -> None:  # type: ignore[no-untyped-def]
    _, sched, _ = make()
    with pytest.raises(UnknownJobError, match=f"{hook}: job 7 was never enqueued"):
        call(sched)


def test_double_registration_is_refused() -> None:
    rec, sched, worker = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    worker.register(JobSpec(job, "r", 0, ("k",)))
    before = rec.recorded
    with pytest.raises(DuplicateJobError, match=f"job {job} is already registered on rank 0"):
        worker.register(JobSpec(job, "r", 0, ("k",)))
    assert rec.recorded == before


def test_an_unregistered_job_is_unledgered_live_and_in_replay() -> None:
    rec, sched, worker = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    with pytest.raises(UnledgeredJobError), worker.run(job):
        pytest.fail("the body of an unregistered job must not run")
    assert [e.event.kind for e in (rec.entries or [])][-2:] == ["job_skipped", "job_reported"]
    live = {v.code for v in worker.violations}
    replayed = {v.code for v in fold_all(rec.entries or []) if not v.is_warning}
    assert live == replayed == {Code.UNLEDGERED_JOB}


def test_an_unregistered_job_without_strict_mode_is_reported_once() -> None:
    rec, _sched, worker = make(strict=False)
    with worker.run(3) as run:
        assert not run.live
    kinds = [e.event.kind for e in (rec.entries or [])]
    assert kinds.count("job_reported") == 1
    assert worker.take_completed() == {3: 1}


def test_an_exception_in_the_preamble_still_reports_the_job(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    rec, sched, worker = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    worker.register(JobSpec(job, "r", 0, ("k",)))

    class Broken(WorkerPolicy):
        def live_at_start(self, ledger: WorkerLedger, job: int, fixed: bool) -> bool:
            raise OSError("liveness lookup failed")

    monkeypatch.setattr(worker, "policy", Broken())
    with pytest.raises(OSError, match="liveness lookup failed"), worker.run(job):
        pytest.fail("the body must not run")
    kinds = [e.event.kind for e in (rec.entries or [])]
    assert kinds[-2:] == ["job_skipped", "job_reported"]
    assert worker.take_completed() == {job: 1}  # the pins can be released
    sched.update_connector_output({job: 1})
    assert sched.release_ready() == [(job, (0,))]


def test_an_exception_in_the_body_reports_once_and_propagates() -> None:
    rec, sched, worker = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    worker.register(JobSpec(job, "r", 0, ("k",)))
    with pytest.raises(ZeroDivisionError), worker.run(job) as run:
        run.dma_started()
        _ = 1 / 0
    kinds = [e.event.kind for e in (rec.entries or [])]
    assert kinds[-3:] == ["dma_started", "job_skipped", "job_reported"]
    assert kinds.count("job_reported") == 1


def test_retiring_a_superseded_generation_is_a_harmless_no_op() -> None:
    rec, sched, worker = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    sched.preempt("r")
    worker.preemption_seen("r", 0)
    sched.resume("r")
    sched.assign_blocks("r", [1], resumed=True)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    worker.register(JobSpec(job, "r", 1, ("k",)))  # the rank now knows generation 1
    before = rec.recorded
    assert worker.retire("r", 0) is True
    assert rec.recorded == before  # nothing recorded: no stale effect on generation 1
    assert worker.retire("r", 1) is False  # job of generation 1 not reported yet


def test_accessors_read_the_folded_state() -> None:
    _rec, sched, worker = make()
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["a", "b"])
    worker.register(JobSpec(job, "r", 0, ("a", "b")))
    assert worker.newest_gen("r") == 0 and worker.newest_gen("nobody") is None
    with worker.run(job) as run:
        run.put_failed("TRANSFER_FAIL")
        run.set_retry_tokens(0, 8)
    assert worker.has_retry_tokens("r", 0) and not worker.has_retry_tokens("r", 1)
    assert worker.saved_offset("r", 0) == 0 and worker.jobs_received == 1
    sched.update_connector_output(worker.take_completed())
    sched.release_ready()
    assert sched.pinned_jobs == 0
    sched.request_finished("r", hold=True)
    assert sched.holds_blocks("r") and sched.holds_blocks("r", 0)
    sched.release_held("r")
    assert not sched.holds_blocks("r")


def test_every_code_has_its_exception_class() -> None:
    import kvstate
    from kvstate import violations
    from kvstate.violations import EXCEPTIONS, WARNING_CODES

    for code in Code:
        if code in WARNING_CODES:
            continue
        cls = EXCEPTIONS[code]
        assert getattr(violations, cls.__name__) is cls and cls.code is code
        assert issubclass(cls, kvstate.KvstateError)
        assert cls.__module__ == "kvstate.violations" and cls.__doc__


def test_every_error_kvstate_raises_on_purpose_is_a_kvstate_error() -> None:
    """What ``kvstate/__init__.py`` promises: one base to catch, the refused
    vLLM included (it was a bare RuntimeError)."""
    from kvstate import KvstateError
    from kvstate.errors import TemporaryStorageError
    from kvstate.violations import InvariantViolation
    from kvstate.vllm._compat import UnsupportedVLLMError

    for cls in (LedgerUsageError, InvariantViolation, TemporaryStorageError, UnsupportedVLLMError):
        assert issubclass(cls, KvstateError), cls
    assert issubclass(UnsupportedVLLMError, RuntimeError)  # callers that caught RuntimeError
