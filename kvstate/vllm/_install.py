"""Patching vLLM's connector classes in place, and taking the patches out.

Patching the classes (not only subclassing the connector) reaches every
scheduler and worker object, including those vLLM's own tests build with
``object.__new__``. Each wrapper calls vLLM's method unchanged and records
what it did; the observer's state hangs off the vLLM object it observes,
created on first use.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstate.errors import RefusedValueError
from kvstate.events import SkipReason
from kvstate.vllm import _journals
from kvstate.vllm._compat import Connector, detect
from kvstate.vllm._scheduler import SchedulerObserver
from kvstate.vllm._worker import WorkerObserver

_patched: list[tuple[Any, str, Any]] = []
_lock = threading.RLock()
_connector: Connector | None = None
#: every observer of this process, closed by :func:`finish`
schedulers: list[SchedulerObserver] = []
workers: dict[int, WorkerObserver] = {}
#: the worker's vLLM config, seen by ``MooncakeStoreWorker.__init__`` before its
#: threads exist (they open the rank's journal and need its world size)
_worker_config: dict[str, Any] = {}
_settings: dict[str, Any] = {"fingerprint": True}
#: errors inside the observer; a journal they touched is never reported clean
failures: list[str] = []
#: ``ended``: finish() ended this process's journals; install() starts anew
_state = {"ended": False}
#: ranks whose journal could not be opened: not tried again on every call
_unobservable: set[int] = set()
_log = logging.getLogger("kvstate.vllm")


def _observe(call: Callable[[], Any]) -> Any:
    """Run one observation; an observer error never reaches vLLM.

    vLLM's own work goes on. The journal is then incomplete, so :func:`finish`
    ends it with ``engine_crashed`` naming the error instead of ``engine_idle``:
    replay reports ``CRASH``, never clean.
    """
    try:
        return call()
    except RefusedValueError as exc:
        # What the observer read off vLLM is not what the contract needs (a
        # connector unit test's MagicMock block_size): it stands down, with
        # the reason, instead of journaling values no reader could read.
        failures.append(f"{type(exc).__name__}: {exc}")
        _log.warning("kvstate observer stands down: %s", exc)
        return None
    except Exception as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        _log.exception("kvstate observer failed; the journal will end with engine_crashed")
        return None


def installed() -> Connector | None:
    """The observed connector, or None when :func:`install` has not run."""
    return _connector


def install(
    journal_dir: str | os.PathLike[str] | None = None, *, fingerprint: bool | None = None
) -> Connector:
    """Journal every MooncakeStoreConnector of this process from now on.

    ``fingerprint`` (default on) hashes each saved block when the save is
    requested and again when the put reads it. Idempotent: a later call
    changes only what it names. Raises :class:`UnsupportedVLLMError` (and patches nothing)
    when the installed vLLM lacks a hook the observer needs.
    """
    global _connector
    with _lock:
        if journal_dir is not None:
            _journals.chosen_dir = Path(journal_dir)
        if fingerprint is not None:  # a later bare install() keeps the choice
            _settings["fingerprint"] = fingerprint
        _state["ended"] = False  # observe again (after a finish(), new journals)
        _unobservable.clear()
        if _connector is not None:
            return _connector
        connector = detect()
        _patch_all(connector)
        _connector = connector
        atexit.register(_close_at_exit)
        return connector


def uninstall() -> None:
    """Restore vLLM's methods (journals already open stay open until :func:`finish`)."""
    global _connector
    with _lock:
        while _patched:
            owner, name, original = _patched.pop()
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _connector = None


def finish(*, audit: bool | None = None, error: str | None = None) -> dict[str, int]:
    """End this process's journals: audit the store, then ``engine_idle`` (or a crash).

    Workers close first and the scheduler last, so the merged journal ends
    with the scheduler's ``engine_idle``. Returns the audit's counts.
    ``audit`` defaults to "unless ``error``": after a crash the store may be
    gone. A caller that knows it is reachable (a watchdog ending a stalled
    engine) passes ``audit=True`` and the stored keys are still read back.
    """
    counts = {"verified": 0, "poisoned": 0, "missing": 0}
    read_back = (error is None) if audit is None else audit
    with _lock:
        # An engine that goes on (a watchdog called this) is no longer
        # observed: a journal opened now would start mid-request.
        _state["ended"] = True
        for rank in sorted(workers):
            observer = workers.pop(rank)
            if read_back and not failures:
                for name, value in (_observe(observer.audit) or {}).items():
                    counts[name] += value
            _observe(observer.close)  # finish() never raises into its caller
        if error is None and failures:
            error = f"kvstate observer failed: {failures[0]}"
        while schedulers:
            _observe(functools.partial(schedulers.pop().close, error=error))
        _journals.new_fallback_run()
    return counts


def _close_at_exit() -> None:
    """A process that exits without :func:`finish` ends its journals where they are.

    No ``engine_idle`` is written: nobody said the engine was idle, so replay
    reports the journals ``UNFINISHED`` rather than clean.
    """
    with _lock:
        for rank in sorted(workers):
            workers.pop(rank).close()
        while schedulers:
            schedulers.pop().recorder.close()


# -- where observers come from ---------------------------------------------------------


def _scheduler_observer(sched: Any) -> SchedulerObserver | None:
    """The observer of one connector's scheduler, made on first use.

    None once :func:`finish` ended this process's journals (until the next
    :func:`install`: an engine still running after finish is no longer
    observed, and must not start a journal mid-request), and None for good
    if its journal could not be opened: an error of ours never reaches vLLM.
    """
    observer = sched.__dict__.get("_kvstate_observer")
    if observer is None and _connector is not None and not _state["ended"]:
        with _lock:
            observer = sched.__dict__.get("_kvstate_observer")
            if observer is None and not _state["ended"]:
                made: SchedulerObserver | None = _observe(lambda: _new_scheduler_observer(sched))
                # False: tried and failed, not tried again on every call
                observer = made if made is not None else False
                sched.__dict__["_kvstate_observer"] = observer
                if made is not None:
                    schedulers.append(made)
    if not observer or observer.closed:
        return None  # never made, or its journal was ended by finish()
    return observer


def _new_scheduler_observer(sched: Any) -> SchedulerObserver:
    config = sched.__dict__.get("_kvstate_config")
    world = getattr(sched, "_num_workers", None) or _world_size(config)
    connector = _installed()
    recorder = _journals.open_journal(
        _journals.journal_dir(config),
        "scheduler",
        block_size=sched._block_size,
        world_size=world,
        engine=f"vllm {connector.version} ({connector.flavor})",
        run=_journals.run_name(config),
    )
    return SchedulerObserver(
        recorder,
        block_size=sched._block_size,
        world_size=world,
        numbering=connector.flavor == "req-counters",
    )


def _worker_observer(thread: Any) -> WorkerObserver | None:
    """The observer of one rank of this process, made on first use (None as
    for :func:`_scheduler_observer`)."""
    rank = int(getattr(thread, "tp_rank", 0))
    observer = workers.get(rank)
    if observer is None and _connector is not None and not _state["ended"]:
        with _lock:
            observer = workers.get(rank)
            if observer is None and not _state["ended"] and rank not in _unobservable:
                observer = _observe(lambda: _new_worker_observer(thread, rank))
                if observer is None:
                    _unobservable.add(rank)
                else:
                    workers[rank] = observer
    return observer


def _new_worker_observer(thread: Any, rank: int) -> WorkerObserver:
    config = _worker_config.get("config")
    connector = _installed()
    recorder = _journals.open_journal(
        _journals.journal_dir(config),
        f"worker-{rank}",
        block_size=thread.block_size,
        world_size=_world_size(config),
        engine=f"vllm {connector.version} ({connector.flavor})",
        run=_journals.run_name(config),
    )
    return WorkerObserver(recorder, rank=rank, fingerprint=bool(_settings["fingerprint"]))


def _installed() -> Connector:
    if _connector is None:  # uninstall() raced the first call
        raise RuntimeError("kvstate.vllm is not installed")
    return _connector


def _world_size(config: Any) -> int:
    parallel = getattr(config, "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1)


# -- the patches ------------------------------------------------------------------------


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__.get(name)
    inherited = getattr(owner, name)
    wrapper = make(inherited)
    functools.update_wrapper(wrapper, inherited)
    _patched.append((owner, name, original))
    setattr(owner, name, wrapper)


def _patch_all(c: Connector) -> None:
    conn = c.cls("connector", "MooncakeStoreConnector")
    sched = c.cls("scheduler", "MooncakeStoreScheduler")
    worker = c.cls("worker", "MooncakeStoreWorker")
    send = c.cls("worker", "KVCacheStoreSendingThread")
    recv = c.cls("worker", "KVCacheStoreRecvingThread")
    legacy = c.flavor == "req-counters"

    def sched_init(original: Any) -> Any:
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            self.__dict__["_kvstate_config"] = vllm_config
            original(self, vllm_config, *args, **kwargs)

        return __init__

    def build(original: Any) -> Any:
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            observer = _scheduler_observer(self)
            if observer is None:
                return original(self, scheduler_output)
            before = _observe(lambda: observer.before_build(self))
            meta = original(self, scheduler_output)
            if before is not None:
                _observe(lambda: observer.after_build(self, scheduler_output, meta, before))
            return meta

        return build_connector_meta

    def finished(original: Any) -> Any:
        def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
            result = original(self, request, block_ids)
            inner = getattr(self, "connector_scheduler", None)
            observer = _scheduler_observer(inner) if inner is not None else None
            if observer is not None:
                _observe(lambda: observer.request_finished(request, hold=bool(result[0])))
            return result

        return request_finished_all_groups

    def conn_output(original: Any) -> Any:
        def update_connector_output(self: Any, connector_output: Any) -> Any:
            inner = getattr(self, "connector_scheduler", None)
            observer = _scheduler_observer(inner) if inner is not None else None
            result = original(self, connector_output)
            if observer is not None:
                if legacy:
                    _observe(lambda: observer.finished_sending(connector_output.finished_sending))
                _observe(observer.commit)
            return result

        return update_connector_output

    def sched_output(original: Any) -> Any:
        def update_connector_output(self: Any, connector_output: Any) -> Any:
            observer = _scheduler_observer(self)
            meta = connector_output.kv_connector_worker_meta
            completed = dict(getattr(meta, "completed_saves", None) or {})
            if observer is None or not completed:
                return original(self, connector_output)  # most steps: nothing reported
            pinned = self._pinned_saves
            before = {job: list(pinned[job][0]) for job in completed if job in pinned}
            result = original(self, connector_output)
            released = {job: ids for job, ids in before.items() if job not in pinned}
            _observe(lambda: observer.completions(completed, released))
            return result

        return update_connector_output

    def worker_init(original: Any) -> Any:
        def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
            _worker_config["config"] = vllm_config
            original(self, vllm_config, *args, **kwargs)

        return __init__

    def get_finished(original: Any) -> Any:
        def get_finished(self: Any, finished_req_ids: Any, meta: Any) -> Any:
            thread = getattr(self, "kv_send_thread", None)
            observer = _worker_observer(thread) if thread is not None else None
            if observer is None:
                return original(self, finished_req_ids, meta)
            _observe(lambda: observer.before_step(meta))
            try:
                return original(self, finished_req_ids, meta)
            finally:
                _observe(observer.after_step)

        return get_finished

    def send_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            observer = _worker_observer(self)
            if observer is not None:
                observer.store = self.store
                self.store = _ObservedStore(self.store, observer)

        return __init__

    def add_request(original: Any) -> Any:
        def add_request(self: Any, request: Any) -> None:
            observer = _worker_observer(self)
            if observer is not None:
                _observe(lambda: observer.received(self, request))
            original(self, request)

        return add_request

    def handle(original: Any) -> Any:
        def _handle_request(self: Any, req_meta: Any) -> Any:
            observer = _worker_observer(self)
            if observer is None:
                return original(self, req_meta)
            if legacy:
                live = req_meta.req_id in self.stored_requests
            else:
                live = self.is_live_store_job(req_meta)
            pressure = live and self._should_skip_request(req_meta.req_id)
            reason: SkipReason = "stale" if not live else "pressure" if pressure else "empty"
            run = _observe(lambda: observer.begin_job(req_meta, reason))
            try:
                return original(self, req_meta)
            finally:
                if run is not None:
                    _observe(lambda: observer.end_job(run))

        return _handle_request

    def record_saved(original: Any) -> Any:
        def _record_saved(self: Any, first: Any, token_len: int) -> None:
            req = first if isinstance(first, str) else first.req_id
            original(self, first, token_len)
            observer = _worker_observer(self)
            if observer is not None and self._saved_offset.get(req) == token_len:
                _observe(lambda: observer.offset_saved(req, token_len))

        return _record_saved

    def mark_skipped(original: Any) -> Any:
        def _mark_request_skipped_for_pressure(self: Any, first: Any) -> Any:
            req = first if isinstance(first, str) else first.req_id
            result = original(self, first)
            observer = _worker_observer(self)
            if observer is not None and req in self._skip_store_requests:
                _observe(lambda: observer.marked_skipped(req))
            return result

        return _mark_request_skipped_for_pressure

    def kv_events(original: Any) -> Any:
        def update_kv_event(self: Any, events: Any) -> Any:
            observer = _worker_observer(self)
            if observer is not None:
                _observe(lambda: observer.kv_events(events))
            return original(self, events)

        return update_kv_event

    def retry_tokens(original: Any) -> Any:
        def _update_retry_token_ids(self: Any, req_meta: Any, *args: Any, **kwargs: Any) -> Any:
            req = req_meta.req_id
            before = self._retry_token_ids.get(req)
            result = original(self, req_meta, *args, **kwargs)
            after = self._retry_token_ids.get(req)
            observer = _worker_observer(self)
            if observer is not None and after is not before:
                _observe(lambda: observer.retry_tokens(req, after))
            return result

        return _update_retry_token_ids

    def dropped(original: Any) -> Any:
        def delete_finished_stored_request(self: Any, req_id: str) -> None:
            had = req_id in self.stored_requests
            original(self, req_id)
            observer = _worker_observer(self)
            if observer is not None and had:
                _observe(lambda: observer.ledger_entry_dropped(req_id))

        return delete_finished_stored_request

    def recv_init(original: Any) -> Any:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            observer = _worker_observer(self)
            if observer is not None:
                self.store = _ObservedStore(self.store, observer)

        return __init__

    def recv_handle(original: Any) -> Any:
        def _handle_request(self: Any, req_meta: Any) -> Any:
            observer = _worker_observer(self)
            if observer is not None:
                observer.current.load = req_meta
            try:
                return original(self, req_meta)
            finally:
                if observer is not None:
                    observer.current.load = None

        return _handle_request

    _patch(sched, "__init__", sched_init)
    _patch(sched, "build_connector_meta", build)
    _patch(conn, "request_finished_all_groups", finished)
    _patch(conn, "update_connector_output", conn_output)
    if not legacy:
        _patch(sched, "update_connector_output", sched_output)
    _patch(worker, "__init__", worker_init)
    _patch(worker, "get_finished", get_finished)
    _patch(send, "__init__", send_init)
    _patch(send, "add_request", add_request)
    _patch(send, "_handle_request", handle)
    _patch(send, "_record_saved", record_saved)
    _patch(send, "_mark_request_skipped_for_pressure", mark_skipped)
    _patch(send, "delete_finished_stored_request", dropped)
    _patch(send, "update_kv_event", kv_events)
    if hasattr(send, "_update_retry_token_ids"):  # KV-event retries, after #52372
        _patch(send, "_update_retry_token_ids", retry_tokens)
    _patch(recv, "__init__", recv_init)
    _patch(recv, "_handle_request", recv_handle)


class _ObservedStore:
    """The thread's store handle, with the calls that move KV observed."""

    def __init__(self, store: Any, observer: WorkerObserver) -> None:
        self._store = store
        self._observer = observer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_is_exist(self, keys: list[str]) -> Any:
        states = self._store.batch_is_exist(keys)
        if getattr(self._observer.current, "job", None) is not None:
            _observe(lambda: self._observer.exist_checked(states))
        return states

    def batch_put_from_multi_buffers(
        self, keys: list[str], addrs: Any, sizes: Any, *rest: Any
    ) -> Any:
        pre = _observe(lambda: self._observer.before_put(keys, addrs, sizes))
        try:
            result = self._store.batch_put_from_multi_buffers(keys, addrs, sizes, *rest)
        except BaseException as exc:
            error = exc
            if pre is not None:
                _observe(lambda: self._observer.after_put(pre, None, error))
            raise
        if pre is not None:
            _observe(lambda: self._observer.after_put(pre, result, None))
        return result

    def batch_get_into_multi_buffers(
        self, keys: list[str], addrs: Any, sizes: Any, *rest: Any
    ) -> Any:
        result = self._store.batch_get_into_multi_buffers(keys, addrs, sizes, *rest)
        meta = getattr(self._observer.current, "load", None)
        if meta is not None:
            _observe(lambda: self._observer.loaded(meta, keys, addrs, sizes, result))
        return result
