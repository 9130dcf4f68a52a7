"""The store connector on the ledgers, tested the way vLLM tests its store
connector: resumed replaces, running appends, a save on the step that fills a
block without allocating one, finish after preemption, stale jobs cannot
touch a reused request id, and every rank must report before blocks free."""

from __future__ import annotations

from kvstate.folder import fold_all
from kvstate.harness.sim.batching import Request
from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.runtime import Simulation

BS = 4


def make(**overrides: object) -> Simulation:
    settings: dict[str, object] = {
        "requests": 0, "blocks": 8, "block_size": BS, "world_size": 2, "token_budget": 64
    }  # fmt: skip
    settings.update(overrides)
    return Simulation(SimConfig(**settings))  # type: ignore[arg-type]


def request(name: str, tokens: int, out: int = 4) -> Request:
    base = 1000 * (1 + sum(map(ord, name)))  # distinct prompts: no accidental prefix hits
    return Request(name, list(range(base, base + tokens)), out)


def pressure(sim: Simulation) -> None:
    """Two running requests fill a 4-block pool and their saves are in flight
    (dequeued, before the DMA); the next step the older one needs a block, so
    the engine preempts the newer one ("c"). The in-flight saves finish after."""
    sim.engine.add_request(request("a", 8))
    sim.engine.add_request(request("c", 8))
    sim.engine_step()  # both prefilled; a store job for each is queued
    in_flight = []
    for worker in sim.workers:
        while worker.queue:
            job = worker.run_job(worker.queue.popleft())
            next(job)  # dequeued, live, waiting on the store
            in_flight.append(job)
    sim.engine_step()
    for job in in_flight:
        for _ in job:
            pass


def drain(sim: Simulation, rank: int | None = None) -> None:
    """The sending threads run every queued job to the end."""
    for worker in sim.workers if rank is None else [sim.workers[rank]]:
        while worker.queue:
            for _ in worker.run_job(worker.queue.popleft()):
                pass


def kinds(sim: Simulation, kind: str) -> list:
    return [e.event for e in sim.recorder.entries or [] if e.event.kind == kind]


def replay_violations(sim: Simulation) -> list[str]:
    return [v.code.value for v in fold_all(sim.recorder.entries or []) if not v.is_warning]


def test_running_request_appends_and_resumed_request_replaces() -> None:
    sim = make()
    sim.engine.add_request(request("a", 8, out=8))
    sim.engine_step()  # prefill: blocks [0, 1]
    drain(sim)
    for _ in range(2):  # decode into a third block
        sim.engine_step()
    assigned = kinds(sim, "blocks_assigned")
    assert [(a.mode, a.blocks) for a in assigned] == [("append", (0, 1)), ("append", (2,))]
    assert sim.sched_ledger.table("a") == sim.engine.requests["a"].blocks

    sim.engine.preempt("a")
    sim.engine_step()  # the preemption is journaled, then "a" resumes as generation 1
    assert [(p.req, p.gen) for p in kinds(sim, "request_preempted")] == [("a", 0)]
    last = kinds(sim, "blocks_assigned")[-1]
    assert last.mode == "replace" and last.gen == 1
    assert sim.sched_ledger.table("a") == sim.engine.requests["a"].blocks


def test_save_on_the_step_that_fills_a_block_without_allocating_one() -> None:
    sim = make(token_budget=6)
    sim.engine.add_request(request("a", 8))
    sim.engine_step()  # tokens 0-6: blocks 0 and 1 allocated, block 0 full
    first = kinds(sim, "job_enqueued")
    assert [(j.token_start, j.token_end) for j in first] == [(0, 4)]
    output_new_blocks = len(kinds(sim, "blocks_assigned"))
    sim.engine_step()  # tokens 6-8 fill block 1; nothing is allocated
    assert len(kinds(sim, "blocks_assigned")) == output_new_blocks
    jobs = kinds(sim, "job_enqueued")
    assert [(j.token_start, j.token_end) for j in jobs] == [(0, 4), (4, 8)]
    drain(sim)
    assert replay_violations(sim) == []


def test_finish_after_preemption_is_legal() -> None:
    sim = make(blocks=4)
    pressure(sim)
    assert sim.engine.requests["c"].status == "preempted"
    sim.engine.abort("c")  # the client gives up while it waits
    sim.engine_step()
    finished = kinds(sim, "request_finished")
    assert [(f.req, f.gen, f.aborted) for f in finished] == [("c", 0, True)]
    assert not sim.crashed
    drain(sim)
    assert replay_violations(sim) == []


def test_stale_job_cannot_touch_a_reused_request_id() -> None:
    sim = make()
    sim.engine.add_request(request("a", 8, out=8))
    sim.engine_step()  # job 0 for generation 0 is queued on both ranks
    sim.engine.preempt("a")
    sim.engine_step()  # preemption journaled and seen by the ranks; "a" resumes as gen 1
    assert sim.engine.requests["a"].gen == 1
    drain(sim)
    skipped = {(e.job, e.rank, e.reason) for e in kinds(sim, "job_skipped")}
    assert {(0, 0, "stale"), (0, 1, "stale")} <= skipped
    offsets = kinds(sim, "offset_saved")
    assert offsets and all(o.job != 0 for o in offsets)
    for worker in sim.workers:
        assert worker.ledger.newest_gen("a") == 1 and worker.ledger.saved_offset("a", 1) == 8
    assert replay_violations(sim) == []


def test_every_rank_must_report_before_the_pins_are_freed() -> None:
    sim = make()
    sim.engine.add_request(request("a", 8, out=1))
    sim.engine_step()  # job 0 pins blocks 0 and 1; "a" finishes and frees its table
    blocks = sim.sched_ledger.job(0).pins
    assert all(sim.pool.refs[b] == 1 for b in blocks)  # only the pins hold them now
    drain(sim, rank=0)
    sim.engine_step()
    assert all(sim.pool.refs[b] == 1 for b in blocks)  # one rank of two reported
    drain(sim, rank=1)
    sim.engine_step()
    assert all(sim.pool.refs[b] == 0 for b in blocks)
    released = kinds(sim, "pins_released")
    assert [(r.job, r.blocks) for r in released] == [(0, tuple(reversed(blocks)))]


def test_legacy_connector_reads_reused_blocks() -> None:
    sim = make(policy="legacy", blocks=4)
    pressure(sim)  # c's blocks go back to the pool with its PUT still queued
    drain(sim)
    found = replay_violations(sim)
    assert "POISONED_READ" in found

    fixed = make(blocks=4)
    pressure(fixed)  # the pins keep c's blocks: the engine preempts "a" too instead
    drain(fixed)
    assert replay_violations(fixed) == []


def test_consumer_saves_only_with_save_decode_cache_and_backfills_the_prompt() -> None:
    quiet = make(kv_role="kv_consumer")
    quiet.engine.add_request(request("a", 8, out=8))
    for _ in range(8):
        quiet.engine_step()
    assert kinds(quiet, "job_enqueued") == []

    sim = make(kv_role="kv_consumer", save_decode_cache=True)
    sim.engine.add_request(request("a", 6, out=10))
    for _ in range(10):
        sim.engine_step()
        drain(sim)
    jobs = [(j.token_start, j.token_end) for j in kinds(sim, "job_enqueued")]
    # nothing during the 6-token prefill; the first decode step backfills the
    # prompt's full block, and each later save adds only the block it filled
    assert jobs == [(0, 4), (4, 8), (8, 12)]
    assert replay_violations(sim) == []
