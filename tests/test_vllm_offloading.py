"""vLLM's own OffloadingConnector in the real engine, on kvstate's host tier, journaled.

vLLM's CPU tier refuses a machine without CUDA (its copies run on CUDA
streams); :mod:`kvstate.harness.vllm_engine.host_tier` is that tier with a copy thread of
ours. vLLM's scheduler, tier manager, flush and preemption logic run
unchanged. The engine runs under preemption pressure on prompts sharing
prefixes; round 2 runs after the local prefix cache is reset, so its hits
are loads from the tier. Each store's copy is held 40 engine steps (steps,
not seconds: the same window on a loaded machine), so preemptions and
finishes meet stores in flight and vLLM flushes them.

Journaled through ``install()``, the run replays clean with
``--require-idle``; with vLLM's flushes dropped, as before vLLM #29870, the
same run is flagged ``UNFLUSHED_REUSE`` and its wrong output traced to a
``WRONG_KV_LOADED``. ``kvstate vllm-demo --connector offloading`` does both
through the other door, the connector setting. vLLM's MultiConnector
holding both connectors writes a journal per connector, each judged on its
own. Marked ``vllm``: it runs in ``.venv-vllm-0.32.0``.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstate.harness.live.master import MooncakeMaster
from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.engine_run import run_engine, store_env
from replay.cli.harness._vllm_runs import traces, wrong_outputs
from replay.runs import group
from replay.verdict import ReplayResult, replay

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.32.0"

WORKLOAD = {
    "prompts": 16,
    "groups": 4,
    "blocks": 12,
    "max_seqs": 4,
    "max_tokens": 48,
    "watchdog": 300.0,
}
TIER: dict[str, Any] = {"connector": "offloading", "copy_steps": 40, "tier_bytes": 1 << 21}
RETAINED = {"kvstate_rotate_bytes": 65_536, "kvstate_retain_bytes": 3 * 65_536}


def _engines(
    work: Path, plan: list[tuple[str, dict[str, Any]]], env: dict[str, str]
) -> dict[str, dict]:
    """Each (name, settings) of ``plan`` run on the workload, in order; their results."""
    venv = venvs.venv_path(ROOT, RELEASE)
    if not venvs.is_ready(venv, RELEASE):
        pytest.fail(f"{venv} is not set up: run `make vllm-venvs`")
    python = venvs.python_of(venv)
    out = {}
    for name, extra in plan:
        config = {**WORKLOAD, **extra, "model": str(work / "model")}
        if extra["mode"] == "journal":
            config["journal_dir"] = str(work / name)
        out[name] = run_engine(python, config, work, name, env, stall_s=600.0)
        out[name]["journal_dir"] = config.get("journal_dir")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    plan: list[tuple[str, dict[str, Any]]] = [
        ("reference", {"mode": "reference"}),
        ("offloading", {"mode": "plain", **TIER}),
        ("install", {"mode": "journal", "via": "install", **TIER}),
        ("no-flush", {"mode": "journal", "via": "install", "flushes": False, **TIER}),
        # no tier audit: each rank journaled from two of its four calls
        ("lean", {"mode": "journal", "via": "install", "fingerprint": False, **TIER}),
        # the connector setting, flushes dropped, vLLM's stat loggers on
        ("metrics", {"mode": "journal", "via": "connector", "flushes": False, "metrics": True,
                     **TIER}),
        # the connector setting, each journal rotated at 64 KiB and kept within 192 KiB
        ("retained", {"mode": "journal", "via": "connector", "kvstate_extra": RETAINED, **TIER}),
    ]  # fmt: skip
    return _engines(tmp_path_factory.mktemp("offloading"), plan, env)


def _tokens(result: dict, round_: str) -> dict[str, list[int]]:
    return {i: o["tokens"] for i, o in result[round_].items()}


@pytest.mark.vllm
def test_the_host_tier_stores_and_loads_and_the_outputs_are_the_references(
    runs: dict[str, dict],
) -> None:
    reference, offloaded = runs["reference"], runs["offloading"]
    assert "watchdog" not in offloaded, offloaded.get("watchdog")
    tier = offloaded["tier"]
    # It did the work: stores, then loads back from the tier in round 2.
    assert tier.get("stores", 0) > 0 and tier.get("loads", 0) > 0, tier
    assert tier.get("bytes", 0) > 0
    assert offloaded["reset"] is True
    ref = _tokens(reference, "round1")
    assert _tokens(offloaded, "round1") == ref
    # Round 2 computes from the tier's blocks what the reference computed itself.
    assert _tokens(offloaded, "round2") == ref


def _replayed(runs: dict[str, dict], name: str) -> tuple[ReplayResult, dict[str, int]]:
    """The run's journals replayed together, and how many records of each kind they hold."""
    folder = Path(runs[name]["journal_dir"])
    paths = sorted(str(p) for p in folder.glob("*.db"))
    assert [Path(p).name.split("-")[:2] for p in paths] == [
        ["offloading", "scheduler"],
        ["offloading", "worker"],
    ], paths
    kinds: dict[str, int] = {}
    for path in paths:
        with sqlite3.connect(path) as db:
            for kind, n in db.execute("SELECT kind, count(*) FROM records GROUP BY kind"):
                kinds[kind] = kinds.get(kind, 0) + n
    return replay(paths, require_idle=True), kinds


@pytest.mark.vllm
def test_the_journaled_connector_replays_clean_and_its_outputs_are_the_references(
    runs: dict[str, dict],
) -> None:
    run = runs["install"]
    assert "watchdog" not in run, run.get("watchdog")
    ref = _tokens(runs["reference"], "round1")
    assert _tokens(run, "round1") == ref and _tokens(run, "round2") == ref
    result, kinds = _replayed(runs, "install")
    assert result.violations == [] and result.exit_status == 0, result.violations[:3]
    # The run met what the protocol is about: preemptions, flushes and the
    # ranks' waits, evictions, loads from the tier.
    for kind in ("request_preempted", "flush_requested", "flush_done", "tier_evicted"):
        assert kinds.get(kind, 0) > 0, (kind, kinds)
    assert kinds["load_enqueued"] > 0 and kinds["tier_stored"] > 0
    assert kinds["job_reported"] == kinds["job_received"] == kinds["completions_received"]
    # The tier read back: every store's copy, every load of a key stored in this run.
    assert kinds["key_verified"] > 0 and kinds["load_verified"] > 0, kinds


#: what the tier audit adds to a journal (absent without fingerprints)
AUDIT_KINDS = {"key_verified", "load_verified"}


@pytest.mark.vllm
def test_a_rank_without_a_tier_audit_journals_the_same_transitions_from_fewer_calls(
    runs: dict[str, dict],
) -> None:
    # The copies are held by engine steps, so the two runs are the same run:
    # a rank journaled from two of vLLM's calls (the benchmark's cost row)
    # writes every transition the four-call rank writes.
    run = runs["lean"]
    assert "watchdog" not in run, run.get("watchdog")
    assert _tokens(run, "round1") == _tokens(runs["reference"], "round1")
    lean, kinds = _replayed(runs, "lean")
    assert lean.violations == [] and lean.exit_status == 0, lean.violations[:3]
    _, full = _replayed(runs, "install")
    assert not AUDIT_KINDS & set(kinds), kinds
    assert kinds == {k: n for k, n in full.items() if k not in AUDIT_KINDS}


@pytest.mark.vllm
def test_an_engine_whose_journals_rotate_and_keep_a_budget(runs: dict[str, dict]) -> None:
    """Rotation and retention from the connector's extra config, in the real
    engine: vLLM's outputs are the references, each journal keeps within its
    budget, and what is left of each replays by itself from its checkpoint."""
    from journal import segments
    from replay.runs import journal_files

    run = runs["retained"]
    assert "watchdog" not in run, run.get("watchdog")
    ref = _tokens(runs["reference"], "round1")
    assert _tokens(run, "round1") == ref and _tokens(run, "round2") == ref
    folder = Path(run["journal_dir"])
    starts = journal_files([str(folder)])
    assert sorted(Path(p).name.split("-")[1] for p in starts) == ["scheduler", "worker"], starts
    removed = 0
    for start in starts:
        head = segments.head_name(start)
        files = [p for p in folder.iterdir() if p.name.startswith(Path(head).stem + ".")]
        assert sum(p.stat().st_size for p in files) <= RETAINED["kvstate_retain_bytes"]
        result = replay([start])  # unusable input would raise
        if not os.path.exists(head):
            removed += 1
            assert result.from_checkpoint is not None
            assert result.to_dict()["from_checkpoint"]["after_seq"] > 0
    assert removed >= 1  # the scheduler's journal, at least, lost its head


@pytest.mark.vllm
def test_kvstates_figures_are_on_vllms_own_metrics(runs: dict[str, dict]) -> None:
    # Through the connector-stats path: vLLM's Prometheus registry (what its
    # /metrics serves) holds kvstate's counters with vLLM's labels, and the
    # live audit's findings reached them while the engine ran.
    run = runs["metrics"]
    lines = run["metrics"]
    records = [x for x in lines if x.startswith("vllm:kvstate_records_total{")]
    assert records and 'model_name="' in records[0] and 'engine="0"' in records[0], lines
    assert float(records[0].rsplit(" ", 1)[1]) > 0
    reuse = [
        x
        for x in lines
        if x.startswith("vllm:kvstate_violations_total{") and 'code="UNFLUSHED_REUSE"' in x
    ]
    assert reuse and float(reuse[0].rsplit(" ", 1)[1]) >= 1, lines
    result, _ = _replayed(runs, "metrics")
    assert "UNFLUSHED_REUSE" in {v.code.value for v in result.violations}


@pytest.mark.vllm
def test_without_vllms_flushes_the_run_is_unflushed_reuse(runs: dict[str, dict]) -> None:
    """vLLM #29870: stores neither flushed nor failed before their blocks change hands."""
    result, kinds = _replayed(runs, "no-flush")
    assert kinds.get("flush_requested", 0) == 0
    codes = {v.code.value for v in result.violations}
    # The race itself, and what it did: a tier copy of blocks that had
    # changed hands (POISONED_KEY), and a load of one (WRONG_KV_LOADED).
    assert "UNFLUSHED_REUSE" in codes, codes
    assert codes <= {"UNFLUSHED_REUSE", "POISONED_KEY", "WRONG_KV_LOADED"}, codes
    assert result.exit_status == 1
    run = runs["no-flush"]
    wrong = wrong_outputs(run, runs["reference"])
    found = traces(run, wrong, result)
    for prompt in wrong:
        assert any("WRONG_KV_LOADED" in line for line in found[prompt]), (prompt, found)


@pytest.mark.vllm
def test_the_offloading_demo_flags_the_dropped_flushes_and_passes_the_released_connector(
    tmp_path: Path,
) -> None:
    out = tmp_path / "demo"
    command = ["vllm-demo", "--connector", "offloading", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "replay", *command],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=3600,
        check=False,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert "flushes dropped (as before #29870)" in text and "UNFLUSHED_REUSE" in text
    released = replay([str(out / "offloading.db")], require_idle=True)
    assert released.violations == [] and released.exit_status == 0
    dropped = replay([str(out / "offloading-no-flush.db")])
    assert "UNFLUSHED_REUSE" in {v.code.value for v in dropped.violations}


# -- vLLM's MultiConnector: both connectors in one engine ------------------------------------

MULTI: dict[str, Any] = {"connector": "multi", "copy_steps": 40, "tier_bytes": 1 << 21}


@pytest.fixture(scope="module")
def multi_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """vLLM's MultiConnector with the MooncakeStoreConnector (against a local
    Mooncake master started here) and the OffloadingConnector (on kvstate's
    host tier), observed through ``install()``."""
    work = tmp_path_factory.mktemp("multi")
    with MooncakeMaster() as address:
        env = {**os.environ, **store_env(address, work / "mooncake.json")}
        plan: list[tuple[str, dict[str, Any]]] = [
            ("reference", {"mode": "reference"}),
            ("multi", {"mode": "journal", "via": "install", **MULTI}),
        ]
        return _engines(work, plan, env)


@pytest.mark.vllm
def test_each_connector_of_a_multiconnector_is_journaled_and_judged_on_its_own(
    multi_runs: dict[str, dict],
) -> None:
    """Each connector writes its own journals in its own run (the offloading
    one's run name ends in ``-offloading``), and replay judges each: both
    clean with ``--require-idle``, both with jobs, every output the reference's."""
    run = multi_runs["multi"]
    assert "watchdog" not in run, run.get("watchdog")
    reference = {i: o["tokens"] for i, o in multi_runs["reference"]["round1"].items()}
    for round_ in ("round1", "round2"):
        assert {i: o["tokens"] for i, o in run[round_].items()} == reference, round_
    assert run["tier"].get("stores", 0) > 0  # the offloading child did its work
    journals = group([run["journal_dir"]])
    names = {r: sorted(Path(p).name.split("-")[0] for p in paths) for r, paths in journals.items()}
    assert len(journals) == 2, names
    offloading = [r for r in journals if r.endswith("-offloading")]
    assert len(offloading) == 1, names
    for run_name, paths in journals.items():
        result = replay(paths, require_idle=True)
        assert result.violations == [] and result.exit_status == 0, (run_name, result.violations)
        assert result.ledger.jobs, run_name  # each connector journaled its jobs
        header = result.ledger.header
        assert header is not None
        assert (header.protocol == "offloading") == (run_name in offloading)
