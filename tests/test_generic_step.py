"""The generic observer's step: most steps write nothing, and none that must write is skipped.

``ConnectorObserver.after_build`` returns after a few looks when nothing was
admitted, resumed, preempted, grown or allocated for a load (a decode step,
a step waiting for remote KV). Each kind of step that does change a
request's blocks is written all the same, and a step that writes nothing
still ends the step for the group commit. The hook around it never raises
into vLLM, also for a connector object whose observer could not be made.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstate import Recorder
from kvstate.vllm._process import ObservedProcess
from kvstate.vllm.generic._hooks import ConnectorHooks
from kvstate.vllm.generic._observer import ConnectorObserver


def _out(
    *,
    new: list[Any] | None = None,
    preempted: set[str] | None = None,
    cached: list[tuple[str, Any]] | None = None,
    resumed: set[str] | None = None,
) -> SimpleNamespace:
    cached = cached or []
    return SimpleNamespace(
        scheduled_new_reqs=new or [],
        preempted_req_ids=preempted or set(),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[b for _, b in cached],
            num_computed_tokens=[64 for _ in cached],
            resumed_req_ids=resumed or set(),
        ),
    )


def _running() -> tuple[Recorder, ConnectorObserver]:
    """An observer that admitted ``r`` with blocks 1 and 2 (its first step)."""
    rec = Recorder.in_memory(block_size=32, world_size=1)
    observer = ConnectorObserver(rec, block_size=32, world_size=1)
    first = SimpleNamespace(req_id="r", block_ids=([1, 2],), num_computed_tokens=0,
                            prompt_token_ids=list(range(64)))  # fmt: skip
    observer.after_build(_out(new=[first]))
    return rec, observer


def _kinds_after(rec: Recorder, n: int) -> list[str]:
    return [e.event.kind for e in (rec.entries or [])[n:]]


def test_a_decode_step_writes_nothing_and_still_ends_the_step() -> None:
    rec, observer = _running()
    n = len(rec.entries or [])
    observer.after_build(_out(cached=[("r", None)]))
    assert _kinds_after(rec, n) == [] and observer.step == 2
    observer.group.failed = RuntimeError("the hand-over failed")
    with pytest.raises(RuntimeError, match="hand-over failed"):
        observer.after_build(_out(cached=[("r", None)]))  # raised at this step's boundary


@pytest.mark.parametrize(
    ("step", "kinds"),
    [
        ({"preempted": {"r"}}, ["request_preempted"]),
        ({"cached": [("r", ([3],))]}, ["blocks_assigned"]),
        ({"cached": [("r", ([4, 5],))], "resumed": {"r"}}, ["request_resumed", "blocks_assigned"]),
    ],
)
def test_a_step_that_changes_blocks_is_written(step: dict[str, Any], kinds: list[str]) -> None:
    rec, observer = _running()
    n = len(rec.entries or [])
    observer.after_build(_out(**step))
    assert _kinds_after(rec, n) == kinds


def test_a_load_allocated_in_a_step_that_schedules_nothing_is_written() -> None:
    rec = Recorder.in_memory(block_size=32, world_size=1)
    observer = ConnectorObserver(rec, block_size=32, world_size=1)
    request = SimpleNamespace(request_id="d", kv_transfer_params=None, num_prompt_tokens=96)
    observer.matched(request, 0, (95, True))
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],))
    observer.allocated(request, blocks, 95)
    observer.after_build(_out())  # the request waits for its KV: nothing scheduled
    kinds = [e.event.kind for e in rec.entries or []]
    assert kinds[-3:] == ["request_admitted", "blocks_assigned", "remote_load_started"]


def test_the_hook_of_an_object_whose_observer_could_not_be_made_passes_through() -> None:
    process = ObservedProcess()
    hooks = ConnectorHooks(process, object, "scheduler")
    conn = SimpleNamespace(_kvstate_observer=False)  # tried and failed (ObservedProcess._made)
    assert hooks.build(lambda out: "vLLM's metadata", conn, _out()) == "vLLM's metadata"
