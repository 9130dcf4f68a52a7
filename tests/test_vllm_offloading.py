"""vLLM's own OffloadingConnector in the real engine, on kvstate's host tier.

vLLM's CPU tier refuses a machine without CUDA (its copies run on CUDA
streams); :mod:`kvstate.vllm.host_tier` is that tier with a copy thread of
ours. vLLM's scheduler, tier manager, flush and preemption logic run
unchanged. The engine runs under preemption pressure on prompts sharing
prefixes; round 2 runs after the local prefix cache is reset, so its hits
are loads from the tier. Marked ``vllm``: it runs in ``.venv-vllm-0.32.0``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.runs import run_engine

ROOT = Path(__file__).resolve().parent.parent
RELEASE = "0.32.0"

WORKLOAD = {
    "prompts": 16,
    "groups": 4,
    "blocks": 24,
    "max_seqs": 4,
    "max_tokens": 32,
    "watchdog": 300.0,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    venv = venvs.venv_path(ROOT, RELEASE)
    if not venvs.is_ready(venv, RELEASE):
        pytest.fail(f"{venv} is not set up: run `make vllm-venvs`")
    work = tmp_path_factory.mktemp("offloading")
    python = venvs.python_of(venv)
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    model = str(work / "model")
    out = {}
    for name, extra in [
        ("reference", {"mode": "reference"}),
        # the delay keeps stores in flight while the scheduler preempts
        ("offloading", {"mode": "plain", "connector": "offloading", "put_delay": 0.02}),
    ]:
        config = {**WORKLOAD, **extra, "model": model}
        out[name] = run_engine(python, config, work, name, env, stall_s=600.0)
    return out


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
