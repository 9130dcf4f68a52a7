"""Faults the P/D harness injects into the real pair, one per run (``cfg["fault"]``).

vLLM 0.32.0 delays the free of a request's blocks in the two places the P/D
bug class lives, and each fault takes one delay away again, as the engines
upstream had it:

- ``prefill-reuse`` (vLLM #52234, #45357): the prefill engine's scheduler
  hands a finished request's blocks on though its connector asked to keep
  them until the decode engine has read them. The connector still holds
  their ids, and writes whatever the next request computed into them to the
  decode: "the previous prompt's answer returned for the new prompt". The
  prefill computes every prompt before the decode asks for any (the order
  of vLLM's toy proxy, which sends a request to the decode only once the
  prefill answered), in a pool small enough that later prompts take the
  blocks of earlier ones.
- ``decode-abort`` (vLLM #56104, #41269): the decode engine aborts a request
  whose remote write is still to land, and its scheduler frees the
  request's blocks at once instead of after the receive is reported. The
  next request takes them, and the prefill's write lands in its KV: "in-flight
  writes corrupt whichever request owns them next". The harness orders it by
  files, not by time: the decode allocates the write's targets, aborts,
  prefills the next request into the freed blocks and stops stepping; the
  prefill then computes the aborted prompt and writes it; the decode goes on.

The patch is the same for both (:func:`hand_on_early`): nothing of the
connector or of kvstate's observer changes, so the journal shows what the
real engine did.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstate.harness.vllm_engine.in_venv import BLOCK_SIZE
from kvstate.harness.vllm_engine.watchdog import Progress

FAULTS = ("prefill-reuse", "decode-abort")


def hand_on_early(scheduler: Any) -> None:
    """Make ``scheduler`` free a finished request's blocks at once where vLLM
    delays the free (the connector's answer, or a remote write still landing).

    The request stays in ``scheduler.requests`` until its transfer is
    reported, as vLLM keeps it (the report then frees nothing twice: vLLM's
    block manager pops a request's blocks once). Only its blocks go back to
    the pool early, which is the fault.
    """
    original = scheduler._free_request

    def free_request(request: Any, delay_free_blocks: bool = False) -> Any:
        answer = original(request, delay_free_blocks)
        if request.request_id in scheduler.requests:  # vLLM delayed the free
            scheduler._free_request_blocks(request)  # the fault: hand them on now
        return answer

    scheduler._free_request = free_request


def decode_blocks(prompts: list[list[int]], max_tokens: int) -> int:
    """The decode pool of ``decode-abort``: the aborted prompt 0's blocks, or
    prompt 1's whole run if more, plus vLLM's null block. With no block free
    but prompt 0's, prompt 1 is prefilled into the blocks the write targets."""
    aborted = -(-len(prompts[0]) // BLOCK_SIZE)
    follower = -(-(len(prompts[1]) + max_tokens) // BLOCK_SIZE)
    return 1 + max(aborted, follower)


def wait_for(work: Path, name: str, failed: str, progress: Progress) -> None:
    """Wait, unarmed (the other engine's pace is its own), for ``work/name``;
    raise if ``work/failed`` appears first."""
    phase, progress.phase = progress.phase, "starting"
    while not (work / name).exists():
        if (work / failed).exists():
            raise RuntimeError(f"the other engine ended before {name} (see its log)")
        time.sleep(0.05)
    progress.phase = phase


def abort_during_write(
    llm: Any,
    requests: list[Any],
    sampling: Callable[[int, bool], Any],
    work: Path,
    progress: Progress,
) -> dict[str, Any]:
    """The decode engine's part of ``decode-abort``; prompt 1's output and the
    aborted request's id. ``sampling(i, remote)``: prompt ``i``'s parameters,
    with the proxy's transfer params when ``remote``."""
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    hand_on_early(scheduler)
    engine.add_request("0", requests[0], sampling(0, True))
    while not any(
        r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in scheduler.requests.values()
    ):
        engine.step()  # the step that allocates the write's targets and asks the prefill
    (aborted,) = scheduler.requests
    engine.abort_request(["0"])
    engine.add_request("1", requests[1], sampling(1, False))
    tokens: list[int] = []
    while not tokens:  # prompt 1 prefilled, into prompt 0's blocks
        tokens = _tokens(engine.step(), tokens)
    (work / "decode.aborted").write_text("aborted\n")
    wait_for(work, "prefill.sent", "prefill.failed", progress)
    core = engine.engine_core.engine_core
    while engine.has_unfinished_requests():
        tokens = _tokens(engine.step(), tokens)
    while scheduler.requests:  # the aborted request, until its receive is reported
        core.step()
        time.sleep(0.002)
    return {"aborted": aborted, "round1": {"1": {"req": "1", "tokens": tokens}}}


def _tokens(outputs: list[Any], tokens: list[int]) -> list[int]:
    for out in outputs:
        if out.request_id == "1":
            tokens = list(out.outputs[0].token_ids)
    return tokens
