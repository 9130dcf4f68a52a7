"""PROMOTED_UNDER_LATE_WRITE: vLLM 0.33.0's reset fence, as the journal shows it.

A cache reset (vLLM's ``reset_prefix_cache``) discards the connector's jobs
in flight and releases every tier chunk at once, those the discarded stores
were writing too. A worker may still copy such a store into its chunk (a
late DMA) until it reports or flushes it. The worker's own next copy waits
for that flush; a promotion, the tier's own copy from a lower tier, does
not, and on vLLM 0.32.0 may fill the released chunk meanwhile. vLLM 0.33.0
holds promotions until the workers reported every job the reset flushed
(``_reset_fence`` in its offloading scheduler).
"""

from __future__ import annotations

from kvstate.tier_events import OFFLOADING
from tests.builder import JournalBuilder


def reset_with_a_store_in_flight(j: JournalBuilder) -> tuple[int, int]:
    """``a`` stores c0 from blocks 1-2; the reset discards the store while its
    rank still copies. Returns the store's and the reset's seqs."""
    j.admit("a", blocks=[1, 2])
    enq = j.enqueue(0, "a", 0, reads=[1, 2], pins=[], keys=["c0"])
    j.add("job_received", job=0, rank=0)
    j.add("job_started", job=0, rank=0)
    j.add("request_finished", req="a", gen=0)
    j.step = 1
    reset = j.add("cache_reset", jobs=[0])
    j.add("tier_evicted", keys=["c0"])
    return enq, reset


def test_a_promotion_before_the_discarded_store_reported_is_flagged() -> None:
    """vLLM 0.32.0: the promotion is not held."""
    j = JournalBuilder(world_size=1, protocol=OFFLOADING)
    enq, reset = reset_with_a_store_in_flight(j)
    j.step = 2
    promoted = j.add("tier_promoted", keys=["p0"])
    v = j.only("PROMOTED_UNDER_LATE_WRITE")
    assert (v.seq, v.job, v.req, v.key) == (promoted, 0, "a", "p0")
    assert v.chain == (enq, reset)  # oldest first
    assert "late DMA" in v.message


def test_a_promotion_after_every_rank_reported_is_clean() -> None:
    """vLLM 0.33.0: promotions wait for the discarded jobs' reports."""
    j = JournalBuilder(world_size=1, protocol=OFFLOADING)
    reset_with_a_store_in_flight(j)
    j.step = 2
    j.add("job_reported", job=0, rank=0)
    j.add("tier_promoted", keys=["p0"])
    assert "PROMOTED_UNDER_LATE_WRITE" not in j.codes()


def test_a_flush_ends_the_late_write_as_a_report_does() -> None:
    j = JournalBuilder(world_size=1, protocol=OFFLOADING)
    reset_with_a_store_in_flight(j)
    j.step = 2
    j.add("flush_requested", jobs=[])
    j.add("flush_done", jobs=[0], rank=0)
    j.add("tier_promoted", keys=["p0"])
    assert "PROMOTED_UNDER_LATE_WRITE" not in j.codes()


def test_each_rank_must_have_reported() -> None:
    j = JournalBuilder(world_size=2, protocol=OFFLOADING)
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1, 2], pins=[], keys=["c0"])
    for rank in (0, 1):
        j.add("job_received", job=0, rank=rank)
    j.step = 1
    j.add("cache_reset", jobs=[0])
    j.add("job_reported", job=0, rank=0)
    promoted = j.add("tier_promoted", keys=["p0"])
    assert j.only("PROMOTED_UNDER_LATE_WRITE").seq == promoted
    j.add("job_reported", job=0, rank=1)
    j.add("tier_promoted", keys=["p1"])
    assert j.codes().count("PROMOTED_UNDER_LATE_WRITE") == 1


def test_a_promoted_key_is_held_and_loads_read_it_clean() -> None:
    j = JournalBuilder(world_size=1, protocol=OFFLOADING)
    j.admit("b", blocks=[3])
    j.add("tier_promoted", keys=["p0"])
    j.add("load_enqueued", job=0, req="b", gen=0, writes=[3], keys=["p0"], world_size=1)
    assert j.codes() == []
