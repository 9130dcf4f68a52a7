"""A host-memory offload tier for vLLM's OffloadingConnector on a CPU-only machine.

vLLM's own ``CPUOffloadingSpec`` refuses a platform without CUDA or XPU:
its copy worker runs each transfer on a CUDA stream. This spec is the same
tier (vLLM's ``CPUOffloadingManager``: which chunk holds which block hash,
LRU eviction, the store and load bookkeeping) with a worker of ours that
copies blocks between the engine's KV cache and a host tensor on a thread
of its own, one transfer after another, and reports each job when it is
done, as vLLM's handlers do. So vLLM's scheduler, tier manager, flush and
preemption logic run unchanged; only the copy is ours.

Selected as an outside spec::

    KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "HostTierSpec",
            "spec_module_path": "kvstate.harness.vllm_engine.host_tier",
            "cpu_bytes_to_use": 1 << 26})

``kvstate_copy_delay`` (engine steps, default 0) holds every store until
the engine has made that many more steps (calls of ``get_finished``, once a
step) before it reads the engine's blocks. A copy on this machine takes
microseconds, so without it a store is done before a preemption can land;
the delay opens the window in which the bugs of the connector's history
happened. It counts steps, not seconds, so a loaded machine opens the same
window; a flush (``wait``) copies at once what it waits for.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

DELAY_KEY = "kvstate_copy_delay"
#: what this process's tier workers did: stores, loads, flush waits, bytes
#: copied (for the demo and the tests; the journal is the record)
TALLY: collections.Counter[str] = collections.Counter()


class HostTierSpec(CPUOffloadingSpec):
    """vLLM's CPU tier, its copies made by :class:`HostTierWorker`."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # One worker per spec, as vLLM's own spec keeps it.
        worker: OffloadingWorker | None = getattr(self, "_worker", None)
        if worker is None:
            delay = int(self.extra_config.get(DELAY_KEY, 0) or 0)
            worker = HostTierWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, delay)
            self._worker = worker
        return worker


class _Transfer:
    __slots__ = ("dst", "due", "job", "src", "store")

    def __init__(self, job: int, store: bool, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self.job = job
        self.store = store
        self.src = src
        self.dst = dst
        #: the engine step from which the copy may run
        self.due = 0


class HostTierWorker(OffloadingWorker):
    """Copies blocks between the engine's KV cache and host chunks, on its own thread.

    A chunk holds ``blocks_per_chunk`` consecutive blocks of a request; the
    first block of each KV-cache group may start inside a chunk
    (``block_indices``), as in vLLM's copy plan.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, chunks: int, delay: int
    ) -> None:
        self._per_chunk = blocks_per_chunk
        self._delay = delay
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for canonical in kv_caches.tensors:
            page = canonical.page_size_bytes
            self._device.append(canonical.tensor.view(torch.int8).view(-1, page))
            self._host.append(torch.zeros((chunks, page * blocks_per_chunk), dtype=torch.int8))
        self._groups = [[ref.tensor_idx for ref in refs] for refs in kv_caches.group_data_refs]
        self._pages = [[ref.page_size_bytes for ref in refs] for refs in kv_caches.group_data_refs]
        self._queue: collections.deque[_Transfer | None] = collections.deque()
        self._cond = threading.Condition()
        #: submitted, not yet copied (wait() blocks on these)
        self._pending: set[int] = set()
        self._results: list[TransferResult] = []
        #: engine steps so far (get_finished calls), and jobs a flush waits for
        self._steps = 0
        self._flushing: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kvstate-host-tier", daemon=True)
        self._thread.start()

    # -- vLLM's side -------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._submit(_Transfer(job_id, True, src_spec, dst_spec))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # ``expedited`` (vLLM 0.33.0's synchronous loads, waited in the step
        # that submits them): one copy thread copies in order either way, and
        # wait() copies at once what it waits for
        del expedited
        return self._submit(_Transfer(job_id, False, src_spec, dst_spec))

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            done, self._results = self._results, []
            self._steps += 1
            self._cond.notify_all()
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` was copied (a preempted request's
        stores, before vLLM hands its blocks to another request)."""
        if job_ids:
            TALLY["flush waits"] += 1
        with self._cond:
            self._flushing |= job_ids & self._pending
            self._cond.notify_all()
            self._cond.wait_for(lambda: not (self._pending & job_ids))

    def shutdown(self) -> None:
        with self._cond:
            self._queue.append(None)
            self._cond.notify_all()
        self._thread.join()

    # -- read back, for the tier audit (kvstate.vllm.offloading._tier_audit) ---------

    @property
    def blocks_per_chunk(self) -> int:
        return self._per_chunk

    def device_digest(self, block: int) -> str:
        """The digest of one engine block (KV-cache group 0), every layer's page in order."""
        h = hashlib.blake2b(digest_size=8)
        for tensor, nbytes in zip(self._groups[0], self._pages[0], strict=True):
            h.update(self._device[tensor][block, :nbytes].numpy().tobytes())
        return h.hexdigest()

    def host_digest(self, chunk: int, sub: int) -> str:
        """The digest of what the tier holds for block ``sub`` of ``chunk`` (as
        :meth:`device_digest` of the block it was copied from)."""
        h = hashlib.blake2b(digest_size=8)
        for tensor, nbytes in zip(self._groups[0], self._pages[0], strict=True):
            page = self._device[tensor].shape[1]
            h.update(self._host[tensor][chunk, sub * page : sub * page + nbytes].numpy().tobytes())
        return h.hexdigest()

    # -- the copying thread ------------------------------------------------------------

    def _submit(self, transfer: _Transfer) -> bool:
        with self._cond:
            if transfer.store:
                transfer.due = self._steps + self._delay
            self._pending.add(transfer.job)
            self._queue.append(transfer)
            self._cond.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                # In order: a store waits for its step, or for a flush of it
                # or of a job queued behind it.
                self._cond.wait_for(self._head_may_run)
                transfer = self._queue.popleft()
            if transfer is None:
                return
            started = time.perf_counter()
            size = self._copy(transfer)
            TALLY["stores" if transfer.store else "loads"] += 1
            TALLY["bytes"] += size
            result = TransferResult(transfer.job, True, size, time.perf_counter() - started)
            with self._cond:
                self._pending.discard(transfer.job)
                self._flushing.discard(transfer.job)
                self._results.append(result)
                self._cond.notify_all()

    def _head_may_run(self) -> bool:
        head = self._queue[0]
        return head is None or self._steps >= head.due or bool(self._flushing)

    def _copy(self, transfer: _Transfer) -> int:
        device_spec = transfer.src if transfer.store else transfer.dst
        host_spec = transfer.dst if transfer.store else transfer.src
        if not isinstance(device_spec, GPULoadStoreSpec):
            raise TypeError(f"job {transfer.job}: the device side is {type(device_spec).__name__}")
        blocks = device_spec.block_ids
        chunks = host_spec.block_ids  # a CPULoadStoreSpec: chunk ids
        size = 0
        block_at = chunk_at = 0
        per = self._per_chunk
        for group, (count, first) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if count == 0:
                continue
            skip = first % per
            for i in range(count):
                block = int(blocks[block_at + i])
                chunk = int(chunks[chunk_at + (skip + i) // per])
                sub = (skip + i) % per
                for tensor, nbytes in zip(self._groups[group], self._pages[group], strict=True):
                    page = self._device[tensor].shape[1]
                    host = self._host[tensor][chunk, sub * page : sub * page + nbytes]
                    device = self._device[tensor][block, :nbytes]
                    if transfer.store:
                        host.copy_(device)
                    else:
                        device.copy_(host)
                    size += nbytes
            block_at += count
            chunk_at += -(-(skip + count) // per)
        return size
