"""The scheduler-side ledger a connector embeds: the guards of its decisions.

Method names follow vLLM's connector hooks. Each call appends one event to
the journal and keeps only what the connector's decisions need: each
request's newest generation and current block table, and each job's pins
and completion count. Every invariant is checked by the fold
(:mod:`kvstate.audit`), which runs on the same records, inline or where the
journal is written; ``tests/test_stateful.py`` checks after every step that
these guards decide as the fold does.

The two rules the upstream fixes arrived at are built in:

* a store job pins every block it may read (copy-on-write tail blocks first)
  until all ``world_size`` ranks have reported it, so preempting or finishing
  the request cannot hand those blocks to someone else while a PUT reads them
  (vLLM #52360, fixed by #52372);
* job ids come from one monotonic counter, never from the request id, which
  is reused after resume (vLLM #51637).

A job's pins are one tuple, kept by reference: enqueueing, completing and
releasing a job costs the same whatever the length of the table it pins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

import attrs

from . import build
from . import events as ev
from ._generations import Generations
from .archive import Archive
from .errors import UnknownJobError, UnknownRequestError
from .policy import SchedulerPolicy
from .recorder import Recorder
from .violations import Violation, raise_for


@attrs.define(slots=True)
class JobGuard:
    """What the scheduler keeps of a job until every rank reported it and its
    pins went back: its incarnation, reads, pins and completions."""

    job: int
    req: str
    gen: int
    reads: tuple[int, ...]
    pins: tuple[int, ...]
    keys: tuple[str, ...]
    parent: str | None
    world_size: int
    completions: int = 0
    released: bool = False


class SchedulerLedger:
    """Records every scheduler-side transition and guards the connector's decisions.

    With ``strict`` (the default) a finding of the audit raises the code's
    exception (a subclass of :class:`~kvstate.violations.InvariantViolation`)
    from the ledger call that made the breaching record, once its record is
    journaled: at once with the recorder's ``inline`` audit, at the next
    call with a ``commit`` audit. Without it, findings collect in
    :attr:`violations`.

    ``archive`` is where settled state is parked: the generations of
    finished requests here, and settled jobs and requests of an inline
    audit's fold. In memory by default; a :class:`kvstate.spill.SpillArchive`
    keeps them in a temporary file, so memory follows live state however
    long the engine runs. The caller owns it (``close()`` it when done).

    ``policy``: a :class:`~kvstate.policy.SchedulerPolicy` that may replace
    the fixed decisions (the bug zoo's legacy connector); None in production.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        strict: bool = True,
        archive: Archive | None = None,
        policy: SchedulerPolicy | None = None,
    ) -> None:
        self.recorder = recorder
        self.strict = strict
        if strict:
            recorder.attach_strict()
        self.policy = policy
        recorder.auditor.attach_scheduler(archive)
        header = recorder.header.event
        if not isinstance(header, ev.JournalOpened):
            raise TypeError(f"a recorder's first record is journal_opened, not {header.kind}")
        self.block_size = header.block_size
        self.world_size = header.world_size
        self.step = 0
        self._next_job = 0
        self._gens = Generations(archive)
        #: the current table of each request's newest generation
        self._tables: dict[str, list[int]] = {}
        #: requests whose finish kept blocks (``hold``), and which generations
        self._held: dict[str, set[int]] = {}
        #: jobs not yet done (completions outstanding, or pins held)
        self._jobs: dict[int, JobGuard] = {}
        #: jobs whose pins are held, in enqueue order
        self._pinned: dict[int, None] = {}

    @property
    def violations(self) -> list[Violation]:
        """The audit's findings so far (its recorder's :attr:`~Recorder.violations`)."""
        return self.recorder.violations

    # -- recording -----------------------------------------------------------------

    def _emit(self, event: ev.Event, suspect: bool = False) -> None:
        """Record ``event``; ``suspect``: this ledger's own state says it breaks
        an invariant, so the audit folds it before the call returns and
        strict mode raises at this very call (see :meth:`Recorder.emit`)."""
        found = self.recorder.emit(event, self.step, suspect)
        if self.policy is not None:
            self.policy.observe(self, event)
        if found and self.strict and any(not v.is_warning for v in found):
            # The breaching record is on disk before the exception can
            # take the process down.
            self.recorder.flush_before_raising()
            raise_for(found)

    def _fail(self, error: Exception) -> NoReturn:
        """Raise a usage error, with everything recorded so far on disk."""
        self.recorder.flush_before_raising()
        raise error

    def _gen(self, req: str, hook: str) -> int:
        gen = self._gens.get(req)
        if gen is None:
            self._fail(UnknownRequestError(req, hook))
        return gen

    def begin_step(self, step: int | None = None) -> int:
        """Start the next engine step; the previous one's records are committed together."""
        self.recorder.commit()
        self._raise_untaken()
        self.step = self.step + 1 if step is None else step
        return self.step

    def _raise_untaken(self) -> None:
        """Strict: what the writer's audit found since the last call raises now."""
        auditor = self.recorder.auditor
        if self.strict and auditor.untaken:
            raise_for(auditor.take_new())

    # -- requests --------------------------------------------------------------------

    def current_gen(self, req: str, hook: str = "current_gen") -> int:
        """The newest generation of ``req`` (:class:`UnknownRequestError` if never admitted)."""
        return self._gen(req, hook)

    def admit(self, req: str, prompt_tokens: int, hashes: Sequence[str | int] | None = None) -> int:
        """A new request (or a new incarnation of a finished id); returns its gen."""
        newest = self._gens.get(req)
        gen = 0 if newest is None else newest + 1
        self._emit(
            build.request_admitted(req=req, gen=gen, prompt_tokens=prompt_tokens, hashes=hashes)
        )
        self._new_generation(req, gen)
        return gen

    def resume(self, req: str) -> int:
        """A preempted request runs again as a new, greater generation."""
        gen = self._gen(req, "resume") + 1
        self._emit(build.request_resumed(req=req, gen=gen))
        self._new_generation(req, gen)
        return gen

    def _new_generation(self, req: str, gen: int) -> None:
        self._gens.set(req, gen)
        self._tables[req] = []  # a new incarnation starts with an empty table

    def preempt(self, req: str) -> None:
        """The engine took the request's blocks back. Jobs keep their own pins."""
        self._emit(build.request_preempted(req=req, gen=self.current_gen(req, "preempt")))
        self._tables[req] = []

    def request_finished(self, req: str, *, hold: bool = False, aborted: bool = False) -> None:
        """Finish or abort; legal in any state, including after a preemption.

        There is deliberately no lookup that could fail here beyond the id
        itself: upstream's ``assert tracker is not None`` crashed the engine
        on exactly this path (vLLM #43281).
        """
        gen = self.current_gen(req, "request_finished")
        if self.policy is not None:
            hold = self.policy.finish_hold(self, req, hold)
        self._emit(build.request_finished(req=req, gen=gen, hold=hold, aborted=aborted))
        if hold and self._tables.get(req):
            self._held.setdefault(req, set()).add(gen)  # the table stays until released
        else:
            self._tables[req] = []
            self._settle(req)

    finish = request_finished

    def release_held(self, req: str, gen: int | None = None) -> None:
        """Drop the refs a ``hold`` finish kept.

        Without ``gen``, the newest incarnation of ``req`` that holds blocks:
        a finished id may already have been admitted again, so the current
        generation is not necessarily the one holding them.
        """
        current = self.current_gen(req, "release_held")
        held = self._held.get(req, set())
        if gen is None:
            gen = max(held) if held else current
        self._emit(build.held_blocks_released(req=req, gen=gen))
        if gen in held:
            held.discard(gen)
            if not held:
                del self._held[req]
            if gen == current:
                self._tables[req] = []
                self._settle(req)

    def _settle(self, req: str) -> None:
        """A finished request with nothing held: only its generation is kept, parked."""
        if req not in self._held and not self._tables.get(req):
            self._tables.pop(req, None)
            self._gens.park(req)

    def assign_blocks(
        self, req: str, blocks: Iterable[int], *, resumed: bool, cached: Iterable[int] = ()
    ) -> None:
        """Blocks the engine gave the request this step.

        ``resumed`` must be the engine's own flag (vLLM's
        ``scheduled_cached_reqs.resumed_req_ids``): a resumed request's
        ``new_block_ids`` is its whole table and replaces it; a running
        request's is a delta and appends. A connector-local notion of
        "preempted" drifted from the engine's and corrupted tables upstream
        (vLLM #46595).
        """
        blocks = tuple(blocks)
        mode: ev.Mode = "replace" if resumed else "append"
        if self.policy is not None:
            mode = self.policy.assign_mode(self, req, mode)
        self._emit(
            build.blocks_assigned(
                req=req,
                gen=self.current_gen(req, "assign_blocks"),
                blocks=blocks,
                mode=mode,
                cached=cached,
            )
        )
        table = self._tables.setdefault(req, [])
        if mode == "replace":
            table[:] = blocks
        else:
            table.extend(blocks)

    def holds_blocks(self, req: str, gen: int | None = None) -> bool:
        """Whether a ``hold`` finish of ``req`` keeps blocks (of ``gen``, or of any generation)."""
        self._gen(req, "holds_blocks")
        held = self._held.get(req, ())
        return gen in held if gen is not None else bool(held)

    def held_generations(self, req: str) -> list[int]:
        """The generations of ``req`` whose ``hold`` finish still keeps blocks, oldest first."""
        return sorted(self._held.get(req, ()))

    def table(self, req: str) -> list[int]:
        """The current block table of ``req``'s newest generation."""
        self._gen(req, "table")
        return list(self._tables.get(req, ()))

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

        A connector that numbers and pins its jobs itself passes ``job`` and
        ``pins`` as it chose them; the ledger records them as they are, so
        replay judges the connector's own decisions (an id that goes back is
        ``ID_REUSED``; no pins under a preemption is ``POISONED_READ``). A
        finish-time job (a partial tail saved as the request finishes) may
        come after :meth:`request_finished`, with its ``reads`` and ``pins``.
        """
        gen = self._gen(req, "enqueue_store_job")
        # the engine's current table, whatever this step allocated
        table = self._tables.get(req, [])
        if self.policy is not None:
            table = self.policy.job_table(self, req, table)
        chosen = reads is not None or self.policy is not None
        if reads is None:
            covered = -(-token_end // self.block_size)
            reads = (*cow_blocks, *table[:covered]) if cow_blocks else table[:covered]
        if job is None:
            job = self._next_job
        reused = job < self._next_job  # ID_REUSED: not above every earlier id
        self._next_job = max(self._next_job, job + 1)
        if pins is None:
            # every block the job may read, copy-on-write tail blocks first
            # (tuple() of a list copies it in one C call; unpacking walks it)
            pins = (*cow_blocks, *table) if cow_blocks else tuple(table)
            if self.policy is not None:
                pins = self.policy.job_pins(self, req, pins)
        else:
            pins = tuple(pins)
        reads, keys = tuple(reads), tuple(keys)
        # TABLE_OVERRUN, ID_REUSED and FOREIGN_BLOCK_READ, as far as this
        # ledger's own table and counter tell (the fold decides). Reads this
        # ledger derived from the table are within it; only chosen ones are
        # compared.
        current = self._tables.get(req, ())
        suspect = (
            token_end > len(current) * self.block_size
            or reused
            or (chosen and bool(reads) and not set(reads) <= {*current, *pins})
        )
        self._emit(
            build.job_enqueued(
                job=job,
                req=req,
                gen=gen,
                token_start=token_start,
                token_end=token_end,
                reads=reads,
                pins=pins,
                keys=keys,
                world_size=self.world_size,
                parent=parent,
            ),
            suspect,
        )
        self._jobs[job] = JobGuard(job, req, gen, reads, pins, keys, parent, self.world_size)
        if pins:
            self._pinned[job] = None
        return job

    def job(self, job: int) -> JobGuard:
        """What this ledger keeps of a job until it is done (:class:`UnknownJobError` after)."""
        state = self._jobs.get(job)
        if state is None:
            self._fail(UnknownJobError(job, "job", "was never enqueued, or is done"))
        return state

    def outstanding(self, req: str) -> bool:
        """Whether a job of ``req`` still waits for a rank's completion."""
        return any(j.req == req and j.completions < j.world_size for j in self._jobs.values())

    def update_connector_output(self, completed: Mapping[int, int]) -> None:
        """Consume the completion counts of one step, aggregated over ranks."""
        for job, count in sorted(completed.items()):
            if count:
                state = self._jobs.get(job)
                # PHANTOM_COMPLETION or CAUSALITY: more than the job's ranks,
                # or a job this ledger has no longer (or never had)
                suspect = state is None or state.completions + count > state.world_size
                self._emit(build.completions_received(job=job, count=count), suspect)
                if state is not None:
                    state.completions += count
                    self._done(state)

    def _done(self, state: JobGuard) -> None:
        if state.completions >= state.world_size and (state.released or not state.pins):
            del self._jobs[state.job]

    def releasable_jobs(self) -> list[tuple[int, tuple[int, ...]]]:
        """Jobs every rank has reported, with their pins in tail-first order.

        Tail first, like the engine's own frees: the shared prefix goes back
        to the free queue last and so stays cached longest.
        """
        jobs = self._jobs
        return [
            (job, jobs[job].pins[::-1])
            for job in self._pinned
            if jobs[job].completions >= jobs[job].world_size
        ]

    def release_pins(self, job: int) -> tuple[int, ...]:
        """Release one job's pins (tail first); returns the blocks to free, in order."""
        state = self.job(job)
        blocks = state.pins[::-1]
        # EARLY_RELEASE: a rank has not reported the job yet
        self._emit(
            build.pins_released(job=job, blocks=blocks), state.completions < state.world_size
        )
        state.released = True
        self._pinned.pop(job, None)
        self._done(state)
        return blocks

    def release_ready(self) -> list[tuple[int, tuple[int, ...]]]:
        """Release every releasable job; returns ``(job, blocks)`` for the pool to free."""
        return [(job, self.release_pins(job)) for job, _ in self.releasable_jobs()]

    def finished_sending(self, req: str) -> None:
        """Every rank has finished saving ``req``. Nothing to do here: jobs hold
        their own pins, so no block waits for this signal (the legacy policy
        frees its delayed blocks at this point)."""
        if self.policy is not None:
            self.policy.finished_sending(self, req)

    @property
    def pinned_jobs(self) -> int:
        """How many jobs still pin blocks."""
        return len(self._pinned)

    def has_pending_push_work(self) -> bool:
        """True while a job still pins blocks.

        Completions travel only with step outputs, so the engine must keep
        stepping until every pin is released or they would be held forever.
        """
        return bool(self._pinned)

    # -- the engine --------------------------------------------------------------------

    def crashed(self, error: str) -> None:
        """The engine died. Recorded before the strict-mode raise, like any breach."""
        self._emit(build.engine_crashed(error=error), suspect=True)  # CRASH

    def idle(self) -> None:
        """The engine stopped with no work left: quiescence checks run now."""
        # LEAKED_PIN, MISSING_REPORT, HELD_FOREVER: a job or a hold not done
        self._emit(build.engine_idle(), bool(self._jobs or self._held))
        self.recorder.commit()
