"""This process's observers: made on first use, ended together, never raising into vLLM.

What every observed connector shares: the observers of this process (a
scheduler's per connector object, a worker's per rank), the errors they
met, the one :meth:`ObservedProcess.observe` every hook runs its
observation through, and :meth:`ObservedProcess.finish`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvstate import events as ev
from kvstate.errors import RefusedValueError
from kvstate.vllm import _journals
from kvstate.vllm._compat import Connector
from kvstate.vllm._patches import Patches
from kvstate.vllm._scheduler import SchedulerObserver
from kvstate.vllm._stand_down import StandDown, stand_down
from kvstate.vllm._worker import WorkerObserver

_log = logging.getLogger("kvstate.vllm")


class ObservedProcess:
    """The observation state of one process (see :mod:`kvstate.vllm._install`)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: the observed connector, set by install()
        self.connector: Connector | None = None
        self.patches = Patches()
        self.fingerprint = True
        #: every observer of this process, closed by :meth:`finish`
        self.schedulers: list[SchedulerObserver] = []
        self.workers: dict[int, WorkerObserver] = {}
        #: the ranks of other connectors (vLLM's OffloadingConnector), per worker object
        self.ranks: list[Any] = []
        #: the worker's vLLM config, seen by ``MooncakeStoreWorker.__init__``
        #: before its threads exist (they open the rank's journal and need
        #: its world size)
        self.worker_config: Any = None
        #: errors inside the observer; a journal they touched is never reported clean
        self.failures: list[str] = []
        #: why an observer stood down before its journal opened (nothing of it
        #: was journaled, so no other journal of the process is touched)
        self.stood_down: list[str] = []
        #: finish() ended this process's journals; install() starts anew
        self.ended = False
        #: ranks whose journal could not be opened: not tried again on every call
        self.unobservable: set[int] = set()

    def observe(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, one observation; an observer error never reaches vLLM.

        vLLM's own work goes on. Where ``call`` is a method of one observer,
        what went wrong ends that observer's journal alone, so one test's
        hand-built object in a session of hundreds ends one journal, not
        every one:

        - :class:`StandDown`, or values the contract refuses (a connector
          unit test's ``MagicMock`` block size): the observer stands down
          (``observer_stood_down``; replay says UNFINISHED with the reason);
        - any other error, ours: the journal ends with ``engine_crashed``
          naming it, and replay reports ``CRASH``, never clean.

        An error outside any observer (making one, opening its journal) is
        the process's: :meth:`finish` then ends every scheduler journal with
        ``engine_crashed``.
        """
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            self.failed(call, exc)
            return None

    def failed(self, call: Callable[..., Any], exc: Exception) -> None:
        """What :meth:`observe` does when ``call`` raised ``exc``.

        The hooks that run on every engine step call their observer inside
        a ``try`` of their own and hand what it raised here: the same
        outcome, without :meth:`observe`'s frame on the engine's thread.
        """
        reason = f"{type(exc).__name__}: {exc}"
        owner = _owner(call)
        if isinstance(exc, (StandDown, RefusedValueError)):
            if owner is None:
                # Nothing was journaled (its journal never opened): nothing to end.
                self.stood_down.append(reason)
                _log.warning("kvstate observer stands down: %s", reason)
            else:
                _log.warning("kvstate observer stands down for one connector: %s", reason)
                self._end(owner, lambda: stand_down(owner, reason))
            return
        _log.error("kvstate observer failed; its journal ends with engine_crashed", exc_info=exc)
        if owner is None:
            self.failures.append(reason)
        else:
            self._end(owner, lambda: _crashed(owner, f"kvstate observer failed: {reason}"))

    def _end(self, owner: Any, end: Callable[[], None]) -> None:
        # Ending a journal must not raise into vLLM either; if it does, the
        # process's journals end with engine_crashed at finish().
        try:
            end()
        except Exception as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            _log.exception("kvstate could not end a journal")

    def _observing(self) -> bool:
        # False after finish() until the next install(): an engine still
        # running after finish is no longer observed, and must not start a
        # journal mid-request.
        return self.connector is not None and not self.ended

    # -- where observers come from -----------------------------------------------------

    def scheduler(
        self, sched: Any, make: Callable[[Any], SchedulerObserver] | None = None
    ) -> SchedulerObserver | None:
        """The observer of one connector's scheduler, made on first use
        (by ``make``; the MooncakeStoreScheduler's by default).

        None while not observing, and None for good if its journal could not
        be opened: an error of ours never reaches vLLM.
        """
        observer = sched.__dict__.get("_kvstate_observer")
        if observer is None and self._observing():
            with self.lock:
                observer = sched.__dict__.get("_kvstate_observer")
                if observer is None and self._observing():
                    made: SchedulerObserver | None = self.observe(
                        make or self._new_scheduler, sched
                    )
                    # False: tried and failed, not tried again on every call
                    observer = made if made is not None else False
                    sched.__dict__["_kvstate_observer"] = observer
                    if made is not None:
                        self.schedulers.append(made)
        if not observer or observer.closed:
            return None  # never made, or its journal was ended by finish()
        return observer

    def worker(self, thread: Any) -> WorkerObserver | None:
        """The observer of one rank of this process, made on first use (None as
        for :meth:`scheduler`)."""
        rank = int(getattr(thread, "tp_rank", 0))
        observer = self.workers.get(rank)
        if observer is None and self._observing():
            with self.lock:
                observer = self.workers.get(rank)
                if observer is None and self._observing() and rank not in self.unobservable:
                    observer = self.observe(self._new_worker, thread, rank)
                    if observer is None:
                        self.unobservable.add(rank)
                    else:
                        self.workers[rank] = observer
        if observer is None or observer.closed:
            return None  # never made, or stood down
        return observer

    def rank(self, worker: Any, make: Callable[[Any], Any]) -> Any:
        """The observer of one worker object of another connector (one per rank),
        made on first use by ``make``; None as for :meth:`scheduler`."""
        observer = worker.__dict__.get("_kvstate_observer")
        if observer is None and self._observing():
            with self.lock:
                observer = worker.__dict__.get("_kvstate_observer")
                if observer is None and self._observing():
                    made = self.observe(make, worker)
                    observer = made if made is not None else False
                    worker.__dict__["_kvstate_observer"] = observer
                    if made is not None:
                        self.ranks.append(made)
        if not observer or observer.closed or observer not in self.ranks:
            return None  # never made, stood down, or ended by finish()
        return observer

    def _new_scheduler(self, sched: Any) -> SchedulerObserver:
        config = sched.__dict__.get("_kvstate_config")
        world = getattr(sched, "_num_workers", None) or _world_size(config)
        recorder = self.open(config, "scheduler", sched._block_size, world)
        return SchedulerObserver(
            recorder,
            block_size=sched._block_size,
            world_size=world,
            numbering=self._connector().flavor == "req-counters",
        )

    def _new_worker(self, thread: Any, rank: int) -> WorkerObserver:
        config = self.worker_config
        recorder = self.open(config, f"worker-{rank}", thread.block_size, _world_size(config))
        memory = thread.__dict__.get("_kvstate_memory")  # its KV tensors (WorkerHooks)
        return WorkerObserver(recorder, rank=rank, fingerprint=self.fingerprint, memory=memory)

    def open(
        self,
        config: Any,
        role: str,
        block_size: int,
        world_size: int,
        protocol: str | None = None,
    ) -> Any:
        """A new journal for ``role`` of this process (see :func:`_journals.open_journal`)."""
        connector = self._connector()
        return _journals.open_journal(
            _journals.journal_dir(config),
            role,
            block_size=block_size,
            world_size=world_size,
            engine=f"vllm {connector.version} ({connector.flavor})",
            run=_journals.run_name(config),
            protocol=protocol,
            rotation=_journals.rotation_of(config),
            metrics=_journals.metrics_of(config),
        )

    def _connector(self) -> Connector:
        if self.connector is None:  # uninstall() raced the first call
            raise RuntimeError("kvstate.vllm is not installed")
        return self.connector

    # -- the end ----------------------------------------------------------------------

    def outstanding(self) -> int:
        """Jobs this process's ranks received and have not reported yet."""
        with self.lock:
            workers = list(self.workers.values())
            ranks = list(self.ranks)
        return sum(len(w.unreported) for w in [*workers, *ranks])

    def finish(self, *, audit: bool | None, error: str | None) -> dict[str, int]:
        """See :func:`kvstate.vllm.finish`."""
        counts = {"verified": 0, "poisoned": 0, "missing": 0}
        read_back = (error is None) if audit is None else audit
        with self.lock:
            # An engine that goes on (a watchdog called this) is no longer
            # observed: a journal opened now would start mid-request.
            self.ended = True
            for rank in sorted(self.workers):
                observer = self.workers.pop(rank)
                if read_back and not self.failures and not observer.closed:
                    for name, value in (self.observe(observer.audit) or {}).items():
                        counts[name] += value
                self.observe(observer.close)  # finish() never raises into its caller
            while self.ranks:
                self.observe(self.ranks.pop().close)
            if error is None and self.failures:
                error = f"kvstate observer failed: {self.failures[0]}"
            while self.schedulers:
                self.observe(self.schedulers.pop().close, error=error)
            _journals.new_fallback_run()
        return counts

    def close_at_exit(self) -> None:
        """A process that exits without finish() ends its journals where they are.

        No ``engine_idle`` is written: nobody said the engine was idle, so
        replay reports the journals ``UNFINISHED`` rather than clean.
        """
        with self.lock:
            for rank in sorted(self.workers):
                self.workers.pop(rank).close()
            while self.ranks:
                self.ranks.pop().close()
            while self.schedulers:
                observer = self.schedulers.pop()
                if not observer.closed:
                    observer.recorder.close()


def _owner(call: Callable[..., Any]) -> Any:
    """The observer whose method ``call`` is, or None (a hook's own code, a maker)."""
    owner = getattr(call, "__self__", None)
    return owner if hasattr(owner, "recorder") and hasattr(owner, "closed") else None


def _crashed(observer: Any, error: str) -> None:
    """End ``observer``'s journal with ``engine_crashed``: what it journaled is incomplete."""
    if observer.closed:
        return
    observer.closed = True
    observer.recorder.record(ev.EngineCrashed(error=error), observer.step)
    observer.recorder.close()


def _world_size(config: Any) -> int:
    parallel = getattr(config, "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1)
