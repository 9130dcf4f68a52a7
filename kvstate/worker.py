"""The worker-side ledger a connector embeds, one per rank.

The sending thread's bookkeeping from the fixed upstream connector, as an
API: register a job *before* queueing it, check liveness when it is dequeued,
and run it inside :meth:`WorkerLedger.run`, whose single ``finally`` reports
the job exactly once on every path out: success, skip, put failure or an
exception anywhere in the body. Effects on request state (resume offset,
pressure mark, retry tokens) are refused for a job that is no longer live, so
a stale job can never touch a reused request id.

All state is a :class:`~kvstate.rank.RankLedger` folded from this rank's own
records, the same fold replay uses. Like the reference ledger, a worker
ledger parks what has settled (a job reported here, a request with no live
or pending job) a while after it came, packed, and brings it back whole
when a call or record names it again. Parked state stays in memory, a few
hundred bytes a job, unless the ledger is given a
:class:`kvstate.spill.SpillArchive`: then an engine that runs for weeks keeps
in memory what is live, not every job it ever saved.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

import attrs

from . import events as ev
from ._parking import (
    PARK_AFTER,
    SWEEP_EVERY,
    pack_rank_job,
    pack_rank_request,
    sweep,
    unpack_rank_job,
    unpack_rank_request,
)
from .archive import Archive
from .errors import DuplicateJobError, UnknownJobError
from .rank import RankLedger
from .recorder import Recorder
from .violations import Violation, raise_for


def _strings(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(keys)


@attrs.frozen(slots=True)
class JobSpec:
    """What a rank knows about a job, from the scheduler's metadata."""

    job: int
    req: str
    gen: int
    keys: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    parent: str | None = None
    #: a worker does not see the scheduler's journal; chains omit the enqueue
    enqueued_seq: None = None


class _Skip(Exception):
    """Raised by :meth:`JobRun.skip` to leave the job body; swallowed by ``run``."""


class WorkerLedger:
    """Records and checks the transitions of one rank.

    Thread-safe: registration and preemption notices come from the worker's
    main thread while jobs run on the sending thread; one lock orders them,
    like the connector's ``done_task_lock``.

    ``archive``: where settled jobs and requests are parked, as for
    :class:`~kvstate.scheduler.SchedulerLedger` (in memory by default; a
    :class:`kvstate.spill.SpillArchive` keeps them on disk; the caller owns it).
    """

    def __init__(
        self,
        rank: int,
        recorder: Recorder,
        *,
        strict: bool = True,
        commit_steps: bool = False,
        park_after: int = PARK_AFTER,
        sweep_every: int = SWEEP_EVERY,
        archive: Archive | None = None,
    ) -> None:
        self.rank = rank
        self.recorder = recorder
        self.strict = strict
        #: a worker with a recorder of its own (its own process and journal)
        #: commits at each step, as the scheduler does; one sharing the
        #: scheduler's recorder leaves that to the scheduler's begin_step
        self.commit_steps = commit_steps
        self._specs: dict[int, JobSpec] = {}
        #: what this rank has folded; parked jobs and requests are not in it
        #: (see :meth:`spec` and the readers below, which bring them back)
        self.state = RankLedger(rank, self._specs, knows_all_jobs=False)
        self.violations: list[Violation] = []
        self.step = 0
        self._completed: dict[int, int] = {}
        self._lock = threading.RLock()
        #: settled jobs and requests, packed (see kvstate.archive); only ever
        #: used with the lock held, so a SpillArchive needs no lock of its own
        self.archive = archive if archive is not None else Archive()
        self.park_after = park_after
        self.sweep_every = sweep_every
        self._records = 0
        self._parked_jobs = 0
        #: jobs and requests in memory, with the record count when each came
        #: (registered, first seen, or brought back), oldest first (see _recall)
        self._arrived_jobs: OrderedDict[int, int] = OrderedDict()
        self._arrived_requests: OrderedDict[str, int] = OrderedDict()
        #: the generations this rank has seen of each request (parked with it)
        self._gens: dict[str, tuple[int, ...]] = {}

    def _emit(self, event: ev.Event, *, quiet: bool = False) -> None:
        """Record and fold one event; in strict mode raise on a breach unless ``quiet``.

        Called with the lock held: the record and its fold are one step.
        ``quiet`` is for records made while another exception is already
        unwinding: their violations are collected, the first error wins.
        """
        entry = self.recorder.record(event, self.step)
        self._records += 1
        job: int | None = getattr(event, "job", None)
        req: str | None = getattr(event, "req", None)
        self._recall(job, req)
        gen: int | None = getattr(event, "gen", None)  # preemption_seen, request_retired
        if req is not None and gen is not None:
            self._saw_gen(req, gen)
        found: list[Violation] = []
        self.state.apply(entry.seq, event, found)
        if self._records % self.sweep_every == 0:
            self._park_settled()
        if found:
            self.violations.extend(found)
            if self.strict and not quiet and any(not v.is_warning for v in found):
                self.recorder.flush_before_raising()
                raise_for(found)

    def begin_step(self, step: int) -> None:
        """The scheduler step whose metadata this rank is processing.

        With ``commit_steps`` the records of the previous step are committed
        first (durably: see :meth:`Recorder.commit`).
        """
        if self.commit_steps:
            self.recorder.commit()
        self.step = step

    # -- scheduler metadata ----------------------------------------------------------

    def register(self, spec: JobSpec) -> None:
        """Enter a job in the ledger. Call before putting it on the queue, so
        no job is ever dequeued unledgered."""
        with self._lock:
            self._recall(spec.job, spec.req)
            if spec.job in self._specs:
                self.recorder.flush_before_raising()
                raise DuplicateJobError(spec.job, self.rank)
            self._specs[spec.job] = spec
            self._arrived_jobs[spec.job] = self._records
            self._saw_gen(spec.req, spec.gen)
            self._emit(ev.JobReceived(job=spec.job, rank=self.rank))

    def preemption_seen(self, req: str, gen: int) -> None:
        """``(req, gen)`` was preempted or finished: its queued jobs turn stale at once."""
        with self._lock:
            self._emit(ev.PreemptionSeen(req=req, gen=gen, rank=self.rank))

    def is_live(self, job: int) -> bool:
        """Registered, of the newest generation of its request, not ended, not reported."""
        with self._lock:
            self._recall(job)
            return self.state.is_live(job)

    def retire(self, req: str, gen: int) -> bool:
        """Declare every save of ``(req, gen)`` done, if none is still outstanding here.

        Returns False (and records nothing) while a job of that incarnation
        has not been reported; the caller retries on a later step. For a
        generation that a newer one has superseded on this rank it returns
        True and records nothing: the id belongs to the newer generation now,
        and retiring the old one would be a stale effect on it.
        """
        with self._lock:
            self._recall(req=req)
            if self._superseded(req, gen):
                return True
            if self.state.pending_jobs(req, gen):
                return False
            self._emit(ev.RequestRetired(req=req, gen=gen, rank=self.rank))
            return True

    def _superseded(self, req: str, gen: int) -> bool:
        newest = self.newest_gen(req)
        return newest is not None and newest > gen

    # -- what a connector reads (functions of the folded state) ------------------------

    def newest_gen(self, req: str) -> int | None:
        """The newest generation of ``req`` this rank has seen, or None."""
        with self._lock:
            self._recall(req=req)
            state = self.state.requests.get(req)
            return None if state is None else state.gen

    def saved_offset(self, req: str, gen: int) -> int:
        """Tokens this rank has saved for ``(req, gen)``: where its next job resumes.

        0 when the rank's state for ``req`` belongs to another generation, or
        was dropped when the generation was preempted or finished.
        """
        with self._lock:
            self._recall(req=req)
            state = self.state.requests.get(req)
            return state.saved_offset if state is not None and state.gen == gen else 0

    def has_retry_tokens(self, req: str, gen: int) -> bool:
        """Whether this rank keeps a token suffix of ``(req, gen)`` for a KV-event retry."""
        with self._lock:
            self._recall(req=req)
            state = self.state.requests.get(req)
            return state is not None and state.gen == gen and state.retry_tokens is not None

    def spec(self, job: int) -> JobSpec | None:
        """The registered spec of ``job`` (brought back if parked), or None."""
        with self._lock:
            self._recall(job)
            return self._specs.get(job)

    @property
    def jobs_received(self) -> int:
        """How many jobs this rank has registered so far."""
        with self._lock:
            return len(self.state.jobs) + self._parked_jobs

    # -- parking settled state (see kvstate.archive) -------------------------------------

    def _recall(self, job: int | None = None, req: str | None = None) -> None:
        """Bring back ``job`` (and its request) and ``req`` if they were parked,
        before anything reads them; called with the lock held.

        On the hot path this is two dict lookups: what is in memory is not
        touched. A job or request is queued for the sweep when it first
        appears and when it comes back; being named again does not requeue it
        (settled means no longer expected: a reported job, a request with
        nothing live here), so a request that goes quiet for a while may be
        parked and brought back, never judged differently.
        """
        if job is not None:
            spec = self._specs.get(job)
            if spec is None:
                spec = self._unpark_job(job)
            if spec is not None and spec.req != req and spec.req not in self._gens:
                self._unpark_request(spec.req)
        if req is not None and req not in self._gens:
            self._unpark_request(req)

    def _saw_gen(self, req: str, gen: int) -> None:
        gens = self._gens.get(req)
        if gens is None:
            self._gens[req] = (gen,)
            self._arrived_requests[req] = self._records
        elif gen not in gens:
            self._gens[req] = (*gens, gen)

    def _park_settled(self) -> None:
        """Park what has settled and came (or came back) ``park_after`` records
        ago or more: a job this rank has reported; a request with no job live
        or pending here. Whatever has not settled is looked at again later."""
        horizon = self._records - self.park_after
        sweep(self._arrived_jobs, horizon, self._records, self._job_settled, self._park_job)
        sweep(self._arrived_requests, horizon, self._records, self._request_settled,
              self._park_request)  # fmt: skip

    def _job_settled(self, job: int) -> bool | None:
        rj = self.state.jobs.get(job)
        if rj is None or job not in self._specs:
            return None
        return rj.reported_seq is not None

    def _request_settled(self, req: str) -> bool | None:
        if req not in self._gens:
            return None
        state = self.state.requests.get(req)
        if state is not None and state.live_jobs:
            return False
        return not any(self.state.pending_jobs(req, gen) for gen in self._gens[req])

    def _park_job(self, job: int) -> None:
        spec = self._specs.pop(job)
        rj = self.state.jobs.pop(job)
        row = (spec.job, spec.req, spec.gen, spec.keys, spec.parent)
        self.archive.put(("job", job), pack_rank_job(row, rj))
        self._parked_jobs += 1

    def _unpark_job(self, job: int) -> JobSpec | None:
        blob = self.archive.take(("job", job))
        if blob is None:
            return None
        row, rj = unpack_rank_job(blob)
        spec = self._specs[job] = JobSpec(*row)
        self.state.jobs[job] = rj
        self._parked_jobs -= 1
        self._arrived_jobs[job] = self._records
        return spec

    def _park_request(self, req: str) -> None:
        gens = self._gens.pop(req)
        part = self.state.take_request(req, list(gens))
        self.archive.put(("request", req), pack_rank_request(gens, part))

    def _unpark_request(self, req: str) -> None:
        blob = self.archive.take(("request", req))
        if blob is None:
            return
        gens, part = unpack_rank_request(blob)
        self._gens[req] = gens
        self.state.put_request(req, part)
        self._arrived_requests[req] = self._records

    # -- running a job -----------------------------------------------------------------

    def run(self, job: int) -> contextlib.AbstractContextManager[JobRun]:
        """Context manager for one dequeued job; see :class:`JobRun`."""
        return _run(self, job)

    def _report(self, job: int, *, quiet: bool = False) -> None:
        with self._lock:
            self._completed[job] = self._completed.get(job, 0) + 1
            self._emit(ev.JobReported(job=job, rank=self.rank), quiet=quiet)
            self._after_report(job)

    # -- policy: the decisions the upstream fixes changed --------------------------------
    # kvstate.harness.legacy overrides these with the old behaviours, for the bug zoo.

    def _live_at_start(self, job: int) -> bool:
        """The dequeue check: is the job's id among its request's live jobs?"""
        return self.state.is_live(job)

    def _effect_allowed(self, job: int) -> bool:
        """Effects on request state only from a job that is live right now."""
        return self.state.is_live(job)

    def _kv_event_parents(self, spec: JobSpec, stored: Sequence[str]) -> list[str | None]:
        """Each stored key's parent from the request's hash chain, whatever was deduplicated."""
        position = {key: i for i, key in enumerate(spec.keys)}
        return [spec.keys[position[k] - 1] if position[k] else spec.parent for k in stored]

    def _after_report(self, job: int) -> None:
        """Nothing: retiring is the caller's explicit :meth:`retire`."""

    # -- completions -------------------------------------------------------------------

    def take_completed(self) -> dict[int, int]:
        """Completion counts since the last call (this rank's worker metadata)."""
        with self._lock:
            done, self._completed = self._completed, {}
            return done

    @staticmethod
    def aggregate(metas: Iterable[Mapping[int, int]]) -> dict[int, int]:
        """Sum per-job completion counts over ranks, as the engine's output aggregator does."""
        total: dict[int, int] = {}
        for meta in metas:
            for job, count in meta.items():
                total[job] = total.get(job, 0) + count
        return total


@contextlib.contextmanager
def _run(worker: WorkerLedger, job: int) -> Iterator[JobRun]:
    """One job from dequeue to report. The ``finally`` below is the one exit
    every path passes, the liveness check included: upstream leaked a job's
    pins when an exception hit between dequeue and the ``try`` (the #52372
    review moved the ``try`` to the top for that reason)."""
    run = JobRun(worker, job)
    unwinding = False
    try:
        run._start()
        yield run
    except _Skip:
        pass
    except BaseException:
        unwinding = True
        if not run._outcome:
            with worker._lock:
                worker._emit(ev.JobSkipped(job=job, rank=worker.rank, reason="error"), quiet=True)
        raise
    finally:
        # A job that is never reported keeps its pins for the rest of the run.
        worker._report(job, quiet=unwinding)
        if unwinding:
            worker.recorder.flush_before_raising()


class JobRun:
    """One job on one rank, from dequeue to report (made by :meth:`WorkerLedger.run`).

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

    def __init__(self, worker: WorkerLedger, job: int) -> None:
        self.worker = worker
        self.job = job
        self.live = False
        self._outcome = False  # a skip or a put result has been recorded

    def _start(self) -> None:
        w = self.worker
        with w._lock:
            if w.spec(self.job) is None:
                self._outcome = True
                w._emit(ev.JobSkipped(job=self.job, rank=w.rank, reason="error"))
                return
            self.live = w._live_at_start(self.job)
            if self.live:
                w._emit(ev.JobStarted(job=self.job, rank=w.rank))
            else:
                self._outcome = True
                w._emit(ev.JobSkipped(job=self.job, rank=w.rank, reason="stale"))

    def _record(self, event: ev.Event) -> None:
        with self.worker._lock:
            self.worker._emit(event)

    def _effect(self, event: ev.Event) -> bool:
        # Liveness is re-checked at the moment of the effect: a preemption
        # notice may have arrived on the other thread since the job started.
        w = self.worker
        with w._lock:
            if not w._effect_allowed(self.job):
                return False
            w._emit(event)
            return True

    # -- the transfer ------------------------------------------------------------------

    def skip(self, reason: ev.SkipReason) -> None:
        """End the job without a store call (``pressure``, ``empty``, ...); leaves the body."""
        self._outcome = True
        self._record(ev.JobSkipped(job=self.job, rank=self.worker.rank, reason=reason))
        raise _Skip

    def dma_started(self) -> None:
        self._record(ev.DmaStarted(job=self.job, rank=self.worker.rank))

    def dma_done(self, digest: str | int | None = None) -> None:
        self._record(ev.DmaDone(job=self.job, rank=self.worker.rank, digest=digest))

    def put_done(self, stored: int, existed: int) -> None:
        self._outcome = True
        self._record(
            ev.PutDone(job=self.job, rank=self.worker.rank, stored=stored, existed=existed)
        )

    def put_failed(self, error: str) -> None:
        self._outcome = True
        self._record(ev.PutFailed(job=self.job, rank=self.worker.rank, error=error))

    def kv_block_stored(self, key: str, parent: str | None) -> None:
        self._record(ev.KvBlockStored(job=self.job, rank=self.worker.rank, key=key, parent=parent))

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
        for key, parent in zip(stored, self.worker._kv_event_parents(spec, stored), strict=True):
            self.kv_block_stored(key, parent)

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
            ev.OffsetSaved(job=self.job, rank=self.worker.rank, req=self._req, offset=offset)
        )

    def mark_skipped(self) -> bool:
        """Mark the request skipped under pressure; False if the job is stale."""
        return self._effect(
            ev.RequestMarkedSkipped(job=self.job, rank=self.worker.rank, req=self._req)
        )

    def set_retry_tokens(self, start: int, count: int) -> bool:
        """Keep a token suffix for a KV-event retry; False if the job is stale."""
        return self._effect(
            ev.RetryTokensSet(
                job=self.job, rank=self.worker.rank, req=self._req, start=start, count=count
            )
        )

    def clear_retry_tokens(self) -> bool:
        """Drop the retry state; False if the job is stale."""
        return self._effect(
            ev.RetryTokensCleared(job=self.job, rank=self.worker.rank, req=self._req)
        )
