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

from kvstate import build
from kvstate.errors import RefusedValueError
from kvstate.vllm import _journals
from kvstate.vllm._compat import Connector
from kvstate.vllm._lifecycle import LifecycleObserver
from kvstate.vllm._patches import Patches
from kvstate.vllm._stand_down import StandDown, stand_down

_log = logging.getLogger("kvstate.vllm")


class ObservedProcess:
    """The observation state of one process (see :mod:`kvstate.vllm._install`).

    It knows no connector: each adapter (:mod:`kvstate.vllm.registry`) makes
    its observers through :meth:`of` (one per vLLM object) or :meth:`keyed`
    (one per key of its own, a rank), and :meth:`finish` ends them all.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: the installed vLLM and the observed store connector's shape, set by install()
        self.connector: Connector | None = None
        self.patches = Patches()
        self.fingerprint = True
        #: one store job in this many is fingerprinted (install(fingerprint_every=))
        self.fingerprint_every: int | None = None
        #: the adapters install() patched, and the connector classes they claim
        self.adapters: list[Any] = []
        self.claimed: tuple[type, ...] = ()
        #: every observer of this process, in the order made; closed by :meth:`finish`
        self.observers: list[Any] = []
        #: observers an adapter keeps by a key of its own (False: could not be made)
        self.by_key: dict[Any, Any] = {}
        #: errors inside the observer; a journal they touched is never reported clean
        self.failures: list[str] = []
        #: why an observer stood down before its journal opened (nothing of it
        #: was journaled, so no other journal of the process is touched)
        self.stood_down: list[str] = []
        #: finish() ended this process's journals; install() starts anew
        self.ended = False

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

    def of(self, obj: Any, make: Callable[[Any], Any]) -> Any:
        """The observer of one vLLM object (a connector's scheduler, a worker),
        made on first use by ``make(obj)`` and kept on the object.

        None while not observing, and None for good if it could not be made
        (its journal could not be opened): an error of ours never reaches vLLM.
        """
        state = obj.__dict__

        def put(observer: Any) -> None:
            state["_kvstate_observer"] = observer

        return self._made(lambda: state.get("_kvstate_observer"), put, make, obj)

    def keyed(self, key: Any, make: Callable[..., Any], *args: Any) -> Any:
        """The observer an adapter keeps under ``key`` (a rank), made on first
        use by ``make(*args)``; None as for :meth:`of`."""
        by_key = self.by_key

        def put(observer: Any) -> None:
            by_key[key] = observer

        return self._made(lambda: by_key.get(key), put, make, *args)

    def _made(
        self,
        get: Callable[[], Any],
        put: Callable[[Any], None],
        make: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """The one lock-guarded factory behind :meth:`of` and :meth:`keyed`."""
        observer = get()
        if observer is None and self._observing():
            with self.lock:  # two threads of one object: one observer, one journal
                observer = get()
                if observer is None and self._observing():
                    made = self.observe(make, *args)
                    # False: tried and failed, not tried again on every call
                    observer = made if made is not None else False
                    put(observer)
                    if made is not None:
                        self.observers.append(made)
        if not observer or observer.closed:
            return None  # never made, stood down, or ended (finish(), or a fork)
        return observer

    def open(
        self,
        config: Any,
        role: str,
        block_size: int,
        world_size: int,
        protocol: str | None = None,
        *,
        family: str | None = None,
    ) -> Any:
        """A new journal for ``role`` of this process (see :func:`_journals.open_journal`);
        ``family`` names a connector class observed by the generic adapter."""
        connector = self._connector()
        return _journals.open_journal(
            _journals.journal_dir(config),
            role,
            block_size=block_size,
            world_size=world_size,
            engine=f"vllm {connector.version} ({family or connector.flavor})",
            run=_journals.run_name(config),
            protocol=protocol,
            family=family,
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
            observers = list(self.observers)
        return sum(len(getattr(o, "unreported", ())) for o in observers)

    def _ending(self) -> tuple[list[Any], list[Any]]:
        """The observers to end: workers (by rank) first, then schedulers,
        so the merged journal ends with a scheduler's ``engine_idle``."""
        workers = [o for o in self.observers if not isinstance(o, LifecycleObserver)]
        schedulers = [o for o in self.observers if isinstance(o, LifecycleObserver)]
        workers.sort(key=lambda o: getattr(o, "rank", 0))
        self.observers = []
        self.by_key.clear()
        return workers, schedulers

    def finish(self, *, audit: bool | None, error: str | None) -> dict[str, int]:
        """See :func:`kvstate.vllm.finish`."""
        counts = {"verified": 0, "poisoned": 0, "missing": 0}
        read_back = (error is None) if audit is None else audit
        with self.lock:
            # An engine that goes on (a watchdog called this) is no longer
            # observed: a journal opened now would start mid-request.
            self.ended = True
            workers, schedulers = self._ending()
            for observer in workers:
                # a store's observer reads back what its rank wrote
                reads = getattr(observer, "read_back", None)
                if reads is not None and read_back and not self.failures and not observer.closed:
                    for name, value in (self.observe(reads) or {}).items():
                        counts[name] += value
                self.observe(observer.close)  # finish() never raises into its caller
            if error is None and self.failures:
                error = f"kvstate observer failed: {self.failures[0]}"
            for observer in schedulers:
                self.observe(observer.close, error=error)
            _journals.new_fallback_run()
        return counts

    def forked(self) -> None:
        """In a child forked from this process: none of the parent's journals.

        The child's copies of the parent's observers would write into the
        parent's journals through the parent's writer processes (two
        processes appending to one journal). They are dropped unclosed (the
        parent still owns and ends them), and vLLM objects that carry one
        are not observed in the child; objects the child makes get journals
        of its own, named by its pid.
        """
        self.lock = threading.RLock()  # another thread may have held it at the fork
        for observer in self.observers:
            observer.closed = True  # the child's copy: the parent's object is untouched
        self.observers = []
        self.by_key = {}

    def close_at_exit(self) -> None:
        """A process that exits without finish() ends its journals where they are.

        No ``engine_idle`` is written: nobody said the engine was idle, so
        replay reports the journals ``UNFINISHED`` rather than clean.
        """
        with self.lock:
            workers, schedulers = self._ending()
            for observer in workers:
                observer.close()
            for observer in schedulers:
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
    observer.recorder.record(build.engine_crashed(error=error), observer.step)
    observer.recorder.close()


def _world_size(config: Any) -> int:
    parallel = getattr(config, "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1)
