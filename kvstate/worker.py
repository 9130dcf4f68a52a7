"""The worker-side ledger a connector embeds, one per rank: the guards of its decisions.

The sending thread's bookkeeping from the fixed upstream connector (vLLM
#52372), as an API: register a job *before* queueing it, check liveness when
it is dequeued, and run it inside :meth:`WorkerLedger.run`, whose single
``finally`` reports the job exactly once on every path out: success, skip,
put failure or an exception anywhere in the body. Effects on request state
(resume offset, pressure mark, retry tokens) are refused for a job that is
no longer live, so a stale job can never touch a reused request id (the
req_id ABA of vLLM #51637).

A rank keeps only what those decisions need: the specs of jobs registered
and not yet reported, the live jobs, saved offset and retry state of each
request's newest generation while it runs, the jobs each incarnation still
has outstanding, and each request's newest generation (parked once the
request ended, see :mod:`kvstate._generations`). Every invariant is checked
by the fold (:class:`~kvstate.rank.RankLedger`) that the recorder's audit
runs on the same records; ``tests/test_stateful.py`` checks that these
guards decide as the fold does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Mapping

from . import build
from . import events as ev
from ._generations import Generations
from .archive import Archive
from .errors import DuplicateJobError
from .jobrun import JobRun, Run
from .jobspec import JobSpec
from .policy import WorkerPolicy
from .recorder import Recorder
from .violations import Violation, raise_for


class _Running:
    """A request's newest generation on this rank, while it has not ended."""

    __slots__ = ("ended", "gen", "live", "offset", "retry")

    def __init__(self, gen: int, *, ended: bool = False) -> None:
        self.gen = gen
        #: jobs of this generation received here, not reported, not ended
        self.live: set[int] = set()
        self.offset = 0
        self.retry: tuple[int, int] | None = None
        #: only for an effect written on an ended generation (the legacy
        #: policy's unguarded effects): the fold keeps that state, so do we
        self.ended = ended


class WorkerLedger:
    """Records the transitions of one rank and guards its decisions.

    Thread-safe: registration and preemption notices come from the worker's
    main thread while jobs run on the sending thread; one lock orders them,
    like the connector's ``done_task_lock``.

    ``strict`` and the audit's findings work as for
    :class:`~kvstate.scheduler.SchedulerLedger`. ``archive``: where the
    generations of ended requests are parked (in memory by default; a
    :class:`kvstate.spill.SpillArchive` keeps them on disk; the caller owns it).
    """

    def __init__(
        self,
        rank: int,
        recorder: Recorder,
        *,
        strict: bool = True,
        commit_steps: bool = False,
        archive: Archive | None = None,
        policy: WorkerPolicy | None = None,
    ) -> None:
        self.rank = rank
        self.recorder = recorder
        self.strict = strict
        if strict:
            recorder.attach_strict()
        self.policy = policy
        #: a worker with a recorder of its own (its own process and journal)
        #: commits at each step, as the scheduler does; one sharing the
        #: scheduler's recorder leaves that to the scheduler's begin_step
        self.commit_steps = commit_steps
        self.step = 0
        #: jobs registered and not yet reported
        self._specs: dict[int, JobSpec] = {}
        #: every spec registered, for an audit of this rank's records alone
        #: (it cannot read them from a scheduler's job_enqueued)
        self._audit_specs: dict[int, JobSpec] = {}
        recorder.auditor.attach_rank(rank, self._audit_specs)
        self._running: dict[str, _Running] = {}
        #: (req, gen) -> jobs received here and not reported yet
        self._pending: dict[tuple[str, int], set[int]] = {}
        self._gens = Generations(archive)
        self._last_job = -1
        self._received = 0
        self._completed: dict[int, int] = {}
        self.lock = threading.RLock()

    @property
    def violations(self) -> list[Violation]:
        """The audit's findings so far (its recorder's :attr:`~Recorder.violations`)."""
        return self.recorder.violations

    def emit(self, event: ev.Event, *, quiet: bool = False, suspect: bool = False) -> None:
        """Record one event; in strict mode raise on a finding unless ``quiet``.

        For this rank's own calls and its :class:`~kvstate.jobrun.JobRun`s
        (the :class:`~kvstate.jobrun.Rank` interface). Called with
        :attr:`lock` held. ``quiet`` is for records made while
        another exception is already unwinding: the first error wins.
        ``suspect``: this rank's own state says the record breaks an
        invariant, so the audit folds it before the call returns (see
        :meth:`Recorder.emit`).
        """
        found = self.recorder.emit(event, self.step, suspect)
        if self.policy is not None:
            self.policy.observe(self, event)
        if found and self.strict and not quiet and any(not v.is_warning for v in found):
            self.recorder.flush_before_raising()
            raise_for(found)

    def flush_before_raising(self) -> None:
        """Put what was recorded on disk before an exception leaves a job."""
        self.recorder.flush_before_raising()

    def begin_step(self, step: int) -> None:
        """The scheduler step whose metadata this rank is processing.

        With ``commit_steps`` the records of the previous step are committed
        first (durably: see :meth:`Recorder.commit`).
        """
        if self.commit_steps:
            self.recorder.commit()
            auditor = self.recorder.auditor
            if self.strict and auditor.untaken:  # what the writer's audit found
                raise_for(auditor.take_new())
        self.step = step

    # -- scheduler metadata ----------------------------------------------------------

    def register(self, spec: JobSpec) -> None:
        """Enter a job in the ledger. Call before putting it on the queue, so
        no job is ever dequeued unledgered."""
        with self.lock:
            job = spec.job
            # Job ids only grow (one counter on the scheduler), so an id not
            # above every earlier one was registered before.
            if job in self._specs or job <= self._last_job:
                self.recorder.flush_before_raising()
                raise DuplicateJobError(job, self.rank)
            self._last_job = job
            self._specs[job] = spec
            if self.recorder.auditor.wants_specs:
                self._audit_specs[job] = spec
            self.emit(build.job_received(job=job, rank=self.rank))
            self._received += 1
            key = (spec.req, spec.gen)
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = {job}
            else:
                pending.add(job)
            newest = self._gens.get(spec.req)
            running = self._running.get(spec.req)
            if newest is None or spec.gen > newest:
                # A newer generation replaces the request's state wholesale:
                # the old generation's jobs are no longer live, so they can
                # neither retire it nor write its offset.
                self._gens.set(spec.req, spec.gen)
                running = self._running[spec.req] = _Running(spec.gen)
            if running is not None and running.gen == spec.gen and not running.ended:
                running.live.add(job)

    def preemption_seen(self, req: str, gen: int) -> None:
        """``(req, gen)`` was preempted or finished: its queued jobs turn stale at once."""
        with self.lock:
            self.emit(build.preemption_seen(req=req, gen=gen, rank=self.rank))
            newest = self._gens.get(req)
            if newest is None or gen >= newest:
                # Like the fixed connector: the ended generation's live jobs,
                # offset and retry state go at once.
                self._gens.set(req, gen)
                self._running.pop(req, None)
                self._gens.park(req)

    def is_live(self, job: int) -> bool:
        """Registered, of the newest generation of its request, not ended, not reported."""
        with self.lock:
            return self._is_live(job)

    def _is_live(self, job: int) -> bool:
        spec = self._specs.get(job)
        if spec is None:
            return False
        running = self._running.get(spec.req)
        return running is not None and job in running.live

    def retire(self, req: str, gen: int) -> bool:
        """Declare every save of ``(req, gen)`` done, if none is still outstanding here.

        Returns False (and records nothing) while a job of that incarnation
        has not been reported; the caller retries on a later step. For a
        generation that a newer one has superseded on this rank it returns
        True and records nothing: the id belongs to the newer generation now,
        and retiring the old one would be a stale effect on it.
        """
        with self.lock:
            if self._superseded(req, gen):
                return True
            outstanding = bool(self._pending.get((req, gen)))
            blocked = outstanding
            if self.policy is not None:
                blocked = self.policy.retire_blocked(self, req, gen, blocked)
            if blocked:
                return False
            # PREMATURE_RETIRE: a policy let it retire with a job outstanding
            self.emit(build.request_retired(req=req, gen=gen, rank=self.rank), suspect=outstanding)
            return True

    def _superseded(self, req: str, gen: int) -> bool:
        newest = self._gens.get(req)
        return newest is not None and newest > gen

    # -- what a connector reads --------------------------------------------------------

    def newest_gen(self, req: str) -> int | None:
        """The newest generation of ``req`` this rank has seen, or None."""
        with self.lock:
            return self._gens.get(req)

    def saved_offset(self, req: str, gen: int) -> int:
        """Tokens this rank has saved for ``(req, gen)``: where its next job resumes.

        0 when the rank's state for ``req`` belongs to another generation, or
        was dropped when the generation was preempted or finished.
        """
        with self.lock:
            running = self._running.get(req)
            return running.offset if running is not None and running.gen == gen else 0

    def has_retry_tokens(self, req: str, gen: int) -> bool:
        """Whether this rank keeps a token suffix of ``(req, gen)`` for a KV-event retry."""
        with self.lock:
            running = self._running.get(req)
            return running is not None and running.gen == gen and running.retry is not None

    def spec(self, job: int) -> JobSpec | None:
        """The spec of ``job`` while it is registered and not reported, else None."""
        with self.lock:
            return self._specs.get(job)

    def pending_jobs(self, req: str, gen: int) -> list[int]:
        """Jobs of ``(req, gen)`` received here and not reported yet."""
        with self.lock:
            return sorted(self._pending.get((req, gen), ()))

    @property
    def jobs_received(self) -> int:
        """How many jobs this rank has registered so far."""
        with self.lock:
            return self._received

    # -- running a job -----------------------------------------------------------------

    def run(self, job: int) -> contextlib.AbstractContextManager[JobRun]:
        """Context manager for one dequeued job; see :class:`JobRun`."""
        return Run(self, job)

    def report(self, job: int, *, quiet: bool = False) -> None:
        with self.lock:
            self._completed[job] = self._completed.get(job, 0) + 1
            # DOUBLE_REPORT (or UNLEDGERED_JOB): reported already, or never registered
            self.emit(
                build.job_reported(job=job, rank=self.rank),
                quiet=quiet,
                suspect=job not in self._specs,
            )
            spec = self._specs.pop(job, None)
            if spec is None:
                return
            key = (spec.req, spec.gen)
            pending = self._pending.get(key)
            if pending is not None:
                pending.discard(job)
                if not pending:
                    del self._pending[key]
            running = self._running.get(spec.req)
            if running is not None:
                running.live.discard(job)

    def effect_state(self, job: int) -> _Running | None:
        """The state an effect of ``job`` changes: its request's, whatever its
        generation (an unguarded stale effect lands on the newer one: the
        damage the fold shows)."""
        spec = self._specs.get(job)
        if spec is None:
            return None
        running = self._running.get(spec.req)
        if running is None:
            newest = self._gens.get(spec.req)
            gen = spec.gen if newest is None else max(newest, spec.gen)
            running = self._running[spec.req] = _Running(gen, ended=True)
        return running

    # -- completions -------------------------------------------------------------------

    def take_completed(self) -> dict[int, int]:
        """Completion counts since the last call (this rank's worker metadata)."""
        with self.lock:
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
