"""One job on one rank, from dequeue to report: :class:`JobRun`.

:meth:`WorkerLedger.run <kvstate.worker.WorkerLedger.run>` makes one per
dequeued job. Its single ``finally`` reports the job exactly once on every
path out (success, skip, put failure, or an exception anywhere, the
liveness check included), and its effects on request state are refused
for a job that is no longer live.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from . import build
from . import events as ev
from .errors import UnknownJobError
from .jobspec import JobSpec
from .policy import WorkerPolicy


class Effects(Protocol):
    """A request's state on a rank that an effect changes."""

    offset: int
    retry: tuple[int, int] | None


class Rank(Protocol):
    """What a job run needs of its rank: the interface
    :class:`kvstate.worker.WorkerLedger` gives it (this module imports no ledger)."""

    rank: int
    step: int
    policy: WorkerPolicy | None
    lock: threading.RLock

    def spec(self, job: int) -> JobSpec | None: ...
    def is_live(self, job: int) -> bool: ...
    def effect_state(self, job: int) -> Effects | None: ...
    def emit(self, event: ev.Event, *, quiet: bool = False, suspect: bool = False) -> None: ...
    def report(self, job: int, *, quiet: bool = False) -> None: ...
    def flush_before_raising(self) -> None: ...


class _Skip(Exception):
    """Raised by :meth:`JobRun.skip` to leave the job body; swallowed by ``run``."""


class Run:
    """One job from dequeue to report, as a context manager.

    :meth:`__exit__`'s ``finally`` is the one exit every path passes, the
    liveness check included (a failing check in :meth:`__enter__` goes
    through it too): upstream leaked a job's pins when an exception hit
    between dequeue and the ``try`` (the #52372 review moved the ``try`` to
    the top for that reason). A class, not ``contextlib.contextmanager``:
    a generator per job on every rank was a third of what a job cost here.
    """

    __slots__ = ("run",)

    def __init__(self, worker: Rank, job: int) -> None:
        self.run = JobRun(worker, job)

    def __enter__(self) -> JobRun:
        try:
            self.run._start()
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self.run

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> bool:
        run = self.run
        worker, job = run.worker, run.job
        unwinding = kind is not None and not issubclass(kind, _Skip)
        try:
            if unwinding and not run._outcome:
                with worker.lock:
                    worker.emit(
                        build.job_skipped(job=job, rank=worker.rank, reason="error"), quiet=True
                    )
            return kind is not None and not unwinding  # a skip leaves the body quietly
        finally:
            # A job that is never reported keeps its pins for the rest of the run.
            worker.report(job, quiet=unwinding)
            if unwinding:
                worker.flush_before_raising()


class JobRun:
    """One job on one rank, from dequeue to report (made by ``WorkerLedger.run``).

    Entering checks liveness: a live job records ``job_started``; a stale one
    records ``job_skipped`` (``stale``) and the body must do nothing (check
    :attr:`live`). Leaving always records ``job_reported``, exactly once,
    whatever happened inside, the liveness check included; an exception is
    recorded as a skip with reason ``error`` (unless a put outcome was
    already recorded) and then propagates. A job that was never registered
    on this rank is skipped with reason ``error`` and flagged
    ``UNLEDGERED_JOB``, as replay flags it.

    ::

        with worker.run(job) as run:
            if not run.live:
                return
            run.dma_started()
            ...
            run.put_done(stored=2, existed=0)
            run.save_offset(32)
    """

    def __init__(self, worker: Rank, job: int) -> None:
        self.worker = worker
        self.job = job
        self.live = False
        self._outcome = False  # a skip or a put result has been recorded

    def _start(self) -> None:
        w = self.worker
        with w.lock:
            if w.spec(self.job) is None:
                self._outcome = True
                # UNLEDGERED_JOB: dequeued without being registered here
                w.emit(build.job_skipped(job=self.job, rank=w.rank, reason="error"), suspect=True)
                return
            # the dequeue check: is the job's id among its request's live jobs?
            self.live = w.is_live(self.job)
            if w.policy is not None:
                self.live = w.policy.live_at_start(w, self.job, self.live)
            if self.live:
                w.emit(build.job_started(job=self.job, rank=w.rank))
            else:
                self._outcome = True
                w.emit(build.job_skipped(job=self.job, rank=w.rank, reason="stale"))

    def _record(self, event: ev.Event, suspect: bool = False) -> None:
        with self.worker.lock:
            self.worker.emit(event, suspect=suspect)

    def _effect(self, event: ev.Event, offset: int | None = None, retry: object = False) -> bool:
        """Record an effect if the job may make it, and apply it to the rank's state:
        ``offset`` a saved offset, ``retry`` the retry state (False: unchanged)."""
        # Liveness is re-checked at the moment of the effect: a preemption
        # notice may have arrived on the other thread since the job started.
        w = self.worker
        with w.lock:
            live = w.is_live(self.job)
            allowed = live
            if w.policy is not None:
                allowed = w.policy.effect_allowed(w, self.job, allowed)
            if not allowed:
                return False
            state = w.effect_state(self.job)
            # STALE_GENERATION (a policy let a job that is not live write) or
            # OFFSET_REWOUND (below what this rank saved for the request)
            rewound = offset is not None and state is not None and offset < state.offset
            w.emit(event, suspect=not live or rewound)
            if state is not None:
                if offset is not None:
                    state.offset = offset
                if retry is not False:
                    state.retry = retry  # type: ignore[assignment]
            return True

    # -- the transfer ------------------------------------------------------------------

    def skip(self, reason: ev.SkipReason) -> None:
        """End the job without a store call (``pressure``, ``empty``, ...); leaves the body."""
        self._outcome = True
        self._record(build.job_skipped(job=self.job, rank=self.worker.rank, reason=reason))
        raise _Skip

    def dma_started(self) -> None:
        self._record(build.dma_started(job=self.job, rank=self.worker.rank))

    def dma_done(self, digest: str | int | None = None) -> None:
        self._record(build.dma_done(job=self.job, rank=self.worker.rank, digest=digest))

    def put_done(self, stored: int, existed: int) -> None:
        self._outcome = True
        self._record(
            build.put_done(job=self.job, rank=self.worker.rank, stored=stored, existed=existed)
        )

    def put_failed(self, error: str) -> None:
        self._outcome = True
        self._record(build.put_failed(job=self.job, rank=self.worker.rank, error=error))

    def kv_block_stored(self, key: str, parent: str | None) -> None:
        self._record(
            build.kv_block_stored(job=self.job, rank=self.worker.rank, key=key, parent=parent)
        )

    def publish_kv_events(self, stored: Sequence[str]) -> None:
        """One KV event per key this rank actually stored (in chain order).

        Parents come from the request's hash chain: when the store already
        had some keys (dedup) the first stored key is not a root, which a
        parent taken from store order would claim.
        """
        spec = self.worker.spec(self.job)
        if spec is None:
            raise UnknownJobError(
                self.job, "publish_kv_events", "was never registered on this rank"
            )
        # each stored key's parent from the request's hash chain, whatever was deduplicated
        position = {key: i for i, key in enumerate(spec.keys)}
        index = [position.get(k, 0) for k in stored]  # a key outside the chain: the fold flags it
        parents = [spec.keys[i - 1] if i else spec.parent for i in index]
        policy = self.worker.policy
        chained = parents
        if policy is not None:
            parents = policy.kv_event_parents(spec, stored, parents)
        for i, (key, parent) in enumerate(zip(stored, parents, strict=True)):
            # PARENT_CHAIN_BROKEN: a key outside the chain, or a parent a
            # policy took from elsewhere
            broken = key not in position or parent != chained[i]
            self._record(
                build.kv_block_stored(job=self.job, rank=self.worker.rank, key=key, parent=parent),
                suspect=broken,
            )

    # -- effects (refused for stale jobs) ------------------------------------------------

    @property
    def _req(self) -> str:
        spec = self.worker.spec(self.job)
        if spec is None:
            raise UnknownJobError(self.job, "JobRun effect", "was never registered on this rank")
        return spec.req

    def save_offset(self, offset: int) -> bool:
        """Advance this rank's resume offset for the request; False if the job is stale."""
        return self._effect(
            build.offset_saved(job=self.job, rank=self.worker.rank, req=self._req, offset=offset),
            offset=offset,
        )

    def mark_skipped(self) -> bool:
        """Mark the request skipped under pressure; False if the job is stale."""
        return self._effect(
            build.request_marked_skipped(job=self.job, rank=self.worker.rank, req=self._req)
        )

    def set_retry_tokens(self, start: int, count: int) -> bool:
        """Keep a token suffix for a KV-event retry; False if the job is stale."""
        return self._effect(
            build.retry_tokens_set(
                job=self.job, rank=self.worker.rank, req=self._req, start=start, count=count
            ),
            retry=(start, count),
        )

    def clear_retry_tokens(self) -> bool:
        """Drop the retry state; False if the job is stale."""
        return self._effect(
            build.retry_tokens_cleared(job=self.job, rank=self.worker.rank, req=self._req),
            retry=None,
        )
