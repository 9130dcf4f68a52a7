"""vLLM's OffloadingConnector, journaled: one hook class and one observer per half.

vLLM splits the connector into ``OffloadingConnectorScheduler`` and
``OffloadingConnectorWorker``; so does this. The hooks call vLLM's methods
unchanged and write, through the process's
:meth:`~kvstate.vllm._process.ObservedProcess.observe`, what they did, in the
protocol of :mod:`kvstate.tier_events` (``journal_opened.protocol``
``"offloading"``):

- scheduler side, once per step (``build_connector_meta``): preemptions; the
  flush of jobs journaled in earlier steps (before any block of this step
  changes hands: vLLM flushes a preempted request's stores, and the stores of
  a finished request whose blocks this step reallocates); the new block
  tables; the load jobs (``update_state_after_alloc`` issued them while
  scheduling); each store job, after the tier evictions its
  ``prepare_store`` made; then the flush of store jobs built this step
  (a finished request's last stores, whose freed blocks this step handed on);
- scheduler side, between steps: finishes (``request_finished``); per-job
  completion counts (``update_connector_output``), and for each job that
  ended, ``tier_stored`` (a store: the manager's ``complete_store``) and
  ``pins_released`` with no blocks;
- worker side, per rank: ``job_received`` when a job reaches the rank,
  ``job_started`` when it is submitted to the copy worker, ``job_reported``
  when the rank counts it complete, ``flush_done`` once ``wait(job_ids)``
  returned.

Tier keys and store keys are vLLM's ``OffloadKey`` bytes, in hex.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from kvstate import events as ev
from kvstate import tier_events as tier
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit
from kvstate.vllm._process import ObservedProcess
from kvstate.vllm._scheduler import SchedulerObserver, _table
from kvstate.vllm._tier_audit import TierAudit

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
#: (module, class, methods) the observer hooks or reads
NEEDS = (
    (
        "scheduler",
        "OffloadingConnectorScheduler",
        (
            "build_connector_meta",
            "update_state_after_alloc",
            "update_connector_output",
            "request_finished",
            "_generate_job_id",
        ),
    ),
    (
        "worker",
        "OffloadingConnectorWorker",
        ("handle_preemptions", "start_kv_transfers", "prepare_store_kv", "get_finished"),
    ),
)


def classes() -> tuple[Any, Any] | None:
    """vLLM's two halves of the connector, or None where this vLLM has not
    the shape observed here (then it is not patched, and writes no journal)."""
    found = []
    for module, name, methods in NEEDS:
        try:
            cls = getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)
        except (ImportError, AttributeError):
            return None
        if not all(hasattr(cls, m) for m in methods):
            return None
        found.append(cls)
    return found[0], found[1]


def _hex(key: Any) -> str:
    return key.hex() if hasattr(key, "hex") else str(key)


def _ids(spec: Any) -> tuple[int, ...]:
    return tuple(int(b) for b in getattr(spec, "block_ids", ()))


class _ObservedManager:
    """The scheduler's tier manager, with what ``prepare_*`` decided kept for the journal.

    Every other attribute is the manager's own.
    """

    def __init__(self, manager: Any, sched: Any) -> None:
        self._manager = manager
        self._sched = sched
        #: (the next job id when it ran, keys to store, keys evicted), this step
        self.stores: list[tuple[int, list[str], list[str]]] = []
        self.last_load: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def prepare_store(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._manager.prepare_store(keys, *args, **kwargs)
        if result is not None:
            self.stores.append(
                (
                    self._sched._job_counter,
                    [_hex(k) for k in result.keys_to_store],
                    [_hex(k) for k in result.evicted_keys],
                )
            )
        return result

    def prepare_load(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        self.last_load = [_hex(k) for k in keys]
        return self._manager.prepare_load(keys, *args, **kwargs)


class OffloadingSchedulerObserver(SchedulerObserver):
    """Journals one ``OffloadingConnectorScheduler`` (see the module docstring)."""

    def __init__(self, recorder: Recorder, *, block_size: int, world_size: int) -> None:
        super().__init__(recorder, block_size=block_size, world_size=world_size, numbering=False)
        #: load job -> (req, the request's table, its locally cached tokens, prompt
        #: tokens, tier keys), from ``update_state_after_alloc``
        self.loads: dict[int, tuple[str, list[int], int, int, list[str]]] = {}
        #: live job -> its keys (a store's, in the order it stores them)
        self.keys: dict[int, tuple[str, ...]] = {}
        self._flush_first: tuple[int, ...] = ()
        #: this step's jobs: job -> (req, gen, keys, of a finished request)
        self.step_jobs: dict[int, tuple[str, int, tuple[str, ...], bool]] = {}

    # -- one scheduler step ---------------------------------------------------------

    def load_issued(self, sched: Any, request: Any, blocks: Any, job: int) -> None:
        """``update_state_after_alloc`` issued load job ``job`` into ``blocks``."""
        manager = sched.manager
        keys = list(getattr(manager, "last_load", ()))
        status = sched._req_status.get(request.request_id)
        local = getattr(status, "num_locally_computed_tokens", 0) if status else 0
        table = _table(blocks.get_block_ids())
        self.loads[job] = (request.request_id, table, local, request.num_prompt_tokens, keys)

    def after_build(self, sched: Any, out: Any, meta: Any, before: dict[str, Any]) -> None:
        self.step += 1
        flush = set(meta.jobs_to_flush or ())
        self._flush_first = tuple(sorted(j for j in flush if j in self.keys))
        status = sched._req_status

        def local(req: str, computed: int) -> int:
            state = status.get(req)
            return (
                int(getattr(state, "num_locally_computed_tokens", computed)) if state else computed
            )

        self.record_requests(out, local)
        for job in sorted(meta.load_jobs):
            self._load(job, meta.load_jobs[job])
        manager = sched.manager
        stores = list(getattr(manager, "stores", ()))
        if stores:
            manager.stores = []
        for job in sorted(meta.store_jobs):
            # A prepare_store that made no job may still have evicted.
            while stores and stores[0][0] < job:
                self._evicted(stores.pop(0)[2])
            keys: list[str] = []
            if stores and stores[0][0] == job:
                _, keys, evicted = stores.pop(0)
                self._evicted(evicted)
            self._store(job, meta.store_jobs[job], keys)
        for _, _, evicted in stores:
            self._evicted(evicted)
        late = sorted(j for j in flush if j in self.keys and j not in self._flush_first)
        if late:
            self._record(tier.FlushRequested(jobs=tuple(late)))
        self.met_in_flight += sum(1 for j in flush if j not in self.keys)
        meta._kvstate_step = self.step
        # What the ranks' tier audit needs of this step's jobs (a job of a
        # finished request reads blocks the step's forward pass may reuse).
        meta._kvstate_jobs, self.step_jobs = self.step_jobs, {}
        self.commit()

    def after_preemptions(self) -> None:
        # Before the step's tables: these jobs' blocks may be handed on below.
        if self._flush_first:
            self._record(tier.FlushRequested(jobs=self._flush_first))

    def _load(self, job: int, transfer: Any) -> None:
        issued = self.loads.pop(job, None)
        if issued is None:
            self.met_in_flight += 1
            return
        req, table, local, prompt, keys = issued
        gen = self.gens.get(req)
        if gen is None:
            gen = self.gens[req] = 0
            self._record(ev.RequestAdmitted(req=req, gen=0, prompt_tokens=prompt))
        elif req in self.finished or req in self.waiting:
            self.met_in_flight += 1
            return
        else:  # preempted earlier; its load is its resume
            gen = self.gens[req] = gen + 1
            self._record(ev.RequestResumed(req=req, gen=gen))
        self.waiting.add(req)
        cached = tuple(table[: local // self.block_size])
        self._record(
            ev.BlocksAssigned(req=req, gen=gen, blocks=tuple(table), mode="replace", cached=cached)
        )
        self.keys[job] = tuple(keys)
        self.step_jobs[job] = (req, gen, tuple(keys), False)
        self._record(
            tier.LoadEnqueued(
                job=job,
                req=req,
                gen=gen,
                writes=_ids(transfer.dst_spec),
                keys=tuple(keys),
                world_size=self.world_size,
            )
        )

    def _store(self, job: int, transfer: Any, stored: list[str]) -> None:
        req = transfer.req_id
        gen = self.gens.get(req)
        if gen is None:
            self.met_in_flight += 1
            return
        keys = self.keys[job] = tuple(stored)
        self.step_jobs[job] = (req, gen, keys, req in self.finished)
        self._record(
            ev.JobEnqueued(
                job=job,
                req=req,
                gen=gen,
                token_start=0,
                token_end=0,
                reads=_ids(transfer.src_spec),
                pins=(),
                keys=keys,
                world_size=self.world_size,
            )
        )

    def _evicted(self, keys: list[str]) -> None:
        if keys:
            self._record(tier.TierEvicted(keys=tuple(keys)))

    # -- between steps --------------------------------------------------------------

    def jobs_completed(self, completed: dict[int, int], ended: dict[int, bool]) -> None:
        """Per-job counts summed over ranks; then, for each job that ended, its end.

        ``ended`` maps a job that vLLM retired to whether it was a store.
        """
        for job, count in sorted(completed.items()):
            if job not in self.keys:
                self.met_in_flight += 1  # enqueued before this journal began
                continue
            self._record(ev.CompletionsReceived(job=job, count=count))
        for job, is_store in sorted(ended.items()):
            keys = self.keys.pop(job, None)
            if keys is None:
                continue
            if is_store and keys:
                self._record(tier.TierStored(job=job, keys=keys))
            self._record(ev.PinsReleased(job=job, blocks=()))


class OffloadingWorkerObserver:
    """Journals one rank's ``OffloadingConnectorWorker`` (see the module docstring)."""

    def __init__(self, recorder: Recorder, *, rank: int, audit: TierAudit | None) -> None:
        self.recorder = recorder
        self.rank = rank
        self.step = 0
        self.group = GroupCommit(recorder)
        #: jobs received and not yet reported (kvstate.vllm.outstanding)
        self.unreported: set[int] = set()
        self.received: set[int] = set()
        #: the tier audited by bytes (None: fingerprints off, or a tier it cannot read)
        self.audit = audit
        #: job -> (req, gen, keys, of a finished request), as the scheduler named it
        self.jobs: dict[int, tuple[str, int, tuple[str, ...], bool]] = {}

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

    def saw(self, meta: Any) -> None:
        self.step = getattr(meta, "_kvstate_step", self.step)
        self.jobs.update(getattr(meta, "_kvstate_jobs", None) or {})

    def saves_due(self, meta: Any, *, finished_only: bool) -> None:
        """Fingerprint the store jobs whose blocks hold what they are to store now."""
        if self.audit is None:
            return
        for job, transfer in meta.store_jobs.items():
            named = self.jobs.get(job)
            if named is not None and (named[3] or not finished_only):
                self.audit.store_due(job, transfer, named[2])

    def loads_received(self, meta: Any) -> None:
        if self.audit is None:
            return
        for job, transfer in meta.load_jobs.items():
            named = self.jobs.get(job)
            if named is not None:
                self.audit.load_received(job, transfer, named[0], named[1], named[2])

    def receive(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            if job not in self.received:
                self.received.add(job)
                self.unreported.add(job)
                self._record(ev.JobReceived(job=job, rank=self.rank))

    def start(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            if job in self.received:
                self._record(ev.JobStarted(job=job, rank=self.rank))

    def reported(self, before: dict[int, int], after: dict[int, int]) -> None:
        """The jobs whose completion count this rank raised during one vLLM call."""
        for job in sorted(after):
            if after[job] > before.get(job, 0) and job in self.unreported:
                self.unreported.discard(job)
                self._record(ev.JobReported(job=job, rank=self.rank))
                self.jobs.pop(job, None)
                if self.audit is not None:
                    for verdict in self.audit.done(job):
                        self._record(verdict)

    def flushed(self, jobs: Iterable[int]) -> None:
        mine = tuple(sorted(j for j in jobs if j in self.received))
        if mine:
            self._record(tier.FlushDone(jobs=mine, rank=self.rank))

    def step_ended(self) -> None:
        self.group.step_ended()

    def close(self) -> None:
        self.recorder.close()


def _completed(worker: Any) -> dict[int, int]:
    return dict(worker._connector_worker_meta.completed_jobs)


class OffloadingHooks:
    """The hooks on both halves; the observers come from the process, made on first use."""

    def __init__(self, process: ObservedProcess, scheduler: Any, worker: Any) -> None:
        self.process = process
        self.classes = (scheduler, worker)

    def patch(self) -> None:
        sched, worker = self.classes
        around = self.process.patches.around
        around(sched, "__init__", self.init)
        around(sched, "update_state_after_alloc", self.after_alloc)
        around(sched, "build_connector_meta", self.build_connector_meta)
        around(sched, "update_connector_output", self.connector_output)
        around(sched, "request_finished", self.request_finished)
        around(worker, "__init__", self.worker_init)
        around(worker, "prepare_store_kv", self.prepare_store)
        around(worker, "handle_preemptions", self.handle_preemptions)
        around(worker, "start_kv_transfers", self.start_transfers)
        around(worker, "get_finished", self.get_finished)

    # -- the scheduler half ---------------------------------------------------------

    def init(
        self, original: Any, sched: Any, spec: Any, vllm_config: Any, *a: Any, **kw: Any
    ) -> None:
        original(sched, spec, vllm_config, *a, **kw)
        sched.__dict__["_kvstate_config"] = vllm_config
        sched.manager = _ObservedManager(sched.manager, sched)

    def _observer(self, sched: Any) -> OffloadingSchedulerObserver | None:
        return self.process.scheduler(sched, self._new_scheduler)  # type: ignore[return-value]

    def _new_scheduler(self, sched: Any) -> OffloadingSchedulerObserver:
        config = sched.__dict__.get("_kvstate_config")
        block_size = int(sched.config.kv_group_configs[0].tokens_per_block)
        world = int(sched.config.num_workers)
        recorder = self.process.open(config, "scheduler", block_size, world, tier.OFFLOADING)
        return OffloadingSchedulerObserver(recorder, block_size=block_size, world_size=world)

    def after_alloc(
        self, original: Any, sched: Any, request: Any, blocks: Any, n: int, *a: Any, **kw: Any
    ) -> Any:
        before = sched._job_counter
        result = original(sched, request, blocks, n, *a, **kw)
        if sched._job_counter != before:  # a load job was issued
            observer = self._observer(sched)
            if observer is not None:
                self.process.observe(observer.load_issued, sched, request, blocks, before)
        return result

    def build_connector_meta(self, original: Any, sched: Any, scheduler_output: Any) -> Any:
        meta = original(sched, scheduler_output)
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(observer.after_build, sched, scheduler_output, meta, {})
        return meta

    def connector_output(self, original: Any, sched: Any, connector_output: Any) -> Any:
        meta = connector_output.kv_connector_worker_meta
        completed = dict(getattr(meta, "completed_jobs", None) or {})
        observer = self._observer(sched) if completed else None
        if observer is None:
            return original(sched, connector_output)
        jobs = sched._jobs
        kinds = {job: jobs[job].is_store for job in completed if job in jobs}
        result = original(sched, connector_output)
        ended = {job: is_store for job, is_store in kinds.items() if job not in jobs}
        self.process.observe(observer.jobs_completed, completed, ended)
        self.process.observe(observer.commit)
        return result

    def request_finished(self, original: Any, sched: Any, request: Any, *a: Any, **kw: Any) -> Any:
        result = original(sched, request, *a, **kw)
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(observer.request_finished, request, hold=bool(result[0]))
        return result

    # -- the worker half ------------------------------------------------------------

    def worker_init(
        self, original: Any, worker: Any, spec: Any, vllm_config: Any, *a: Any, **kw: Any
    ) -> None:
        original(worker, spec, vllm_config, *a, **kw)
        worker.__dict__["_kvstate_config"] = vllm_config

    def _worker(self, worker: Any) -> OffloadingWorkerObserver | None:
        return self.process.rank(worker, self._new_worker)

    def _new_worker(self, worker: Any) -> OffloadingWorkerObserver:
        config = worker.__dict__.get("_kvstate_config")
        parallel = getattr(getattr(worker.spec, "config", None), "parallel", None)
        rank = int(getattr(parallel, "rank", 0) or 0)
        block_size = int(getattr(getattr(config, "cache_config", None), "block_size", 0) or 16)
        world = int(getattr(getattr(config, "parallel_config", None), "world_size", 1) or 1)
        recorder = self.process.open(config, f"worker-{rank}", block_size, world, tier.OFFLOADING)
        copier = getattr(worker, "worker", None)
        readable = self.process.fingerprint and hasattr(copier, "device_digest")
        audit = TierAudit(copier) if readable else None
        return OffloadingWorkerObserver(recorder, rank=rank, audit=audit)

    def prepare_store(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        before = _completed(worker)
        self.process.observe(observer.saw, meta)
        # After the forward pass that computed their tokens: what they are to store.
        self.process.observe(observer.saves_due, meta, finished_only=False)
        self.process.observe(observer.receive, sorted(meta.store_jobs))
        result = original(worker, meta)
        self.process.observe(observer.reported, before, _completed(worker))
        return result

    def handle_preemptions(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        flush = set(meta.jobs_to_flush or ())
        self.process.observe(observer.saw, meta)
        # A finished request's stores, before this step's forward pass may
        # write the blocks vLLM freed (a new holder's, this very step).
        self.process.observe(observer.saves_due, meta, finished_only=True)
        before = _completed(worker)
        # Stores flushed in the step that built them go straight to the copy worker.
        popped = sorted(j for j in flush if j in meta.store_jobs)
        self.process.observe(observer.receive, popped)
        queued = [job for job, _, _ in worker._unsubmitted_store_jobs]
        if worker._is_store_writer:
            self.process.observe(observer.start, queued + popped)
        result = original(worker, meta)
        self.process.observe(observer.reported, before, _completed(worker))
        if flush:
            self.process.observe(observer.flushed, flush)
        return result

    def start_transfers(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        loads = sorted(meta.load_jobs)
        queued = [job for job, _, _ in worker._unsubmitted_store_jobs]
        self.process.observe(observer.saw, meta)
        self.process.observe(observer.loads_received, meta)
        self.process.observe(observer.receive, loads)
        self.process.observe(observer.start, queued + loads)
        return original(worker, meta)

    def get_finished(self, original: Any, worker: Any, *a: Any, **kw: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, *a, **kw)
        before = _completed(worker)
        try:
            return original(worker, *a, **kw)
        finally:
            self.process.observe(observer.reported, before, _completed(worker))
            self.process.observe(observer.step_ended)
