"""Every connector adapter passes the conformance suite, and the suite fails a broken one.

``tests/in_vllm/`` runs inside vLLM 0.32.0's venv (kvstate has no vLLM of its
own): :class:`tests.in_vllm.conformance.AdapterContract` against the Mooncake
store, the OffloadingConnector and the generic adapter, each driving a real V1
``Scheduler`` built by vLLM's own test helpers. ``LeakyAdapter`` is a generic
adapter whose hook calls its observer outside the process's ``observe``; the
same contract, selected with ``-m broken``, must fail it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import upstream, venvs

ROOT = Path(__file__).resolve().parent.parent


def _run(*select: str) -> subprocess.CompletedProcess[str]:
    tree = upstream.ensure(ROOT)
    python = venvs.python_of(venvs.venv_path(ROOT, "0.32.0"))
    env = {
        **os.environ,
        "KVSTATE_VLLM_TREE": str(tree),
        "HF_HOME": str(upstream.model_cache(tree)),
        "HF_HUB_OFFLINE": "1",
    }
    argv = [str(python), "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
            "-W", "ignore::DeprecationWarning", "tests/in_vllm", *select]  # fmt: skip
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, check=False)


@pytest.mark.vllm
def test_every_adapter_passes_the_contract() -> None:
    done = _run()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    for family in ("TestGenericAdapter", "TestOffloadingAdapter", "TestMooncakeStoreAdapter"):
        assert family not in done.stdout.split("short test summary")[-1]


@pytest.mark.vllm
def test_the_contract_fails_a_broken_adapter() -> None:
    done = _run("-m", "broken")
    assert done.returncode == 1, done.stdout[-4000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    # vLLM's own calls raise once the observer does: every test that drives it fails
    assert any("a_failing_observer_ends_only_its_journal" in line for line in failed), failed
    assert any("decides_as_plain" in line for line in failed), failed
