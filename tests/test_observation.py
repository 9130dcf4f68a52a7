"""The ledger API a journaling observer of another connector needs (vLLM's):
job ids and pins as the connector chose them, finish-time jobs after the
finish, and workers with journals of their own that commit per step."""

from __future__ import annotations

from pathlib import Path

from journal import Journal
from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger
from kvstate.folder import fold_all
from replay import replay


def observed(world: int = 1) -> tuple[Recorder, SchedulerLedger, list[WorkerLedger]]:
    rec = Recorder.in_memory(block_size=4, world_size=world)
    # An observer records what the connector did; replay judges it.
    sched = SchedulerLedger(rec, strict=False)
    return rec, sched, [WorkerLedger(r, rec, strict=False) for r in range(world)]


def codes(rec: Recorder) -> list[str]:
    return [v.code.value for v in fold_all(rec.entries or []) if not v.is_warning]


def run_job(worker: WorkerLedger, job: int, req: str, gen: int) -> None:
    worker.register(JobSpec(job, req, gen, ("k",)))
    with worker.run(job) as run:
        run.dma_started()
        run.dma_done()
        run.put_done(stored=1, existed=0)


def test_job_ids_and_pins_are_recorded_as_the_connector_chose_them() -> None:
    rec, sched, _ = observed()
    sched.admit("r", 4)
    sched.assign_blocks("r", [3], resumed=False)
    assert sched.enqueue_store_job("r", 0, 4, ["k"], job=41, pins=[3]) == 41
    assert sched.job(41).pins == (3,)
    assert sched.enqueue_store_job("r", 0, 4, ["k2"]) == 42  # kvstate's own numbering follows
    sched.enqueue_store_job("r", 0, 4, ["k3"], job=7, pins=[3])  # the connector went back
    assert codes(rec) == ["ID_REUSED"]


def test_a_connector_without_pins_is_caught_by_replay() -> None:
    # vLLM before #52372: no pins; a preemption frees the blocks under the queued job.
    rec, sched, (worker,) = observed()
    sched.admit("a", 4)
    sched.assign_blocks("a", [0], resumed=False)
    job = sched.enqueue_store_job("a", 0, 4, ["k"], job=0, pins=[])
    sched.preempt("a")
    sched.admit("b", 4)
    sched.assign_blocks("b", [0], resumed=False)  # block 0 is someone else's now
    run_job(worker, job, "a", 0)
    assert "POISONED_READ" in codes(rec)


def test_a_finish_time_job_after_request_finished_is_clean() -> None:
    rec, sched, (worker,) = observed()
    sched.admit("r", 6)
    sched.assign_blocks("r", [0, 1], resumed=False)
    sched.request_finished("r")
    # vLLM's partial tail: registered at finish, pinning exactly what it reads
    job = sched.enqueue_store_job("r", 4, 8, ["k"], reads=[1], pins=[1])
    run_job(worker, job, "r", 0)
    sched.update_connector_output(worker.take_completed())
    sched.release_ready()
    sched.idle()
    assert codes(rec) == []


def test_a_finish_time_job_larger_than_the_table_overruns() -> None:
    rec, sched, _ = observed()
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    sched.request_finished("r")
    sched.enqueue_store_job("r", 0, 8, ["k"], reads=[0], pins=[0])
    assert codes(rec) == ["TABLE_OVERRUN"]


def test_per_process_journals_commit_per_step_and_merge(tmp_path: Path) -> None:
    # one run, two processes: the same run in both headers, a role each
    sched_rec = Recorder.open(
        tmp_path / "sched.db", block_size=4, world_size=1, run="r1", role="scheduler"
    )
    rank_rec = Recorder.open(
        tmp_path / "rank0.db", block_size=4, world_size=1, run="r1", role="worker-0"
    )
    sched = SchedulerLedger(sched_rec)
    worker = WorkerLedger(0, rank_rec, commit_steps=True)
    step = sched.begin_step()
    worker.begin_step(step)
    sched.admit("r", 4)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, 4, ["k"])
    run_job(worker, job, "r", 0)
    worker.begin_step(sched.begin_step())  # both processes commit their step
    with Journal(tmp_path / "rank0.db", readonly=True) as journal:
        assert len(journal) == 7  # the header and the job's six records, before any close
    sched.update_connector_output(worker.take_completed())
    sched.release_ready()
    sched.request_finished("r")
    sched.idle()
    sched_rec.close()
    rank_rec.close()
    # one host, one monotonic clock: merged by ts, the worker records follow the enqueue
    result = replay([str(tmp_path / "sched.db"), str(tmp_path / "rank0.db")])
    assert result.verdict == "clean" and not result.unfinished
