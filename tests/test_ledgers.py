"""The embeddable ledgers, tested the way vLLM's tests exercise the store
connector: resumed replaces, running appends, pins until every rank reports,
finish after preemption, stale jobs cannot touch a reused request id, and
every job reported exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate import JobSpec, Ledger, Recorder, SchedulerLedger, WorkerLedger
from kvstate import events as ev
from kvstate.folder import fold_all
from kvstate.violations import (
    DoubleReportError,
    EarlyReleaseError,
    InvariantViolation,
    PoisonedKeyError,
    TableOverrunError,
)
from replay import replay


def make(world_size: int = 2, *, strict: bool = True):
    rec = Recorder.in_memory(block_size=4, world_size=world_size)
    sched = SchedulerLedger(rec, strict=strict)
    workers = [WorkerLedger(r, rec, strict=strict) for r in range(world_size)]
    return rec, sched, workers


def fold(sched: SchedulerLedger) -> Ledger:
    """The audit's fold of the scheduler's recorder (the guards keep no blocks)."""
    ledger = sched.recorder.auditor.state()
    assert isinstance(ledger, Ledger)
    return ledger


def replayed(rec: Recorder) -> tuple[Ledger, list]:
    ledger = Ledger()
    return ledger, fold_all(rec.entries or [], ledger)


def register(workers: list[WorkerLedger], sched: SchedulerLedger, job: int) -> None:
    state = sched.job(job)
    for w in workers:
        w.register(JobSpec(job, state.req, state.gen, state.keys, state.parent))


def run_ok(worker: WorkerLedger, job: int, offset: int) -> None:
    with worker.run(job) as run:
        if not run.live:
            return
        run.dma_started()
        run.dma_done("d")
        run.put_done(stored=1, existed=0)
        run.save_offset(offset)


def test_running_request_appends_and_resumed_request_replaces() -> None:
    _, sched, _ = make()
    sched.admit("r", 12)
    sched.assign_blocks("r", [0, 1], resumed=False)
    sched.assign_blocks("r", [2], resumed=False)
    assert sched.table("r") == [0, 1, 2]
    sched.preempt("r")
    assert sched.table("r") == []
    gen = sched.resume("r")
    sched.assign_blocks("r", [5, 6, 7], resumed=True)
    assert gen == 1 and sched.table("r") == [5, 6, 7]
    assert fold(sched).requests["r"].incarnations[0].state == "preempted"


def test_job_pins_the_whole_table_copy_on_write_first_and_releases_tail_first() -> None:
    _, sched, workers = make()
    sched.admit("r", 12)
    sched.assign_blocks("r", [0, 1, 2], resumed=False)
    job = sched.enqueue_store_job("r", 4, 8, ["k1"], parent="k0", cow_blocks=[9])
    state = sched.job(job)
    assert state.pins == (9, 0, 1, 2)
    assert state.reads == (9, 0, 1)  # blocks covering [0, 8) plus the CoW block
    assert [fold(sched).blocks[b].refs for b in (0, 1, 2, 9)] == [2, 2, 2, 1]
    register(workers, sched, job)
    run_ok(workers[0], job, 8)
    sched.update_connector_output(workers[0].take_completed())
    assert sched.releasable_jobs() == []  # one of two ranks
    assert sched.has_pending_push_work()
    run_ok(workers[1], job, 8)
    sched.update_connector_output(workers[1].take_completed())
    assert sched.release_ready() == [(job, (2, 1, 0, 9))]
    assert not sched.has_pending_push_work()
    assert [fold(sched).blocks[b].refs for b in (0, 1, 2, 9)] == [1, 1, 1, 0]


def test_preemption_does_not_release_the_blocks_of_an_in_flight_job() -> None:
    rec, sched, workers = make()
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, job)
    sched.preempt("r")
    assert [fold(sched).blocks[b].refs for b in (0, 1)] == [1, 1]
    # another request takes blocks: free ones only, never the pinned 0 and 1
    free = [
        b for b in range(4) if fold(sched).blocks.get(b) is None or not fold(sched).blocks[b].refs
    ]
    assert free == [2, 3]
    for w in workers:
        run_ok(w, job, 8)  # not live any more: skipped, still reported
    sched.update_connector_output(WorkerLedger.aggregate(w.take_completed() for w in workers))
    sched.release_ready()
    sched.request_finished("r")
    sched.idle()
    _, found = replayed(rec)
    assert found == []


def test_finish_after_preemption_is_legal() -> None:
    _, sched, _ = make()
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    sched.preempt("r")
    sched.request_finished("r", aborted=True)
    assert sched.violations == []


def test_stale_job_cannot_touch_a_reused_request_id() -> None:
    rec, sched, workers = make(world_size=1)
    w = workers[0]
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    old = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, old)
    sched.preempt("r")
    sched.resume("r")
    sched.assign_blocks("r", [2], resumed=True)
    new = sched.enqueue_store_job("r", 0, 4, ["k0"])
    register(workers, sched, new)  # the rank sees gen 1 before the stale job runs
    assert not w.is_live(old) and w.is_live(new)
    with w.run(old) as run:
        assert not run.live
        assert not run.save_offset(8)
        assert not run.mark_skipped()
        assert not run.set_retry_tokens(0, 8)
    state = w.recorder.auditor.rank_ledger(w.rank).requests["r"]
    assert (state.gen, state.saved_offset, state.skipped, state.retry_tokens) == (1, 0, False, None)
    assert state.live_jobs == {new}
    kinds = [e.event.kind for e in rec.entries if e.event.side == "worker"][-2:]
    assert kinds == ["job_skipped", "job_reported"]


def test_effect_refused_when_preemption_arrives_during_the_job() -> None:
    _, sched, workers = make(world_size=1)
    w = workers[0]
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, job)
    with w.run(job) as run:
        assert run.live
        run.put_done(stored=2, existed=0)
        w.preemption_seen("r", 0)  # the worker's main thread, meanwhile
        assert not run.save_offset(8)
    assert w.violations == []


@pytest.mark.parametrize("path", ["success", "skip", "put_failed", "exception", "stale"])
def test_every_path_reports_exactly_once(path: str) -> None:
    rec, sched, workers = make(world_size=1)
    w = workers[0]
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, job)
    if path == "stale":
        w.preemption_seen("r", 0)

    def body() -> None:
        with w.run(job) as run:
            if not run.live:
                return
            if path == "exception":
                raise RuntimeError("preamble blew up")
            if path == "skip":
                run.skip("pressure")
            if path == "put_failed":
                run.put_failed("-200")
                assert run.mark_skipped()
                return
            run.put_done(2, 0)

    if path == "exception":
        with pytest.raises(RuntimeError):
            body()
    else:
        body()
    reports = [e for e in rec.entries if e.event.kind == "job_reported"]
    assert len(reports) == 1
    assert w.take_completed() == {job: 1}
    skipped = [e.event.reason for e in rec.entries if e.event.kind == "job_skipped"]
    expected = {"skip": ["pressure"], "exception": ["error"], "stale": ["stale"]}
    assert skipped == expected.get(path, [])


def test_running_a_job_twice_is_a_double_report_in_strict_mode() -> None:
    _, sched, workers = make(world_size=1)
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, job)
    run_ok(workers[0], job, 8)
    with pytest.raises(DoubleReportError) as info:
        run_ok(workers[0], job, 8)
    assert info.value.violation.job == job


def test_retire_waits_for_outstanding_jobs() -> None:
    _, sched, workers = make(world_size=1)
    w = workers[0]
    sched.admit("r", 8)
    sched.assign_blocks("r", [0, 1], resumed=False)
    job = sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])
    register(workers, sched, job)
    assert not w.retire("r", 0)
    run_ok(w, job, 8)
    assert w.retire("r", 0)


def test_aggregate_sums_ranks() -> None:
    assert WorkerLedger.aggregate([{1: 1, 2: 1}, {1: 1}, {}]) == {1: 2, 2: 1}


def test_strict_mode_raises_at_once_and_lax_mode_collects() -> None:
    _, sched, _ = make()
    sched.admit("r", 8)
    sched.assign_blocks("r", [0], resumed=False)
    with pytest.raises(TableOverrunError):
        sched.enqueue_store_job("r", 0, 8, ["k0", "k1"])

    _, lax, _ = make(strict=False)
    lax.admit("r", 8)
    lax.assign_blocks("r", [0], resumed=False)
    job = lax.enqueue_store_job("r", 0, 4, ["k0"])
    lax.release_pins(job)
    assert [v.code.value for v in lax.violations] == ["EARLY_RELEASE"]


def test_early_release_is_an_explicit_exception() -> None:
    _, sched, _ = make()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k0"])
    with pytest.raises(EarlyReleaseError) as info:
        sched.release_pins(job)
    assert isinstance(info.value, InvariantViolation)


def test_journal_database_written_by_the_ledgers_replays_clean(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    # The fold in this process (inline), to compare with the journal's replay.
    rec = Recorder.open(
        path, block_size=4, world_size=2, policy="kvstate", keep=True, process=False,
        audit="inline",
    )  # fmt: skip
    sched = SchedulerLedger(rec)
    workers = [WorkerLedger(r, rec) for r in range(2)]
    for step in range(5):
        sched.begin_step()
        req = f"r{step}"
        sched.admit(req, 8)
        sched.assign_blocks(req, [2 * step, 2 * step + 1], resumed=False)
        job = sched.enqueue_store_job(req, 0, 8, [f"{req}k0", f"{req}k1"])
        register(workers, sched, job)
        for w in workers:
            w.begin_step(sched.step)
            run_ok(w, job, 8)
        sched.update_connector_output(WorkerLedger.aggregate(w.take_completed() for w in workers))
        sched.release_ready()
        sched.request_finished(req)
    sched.idle()
    rec.close()
    result = replay([str(path)])
    assert result.verdict == "clean"
    assert rec.entries is not None and result.events == len(rec.entries)
    assert result.ledger.requests.keys() == fold(sched).requests.keys()
    assert result.ledger.blocks == fold(sched).blocks


@pytest.mark.parametrize("where", ["memory", "thread", "process"])
def test_a_commit_audit_raises_at_a_later_call_within_one_commit(
    tmp_path: Path, where: str
) -> None:
    """With ``audit="commit"`` the caller pays for its guards only; the fold
    runs on each committed batch (on the committing thread, the writer thread,
    or the writer process) and a strict ledger raises a finding no guard
    decides (a poisoned key the runtime read back) at its next call after the
    audit of the batch, with the record already journaled. (A breach a guard
    decides raises at the very call: tests/test_strict.py.)"""
    if where == "memory":
        rec = Recorder.in_memory(block_size=4, world_size=1, audit="commit")
    else:
        rec = Recorder.open(
            tmp_path / "j.db", block_size=4, world_size=1, audit="commit",
            process=where == "process",
        )  # fmt: skip
    sched = SchedulerLedger(rec)
    sched.admit("r", 8)
    rec.record(ev.KeyVerified(key="k0", ok=False), sched.step)  # not raised yet
    assert sched.violations == []
    with pytest.raises(PoisonedKeyError):
        sched.begin_step()  # the commit: the audit folds the batch
        if where == "process":
            # The writer process answers as soon as the batch is durable and
            # folds it after: its findings come back with the next answer.
            sched.begin_step()
    assert [v.code.value for v in sched.violations] == ["POISONED_KEY"]
    sched.admit("t", 4)  # reported once: the next call goes on
    rec.close()
    if where != "memory":
        found = replay([str(tmp_path / "j.db")]).violations
        assert [v.code.value for v in found] == ["POISONED_KEY"]
        assert found[0] == sched.violations[0]


def _publish_cpu(keys: int) -> float:
    """CPU to record and audit (inline) the KV events of one job with ``keys`` keys."""
    import time

    rec = Recorder.in_memory(block_size=4, world_size=1)
    sched = SchedulerLedger(rec)
    worker = WorkerLedger(0, rec)
    sched.admit("r", 4 * keys)
    sched.assign_blocks("r", range(keys), resumed=False)
    chain = [f"k{i}" for i in range(keys)]
    job = sched.enqueue_store_job("r", 0, 4 * keys, chain)
    worker.register(JobSpec(job, "r", 0, chain))
    t0 = time.process_time()
    with worker.run(job) as run:
        run.publish_kv_events(chain)
    took = time.process_time() - t0
    assert not rec.violations  # every parent checked against the chain, all right
    return took


def test_kv_events_cost_what_the_keys_cost_not_their_square() -> None:
    """A job's KV events are checked against its key chain by lookup, not by a
    scan per event: ten times the keys is about ten times the work, 200k keys
    included (a scan per key did not finish 200k in ten minutes)."""
    small, large = _publish_cpu(20_000), _publish_cpu(200_000)
    assert large < 40 * small, (small, large)  # a scan per key would be about 100x
