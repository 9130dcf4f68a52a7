"""How much a recorded transition costs the connector, measured in one run.

The budget is about 2 microseconds per recorded transition on a 2-core
machine. This drives the ledgers through complete job lifecycles (enqueue,
register on every rank, run, report, completions, release) and prints the
caller-side cost per recorded event:

* single transitions on a live job (``dma_started``; ``save_offset``, an
  effect with its liveness re-check), recorded and folded, no journal;
* ``memory``: whole lifecycles, record + fold only (no journal);
* ``journal``: the same with a journal database written by the background
  writer (the caller only appends to a list; encoding and SQLite happen on
  the writer thread, whose time is reported separately as ``flush``);
* ``replay``: folding the written journal back (events per second).

Run: ``python benchmarks/bench_hot_path.py [--jobs N]``. Numbers vary with
the machine; compare the ratios printed by one run, not across runs.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import tracemalloc
from collections.abc import Callable

from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger
from kvstate.archive import Archive
from kvstate.events import JournalOpened
from replay import replay

BUDGET_NS = 2_000
WORLD = 2
BLOCK = 16


def lifecycle(
    recorder: Recorder,
    jobs: int,
    *,
    between: Callable[[], None] | None = None,
    archive: Callable[[], Archive] = Archive,
    every: int | None = None,
) -> int:
    """Run ``jobs`` complete store jobs; returns how many events were recorded.

    ``between`` is called once half the jobs are done (or every ``every``
    jobs) and again when all are, while the ledgers still exist (the
    live-memory measurement looks at the heap there). ``archive`` makes each
    ledger's archive.
    """
    archives = [archive() for _ in range(WORLD + 1)]
    try:
        return _lifecycle(recorder, jobs, between, archives, every)
    finally:
        for made in archives:
            made.close()


def _lifecycle(
    recorder: Recorder,
    jobs: int,
    between: Callable[[], None] | None,
    archives: list[Archive],
    every: int | None = None,
) -> int:
    sched = SchedulerLedger(recorder, archive=archives[0])
    workers = [WorkerLedger(r, recorder, archive=archives[r + 1]) for r in range(WORLD)]
    for i in range(jobs):
        if between is not None and (i == jobs // 2 if every is None else i and i % every == 0):
            between()
        req = f"r{i}"
        sched.begin_step()
        sched.admit(req, 4 * BLOCK)
        sched.assign_blocks(req, [4 * (i % 64) + k for k in range(4)], resumed=False)
        keys = [f"m@tp:0@{i:x}{k}" for k in range(4)]
        job = sched.enqueue_store_job(req, 0, 4 * BLOCK, keys)
        for w in workers:
            w.register(JobSpec(job, req, sched.current_gen(req), keys))
            with w.run(job) as run:
                run.dma_started()
                run.dma_done(digest=i)
                run.put_done(stored=4, existed=0)
                run.save_offset(4 * BLOCK)
        sched.update_connector_output(WorkerLedger.aggregate(w.take_completed() for w in workers))
        sched.release_ready()
        sched.request_finished(req)
        for w in workers:
            w.preemption_seen(req, 0)
            w.retire(req, 0)
    if between is not None:
        between()
    sched.idle()
    return count(recorder)


def count(recorder: Recorder) -> int:
    return recorder.recorded


def live_bytes_per_job(jobs: int, archive: Callable[[], Archive] = Archive) -> float:
    """Bytes the guards (a scheduler and its ranks, no journal, no audit) still
    hold per finished job: the heap after ``jobs`` lifecycles less the heap
    after half of them, over the jobs in between. Bounded by live state is 0.
    ``archive``: where they park ended requests (SpillArchive: on disk, not counted)."""
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD), audit="off")
    marks: list[int] = []

    def mark() -> None:
        gc.collect()
        marks.append(tracemalloc.get_traced_memory()[0])

    tracemalloc.start()
    try:
        lifecycle(rec, jobs, between=mark, archive=archive)
    finally:
        tracemalloc.stop()
    return (marks[1] - marks[0]) / (jobs - jobs // 2)


def single_transitions(n: int) -> dict[str, float]:
    """ns per call of one worker transition and one effect, on a live job."""
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=1))
    sched = SchedulerLedger(rec)
    worker = WorkerLedger(0, rec)
    sched.admit("r", BLOCK)
    sched.assign_blocks("r", [0], resumed=False)
    job = sched.enqueue_store_job("r", 0, BLOCK, ["k"])
    worker.register(JobSpec(job, "r", 0, ("k",)))
    out = {}
    with worker.run(job) as run:
        for name, call in (("dma_started", run.dma_started), ("save_offset", run.save_offset)):
            args = (BLOCK,) if name == "save_offset" else ()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                call(*args)
            out[name] = (time.perf_counter_ns() - t0) / n
    return out


def engine_cpu(
    jobs: int, *, process: bool, audit: str, journal: bool = True
) -> tuple[float, float, int]:
    """CPU per recorded event of whole lifecycles: in the engine's process (every
    thread, a writer thread included) and in the writer process (0 without
    one), and the event count. ``process_time`` of this process; the writer
    process's from ``RUSAGE_CHILDREN`` once it has exited (its start-up, an
    interpreter and its imports, included). Without ``journal`` the records
    stay in memory (the ledgers' decisions and the recorder alone)."""
    import resource

    if not journal:
        rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD), audit=audit)
        t0 = time.process_time_ns()
        lifecycle(rec, jobs)
        rec.commit()
        return (time.process_time_ns() - t0) / count(rec), 0.0, count(rec)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        rec = Recorder.open(path, block_size=BLOCK, world_size=WORLD, process=process, audit=audit)
        t0 = time.process_time_ns()
        lifecycle(rec, jobs)
        rec.close()
        engine_ns = time.process_time_ns() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        events = count(rec)
        if rec.violations:
            raise RuntimeError(
                f"the benchmark's lifecycles broke an invariant: {rec.violations[0]}"
            )
    child_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return engine_ns / events, child_s * 1e9 / events, events


def audited_scheduler(folder: str) -> SchedulerLedger:
    """A lax scheduler ledger of one rank whose journal is written, and audited,
    by a writer process in ``folder``: the configuration the CPU rows measure."""
    rec = Recorder.open(
        os.path.join(folder, "j.db"), block_size=BLOCK, world_size=1, process=True,
        audit="commit",
    )  # fmt: skip
    return SchedulerLedger(rec, strict=False)


def job_cpu(table: int, jobs: int) -> float:
    """Engine-process CPU (ns) of one job's enqueue, completion and release, the
    job pinning a ``table``-block table and saving one block (as a decode save
    does), with the journal written and audited by a writer process."""
    with tempfile.TemporaryDirectory() as tmp:
        sched = audited_scheduler(tmp)
        sched.admit("r", table * BLOCK)
        sched.assign_blocks("r", range(table), resumed=False)
        keys = [(f"k{i}",) for i in range(jobs)]
        start, end = (table - 1) * BLOCK, table * BLOCK
        t0 = time.process_time_ns()
        for i in range(jobs):
            job = sched.enqueue_store_job("r", start, end, keys[i])
            sched.update_connector_output({job: 1})
            sched.release_pins(job)
            if i % 32 == 31:
                sched.begin_step()  # a step's commit
        took = time.process_time_ns() - t0
        sched.recorder.close()
    return took / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    args = parser.parse_args()

    for label, kwargs in (
        ("in memory, no audit      ", {"process": False, "audit": "off", "journal": False}),
        ("writer thread, audit inline", {"process": False, "audit": "inline"}),
        ("writer process, audit there", {"process": True, "audit": "commit"}),
    ):
        engine, writer, n = engine_cpu(args.jobs // 4, **kwargs)  # type: ignore[arg-type]
        print(
            f"{label}: engine-process CPU {engine:6.0f} ns/event, "
            f"writer process {writer:6.0f} ns/event ({n} events)"
        )
    small, large = job_cpu(4, 2000), job_cpu(512, 2000)
    print(f"a job at 4 / 512 blocks: {small:6.0f} / {large:6.0f} ns ({large / small:.2f}x)")
    singles = single_transitions(50_000)
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD))
    t0 = time.perf_counter_ns()
    lifecycle(rec, args.jobs)
    memory_ns = time.perf_counter_ns() - t0
    events = count(rec)

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.db")
        rec = Recorder.open(path, block_size=BLOCK, world_size=WORLD)
        t0 = time.perf_counter_ns()
        lifecycle(rec, args.jobs)
        journal_ns = time.perf_counter_ns() - t0
        t0 = time.perf_counter_ns()
        rec.close()
        flush_ns = time.perf_counter_ns() - t0
        size = os.path.getsize(path)
        t0 = time.perf_counter_ns()
        result = replay([path])
        replay_ns = time.perf_counter_ns() - t0

    per_memory = memory_ns / events
    per_journal = journal_ns / events
    for name, ns in singles.items():
        print(f"{name:<12} {ns:8.0f} ns/transition  ({ns / BUDGET_NS:.2f} x the 2 us budget)")
    print(f"{args.jobs} jobs x {WORLD} ranks, whole lifecycles: {events} recorded events")
    for name, per in (("memory", per_memory), ("journal", per_journal)):
        print(f"{name:<8} {per:8.0f} ns/event  ({per / BUDGET_NS:.2f} x the 2 us budget)")
    print(f"         journal / memory = {per_journal / per_memory:.2f}")
    print(f"flush    {flush_ns / 1e6:8.1f} ms after the run (writer catching up)")
    print(f"journal  {size / events:8.1f} bytes/event on disk")
    print(
        f"replay   {events / (replay_ns / 1e9):8.0f} events/s "
        f"({result.verdict}, {len(result.violations)} violations)"
    )


if __name__ == "__main__":
    main()
