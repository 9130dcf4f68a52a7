"""The scheduler-side ledger a connector embeds.

Method names follow vLLM's connector hooks. Each call appends one event to
the journal and folds it into a :class:`~kvstate.ledger.Ledger`; every answer
the connector asks for (which generation, which jobs may free their pins, is
push work pending) is read from that folded state, never from a second copy.

The two rules the upstream fixes arrived at are built in:

* a store job pins every block it may read (copy-on-write tail blocks first)
  until all ``world_size`` ranks have reported it, so preempting or finishing
  the request cannot hand those blocks to someone else while a PUT reads them;
* job ids come from one monotonic counter, never from the request id, which
  is reused after resume.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

from . import events as ev
from .archive import Archive
from .errors import UnknownJobError, UnknownRequestError
from .ledger import Ledger
from .recorder import Recorder
from .state import RequestState, StoreJobState
from .violations import Violation, raise_for


class SchedulerLedger:
    """Records and checks every scheduler-side transition.

    With ``strict`` (the default) a call that breaks an invariant raises the
    code's exception (a subclass of
    :class:`~kvstate.violations.InvariantViolation`) right after its record
    is journaled, so replay shows the same breach. Without it, violations
    collect in :attr:`violations`.

    ``archive`` is where settled jobs and requests are parked: in memory by
    default (a few hundred bytes per finished job stay behind); pass a
    :class:`kvstate.spill.SpillArchive` to keep them in a temporary file, so
    memory follows live state however long the engine runs. The caller owns
    it (``close()`` it when the ledger is done).
    """

    def __init__(
        self, recorder: Recorder, *, strict: bool = True, archive: Archive | None = None
    ) -> None:
        self.recorder = recorder
        self.strict = strict
        # Settled jobs and requests are parked (kvstate.archive), so a ledger
        # that lives as long as the engine keeps what is live: plus a packed
        # few hundred bytes per finished job in the default in-memory archive,
        # plus nothing with a kvstate.spill.SpillArchive (they go to disk).
        self.ledger = Ledger(
            observes_workers=False, archive=archive if archive is not None else Archive()
        )
        header = recorder.header
        self.ledger.apply(header.seq, header.step, header.event)
        self.block_size = self.ledger.block_size
        self.world_size = self.ledger.world_size
        self.violations: list[Violation] = []
        self.step = 0
        self._next_job = 0

    # -- recording -----------------------------------------------------------------

    def _emit(self, event: ev.Event) -> int:
        entry = self.recorder.record(event, self.step)
        found = self.ledger.apply(entry.seq, entry.step, event)
        if found:
            self.violations.extend(found)
            if self.strict and any(not v.is_warning for v in found):
                # The breaching record is on disk before the exception can
                # take the process down.
                self.recorder.flush_before_raising()
                raise_for(found)
        return entry.seq

    def _fail(self, error: Exception) -> NoReturn:
        """Raise a usage error, with everything recorded so far on disk."""
        self.recorder.flush_before_raising()
        raise error

    def _request(self, req: str, hook: str) -> RequestState:
        request = self.ledger.request(req)
        if request is None:
            self._fail(UnknownRequestError(req, hook))
        return request

    def begin_step(self, step: int | None = None) -> int:
        """Start the next engine step; the previous one's records are committed together."""
        self.recorder.commit()
        self.step = self.step + 1 if step is None else step
        return self.step

    # -- requests --------------------------------------------------------------------

    def current_gen(self, req: str, hook: str = "current_gen") -> int:
        """The newest generation of ``req`` (:class:`UnknownRequestError` if never admitted)."""
        return self._request(req, hook).newest_gen

    def _next_gen(self, req: str) -> int:
        request = self.ledger.request(req)
        return 0 if request is None else request.newest_gen + 1

    def admit(self, req: str, prompt_tokens: int, hashes: Sequence[str | int] | None = None) -> int:
        """A new request (or a new incarnation of a finished id); returns its gen."""
        gen = self._next_gen(req)
        hashes = None if hashes is None else tuple(hashes)
        self._emit(ev.RequestAdmitted(req=req, gen=gen, prompt_tokens=prompt_tokens, hashes=hashes))
        return gen

    def resume(self, req: str) -> int:
        """A preempted request runs again as a new, greater generation."""
        self._request(req, "resume")
        gen = self._next_gen(req)
        self._emit(ev.RequestResumed(req=req, gen=gen))
        return gen

    def preempt(self, req: str) -> None:
        """The engine took the request's blocks back. Jobs keep their own pins."""
        self._emit(ev.RequestPreempted(req=req, gen=self.current_gen(req, "preempt")))

    def request_finished(self, req: str, *, hold: bool = False, aborted: bool = False) -> None:
        """Finish or abort; legal in any state, including after a preemption.

        There is deliberately no lookup that could fail here: upstream's
        ``assert tracker is not None`` crashed the engine on exactly this path.
        """
        gen = self.current_gen(req, "request_finished")
        hold = self._finish_hold(req, hold)
        self._emit(ev.RequestFinished(req=req, gen=gen, hold=hold, aborted=aborted))

    finish = request_finished

    def release_held(self, req: str, gen: int | None = None) -> None:
        """Drop the refs a ``hold`` finish kept.

        Without ``gen``, the newest incarnation of ``req`` that holds blocks:
        a finished id may already have been admitted again, so the current
        generation is not necessarily the one holding them.
        """
        if gen is None:
            incarnations = self._request(req, "release_held").incarnations
            held = [g for g, inc in incarnations.items() if inc.held]
            gen = max(held) if held else self.current_gen(req, "release_held")
        self._emit(ev.HeldBlocksReleased(req=req, gen=gen))

    def assign_blocks(
        self, req: str, blocks: Iterable[int], *, resumed: bool, cached: Iterable[int] = ()
    ) -> None:
        """Blocks the engine gave the request this step.

        ``resumed`` must be the engine's own flag (vLLM's
        ``scheduled_cached_reqs.resumed_req_ids``): a resumed request's
        ``new_block_ids`` is its whole table and replaces it; a running
        request's is a delta and appends. A connector-local notion of
        "preempted" drifted from the engine's and corrupted tables upstream.
        """
        self._emit(
            ev.BlocksAssigned(
                req=req,
                gen=self.current_gen(req, "assign_blocks"),
                blocks=tuple(blocks),
                mode=self._assign_mode(req, resumed),
                cached=tuple(cached),
            )
        )

    def holds_blocks(self, req: str, gen: int | None = None) -> bool:
        """Whether a ``hold`` finish of ``req`` keeps blocks (of ``gen``, or of any generation)."""
        incarnations = self._request(req, "holds_blocks").incarnations
        if gen is not None:
            inc = incarnations.get(gen)
            return inc is not None and inc.held
        return any(inc.held for inc in incarnations.values())

    def table(self, req: str) -> list[int]:
        """The current block table of ``req``'s newest generation."""
        return list(self._request(req, "table").current.table)

    # -- store jobs --------------------------------------------------------------------

    def enqueue_store_job(
        self,
        req: str,
        token_start: int,
        token_end: int,
        keys: Sequence[str],
        *,
        parent: str | None = None,
        cow_blocks: Sequence[int] = (),
        reads: Sequence[int] | None = None,
        job: int | None = None,
        pins: Sequence[int] | None = None,
    ) -> int:
        """Create a store job for the request's current generation; returns its id.

        The job pins every block of the table, not only those of its token
        range: a rank resumes from its own saved offset, which may lag, and
        then reads lower blocks. Copy-on-write tail blocks (outside the
        table) come first, so the tail-first release frees them last.
        ``reads`` defaults to the blocks covering ``[0, token_end)`` plus the
        copy-on-write blocks.

        Observation mode: a connector that numbers and pins its jobs itself
        (vLLM's, journaled by :mod:`kvstate.vllm`) passes ``job`` and
        ``pins`` as it chose them; the ledger records them as they are, so
        replay judges the connector's own decisions (an id that goes back is
        ``ID_REUSED``; no pins under a preemption is ``POISONED_READ``). A
        finish-time job (a partial tail saved as the request finishes) may
        come after :meth:`request_finished`, with its ``reads`` and ``pins``.
        """
        request = self._request(req, "enqueue_store_job")
        table = self._job_table(req)
        if reads is None:
            covered = -(-token_end // self.block_size)
            reads = (*cow_blocks, *table[:covered])
        if job is None:
            job = self._next_job
        self._next_job = max(self._next_job, job + 1)
        pins = self._job_pins(cow_blocks, table) if pins is None else tuple(pins)
        self._emit(
            ev.JobEnqueued(
                job=job,
                req=req,
                gen=request.newest_gen,
                token_start=token_start,
                token_end=token_end,
                reads=tuple(reads),
                pins=pins,
                keys=tuple(keys),
                world_size=self.world_size,
                parent=parent,
            )
        )
        return job

    def job(self, job: int) -> StoreJobState:
        """The folded state of one job."""
        state = self.ledger.job(job)
        if state is None:
            self._fail(UnknownJobError(job, "job"))
        return state

    def update_connector_output(self, completed: Mapping[int, int]) -> None:
        """Consume the completion counts of one step, aggregated over ranks."""
        for job, count in sorted(completed.items()):
            if count:
                self._emit(ev.CompletionsReceived(job=job, count=count))

    def releasable_jobs(self) -> list[tuple[int, tuple[int, ...]]]:
        """Jobs every rank has reported, with their pins in tail-first order.

        Tail first, like the engine's own frees: the shared prefix goes back
        to the free queue last and so stays cached longest.
        """
        jobs = self.ledger.jobs
        ready = []
        for job in self.ledger.pinned:
            state = jobs[job]
            if state.completions >= state.world_size:
                ready.append((job, tuple(reversed(state.pins))))
        return ready

    def release_pins(self, job: int) -> tuple[int, ...]:
        """Release one job's pins (tail first); returns the blocks to free, in order."""
        blocks = tuple(reversed(self.job(job).pins))
        self._emit(ev.PinsReleased(job=job, blocks=blocks))
        return blocks

    def release_ready(self) -> list[tuple[int, tuple[int, ...]]]:
        """Release every releasable job; returns ``(job, blocks)`` for the pool to free."""
        return [(job, self.release_pins(job)) for job, _ in self.releasable_jobs()]

    def finished_sending(self, req: str) -> None:
        """Every rank has finished saving ``req``. Nothing to do here: jobs hold
        their own pins, so no block waits for this signal (the legacy policy
        frees its delayed blocks at this point)."""

    @property
    def pinned_jobs(self) -> int:
        """How many jobs still pin blocks."""
        return len(self.ledger.pinned)

    def has_pending_push_work(self) -> bool:
        """True while a job still pins blocks.

        Completions travel only with step outputs, so the engine must keep
        stepping until every pin is released or they would be held forever.
        """
        return bool(self.ledger.pinned)

    # -- policy: the decisions the upstream fixes changed --------------------------------
    # kvstate.harness.legacy overrides these with the old behaviours, for the bug zoo.

    def _assign_mode(self, req: str, resumed: bool) -> ev.Mode:
        """Append or replace, from the engine's resumed flag only."""
        return "replace" if resumed else "append"

    def _job_table(self, req: str) -> list[int]:
        """The table a new job reads: the engine's current one, whatever this step allocated."""
        return self._request(req, "enqueue_store_job").current.table

    def _job_pins(self, cow_blocks: Sequence[int], table: Sequence[int]) -> tuple[int, ...]:
        """Every block the job may read, copy-on-write tail blocks first."""
        return (*cow_blocks, *table)

    def _finish_hold(self, req: str, hold: bool) -> bool:
        """Whether a finish keeps the table: only when the engine asks (jobs pin their own)."""
        return hold

    # -- the engine --------------------------------------------------------------------

    def crashed(self, error: str) -> None:
        """The engine died. Recorded before the strict-mode raise, like any breach."""
        self._emit(ev.EngineCrashed(error=error))

    def idle(self) -> None:
        """The engine stopped with no work left: quiescence checks run now."""
        self._emit(ev.EngineIdle())
        self.recorder.commit()
