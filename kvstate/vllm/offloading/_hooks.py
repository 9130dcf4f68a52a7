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
import os
import sys
import types
from typing import Any

from kvstate import tier_events as tier
from kvstate.vllm._process import ObservedProcess, _world_size
from kvstate.vllm._shapes import Shapes
from kvstate.vllm._stand_down import stand_down
from kvstate.vllm.offloading._scheduler import OffloadingSchedulerObserver, tap_of
from kvstate.vllm.offloading._tier_audit import TierAudit
from kvstate.vllm.offloading._worker import OffloadingWorkerObserver

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


def missing() -> list[str]:
    """What :func:`classes` looks for and this vLLM has not, as ``Class.method``."""
    lost = []
    for module, name, methods in NEEDS:
        try:
            cls = getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)
        except (ImportError, AttributeError):
            lost.append(name)
            continue
        lost.extend(f"{name}.{m}" for m in methods if not hasattr(cls, m))
    return lost


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


#: what the Mooncake scheduler's hook reads before vLLM's call; this one reads nothing
_NONE: dict[str, Any] = {}

#: the worker's calls a rank without a tier audit leaves unhooked (see
#: :meth:`OffloadingWorkerObserver.step_seen`)
LEAN_SKIPS = ("handle_preemptions", "start_kv_transfers")

#: why a connector of a hybrid model is not journaled
_GROUPS = (
    "the KV cache has {} groups (a hybrid model's full and sliding-window or "
    "Mamba layers); the contract has one block table per request"
)


class OffloadingHooks:
    """The hooks on both halves; the observers come from the process, made on first use."""

    def __init__(self, process: ObservedProcess, scheduler: Any, worker: Any) -> None:
        self.process = process
        self.classes = (scheduler, worker)
        self.shapes = Shapes.of_vllm()
        #: the worker's methods a lean rank does not observe, as vLLM has them
        self.unobserved: dict[str, Any] = {}

    def patch_scheduler_half(self, sched: Any) -> None:
        """The scheduler half's five hooks (each shape of the connector has them)."""
        around = self.process.patches.around
        around(sched, "__init__", self.init)
        around(sched, "update_state_after_alloc", self.after_alloc)
        around(sched, "build_connector_meta", self.build_connector_meta)
        around(sched, "update_connector_output", self.connector_output)
        around(sched, "request_finished", self.request_finished)

    def patch(self) -> None:
        sched, worker = self.classes
        around = self.process.patches.around
        self.patch_scheduler_half(sched)
        if hasattr(sched, "reset_cache"):  # vLLM #41956 on
            around(sched, "reset_cache", self.reset_cache)
        around(worker, "__init__", self.worker_init)
        for name in LEAN_SKIPS:
            self.unobserved[name] = getattr(worker, name)
        around(worker, "prepare_store_kv", self.prepare_store)
        around(worker, "handle_preemptions", self.handle_preemptions)
        around(worker, "start_kv_transfers", self.start_transfers)
        around(worker, "get_finished", self.get_finished)

    # -- the scheduler half ---------------------------------------------------------

    def init(self, original: Any, sched: Any, spec: Any, *a: Any, **kw: Any) -> None:
        original(sched, spec, *a, **kw)
        sched.__dict__["_kvstate_config"] = _config(spec, a, kw)
        tap_of(sched)  # the manager tapped before vLLM's first call

    def _observer(self, sched: Any) -> OffloadingSchedulerObserver | None:
        observer = sched.__dict__.get("_kvstate_observer")
        if observer and not observer.closed:  # every step after the first: no lock, no maker
            return observer
        return self.process.of(sched, self._new_scheduler)

    def _new_scheduler(self, sched: Any) -> OffloadingSchedulerObserver:
        config = sched.__dict__.get("_kvstate_config")
        group = sched.config.kv_group_configs[0]
        # vLLM 0.32 names it tokens_per_block; 0.23 and 0.24 gpu_block_size
        block_size = int(getattr(group, "tokens_per_block", None) or group.gpu_block_size)
        world = int(sched.config.num_workers)
        recorder = self.process.open(config, "scheduler", block_size, world, tier.OFFLOADING)
        observer = OffloadingSchedulerObserver(
            recorder, block_size=block_size, world_size=world, shapes=self.shapes
        )
        groups = len(sched.config.kv_group_configs)
        if groups != 1:
            stand_down(observer, _GROUPS.format(groups))
        return observer

    def after_alloc(self, original: Any, sched: Any, *a: Any, **kw: Any) -> Any:
        # Passed on exactly as called: vLLM's tests name the arguments.
        before = sched._job_counter
        try:
            result = original(sched, *a, **kw)
        except BaseException:
            # vLLM's own check refused the load it had just made (the
            # assertion of vLLM #46014): the load is journaled before vLLM's
            # error goes on, so the journal shows the decision that crashed.
            if sched._job_counter != before:
                self._load_issued(sched, a, kw, before, refused=True)
            raise
        if sched._job_counter != before:  # a load job was issued
            self._load_issued(sched, a, kw, before, refused=False)
        return result

    def _load_issued(
        self, sched: Any, a: tuple[Any, ...], kw: dict[str, Any], job: int, *, refused: bool
    ) -> None:
        request = a[0] if a else kw.get("request")
        blocks = a[1] if len(a) > 1 else kw.get("blocks")
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(observer.load_issued, sched, request, blocks, job)
            if refused:
                self.process.observe(observer.load_refused, sched, job)

    def build_connector_meta(self, original: Any, sched: Any, scheduler_output: Any) -> Any:
        tap_of(sched)  # a manager swapped in since the last step is tapped before vLLM uses it
        meta = original(sched, scheduler_output)
        observer = self._observer(sched)
        if observer is not None:
            try:  # ObservedProcess.observe, inline: this runs every step
                observer.after_build(sched, scheduler_output, meta, _NONE)
            except Exception as exc:
                self.process.failed(observer.after_build, exc)
        return meta

    def connector_output(self, original: Any, sched: Any, connector_output: Any) -> Any:
        counts: Any = getattr(connector_output.kv_connector_worker_meta, "completed_jobs", None)
        observer = self._observer(sched) if counts else None  # most steps complete nothing
        if observer is None:
            return original(sched, connector_output)
        completed = dict(counts)
        if not observer.world_checked:  # once: the world is the engine's for its life
            observer.world_checked = True
            partial = self._partial_world(observer, sched)
            if partial is not None:
                self.process.observe(stand_down, observer, partial)
                return original(sched, connector_output)
        jobs = sched._jobs
        kinds = {job: jobs[job].is_store for job in completed if job in jobs}
        result = original(sched, connector_output)
        ended = {job: is_store for job, is_store in kinds.items() if job not in jobs}
        self.process.observe(observer.jobs_completed, completed, ended)
        self.process.observe(observer.commit)
        return result

    def _partial_world(self, observer: OffloadingSchedulerObserver, sched: Any) -> str | None:
        """Why completions reaching ``observer`` cannot be journaled, or None.

        A real engine runs either every rank of its world beside the
        scheduler (one process) or none of them (a process per worker), and
        its engine core steps the scheduler. vLLM's own tests run one worker
        object for a world of several and hand the scheduler the other
        workers' completions themselves, or (0.33.0's cache-reset tests)
        step a real scheduler with no engine and no worker and play the
        workers' reports: counts no rank made, which the journal would show
        as PHANTOM_COMPLETION.
        """
        run = _run_of(observer)
        with self.process.lock:
            ranks = [o for o in self.process.observers if isinstance(o, OffloadingWorkerObserver)]
            here = sum(1 for rank in ranks if _run_of(rank) == run)
        if 0 < here < observer.world_size:
            return (
                f"the connector has {observer.world_size} workers, and this process runs "
                f"{here} of them beside its scheduler: the others' completions are a "
                "test's, made by no worker"
            )
        if here == 0 and not _driven_by_engine():
            # A real engine's workers may all live in other processes (each
            # journals its own rank), but then vLLM's engine core steps this
            # scheduler; without it, the reports are a test's.
            return (
                "no worker of the connector in this process, and no vLLM engine core "
                "stepping its scheduler: the completions are a test's, made by no worker"
            )
        return None

    def reset_cache(self, original: Any, sched: Any, *a: Any, **kw: Any) -> Any:
        # The jobs in flight, read before vLLM discards them: the journal ends
        # them at the reset (cache_reset), and their workers may still copy.
        in_flight = list(getattr(sched, "_jobs", ()) or ())
        result = original(sched, *a, **kw)
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(observer.reset, in_flight, result is not False)
        return result

    def request_finished(self, original: Any, sched: Any, request: Any, *a: Any, **kw: Any) -> Any:
        result = original(sched, request, *a, **kw)
        observer = self._observer(sched)
        if observer is not None:
            self.process.observe(observer.request_finished, request, hold=bool(result[0]))
        return result

    # -- the worker half ------------------------------------------------------------

    def worker_init(self, original: Any, worker: Any, spec: Any, *a: Any, **kw: Any) -> None:
        original(worker, spec, *a, **kw)
        worker.__dict__["_kvstate_config"] = _config(spec, a, kw)

    def _worker(self, worker: Any) -> OffloadingWorkerObserver | None:
        observer = worker.__dict__.get("_kvstate_observer")
        if observer and not observer.closed:  # every step after the first: no lock, no maker
            return observer
        return self.process.of(worker, self._new_worker)

    def _new_worker(self, worker: Any) -> OffloadingWorkerObserver:
        config = worker.__dict__.get("_kvstate_config")
        parallel = getattr(getattr(worker.spec, "config", None), "parallel", None)
        rank = int(getattr(parallel, "rank", 0) or 0)
        # The spec's, as the scheduler half's (its groups' GPU block sizes):
        # vLLM's tests give the cache config another block size.
        spec = worker.spec
        sizes = tuple(
            getattr(spec, "tokens_per_block", None) or getattr(spec, "gpu_block_size", ()) or (16,)
        )
        world = int(getattr(parallel, "world_size", 0) or _world_size(config))
        recorder = self.process.open(
            config, f"worker-{rank}", int(sizes[0]), world, tier.OFFLOADING
        )
        copier = getattr(worker, "worker", None)
        readable = self.process.fingerprint and hasattr(copier, "device_digest")
        audit = TierAudit(copier) if readable else None
        observer = OffloadingWorkerObserver(recorder, rank=rank, audit=audit)
        if len(sizes) != 1:
            stand_down(observer, _GROUPS.format(len(sizes)))
        if observer.lean:
            # Nothing of these two calls is needed at their moment without a
            # tier audit: this rank calls vLLM's own methods (an attribute of
            # the object, ahead of the class's patch), and each step costs
            # the engine thread two hooks, not four.
            for name, method in self.unobserved.items():
                worker.__dict__[name] = types.MethodType(method, worker)
        return observer

    # One observation before vLLM's call and one after it: each hook runs on
    # the engine thread every step, most steps with nothing to journal.

    def prepare_store(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, meta)
        if observer.lean:
            result = original(worker, meta)
            try:  # ObservedProcess.observe, inline: this runs every step
                observer.step_seen(worker, meta)
            except Exception as exc:
                self.process.failed(observer.step_seen, exc)
            return result
        before = self.process.observe(observer.before_store, worker, meta)
        result = original(worker, meta)
        self.process.observe(observer.after_call, worker, before)
        return result

    def handle_preemptions(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is None or observer.lean:
            return original(worker, meta)
        before = self.process.observe(observer.before_preemptions, worker, meta)
        result = original(worker, meta)
        self.process.observe(observer.after_call, worker, before, meta.jobs_to_flush)
        return result

    def start_transfers(self, original: Any, worker: Any, meta: Any) -> Any:
        observer = self._worker(worker)
        if observer is not None and not observer.lean:
            self.process.observe(observer.before_transfers, worker, meta)
        return original(worker, meta)

    def get_finished(self, original: Any, worker: Any, *a: Any, **kw: Any) -> Any:
        observer = self._worker(worker)
        if observer is None:
            return original(worker, *a, **kw)
        if observer.lean:
            try:
                return original(worker, *a, **kw)
            finally:
                try:  # ObservedProcess.observe, inline: this runs every step
                    observer.finished(worker)
                except Exception as exc:
                    self.process.failed(observer.finished, exc)
        before = self.process.observe(observer.completed, worker)
        try:
            return original(worker, *a, **kw)
        finally:
            self.process.observe(observer.after_call, worker, before, None, True)


def _config(spec: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """The vLLM config a half of the connector was built with: its second
    argument in vLLM 0.32, its spec's in 0.23 and 0.24 (which take the spec alone)."""
    if a:
        return a[0]
    return kw.get("vllm_config", getattr(spec, "vllm_config", None))


#: the file of vLLM's engine core, whose step drives a real engine's scheduler
_ENGINE_CORE = os.path.join("vllm", "v1", "engine", "core.py")


def _driven_by_engine() -> bool:
    """Whether vLLM's engine core is on the calling thread's stack (walked once
    per connector, at its first completions)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_ENGINE_CORE):
            return True
        frame = frame.f_back
    return False


def _run_of(observer: Any) -> Any:
    """The run named in the header of ``observer``'s journal."""
    return getattr(observer.recorder.header.event, "run", None)
