"""The hooks on vLLM's MooncakeStoreConnector, one class per half of it.

vLLM splits the connector into a scheduler half (``MooncakeStoreScheduler``
and the connector's scheduler-side calls) and a worker half
(``MooncakeStoreWorker`` and its sending and receiving threads); so does
this. Each hook calls vLLM's method unchanged and records, through the
process's :meth:`~kvstate.vllm._process.ObservedProcess.observe`, what it did.
"""

from __future__ import annotations

import threading
from typing import Any

from kvstate.events import SkipReason
from kvstate.vllm._compat import Connector
from kvstate.vllm._process import ObservedProcess, _world_size
from kvstate.vllm._store_jobs import SchedulerObserver
from kvstate.vllm.mooncake import _fingerprint
from kvstate.vllm.mooncake._memory import KvMemory
from kvstate.vllm.mooncake._worker import WorkerObserver


class SchedulerHooks:
    """The scheduler half: steps, finishes, completions and pin releases."""

    def __init__(self, process: ObservedProcess, connector: Connector) -> None:
        self.process = process
        #: before vLLM #52372: the connector reports finished requests, not jobs
        self.legacy = connector.flavor == "req-counters"
        self.connector = connector

    def observer(self, sched: Any) -> SchedulerObserver | None:
        """The observer of one MooncakeStoreScheduler (made on first use)."""
        return self.process.of(sched, self._new)

    def _new(self, sched: Any) -> SchedulerObserver:
        config = sched.__dict__.get("_kvstate_config")
        world = getattr(sched, "_num_workers", None) or _world_size(config)
        recorder = self.process.open(config, "scheduler", sched._block_size, world)
        return SchedulerObserver(
            recorder, block_size=sched._block_size, world_size=world, numbering=self.legacy
        )

    def patch(self) -> None:
        sched = self.connector.cls("scheduler", "MooncakeStoreScheduler")
        conn = self.connector.cls("connector", "MooncakeStoreConnector")
        around = self.process.patches.around
        around(sched, "__init__", self.init)
        around(sched, "build_connector_meta", self.build_connector_meta)
        around(conn, "request_finished_all_groups", self.request_finished)
        around(conn, "update_connector_output", self.connector_output)
        if not self.legacy:
            around(sched, "update_connector_output", self.scheduler_output)

    def init(self, original: Any, sched: Any, vllm_config: Any, *args: Any, **kw: Any) -> None:
        sched.__dict__["_kvstate_config"] = vllm_config
        original(sched, vllm_config, *args, **kw)
        # The journal (and its writer process) opens with the engine, not in
        # its first step; a scheduler a test makes with object.__new__ still
        # gets one on first use.
        self.observer(sched)

    def build_connector_meta(self, original: Any, sched: Any, scheduler_output: Any) -> Any:
        observer = self.observer(sched)
        if observer is None:
            return original(sched, scheduler_output)
        before = self.process.observe(observer.before_build, sched)
        meta = original(sched, scheduler_output)
        if before is not None:
            self.process.observe(observer.after_build, sched, scheduler_output, meta, before)
        return meta

    def request_finished(self, original: Any, conn: Any, request: Any, block_ids: Any) -> Any:
        result = original(conn, request, block_ids)
        observer = self._of(conn)
        if observer is not None:
            self.process.observe(observer.request_finished, request, hold=bool(result[0]))
        return result

    def connector_output(self, original: Any, conn: Any, connector_output: Any) -> Any:
        observer = self._of(conn)
        result = original(conn, connector_output)
        if observer is not None:
            if self.legacy:
                self.process.observe(observer.finished_sending, connector_output.finished_sending)
            self.process.observe(observer.commit)
        return result

    def scheduler_output(self, original: Any, sched: Any, connector_output: Any) -> Any:
        observer = self.observer(sched)
        meta = connector_output.kv_connector_worker_meta
        completed = dict(getattr(meta, "completed_saves", None) or {})
        if observer is None or not completed:
            return original(sched, connector_output)  # most steps: nothing reported
        pinned = sched._pinned_saves
        before = {job: list(pinned[job][0]) for job in completed if job in pinned}
        result = original(sched, connector_output)
        released = {job: ids for job, ids in before.items() if job not in pinned}
        self.process.observe(observer.completions, completed, released)
        return result

    def _of(self, conn: Any) -> Any:
        inner = getattr(conn, "connector_scheduler", None)
        return self.observer(inner) if inner is not None else None


class WorkerHooks:
    """The worker half: the step's jobs, the sending thread's puts, the receiving thread's gets."""

    def __init__(self, process: ObservedProcess, connector: Connector) -> None:
        self.process = process
        self.legacy = connector.flavor == "req-counters"
        self.connector = connector
        #: the KV cache tensors of the register_kv_caches call under way (per thread)
        self._registering = threading.local()
        #: the worker's vLLM config, seen by ``MooncakeStoreWorker.__init__``
        #: before its threads exist (they open the rank's journal and need
        #: its world size)
        self.worker_config: Any = None

    def observer(self, thread: Any) -> WorkerObserver | None:
        """The observer of one rank of this process (its sending and receiving
        threads share it), made on first use."""
        rank = int(getattr(thread, "tp_rank", 0))
        return self.process.keyed(("mooncake", rank), self._new, thread, rank)

    def _new(self, thread: Any, rank: int) -> WorkerObserver:
        config = self.worker_config
        recorder = self.process.open(
            config, f"worker-{rank}", thread.block_size, _world_size(config)
        )
        memory = thread.__dict__.get("_kvstate_memory")  # its KV tensors (register_kv_caches)
        fingerprint, every = self.process.fingerprint, self.process.fingerprint_every
        if every is None:
            every = _fingerprint.SAMPLE_EVERY  # install()'s default sample
        return WorkerObserver(
            recorder, rank=rank, fingerprint=fingerprint, every=every, memory=memory
        )

    def patch(self) -> None:
        worker = self.connector.cls("worker", "MooncakeStoreWorker")
        send = self.connector.cls("worker", "KVCacheStoreSendingThread")
        recv = self.connector.cls("worker", "KVCacheStoreRecvingThread")
        around = self.process.patches.around
        around(worker, "__init__", self.worker_init)
        around(worker, "register_kv_caches", self.register_kv_caches)
        around(worker, "get_finished", self.get_finished)
        around(send, "__init__", self.sending_init)
        around(send, "add_request", self.add_request)
        around(send, "_handle_request", self.store)
        around(send, "_record_saved", self.record_saved)
        around(send, "_mark_request_skipped_for_pressure", self.mark_skipped)
        around(send, "delete_finished_stored_request", self.dropped)
        around(send, "update_kv_event", self.kv_events)
        if hasattr(send, "_update_retry_token_ids"):  # KV-event retries, after #52372
            around(send, "_update_retry_token_ids", self.retry_tokens)
        around(recv, "__init__", self.receiving_init)
        around(recv, "_handle_request", self.load)

    def worker_init(self, original: Any, worker: Any, vllm_config: Any, *a: Any, **kw: Any) -> None:
        self.worker_config = vllm_config
        original(worker, vllm_config, *a, **kw)

    def register_kv_caches(self, original: Any, worker: Any, kv_caches: Any, *a: Any) -> Any:
        """The KV cache tensors, seen as vLLM registers them: the rank's
        transfer threads are made in this call, and their observer reads the
        blocks' bytes for fingerprints only through these tensors
        (kvstate.vllm.mooncake._memory), never through a raw address alone."""
        try:
            self._registering.memory = KvMemory.of(kv_caches)
        except Exception:  # not tensors (a unit test's stand-ins): no fingerprints
            self._registering.memory = None
        try:
            return original(worker, kv_caches, *a)
        finally:
            self._registering.memory = None

    def _memory_to(self, thread: Any) -> None:
        """Hand the tensors being registered to a transfer thread made meanwhile."""
        memory = getattr(self._registering, "memory", None)
        if memory is not None:
            thread.__dict__["_kvstate_memory"] = memory

    def get_finished(self, original: Any, worker: Any, finished_req_ids: Any, meta: Any) -> Any:
        thread = getattr(worker, "kv_send_thread", None)
        observer = self.observer(thread) if thread is not None else None
        if observer is None:
            return original(worker, finished_req_ids, meta)
        self.process.observe(observer.before_step, meta)
        try:
            return original(worker, finished_req_ids, meta)
        finally:
            self.process.observe(observer.after_step)

    def sending_init(self, original: Any, thread: Any, *args: Any, **kwargs: Any) -> None:
        original(thread, *args, **kwargs)
        self._memory_to(thread)
        observer = self.observer(thread)
        if observer is not None:
            observer.store = thread.store  # unobserved, for finish()'s read-back
            thread.store = _ObservedStore(thread.store, observer, self.process)

    def receiving_init(self, original: Any, thread: Any, *args: Any, **kwargs: Any) -> None:
        original(thread, *args, **kwargs)
        self._memory_to(thread)
        observer = self.observer(thread)
        if observer is not None:
            thread.store = _ObservedStore(thread.store, observer, self.process)

    def add_request(self, original: Any, thread: Any, request: Any) -> None:
        observer = self.observer(thread)
        if observer is not None:
            self.process.observe(observer.received, thread, request)
        original(thread, request)

    def store(self, original: Any, thread: Any, req_meta: Any) -> Any:
        observer = self.observer(thread)
        if observer is None:
            return original(thread, req_meta)
        if self.legacy:
            live = req_meta.req_id in thread.stored_requests
        else:
            live = thread.is_live_store_job(req_meta)
        pressure = live and thread._should_skip_request(req_meta.req_id)
        reason: SkipReason = "stale" if not live else "pressure" if pressure else "empty"
        run = self.process.observe(observer.begin_job, req_meta, reason)
        try:
            return original(thread, req_meta)
        finally:
            if run is not None:
                self.process.observe(observer.end_job, run)

    def record_saved(self, original: Any, thread: Any, first: Any, token_len: int) -> None:
        req = first if isinstance(first, str) else first.req_id
        original(thread, first, token_len)
        observer = self.observer(thread)
        if observer is not None and thread._saved_offset.get(req) == token_len:
            self.process.observe(observer.offset_saved, req, token_len)

    def mark_skipped(self, original: Any, thread: Any, first: Any) -> Any:
        req = first if isinstance(first, str) else first.req_id
        result = original(thread, first)
        observer = self.observer(thread)
        if observer is not None and req in thread._skip_store_requests:
            self.process.observe(observer.marked_skipped, req)
        return result

    def dropped(self, original: Any, thread: Any, req_id: str) -> None:
        had = req_id in thread.stored_requests
        original(thread, req_id)
        observer = self.observer(thread)
        if observer is not None and had:
            self.process.observe(observer.ledger_entry_dropped, req_id)

    def kv_events(self, original: Any, thread: Any, events: Any) -> Any:
        observer = self.observer(thread)
        if observer is not None:
            self.process.observe(observer.kv_events, events)
        return original(thread, events)

    def retry_tokens(self, original: Any, thread: Any, req_meta: Any, *a: Any, **kw: Any) -> Any:
        req = req_meta.req_id
        before = thread._retry_token_ids.get(req)
        result = original(thread, req_meta, *a, **kw)
        after = thread._retry_token_ids.get(req)
        observer = self.observer(thread)
        if observer is not None and after is not before:
            self.process.observe(observer.retry_tokens, req, after)
        return result

    def load(self, original: Any, thread: Any, req_meta: Any) -> Any:
        observer = self.observer(thread)
        if observer is not None:
            observer.current.load = req_meta
        try:
            return original(thread, req_meta)
        finally:
            if observer is not None:
                observer.current.load = None


class _ObservedStore:
    """A thread's store handle, with the calls that move KV observed."""

    def __init__(self, store: Any, observer: WorkerObserver, process: ObservedProcess) -> None:
        self._store = store
        self._observer = observer
        self._observe = process.observe

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_is_exist(self, keys: list[str]) -> Any:
        states = self._store.batch_is_exist(keys)
        if getattr(self._observer.current, "job", None) is not None:
            self._observe(self._observer.exist_checked, states)
        return states

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: Any, sizes: Any, *rest: Any
    ) -> Any:
        pre = self._observe(self._observer.before_put, keys, addrs, sizes)
        try:
            result = self._store.batch_put_from_multi_buffers(keys, addrs, sizes, *rest)
        except BaseException as exc:
            if pre is not None:
                self._observe(self._observer.after_put, pre, None, exc)
            raise
        if pre is not None:
            self._observe(self._observer.after_put, pre, result, None)
        return result

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: Any, sizes: Any, *rest: Any
    ) -> Any:
        result = self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *rest)
        meta = getattr(self._observer.current, "load", None)
        if meta is not None:
            self._observe(self._observer.loaded, meta, keys, addrs, sizes, result)
        return result
