"""The offloading protocol's codes (kvstate.tier_events): a journal that fires each
at the right record with the right chain, and a near miss that must not.

The journals are written as vLLM's OffloadingConnector behaves: a store job
reads its request's blocks and pins none (``pins: []``), a preempted
request's blocks are fenced by ``flush_requested`` / ``flush_done`` instead,
load jobs take ids from the same counter, and the tier's contents are
journaled (``tier_stored``, ``tier_evicted``).
"""

from __future__ import annotations

from kvstate.ledger import Ledger
from kvstate.tier_events import OFFLOADING
from replay.verdict import replay
from tests.builder import JournalBuilder


def offloading(world_size: int = 1) -> JournalBuilder:
    return JournalBuilder(world_size=world_size, protocol=OFFLOADING)


def store(j: JournalBuilder, job: int, req: str, gen: int, reads: list[int]) -> int:
    return j.enqueue(job, req, gen, reads=reads, pins=[], keys=[f"h{b}" for b in reads])


def transfer(j: JournalBuilder, job: int, rank: int = 0) -> None:
    """One rank's transfer as the offloading worker journals it: no DMA records."""
    j.add("job_received", job=job, rank=rank)
    j.add("job_started", job=job, rank=rank)
    j.add("job_reported", job=job, rank=rank)


def end(j: JournalBuilder, job: int) -> int:
    j.add("completions_received", job=job, count=j.world_size)
    return j.add("pins_released", job=job, blocks=[])


def load(
    j: JournalBuilder, job: int, req: str, gen: int, writes: list[int], keys: list[str]
) -> int:
    return j.add(
        "load_enqueued",
        job=job,
        req=req,
        gen=gen,
        writes=writes,
        keys=keys,
        world_size=j.world_size,
    )


def preempted_with_store_in_flight(j: JournalBuilder) -> int:
    """``a`` stores blocks 1 and 2, is preempted before the store ends; returns the enqueue."""
    j.admit("a", blocks=[1, 2])
    enq = store(j, 0, "a", 0, [1, 2])
    j.add("job_received", job=0, rank=0)
    j.add("job_started", job=0, rank=0)
    j.step = 1
    j.add("request_preempted", req="a", gen=0)
    return enq


def the_clean_run() -> JournalBuilder:
    """Preempted, flushed, reused, stored in the tier, resumed and loaded back."""
    j = offloading()
    preempted_with_store_in_flight(j)
    j.add("flush_requested", jobs=[0])
    j.admit("b", blocks=[1, 2])
    j.add("flush_done", jobs=[0], rank=0)
    j.add("job_reported", job=0, rank=0)
    end(j, 0)
    j.add("tier_stored", job=0, keys=["h1", "h2"])
    j.step = 2
    j.add("request_finished", req="b", gen=0)
    j.add("request_resumed", req="a", gen=1)
    j.add("blocks_assigned", req="a", gen=1, blocks=[3, 4], mode="replace")
    load(j, 1, "a", 1, [3, 4], ["h1", "h2"])
    transfer(j, 1)
    end(j, 1)
    j.add("request_finished", req="a", gen=1)
    j.add("engine_idle")
    return j


def test_the_offloading_lifecycle_is_clean() -> None:
    assert the_clean_run().fold() == ([], [])


def test_the_same_run_replays_clean_from_a_file(tmp_path) -> None:
    path = the_clean_run().write(tmp_path / "offload.jsonl")
    result = replay([str(path)], require_idle=True)
    assert result.violations == [] and result.exit_status == 0


# -- UNFLUSHED_REUSE (vLLM #29870) ---------------------------------------------------------


def test_a_reuse_without_a_flush_is_unflushed_reuse() -> None:
    j = offloading()
    enq = preempted_with_store_in_flight(j)
    j.add("request_admitted", req="b", gen=0, prompt_tokens=8)
    reuse = j.add("blocks_assigned", req="b", gen=0, blocks=[2, 1], mode="append")
    v = j.only("UNFLUSHED_REUSE")
    assert (v.seq, v.job, v.req, v.block) == (reuse, 0, "a", 2)
    assert enq in v.chain


def test_near_miss_a_store_done_on_every_rank_needs_no_flush() -> None:
    j = offloading(world_size=2)
    preempted_with_store_in_flight(j)
    j.add("job_reported", job=0, rank=0)
    transfer(j, 0, rank=1)
    j.admit("b", blocks=[1, 2])
    assert "UNFLUSHED_REUSE" not in j.codes()


def test_a_store_done_on_one_rank_of_two_still_needs_its_flush() -> None:
    j = offloading(world_size=2)
    preempted_with_store_in_flight(j)
    j.add("job_reported", job=0, rank=0)
    j.admit("b", blocks=[1, 2])
    assert j.only("UNFLUSHED_REUSE").job == 0


def test_a_flush_fences_only_its_own_step() -> None:
    j = offloading()
    preempted_with_store_in_flight(j)
    j.add("flush_requested", jobs=[0])
    j.step = 2  # no flush_done: the rank never waited, and the next step reuses
    j.admit("b", blocks=[1])
    assert j.only("UNFLUSHED_REUSE").block == 1


def finished_then_handed_over(j: JournalBuilder) -> None:
    """``a`` finishes at step 0 (its blocks freed); at step 1 ``b`` gets block 2,
    then the connector builds ``a``'s last store, reading blocks 1 and 2."""
    j.admit("a", blocks=[1, 2])
    j.add("request_finished", req="a", gen=0)
    j.step = 1
    j.admit("b", blocks=[2])
    store(j, 0, "a", 0, [1, 2])


def test_a_finish_time_store_flushed_in_the_hand_over_step_is_clean() -> None:
    j = offloading()
    finished_then_handed_over(j)
    j.add("flush_requested", jobs=[0])
    j.step = 2
    transfer(j, 0)
    end(j, 0)
    j.admit("c", blocks=[1])  # a later hand-over of a block the store no longer reads
    assert j.codes() == []


def test_a_finish_time_store_not_flushed_in_its_step_is_unflushed_reuse() -> None:
    j = offloading()
    finished_then_handed_over(j)
    j.step = 2
    late = j.admit("c")  # the next step's first scheduler record
    v = j.only("UNFLUSHED_REUSE")
    assert (v.seq, v.job, v.req, v.block) == (late, 0, "a", 2)
    kinds = {r["seq"]: r["kind"] for r in j.records}
    assert [kinds[s] for s in v.chain] == ["blocks_assigned", "job_enqueued"]


def test_a_finish_time_store_unflushed_at_engine_idle() -> None:
    j = offloading()
    finished_then_handed_over(j)
    transfer(j, 0)
    end(j, 0)
    idle = j.add("engine_idle")
    assert j.only("UNFLUSHED_REUSE").seq == idle


def test_a_finish_time_store_of_a_block_handed_over_a_step_earlier() -> None:
    j = offloading()
    j.admit("a", blocks=[1, 2])
    j.add("request_finished", req="a", gen=0)
    j.step = 1
    j.admit("b", blocks=[2])
    j.step = 2  # b's forward pass of step 1 may already have written block 2
    enq = store(j, 0, "a", 0, [1, 2])
    v = j.only("UNFLUSHED_REUSE")
    assert (v.seq, v.block) == (enq, 2)


def test_a_finish_time_store_of_free_blocks_is_fenced_on_their_reuse() -> None:
    j = offloading()
    j.admit("a", blocks=[1, 2])
    j.add("request_finished", req="a", gen=0)
    j.step = 1
    store(j, 0, "a", 0, [1, 2])
    assert j.codes() == []  # free since the finish: nothing to fence yet
    j.step = 2
    reuse = j.add("request_admitted", req="b", gen=0, prompt_tokens=8)
    reuse = j.add("blocks_assigned", req="b", gen=0, blocks=[1], mode="append")
    assert j.only("UNFLUSHED_REUSE").seq == reuse


def test_a_finish_time_store_outside_the_final_table_is_foreign() -> None:
    j = offloading()
    finished_then_handed_over(j)
    j.add("flush_requested", jobs=[0])
    store(j, 1, "a", 0, [7])
    assert "FOREIGN_BLOCK_READ" in j.codes()


def test_a_store_connector_finish_time_read_stays_foreign() -> None:
    j = JournalBuilder(world_size=1)
    j.admit("a", blocks=[1, 2])
    j.add("request_finished", req="a", gen=0)
    j.step = 1
    j.enqueue(0, "a", 0, reads=[1, 2], pins=[], keys=["h1", "h2"])
    assert "FOREIGN_BLOCK_READ" in j.codes()


def test_a_cache_hit_is_no_reuse() -> None:
    j = offloading()
    preempted_with_store_in_flight(j)
    j.add("request_admitted", req="b", gen=0, prompt_tokens=8)
    j.add("blocks_assigned", req="b", gen=0, blocks=[1, 2], mode="append", cached=[1, 2])
    assert j.codes() == []


def test_a_store_connector_journal_is_not_judged_by_flushes() -> None:
    """Without the header's protocol the same records keep the store contract's verdict."""
    j = JournalBuilder()
    preempted_with_store_in_flight(j)
    j.admit("b", blocks=[1, 2])
    assert "UNFLUSHED_REUSE" not in j.codes()


# -- LOAD_STORE_OVERLAP (vLLM #46014) ------------------------------------------------------


def test_a_load_while_the_requests_store_is_in_flight_overlaps() -> None:
    j = offloading()
    enq = preempted_with_store_in_flight(j)
    j.add("flush_requested", jobs=[0])
    j.add("flush_done", jobs=[0], rank=0)
    j.add("tier_stored", job=0, keys=["h1", "h2"])  # stored, not yet completed
    j.add("request_resumed", req="a", gen=1)
    j.add("blocks_assigned", req="a", gen=1, blocks=[3, 4], mode="replace")
    at = load(j, 1, "a", 1, [3, 4], ["h1", "h2"])
    v = j.only("LOAD_STORE_OVERLAP")
    assert (v.seq, v.job, v.req, v.gen) == (at, 1, "a", 1)
    assert enq in v.chain and "store job 0" in v.message


def test_a_store_while_the_requests_load_is_in_flight_overlaps() -> None:
    j = offloading()
    j.admit("a", blocks=[1, 2])
    store(j, 0, "a", 0, [1])
    transfer(j, 0)
    end(j, 0)
    j.add("tier_stored", job=0, keys=["h1"])
    first = load(j, 1, "a", 0, [2], ["h1"])
    at = store(j, 2, "a", 0, [2])
    v = j.only("LOAD_STORE_OVERLAP")
    assert (v.seq, v.job) == (at, 2) and first in v.chain


def test_near_miss_the_store_ended_before_the_load() -> None:
    j = the_clean_run()
    assert "LOAD_STORE_OVERLAP" not in j.codes()


# -- STALE_COMPLETION (vLLM #39186) --------------------------------------------------------


def stale_completion(protocol: str | None) -> tuple[JournalBuilder, int, int, int]:
    j = JournalBuilder(protocol=protocol)
    j.admit("a", blocks=[1])
    enq = store(j, 0, "a", 0, [1])
    transfer(j, 0)
    released = end(j, 0)
    late = j.add("completions_received", job=0, count=1)
    return j, enq, released, late


def test_a_completion_after_the_job_ended_is_stale() -> None:
    j, enq, released, late = stale_completion(OFFLOADING)
    v = j.only("STALE_COMPLETION")
    assert (v.seq, v.job, v.chain) == (late, 0, (enq, released))
    assert j.codes() == ["STALE_COMPLETION"]


def test_a_store_connector_journal_keeps_its_phantom_completion() -> None:
    j, _, _, late = stale_completion(None)
    assert j.codes() == ["PHANTOM_COMPLETION"] and j.only("PHANTOM_COMPLETION").seq == late


def test_near_miss_completions_before_the_end() -> None:
    j = offloading(world_size=2)
    j.admit("a", blocks=[1])
    store(j, 0, "a", 0, [1])
    transfer(j, 0, rank=0)
    j.add("completions_received", job=0, count=1)
    transfer(j, 0, rank=1)
    j.add("completions_received", job=0, count=1)
    j.add("pins_released", job=0, blocks=[])
    assert j.codes() == []


# -- TIER_READ_STALE -----------------------------------------------------------------------


def stored_in_the_tier() -> JournalBuilder:
    j = offloading()
    j.admit("a", blocks=[1, 2])
    store(j, 0, "a", 0, [1, 2])
    transfer(j, 0)
    end(j, 0)
    j.add("tier_stored", job=0, keys=["h1", "h2"])
    j.admit("b", blocks=[3, 4])
    return j


def test_a_load_of_a_key_the_tier_never_held() -> None:
    j = stored_in_the_tier()
    at = load(j, 1, "b", 0, [3], ["h9"])
    v = j.only("TIER_READ_STALE")
    assert (v.seq, v.job, v.key) == (at, 1, "h9") and "never held" in v.message


def test_a_load_of_an_evicted_key() -> None:
    j = stored_in_the_tier()
    gone = j.add("tier_evicted", keys=["h2"])
    at = load(j, 1, "b", 0, [3, 4], ["h1", "h2"])
    v = j.only("TIER_READ_STALE")
    assert (v.seq, v.key, v.chain) == (at, "h2", (gone,)) and "evicted" in v.message


def test_an_eviction_under_a_live_load() -> None:
    j = stored_in_the_tier()
    at_load = load(j, 1, "b", 0, [3, 4], ["h1", "h2"])
    gone = j.add("tier_evicted", keys=["h1"])
    v = j.only("TIER_READ_STALE")
    assert (v.seq, v.job, v.key) == (gone, 1, "h1") and at_load in v.chain


def test_a_rewrite_under_a_live_load() -> None:
    j = stored_in_the_tier()
    load(j, 1, "b", 0, [3, 4], ["h1", "h2"])
    j.admit("c", blocks=[5])
    store(j, 2, "c", 0, [5])
    transfer(j, 2)
    end(j, 2)
    rewrite = j.add("tier_stored", job=2, keys=["h2"])
    v = j.only("TIER_READ_STALE")
    assert (v.seq, v.job, v.key) == (rewrite, 1, "h2") and "rewritten" in v.message


def test_near_miss_an_eviction_after_the_load_ended() -> None:
    j = stored_in_the_tier()
    load(j, 1, "b", 0, [3, 4], ["h1", "h2"])
    transfer(j, 1)
    end(j, 1)
    j.add("tier_evicted", keys=["h1", "h2"])
    assert j.codes() == []


# -- the fold's bookkeeping ----------------------------------------------------------------


def test_a_load_never_reported_is_a_missing_report_at_idle() -> None:
    j = stored_in_the_tier()
    load(j, 1, "b", 0, [3], ["h1"])
    j.add("job_received", job=1, rank=0)
    j.add("engine_idle")
    assert j.only("MISSING_REPORT").job == 1


def test_load_and_store_ids_share_one_counter() -> None:
    j = stored_in_the_tier()
    at = load(j, 0, "b", 0, [3], ["h1"])
    assert j.only("ID_REUSED").seq == at


def test_a_flush_of_an_unknown_job_is_causality() -> None:
    j = offloading()
    at = j.add("flush_requested", jobs=[5])
    assert j.only("CAUSALITY").seq == at


def test_a_snapshot_folds_on_independently() -> None:
    """Time travel folds on from snapshots: the offload state is copied, not shared."""
    j = offloading()
    preempted_with_store_in_flight(j)
    records = j.entries()
    ledger = Ledger()
    for entry in records:
        ledger.apply(entry.seq, entry.step, entry.event)
    copy = ledger.snapshot()
    j.admit("b", blocks=[1])
    later = j.entries()[len(records) :]
    found = [v for e in later for v in ledger.apply(e.seq, e.step, e.event)]
    assert [v.code.value for v in found] == ["UNFLUSHED_REUSE"]
    assert copy.offload.readers == {1: {0: None}, 2: {0: None}}
    assert [v.code.value for e in later for v in copy.apply(e.seq, e.step, e.event)] == [
        "UNFLUSHED_REUSE"
    ]
    assert copy == ledger


def test_the_evicted_keys_remembered_are_the_newest_and_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A tier that cycles through prefixes for weeks evicts keys without end:
    the fold remembers the newest evictions only (they word a finding), so
    it, and every retention checkpoint, stays bounded."""
    from kvstate import _offload

    monkeypatch.setattr(_offload, "EVICTED_KEPT", 3)
    state = _offload.OffloadState()
    out: list = []  # type: ignore[type-arg]
    for seq, key in enumerate(["a", "b", "c", "d", "b", "e"], 1):
        state.tier_evicted(seq, (key,), {}, out)
    assert list(state.evicted.items()) == [("d", 4), ("b", 5), ("e", 6)] and out == []


# -- cache_reset: the jobs a reset discards (kvstate.transfer_events) --------------------


def reset_with_store_in_flight() -> JournalBuilder:
    """``a``'s store of blocks 1 and 2 is in flight when vLLM resets the cache;
    ``a`` then finishes and its blocks are free."""
    j = offloading()
    preempted_with_store_in_flight(j)
    j.add("cache_reset", jobs=[0])
    return j


def test_a_reset_ends_the_jobs_it_discards_and_the_run_stays_clean() -> None:
    """No completion comes for a discarded job, and none is owed: no
    LEAKED_PIN, EARLY_RELEASE or MISSING_REPORT once its rank reported it."""
    j = reset_with_store_in_flight()
    j.add("job_reported", job=0, rank=0)  # the copy ran to its end; the report is dropped
    j.admit("b", blocks=[1, 2])
    j.add("request_finished", req="b", gen=0)
    j.add("engine_idle")
    assert j.fold() == ([], [])


def test_a_block_a_discarded_store_still_reads_is_guarded_until_its_report() -> None:
    """The reset ends the job, not its copy: handing its block on before the
    rank reports it (or a flush) is the late DMA's race."""
    j = reset_with_store_in_flight()
    j.add("request_admitted", req="b", gen=0, prompt_tokens=8)
    reuse = j.add("blocks_assigned", req="b", gen=0, blocks=[2, 1], mode="append")
    v = j.only("UNFLUSHED_REUSE")
    assert (v.seq, v.job) == (reuse, 0)
