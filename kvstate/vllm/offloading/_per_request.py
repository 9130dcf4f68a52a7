"""vLLM's OffloadingConnector before per-job completion (0.13 to 0.20), journaled.

Until vLLM #39186 (first released in 0.21.0) the connector named its
transfers by request, not by job: the scheduler half puts at most one load
and one store per request into a step's metadata (``reqs_to_load``,
``reqs_to_store``), the worker half numbers them itself, and a store is
acknowledged only when its request finishes (``finished_sending``, once
every store of the request is done). Before vLLM #29870 (0.14.0) nothing
waited for a preempted request's stores; from 0.14.0 the worker waits for
them (``handle_preemptions``) before the step writes any block.

The journal speaks of jobs all the same, so the checks of the offloading
protocol (:mod:`kvstate.tier_events`) judge these releases as they judge
later ones. :class:`PerRequestHooks` gives each transfer a job id of the
journal's own when vLLM makes it (a load in ``update_state_after_alloc``, a
store in ``build_connector_meta``), hands the step's ids to the worker half
on the metadata, and translates the worker's own numbering back. It drives
the same two observers as the per-job connector (:mod:`._hooks`)
through a per-job view of each step: a request's acknowledgement ends
every store of that request, each with the completions of every rank, as
vLLM's output aggregator sums them.

Run here on 0.13.0, 0.14.0 and 0.20.0 (``tests/test_vllm_history.py``).
Releases 0.15 to 0.20 keep the same design in two modules
(``offloading/scheduler.py`` and ``offloading/worker.py``, flushes named in
the metadata); 0.15 to 0.19 are followed as read from the 0.20.0 wheel, and
no test drives them.

What these releases do not give the journal: the tier's keys (a store's
keys are not journaled, so the tier audit and the checks by key are off),
and per-job completion before the request's end (a store stays live in
the journal until then, as it does in vLLM).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, NamedTuple

from kvstate.tier_events import OFFLOADING
from kvstate.vllm._process import ObservedProcess, _world_size
from kvstate.vllm._stand_down import stand_down
from kvstate.vllm.offloading._hooks import _GROUPS, OffloadingHooks, _config
from kvstate.vllm.offloading._scheduler import OffloadingSchedulerObserver
from kvstate.vllm.offloading._worker import OffloadingWorkerObserver

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1"
#: where each release keeps the two halves: one module until 0.14, two from 0.15
MODULES = (
    ("offloading.scheduler", "offloading.worker"),
    ("offloading_connector", "offloading_connector"),
)
SCHEDULER_NEEDS = ("build_connector_meta", "update_state_after_alloc", "update_connector_output")
WORKER_NEEDS = ("get_finished", "_generate_job_id")


def classes() -> tuple[Any, Any] | None:
    """The two halves of a per-request OffloadingConnector, or None."""
    for sched_module, worker_module in MODULES:
        try:
            sched = importlib.import_module(f"{PACKAGE}.{sched_module}")
            worker = importlib.import_module(f"{PACKAGE}.{worker_module}")
            sched_cls = sched.OffloadingConnectorScheduler
            worker_cls = worker.OffloadingConnectorWorker
        except (ImportError, AttributeError):
            continue
        if hasattr(sched_cls, "_generate_job_id"):  # per-job: vLLM #39186 on
            return None
        if all(hasattr(sched_cls, m) for m in SCHEDULER_NEEDS) and all(
            hasattr(worker_cls, m) for m in WORKER_NEEDS
        ):
            return sched_cls, worker_cls
    return None


class _Transfer(NamedTuple):
    """One request's transfer, as :func:`~._scheduler.specs` reads it."""

    req_id: str
    transfer_spec: tuple[Any, Any]


class _Step:
    """One step's metadata in the per-job shape the observers read."""

    def __init__(self) -> None:
        self.load_jobs: dict[int, _Transfer] = {}
        self.store_jobs: dict[int, _Transfer] = {}
        self.jobs_to_flush: set[int] = set()


class _Jobs:
    """The journal's job ids for one scheduler half: live loads and stores by request."""

    def __init__(self) -> None:
        self.next = 0
        self.loads: dict[str, int] = {}
        self.stores: dict[str, list[int]] = {}

    def new(self) -> int:
        self.next += 1
        return self.next - 1


class PerRequestHooks(OffloadingHooks):
    """The hooks on both halves (see the module docstring); what a finish and
    a worker's construction need is the per-job connector's."""

    def __init__(self, process: ObservedProcess, scheduler: Any, worker: Any) -> None:
        super().__init__(process, scheduler, worker)
        #: the release waits for a preempted request's stores (vLLM #29870 on)
        self.flushes = hasattr(worker, "handle_preemptions")

    def patch(self) -> None:
        sched, worker = self.classes
        around = self.process.patches.around
        self.patch_scheduler_half(sched)  # the hooks below are this shape's
        around(worker, "__init__", self.worker_init)
        for name in ("start_load_kv", "start_kv_transfers"):  # 0.13; 0.14 on
            if hasattr(worker, name):
                around(worker, name, self.start_transfers)
        for name in ("start_store_kv", "prepare_store_kv"):
            if hasattr(worker, name):
                around(worker, name, self.stores)
        if self.flushes:
            around(worker, "handle_preemptions", self.handle_preemptions)
        around(worker, "get_finished", self.get_finished)

    # -- the scheduler half ---------------------------------------------------------

    def init(self, original: Any, sched: Any, spec: Any, *a: Any, **kw: Any) -> None:
        original(sched, spec, *a, **kw)
        state = sched.__dict__
        state["_kvstate_config"] = _config(spec, a, kw)
        state["_kvstate_jobs"] = _Jobs()
        # No tap on the tier manager: its decisions cannot be paired with jobs
        # here (the module docstring), so stores are journaled without keys.
        state["_kvstate_tapped"], state["_kvstate_tap"] = getattr(sched, "manager", None), None

    def _new_scheduler(self, sched: Any) -> OffloadingSchedulerObserver:
        config = sched.__dict__.get("_kvstate_config")
        # one attribute in 0.13 and 0.14; the first group's from 0.15
        size = getattr(sched, "gpu_block_size", None)
        block_size = int(size or sched.config.kv_group_configs[0].gpu_block_size)
        world = _world_size(config)
        recorder = self.process.open(config, "scheduler", block_size, world, OFFLOADING)
        return OffloadingSchedulerObserver(
            recorder, block_size=block_size, world_size=world, shapes=self.shapes
        )

    def after_alloc(
        self, original: Any, sched: Any, request: Any, blocks: Any, *a: Any, **kw: Any
    ) -> Any:
        req = request.request_id
        had = req in sched._reqs_to_load
        result = original(sched, request, blocks, *a, **kw)
        if not had and req in sched._reqs_to_load:  # a load was issued
            observer = self._observer(sched)
            if observer is not None:
                self.process.observe(self._issued_load, observer, sched, request, blocks)
        return result

    @staticmethod
    def _issued_load(
        observer: OffloadingSchedulerObserver, sched: Any, request: Any, blocks: Any
    ) -> None:
        jobs: _Jobs = sched.__dict__["_kvstate_jobs"]
        job = jobs.loads[request.request_id] = jobs.new()
        held = sum(1 for block in blocks.blocks[0] if block.block_hash is not None)
        table = [int(b) for b in blocks.get_block_ids()[0]]
        observer.issued(job, request, table, held * observer.block_size, [])

    def build_connector_meta(self, original: Any, sched: Any, scheduler_output: Any) -> Any:
        meta = original(sched, scheduler_output)
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(self._built, observer, sched, scheduler_output, meta)
        return meta

    def _built(
        self, observer: OffloadingSchedulerObserver, sched: Any, out: Any, meta: Any
    ) -> None:
        jobs: _Jobs = sched.__dict__["_kvstate_jobs"]
        step = _Step()
        ids: dict[tuple[str, str], int] = {}
        for req, spec in meta.reqs_to_load.items():
            job = jobs.loads.get(req)
            if job is not None:
                step.load_jobs[job] = _Transfer(req, spec)
                ids["load", req] = job
        for req, spec in meta.reqs_to_store.items():
            job = ids["store", req] = jobs.new()
            jobs.stores.setdefault(req, []).append(job)
            step.store_jobs[job] = _Transfer(req, spec)
        if self.flushes:  # the worker waits for a preempted request's stores
            for req in out.preempted_req_ids or ():
                step.jobs_to_flush.update(jobs.stores.get(req, ()))
        observer.after_build(sched, out, step, {})
        # What the worker half needs of this step: the journal's ids, its step.
        meta._kvstate_ids = ids
        meta._kvstate_step = getattr(step, "_kvstate_step", observer.step)
        meta._kvstate_jobs = getattr(step, "_kvstate_jobs", {})

    def connector_output(self, original: Any, sched: Any, connector_output: Any) -> Any:
        sending = set(connector_output.finished_sending or ())
        receiving = set(connector_output.finished_recving or ())
        observer = self._observer(sched) if sending or receiving else None
        result = original(sched, connector_output)
        if observer is not None:
            self.process.observe(self._acknowledged, observer, sched, sending, receiving)
        return result

    @staticmethod
    def _acknowledged(
        observer: OffloadingSchedulerObserver, sched: Any, sending: set[str], receiving: set[str]
    ) -> None:
        """A request's acknowledgement ends its jobs, each done on every rank."""
        jobs: _Jobs = sched.__dict__["_kvstate_jobs"]
        world = observer.world_size
        completed: dict[int, int] = {}
        ended: dict[int, bool] = {}
        for req in sorted(sending):
            for job in jobs.stores.pop(req, ()):
                completed[job], ended[job] = world, True
        for req in sorted(receiving):
            load = jobs.loads.pop(req, None)
            if load is not None:
                completed[load], ended[load] = world, False
        observer.jobs_completed(completed, ended)
        observer.finished_sending(sending)  # vLLM frees a held request's blocks
        observer.commit()

    # -- the worker half ------------------------------------------------------------

    def worker_init(self, original: Any, worker: Any, spec: Any, *a: Any, **kw: Any) -> None:
        super().worker_init(original, worker, spec, *a, **kw)
        #: vLLM's job id on this worker -> the journal's
        worker.__dict__["_kvstate_ids"] = {}

    def _new_worker(self, worker: Any) -> OffloadingWorkerObserver:
        config = worker.__dict__.get("_kvstate_config")
        parallel = getattr(config, "parallel_config", None)
        rank = int(getattr(parallel, "rank", 0) or 0)
        size = getattr(worker.spec, "gpu_block_size", 16)
        sizes = tuple(size) if isinstance(size, (tuple, list)) else (size,)
        world = _world_size(config)
        recorder = self.process.open(config, f"worker-{rank}", int(sizes[0]), world, OFFLOADING)
        observer = OffloadingWorkerObserver(recorder, rank=rank, audit=None)
        if len(sizes) != 1:
            stand_down(observer, _GROUPS.format(len(sizes)))
        return observer

    def _numbered(
        self, worker: Any, meta: Any, kind: str, reqs: Iterable[str], first: int
    ) -> list[int]:
        """The journal's ids of the jobs vLLM just numbered from ``first``, in order."""
        named = getattr(meta, "_kvstate_ids", None) or {}
        mine: dict[int, int] = worker.__dict__["_kvstate_ids"]
        out = []
        for number, req in enumerate(reqs, start=first):
            job = named.get((kind, req))
            if job is not None:
                mine[number] = job
                out.append(job)
        return out

    def _queued(self, worker: Any) -> list[int]:
        mine: dict[int, int] = worker.__dict__["_kvstate_ids"]
        queued = getattr(worker, "_unsubmitted_store_jobs", ())
        return [mine[entry[0]] for entry in queued if entry[0] in mine]

    def start_transfers(self, original: Any, worker: Any, meta: Any) -> Any:
        """This step's loads start (0.14 on: after the stores queued last step)."""
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        queued = self.process.observe(self._queued, worker) or []
        first = worker._job_counter
        result = original(worker, meta)
        self.process.observe(self._loads_started, observer, worker, meta, first, queued)
        return result

    def _loads_started(
        self,
        observer: OffloadingWorkerObserver,
        worker: Any,
        meta: Any,
        first: int,
        queued: list[int],
    ) -> None:
        observer.saw(meta)
        observer.start(queued)
        loads = self._numbered(worker, meta, "load", meta.reqs_to_load, first)
        observer.receive(loads)
        observer.start(loads)

    def stores(self, original: Any, worker: Any, meta: Any) -> Any:
        """This step's stores reach the rank: submitted at once until 0.14,
        queued for the next step's start from then on."""
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        first = worker._job_counter
        result = original(worker, meta)
        self.process.observe(self._stores_received, observer, worker, meta, first)
        return result

    def _stores_received(
        self, observer: OffloadingWorkerObserver, worker: Any, meta: Any, first: int
    ) -> None:
        observer.saw(meta)
        stores = self._numbered(worker, meta, "store", meta.reqs_to_store, first)
        observer.receive(stores)
        if not hasattr(worker, "_unsubmitted_store_jobs"):  # 0.13: submitted now
            observer.start(stores)

    def handle_preemptions(self, original: Any, worker: Any, arg: Any) -> Any:
        """The queued stores start, then the worker waits for the preempted
        requests' stores (a set of them in 0.14, the metadata's from 0.15)."""
        observer = self._worker(worker)
        if observer is None:
            return original(worker, arg)
        reqs = getattr(arg, "reqs_to_flush", arg) or ()
        mine: dict[int, int] = worker.__dict__["_kvstate_ids"]
        waited = [
            mine[job] for req in reqs for job in worker._store_jobs.get(req, ()) if job in mine
        ]
        queued = self.process.observe(self._queued, worker) or []
        result = original(worker, arg)
        if not hasattr(arg, "reqs_to_flush"):  # 0.14: before the step's metadata is bound
            observer.step += 1
        self.process.observe(observer.start, queued)
        self.process.observe(observer.flushed, waited)
        return result

    def get_finished(self, original: Any, worker: Any, *a: Any, **kw: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, *a, **kw)
        before = set(worker._jobs)
        try:
            return original(worker, *a, **kw)
        finally:
            self.process.observe(self._reported, observer, worker, before)

    @staticmethod
    def _reported(observer: OffloadingWorkerObserver, worker: Any, before: set[int]) -> None:
        mine: dict[int, int] = worker.__dict__["_kvstate_ids"]
        done = {mine.pop(job): 1 for job in sorted(before - set(worker._jobs)) if job in mine}
        if done:
            observer.reported({}, done)
        observer.step_ended()
