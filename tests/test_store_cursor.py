"""STORE_CURSOR_PAST_TABLE (vLLM #52211): a resumed request's store cursor
must start again with its table.

vLLM's OffloadingConnector keeps, per request, the index of the next chunk
to store. A preemption clears the request's block ids; the index is not
rewound (vLLM PR #52211, closed unmerged), so the resumed request's first
store begins where the preempted incarnation's table ended. The chunks in
between are stored again only if the tier still holds them; once one is
evicted, the keys stored after it sit behind a hole that no prefix lookup
crosses. The journal shows it as a store whose ``parent`` (the tier key of
the chunk before its first key) the resumed incarnation neither loaded nor
stored, and the tier does not hold.
"""

from __future__ import annotations

from kvstate.folder import fold_all
from kvstate.ledger import Ledger
from kvstate.tier_events import OFFLOADING
from tests.builder import JournalBuilder


def offloading() -> JournalBuilder:
    return JournalBuilder(world_size=1, protocol=OFFLOADING)


def folded(j: JournalBuilder) -> Ledger:
    ledger = Ledger()
    fold_all(j.entries(), ledger)
    return ledger


def stored_then_resumed(j: JournalBuilder, *, evict: list[str]) -> tuple[int, int]:
    """``a`` stores chunks c0..c3 (blocks 1-4), is preempted and resumed as gen 1;
    the tier evicts ``evict`` meanwhile. Returns the resume's and the eviction's seqs."""
    j.admit("a", blocks=[1, 2, 3, 4])
    j.enqueue(0, "a", 0, reads=[1, 2, 3, 4], pins=[], keys=["c0", "c1", "c2", "c3"])
    j.add("job_received", job=0, rank=0)
    j.add("job_started", job=0, rank=0)
    j.add("job_reported", job=0, rank=0)
    j.add("completions_received", job=0, count=1)
    j.add("pins_released", job=0, blocks=[])
    j.add("tier_stored", job=0, keys=["c0", "c1", "c2", "c3"])
    j.step = 1
    j.add("request_preempted", req="a", gen=0)
    evicted = j.add("tier_evicted", keys=evict) if evict else 0
    j.step = 2
    resumed = j.add("request_resumed", req="a", gen=1)
    j.add("blocks_assigned", req="a", gen=1, blocks=[5, 6, 7, 8, 9], mode="replace")
    return resumed, evicted


def test_a_resumed_store_past_an_evicted_chunk_is_flagged() -> None:
    """vLLM 0.32.0: nothing was loaded (c0 is gone), the cursor stayed at 4."""
    j = offloading()
    resumed, evicted = stored_then_resumed(j, evict=["c0", "c3"])
    enq = j.enqueue(1, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    v = j.only("STORE_CURSOR_PAST_TABLE")
    assert (v.seq, v.job, v.req, v.gen, v.key) == (enq, 1, "a", 1, "c3")
    assert v.chain == (evicted, resumed)  # oldest first
    assert "evicted" in v.message and "cursor" in v.message


def test_near_miss_the_tier_still_holds_the_chunk_before() -> None:
    """The stale cursor is harmless while the tier holds what it skips."""
    j = offloading()
    stored_then_resumed(j, evict=["c0"])
    j.enqueue(1, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    assert j.codes() == []


def test_near_miss_a_rewound_cursor_stores_the_evicted_chunks_again() -> None:
    """The fixed connector starts the resumed request's stores at its first
    chunk: each store's parent is its own previous key."""
    j = offloading()
    stored_then_resumed(j, evict=["c0", "c3"])
    j.enqueue(1, "a", 1, reads=[5, 8], pins=[], keys=["c0", "c3"], parent=None)
    j.add("job_received", job=1, rank=0)
    j.step = 3
    j.enqueue(2, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    assert j.codes() == []


def test_near_miss_the_chunk_before_was_loaded_by_the_resumed_request() -> None:
    """A load that hits sets the cursor to its end: the store continues from it,
    even once the tier has evicted what the load read."""
    j = offloading()
    stored_then_resumed(j, evict=[])
    j.add("load_enqueued", job=1, req="a", gen=1, writes=[5, 6, 7, 8],
          keys=["c0", "c1", "c2", "c3"], world_size=1)  # fmt: skip
    for kind in ("job_received", "job_started", "job_reported"):
        j.add(kind, job=1, rank=0)
    j.add("completions_received", job=1, count=1)
    j.add("pins_released", job=1, blocks=[])
    j.add("tier_evicted", keys=["c3"])
    j.step = 3
    j.enqueue(2, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    assert j.codes() == []


def test_near_miss_a_request_never_preempted_is_not_judged() -> None:
    """Mid-run, the tier may evict an earlier chunk of a running request; its
    cursor moves forward by design, and the next store is no cursor bug."""
    j = offloading()
    j.admit("a", blocks=[1, 2])
    j.enqueue(0, "a", 0, reads=[1], pins=[], keys=["c0"])
    j.add("tier_evicted", keys=["c0"])
    j.enqueue(1, "a", 0, reads=[2], pins=[], keys=["c1"], parent="c0")
    assert "STORE_CURSOR_PAST_TABLE" not in j.codes()


def test_near_miss_a_store_connectors_journal_keeps_its_verdict() -> None:
    """Without the offloading protocol the tier is not journaled: never judged."""
    j = JournalBuilder(world_size=1)
    j.admit("a", blocks=[1])
    j.add("request_preempted", req="a", gen=0)
    j.add("request_resumed", req="a", gen=1)
    j.add("blocks_assigned", req="a", gen=1, blocks=[2], mode="replace")
    j.enqueue(0, "a", 1, reads=[2], pins=[2], keys=["c1"], parent="c0")
    assert "STORE_CURSOR_PAST_TABLE" not in j.codes()


def test_near_miss_the_chunk_before_is_being_stored_by_another_request() -> None:
    """The connector skips a key another request's live store is writing, as
    one the tier holds: the resumed request's store continues after it."""
    j = offloading()
    stored_then_resumed(j, evict=["c0", "c1", "c2", "c3"])
    j.admit("b", blocks=[1, 2, 3, 4])  # the same prompt: the same keys
    j.enqueue(1, "b", 0, reads=[1, 2, 3, 4], pins=[], keys=["c0", "c1", "c2", "c3"])
    j.enqueue(2, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    assert j.codes() == []
    j.add("job_received", job=1, rank=0)
    j.add("job_reported", job=1, rank=0)
    j.add("completions_received", job=1, count=1)
    j.add("pins_released", job=1, blocks=[])  # ended without tier_stored: written nowhere
    j.add("request_preempted", req="a", gen=1)
    j.add("request_resumed", req="a", gen=2)
    j.add("blocks_assigned", req="a", gen=2, blocks=[5, 6, 7, 8, 9], mode="replace")
    assert j.enqueue(3, "a", 2, reads=[9], pins=[], keys=["c4"], parent="c3") == (
        j.only("STORE_CURSOR_PAST_TABLE").seq
    )


def test_a_finish_time_store_of_a_resumed_request_is_judged_too() -> None:
    """The connector builds a finished request's last store in the next step."""
    j = offloading()
    stored_then_resumed(j, evict=["c0", "c3"])
    j.add("request_finished", req="a", gen=1)
    j.step = 3
    enq = j.enqueue(1, "a", 1, reads=[9], pins=[], keys=["c4"], parent="c3")
    assert j.only("STORE_CURSOR_PAST_TABLE").seq == enq


def test_the_cursor_of_a_finished_request_is_forgotten_a_step_later() -> None:
    """Two steps after its finish, a request's cursor state is gone: memory
    follows live requests, not history."""
    j = offloading()
    stored_then_resumed(j, evict=[])
    j.add("request_finished", req="a", gen=1)
    j.step = 3
    j.admit("b", blocks=[1])
    assert "a" in folded(j).offload.resumed
    j.step = 4
    j.admit("c", blocks=[2])
    assert "a" not in folded(j).offload.resumed
