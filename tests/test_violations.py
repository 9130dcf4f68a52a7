"""Every violation code of docs/events.md, "Violation codes": a journal that fires it, at the
right record with the right chain, and a near miss that must not."""

from __future__ import annotations

from tests.builder import JournalBuilder


def clean_single_job() -> JournalBuilder:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2])
    j.run(0)
    j.complete(0, [1, 2])
    j.add("request_finished", req="a", gen=0)
    j.add("engine_idle")
    return j


def test_baseline_is_clean() -> None:
    violations, warnings = clean_single_job().fold()
    assert violations == [] and warnings == []


# -- STALE_GENERATION -------------------------------------------------------------------


def stale_setup() -> tuple[JournalBuilder, int]:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    enq = j.enqueue(0, "a", 0, reads=[1, 2])
    j.add("job_received", job=0, rank=0)
    j.add("job_started", job=0, rank=0)
    return j, enq


def test_stale_generation_after_preemption_seen() -> None:
    j, enq = stale_setup()
    seen = j.add("preemption_seen", req="a", gen=0, rank=0)
    effect = j.add("offset_saved", job=0, rank=0, req="a", offset=8)
    v = j.only("STALE_GENERATION")
    assert (v.seq, v.job, v.req, v.gen, v.rank) == (effect, 0, "a", 0, 0)
    assert enq in v.chain and seen in v.chain


def test_stale_generation_after_newer_gen_received() -> None:
    j, _ = stale_setup()
    j.add("request_preempted", req="a", gen=0)
    j.add("request_resumed", req="a", gen=1)
    j.add("blocks_assigned", req="a", gen=1, blocks=[3], mode="replace")
    j.enqueue(1, "a", 1, reads=[3])
    newer = j.add("job_received", job=1, rank=0)
    for kind, extra in [
        ("request_marked_skipped", {}),
        ("retry_tokens_set", {"start": 0, "count": 4}),
        ("retry_tokens_cleared", {}),
    ]:
        j.add(kind, job=0, rank=0, req="a", **extra)
    found = [v for v in j.fold()[0] if v.code.value == "STALE_GENERATION"]
    assert len(found) == 3 and all(newer in v.chain for v in found)


def test_stale_generation_retire_of_older_gen() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.add("request_preempted", req="a", gen=0)
    j.add("request_resumed", req="a", gen=1)
    j.add("preemption_seen", req="a", gen=1, rank=0)
    retire = j.add("request_retired", req="a", gen=0, rank=0)
    assert j.only("STALE_GENERATION").seq == retire


def test_near_miss_effects_before_the_rank_learns_of_preemption() -> None:
    j, _ = stale_setup()
    j.add("offset_saved", job=0, rank=0, req="a", offset=8)
    j.add("request_preempted", req="a", gen=0)  # scheduler knows; the rank does not yet
    j.add("request_marked_skipped", job=0, rank=0, req="a")
    j.add("preemption_seen", req="a", gen=0, rank=0)
    j.add("job_reported", job=0, rank=0)
    j.add("request_retired", req="a", gen=0, rank=0)
    assert "STALE_GENERATION" not in j.codes()


# -- POISONED_READ ----------------------------------------------------------------------


def poison_setup(pins: list[int]) -> tuple[JournalBuilder, int]:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    enq = j.enqueue(0, "a", 0, reads=[1, 2], pins=pins)
    j.add("job_received", job=0, rank=0)
    j.add("request_preempted", req="a", gen=0)
    return j, enq


def test_poisoned_read_at_dma_started() -> None:
    j, enq = poison_setup(pins=[])
    j.admit("b", blocks=[2])
    j.add("job_started", job=0, rank=0)
    dma = j.add("dma_started", job=0, rank=0)
    j.add("dma_done", job=0, rank=0)  # same epoch change: not reported twice
    v = j.only("POISONED_READ")
    assert (v.seq, v.block, v.job, v.rank) == (dma, 2, 0, 0)
    preempt, reassign = enq + 2, len(j.records) - 3
    assert v.chain == (enq, preempt, reassign)


def test_poisoned_read_when_reuse_lands_during_the_dma() -> None:
    j, _ = poison_setup(pins=[])
    j.add("dma_started", job=0, rank=0)
    j.admit("b", blocks=[1])
    done = j.add("dma_done", job=0, rank=0)
    v = [v for v in j.fold()[0] if v.code.value == "POISONED_READ"]
    assert [(x.seq, x.block) for x in v] == [(done, 1)]


def test_near_miss_pinned_blocks_cannot_be_reassigned_to_a_new_epoch() -> None:
    j, _ = poison_setup(pins=[1, 2])
    j.admit("b", blocks=[1, 2])  # shared: still held by the pin, no new epoch
    j.add("job_started", job=0, rank=0)
    j.add("dma_started", job=0, rank=0)
    j.add("dma_done", job=0, rank=0)
    assert "POISONED_READ" not in j.codes()


def test_near_miss_prefix_cache_hit_keeps_the_epoch() -> None:
    j, _ = poison_setup(pins=[])
    j.add("request_admitted", req="b", gen=0, prompt_tokens=8)
    j.add("blocks_assigned", req="b", gen=0, blocks=[1, 2], mode="append", cached=[1, 2])
    j.add("dma_started", job=0, rank=0)
    assert "POISONED_READ" not in j.codes()


# -- FOREIGN_BLOCK_READ / TABLE_OVERRUN -------------------------------------------------


def test_foreign_block_read() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    enq = j.enqueue(0, "a", 0, reads=[1, 9], pins=[1], token_end=4)
    v = j.only("FOREIGN_BLOCK_READ")
    assert (v.seq, v.block, v.job) == (enq, 9, 0)


def test_near_miss_copy_on_write_block_is_pinned_not_in_table() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[9, 1], pins=[9, 1], token_end=4)
    assert j.codes() == []


def test_table_overrun_and_exact_fit() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2], token_end=8)
    assert j.codes() == []
    over = j.enqueue(1, "a", 0, reads=[1, 2], token_end=9)
    assert j.only("TABLE_OVERRUN").seq == over


def test_table_overrun_after_an_append_that_should_have_been_a_replace() -> None:
    # Bug (d): a resumed request whose full table is *appended* to a stale one
    # is the mirror image; here a running request's delta replaced its table.
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.add("blocks_assigned", req="a", gen=0, blocks=[3], mode="replace")
    over = j.enqueue(0, "a", 0, reads=[3], token_end=12)
    assert j.only("TABLE_OVERRUN").seq == over


# -- reports and completions --------------------------------------------------------------


def test_double_report_and_two_ranks_near_miss() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    j.run(0, rank=0)
    j.run(0, rank=1)
    assert j.codes() == []
    first_report = j.records[-1]["seq"]
    again = j.add("job_reported", job=0, rank=1)
    v = j.only("DOUBLE_REPORT")
    assert (v.seq, v.rank, v.chain) == (again, 1, (first_report,))


def test_phantom_completion_before_reports_and_beyond_world() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    j.run(0, rank=0)
    early = j.add("completions_received", job=0, count=2)
    assert j.only("PHANTOM_COMPLETION").seq == early

    k = JournalBuilder(world_size=1)
    k.admit("a", blocks=[1])
    k.enqueue(0, "a", 0, reads=[1])
    k.run(0)
    k.add("completions_received", job=0, count=1)
    assert k.codes() == []
    extra = k.add("completions_received", job=0, count=1)
    assert k.only("PHANTOM_COMPLETION").seq == extra


def test_early_release_and_near_miss() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    j.run(0, rank=0)
    j.add("completions_received", job=0, count=1)
    release = j.add("pins_released", job=0, blocks=[1])
    assert j.only("EARLY_RELEASE").seq == release

    ok = JournalBuilder(world_size=2)
    ok.admit("a", blocks=[1])
    ok.enqueue(0, "a", 0, reads=[1])
    ok.run(0, rank=0)
    ok.run(0, rank=1)
    ok.complete(0, [1])
    assert ok.codes() == []


def test_pin_mismatch_wrong_blocks_and_double_release() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2])
    j.run(0)
    j.add("completions_received", job=0, count=1)
    wrong = j.add("pins_released", job=0, blocks=[2])
    assert j.only("PIN_MISMATCH").seq == wrong

    k = clean_single_job()
    k.records.pop()  # engine_idle
    twice = k.add("pins_released", job=0, blocks=[2, 1])
    assert k.only("PIN_MISMATCH").seq == twice


def test_release_order_is_a_warning_not_a_violation() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2])
    j.run(0)
    j.add("completions_received", job=0, count=1)
    release = j.add("pins_released", job=0, blocks=[1, 2])  # head first
    violations, warnings = j.fold()
    assert violations == []
    assert [(w.code.value, w.seq) for w in warnings] == [("RELEASE_ORDER", release)]


def test_refcount_underflow() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    j.run(0)
    j.add("request_finished", req="a", gen=0)
    j.add("completions_received", job=0, count=1)
    bad = j.add("pins_released", job=0, blocks=[1, 1])
    codes = j.codes()
    assert "REFCOUNT_UNDERFLOW" in codes and "PIN_MISMATCH" in codes
    assert j.only("REFCOUNT_UNDERFLOW").block == 1
    assert j.only("REFCOUNT_UNDERFLOW").seq == bad


def test_near_miss_finish_after_preemption_drops_nothing_twice() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.add("request_preempted", req="a", gen=0)
    j.add("request_finished", req="a", gen=0)
    j.add("engine_idle")
    assert j.codes() == []


# -- retire and offsets -----------------------------------------------------------------


def test_premature_retire_and_near_miss() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    received = j.add("job_received", job=0, rank=0)
    retire = j.add("request_retired", req="a", gen=0, rank=0)
    v = j.only("PREMATURE_RETIRE")
    assert (v.seq, v.job, v.chain) == (retire, 0, (received,))

    ok = JournalBuilder()
    ok.admit("a", blocks=[1])
    ok.enqueue(0, "a", 0, reads=[1])
    ok.run(0)
    ok.add("request_retired", req="a", gen=0, rank=0)
    assert ok.codes() == []


def test_offset_rewound_same_generation_only() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2])
    j.enqueue(1, "a", 0, reads=[1, 2])
    j.run(0, report=False)
    j.add("job_received", job=1, rank=0)
    first = j.add("offset_saved", job=0, rank=0, req="a", offset=8)
    back = j.add("offset_saved", job=1, rank=0, req="a", offset=4)
    v = j.only("OFFSET_REWOUND")
    assert (v.seq, v.chain) == (back, (first,))

    ok = JournalBuilder()
    ok.admit("a", blocks=[1, 2])
    ok.enqueue(0, "a", 0, reads=[1, 2])
    ok.add("job_received", job=0, rank=0)
    ok.add("offset_saved", job=0, rank=0, req="a", offset=4)
    ok.add("offset_saved", job=0, rank=0, req="a", offset=8)
    ok.add("request_preempted", req="a", gen=0)
    ok.add("request_resumed", req="a", gen=1)
    ok.add("blocks_assigned", req="a", gen=1, blocks=[3], mode="replace")
    ok.enqueue(1, "a", 1, reads=[3])
    ok.add("job_received", job=1, rank=0)
    ok.add("offset_saved", job=1, rank=0, req="a", offset=4)  # new generation starts over
    assert ok.codes() == []


# -- KV events ----------------------------------------------------------------------------


def test_parent_chain_broken_and_correct_chain() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2], keys=["k1", "k2"], parent="k0")
    j.add("job_received", job=0, rank=0)
    j.add("kv_block_stored", job=0, rank=0, key="k1", parent="k0")
    j.add("kv_block_stored", job=0, rank=0, key="k2", parent="k1")
    assert j.codes() == []
    store_order = j.add("kv_block_stored", job=0, rank=0, key="k2", parent=None)
    unknown = j.add("kv_block_stored", job=0, rank=0, key="k9", parent="k2")
    found = [(v.seq, v.key) for v in j.fold()[0]]
    assert found == [(store_order, "k2"), (unknown, "k9")]


# -- identity -------------------------------------------------------------------------


def test_id_reused_for_jobs_and_generations() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1, 2])
    first = j.enqueue(0, "a", 0, reads=[1])
    j.enqueue(5, "a", 0, reads=[1])  # gaps are fine
    again = j.enqueue(5, "a", 0, reads=[2])
    v = j.only("ID_REUSED")
    assert (v.seq, v.job) == (again, 5) and first < v.chain[0]

    g = JournalBuilder()
    admitted = g.admit("a", blocks=[1])
    g.add("request_preempted", req="a", gen=0)
    same = g.add("request_resumed", req="a", gen=0)
    v = g.only("ID_REUSED")
    assert (v.seq, v.req, v.gen, v.chain) == (same, "a", 0, (admitted,))

    ok = JournalBuilder()
    ok.admit("a", blocks=[1])
    ok.add("request_finished", req="a", gen=0)
    ok.admit("a", gen=3, blocks=[1])  # a finished id admitted again, greater gen
    assert ok.codes() == []


# -- quiescence -----------------------------------------------------------------------


def test_leaked_pin_and_missing_report_at_idle() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    enq = j.enqueue(0, "a", 0, reads=[1])
    j.run(0, rank=0)
    received = j.add("job_received", job=0, rank=1)
    j.add("request_finished", req="a", gen=0)
    idle = j.add("engine_idle")
    j.add("engine_idle")  # a second idle does not repeat the findings
    found = sorted((v.code.value, v.seq, v.rank) for v in j.fold()[0])
    assert found == [("LEAKED_PIN", idle, None), ("MISSING_REPORT", idle, 1)]
    missing = j.only("MISSING_REPORT")
    assert missing.chain == (enq, received)


def test_missing_report_for_a_rank_that_never_received() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1], pins=[])
    j.run(0, rank=0)
    j.add("engine_idle")
    v = j.only("MISSING_REPORT")
    assert v.rank == 1 and "never received" in v.message


def test_near_miss_job_without_pins_is_not_leaked() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1], pins=[])
    j.run(0)
    j.add("request_finished", req="a", gen=0)
    j.add("engine_idle")
    assert j.codes() == []


def test_a_lost_finish_leaves_blocks_held_at_idle() -> None:
    """An addition: an incarnation never preempted nor finished that still holds
    its table when the engine is idle (its request_finished was lost, or the
    engine leaked the blocks). A preempted or finished one does not count."""
    j = JournalBuilder()
    admitted = j.admit("a", blocks=[1, 2])
    j.admit("b", blocks=[3])
    j.add("request_finished", req="b", gen=0)
    j.admit("c", blocks=[4])
    j.add("request_preempted", req="c", gen=0)
    idle = j.add("engine_idle")
    v = j.only("LEAKED_BLOCKS")
    assert (v.seq, v.req, v.gen, v.chain) == (idle, "a", 0, (admitted + 1,))  # the assignment
    j.add("engine_idle")
    assert j.codes().count("LEAKED_BLOCKS") == 1  # reported once


def test_held_forever_and_released() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    finish = j.add("request_finished", req="a", gen=0, hold=True)
    idle = j.add("engine_idle")
    v = j.only("HELD_FOREVER")
    assert (v.seq, v.chain) == (idle, (finish,))

    ok = JournalBuilder()
    ok.admit("a", blocks=[1])
    ok.add("request_finished", req="a", gen=0, hold=True)
    ok.add("held_blocks_released", req="a", gen=0)
    ok.add("engine_idle")
    assert ok.codes() == []


# -- audit and crash --------------------------------------------------------------------


def test_poisoned_key_and_wrong_kv_loaded() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    enq = j.enqueue(0, "a", 0, reads=[1], keys=["m@h0"])
    j.add("key_verified", key="m@h0", ok=True)
    j.add("load_verified", req="a", gen=0, key="m@h0", ok=True)
    assert j.codes() == []
    bad = j.add("key_verified", key="m@h0", ok=False, expected="aa", actual="bb")
    wrong = j.add("load_verified", req="a", gen=0, key="m@h0", ok=False)
    found = [(v.code.value, v.seq, v.chain) for v in j.fold()[0]]
    assert found == [("POISONED_KEY", bad, (enq,)), ("WRONG_KV_LOADED", wrong, (enq,))]


def test_crash() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    j.add("request_preempted", req="a", gen=0)
    crash = j.add("engine_crashed", error="AssertionError: tracker is None")
    v = j.only("CRASH")
    assert v.seq == crash and "tracker" in v.message


# -- registration and causality ---------------------------------------------------------


def test_unledgered_job_and_near_miss() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    enq = j.enqueue(0, "a", 0, reads=[1])
    started = j.add("job_started", job=0, rank=0)
    v = j.only("UNLEDGERED_JOB")
    assert (v.seq, v.chain) == (started, (enq,))
    assert clean_single_job().codes() == []


def test_causality_unknown_job_and_incarnation() -> None:
    j = JournalBuilder()
    orphan = j.add("job_received", job=3, rank=0)
    ghost = j.add("blocks_assigned", req="x", gen=0, blocks=[1], mode="append")
    seen = j.add("preemption_seen", req="x", gen=0, rank=0)
    found = [(v.code.value, v.seq) for v in j.fold()[0]]
    assert found == [("CAUSALITY", orphan), ("CAUSALITY", ghost), ("CAUSALITY", seen)]


def test_causality_worker_record_before_enqueue_in_a_merged_order() -> None:
    j = JournalBuilder()
    j.admit("a", blocks=[1])
    early = j.add("job_received", job=0, rank=0)
    j.enqueue(0, "a", 0, reads=[1])
    assert j.only("CAUSALITY").seq == early


def test_rank_outside_the_world_is_causality() -> None:
    j = JournalBuilder(world_size=2)
    j.admit("a", blocks=[1])
    j.enqueue(0, "a", 0, reads=[1])
    bad = j.add("job_received", job=0, rank=2)
    assert j.only("CAUSALITY").seq == bad


# -- additions: the blocks a transfer actually reads, and proof by bytes -----------------


def test_dma_blocks_limits_the_check_to_what_was_read() -> None:
    """Keys already in the store are not read again: their reused blocks are no poison."""
    j, _ = poison_setup(pins=[])
    j.admit("b", blocks=[2])  # block 2 changes hands; block 1 does not
    j.add("job_started", job=0, rank=0)
    j.add("dma_started", job=0, rank=0, blocks=[1])
    j.add("dma_done", job=0, rank=0, blocks=[1])
    assert "POISONED_READ" not in j.codes()
    read = j.add("dma_started", job=0, rank=0, blocks=[1, 2])
    v = j.only("POISONED_READ")
    assert (v.seq, v.block) == (read, 2)


def test_dma_of_no_blocks_reads_none_and_without_the_field_reads_all() -> None:
    """``blocks: []`` is a transfer that read nothing (every key was already
    stored: the vLLM observer writes that), not "every block of reads"."""
    j, _ = poison_setup(pins=[])
    j.admit("b", blocks=[2])  # block 2 changes hands under the queued job
    j.add("job_started", job=0, rank=0)
    j.add("dma_started", job=0, rank=0, blocks=[])
    j.add("dma_done", job=0, rank=0, blocks=[])
    assert "POISONED_READ" not in j.codes()
    read = j.add("dma_started", job=0, rank=0)  # no field: all of reads
    assert j.only("POISONED_READ").seq == read


def test_dma_done_with_different_bytes_is_a_poisoned_read() -> None:
    j, _ = poison_setup(pins=[1, 2])  # pinned: the epochs cannot tell
    j.add("job_started", job=0, rank=0)
    j.add("dma_started", job=0, rank=0)
    same = j.add("dma_done", job=0, rank=0, digest="aa", expected="aa")
    assert "POISONED_READ" not in j.codes()
    differs = j.add("dma_done", job=0, rank=0, digest="bb", expected="aa")
    v = j.only("POISONED_READ")
    assert (v.seq, v.job, v.rank) == (differs, 0, 0) and same < differs
    assert "bb" in v.message and "aa" in v.message


def test_bytes_do_not_repeat_what_the_epochs_found() -> None:
    j, _ = poison_setup(pins=[])
    j.admit("b", blocks=[2])
    j.add("dma_started", job=0, rank=0)
    j.add("dma_done", job=0, rank=0, digest="bb", expected="aa")
    assert [v.code.value for v in j.fold()[0]].count("POISONED_READ") == 1
