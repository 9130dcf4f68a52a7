"""The reference ledger and the fold: one transition per record.

:meth:`Ledger.apply` is the single transition function of the project. It
folds one record into requests and generations, block tables, block ``refs``
and ``epoch``, per-job :class:`~kvstate.state.StoreJobState` and one
:class:`~kvstate.rank.RankLedger` per rank, and returns the violations that
record causes, each with the ``chain`` of earlier seqs it depends on. It does
no I/O and reads no clock: the same records give the same ledger and the same
violations, live or in replay.

Every check runs at the record that breaks it, in one forward pass; the
quiescence checks (leaked pins, missing reports, held blocks) run at
``engine_idle``. The fold is this module and the ones it calls, each one
concept: :mod:`kvstate.rank` (one rank's records), ``_blocks`` (refs and
epochs), ``_reads`` (did each read see its KV), ``_quiescence`` (the
end-of-run checks), ``_parking`` (settled state out of memory) and
``_copies`` (snapshots and plain data).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from journal import RecordError

from . import _copies
from . import events as ev
from . import tier_events as tier
from . import transfer_events as tx
from ._blocks import assign, drop
from ._blocks import block as block_state
from ._ledger_state import LedgerState, folded_state
from ._parking import PARK_AFTER, SWEEP_EVERY, Parking
from ._quiescence import check_ended, check_quiescent
from ._reads import check_enqueued_reads, check_epochs, check_key, check_load
from .archive import Archive
from .state import (
    FINISHED,
    PREEMPTED,
    Incarnation,
    RequestState,
    StoreJobState,
)
from .violations import Code, Violation, chain_of, finding

Out = list[Violation]

_SCHEDULER_KINDS = frozenset(
    cls for cls in ev.EVENT_TYPES.values() if cls.side == ev.SIDE_SCHEDULER
)
_WORKER_KINDS = frozenset(cls for cls in ev.EVENT_TYPES.values() if cls.side == ev.SIDE_WORKER)
#: worker kinds that name a job (the rest name a request's incarnation)
_WORKER_JOB_KINDS = frozenset(k for k in _WORKER_KINDS if "job" in k.payload_fields)
_DMA_KINDS = (ev.DmaStarted, ev.DmaDone)


class Ledger(LedgerState):
    """The whole engine as the journal describes it: its state (declared in
    :class:`~kvstate._ledger_state.LedgerState`) and the transition function.

    ``observes_workers``: whether worker records reach this ledger. Replay
    sees them all; a live scheduler in another process does not, so it
    cannot tell how many reports a rank made and checks completions against
    ``world_size`` only.

    ``archive``: where settled jobs and requests are parked (see
    :mod:`kvstate.archive`). Without one everything stays in the dicts
    below; with one, ``jobs`` and ``requests`` hold what is live or was
    named recently, and the rest comes back the moment a record names it,
    so every check sees exactly the state it would have seen. The key log
    is always kept by an archive (a private in-memory one by default).
    """

    def __init__(
        self,
        *,
        observes_workers: bool = True,
        archive: Archive | None = None,
        park_after: int = PARK_AFTER,
        sweep_every: int = SWEEP_EVERY,
    ) -> None:
        super().__init__(
            observes_workers=observes_workers,
            archive=archive if archive is not None else Archive(),
        )
        if archive is not None:  # only then is there somewhere to park
            self.parking = Parking(self, park_after, sweep_every)
        self._dispatch: dict[type, Callable[[int, Any, Out], None]] = {
            **dict.fromkeys(_WORKER_KINDS, self._on_worker),
            ev.JournalOpened: self._on_journal_opened,
            ev.RequestAdmitted: self._on_admitted,
            ev.RequestResumed: self._on_resumed,
            ev.BlocksAssigned: self._on_blocks_assigned,
            ev.RequestPreempted: self._on_preempted,
            ev.RequestFinished: self._on_finished,
            ev.HeldBlocksReleased: self._on_held_released,
            ev.JobEnqueued: self._on_job_enqueued,
            ev.CompletionsReceived: self._on_completions,
            ev.PinsReleased: self._on_pins_released,
            ev.EngineCrashed: self._on_crashed,
            ev.EngineIdle: self._on_idle,
            ev.KeyVerified: self._on_key_verified,
            ev.LoadVerified: self._on_load_verified,
            ev.KeyLoaded: self._on_key_loaded,
            ev.KeyMissing: self._on_key_missing,
            ev.RecordRefused: self._on_refused,
            ev.ObserverStoodDown: self._on_stood_down,
            tier.LoadEnqueued: self._on_load_enqueued,
            tier.FlushRequested: self._on_flush_requested,
            tier.FlushDone: self._on_flush_done,
            tier.TierStored: self._on_tier_stored,
            tier.TierEvicted: self._on_tier_evicted,
            tier.TierPromoted: self._on_tier_promoted,
            tx.KvMatched: self._on_kv_matched,
            tx.RemoteLoadStarted: self._on_remote_load,
            tx.TransferFinished: self._on_transfer_finished,
            tx.BlocksInvalid: self._on_blocks_invalid,
            tx.CacheReset: self._on_cache_reset,
            tx.TransferParams: self._on_transfer_params,
        }

    # -- the transition function ---------------------------------------------------

    def apply(self, seq: int, step: int, event: ev.Event) -> list[Violation]:
        """Fold one record; return the violations (and warnings) it causes.

        Raises :class:`journal.RecordError` when the input is unusable as a
        journal: the first record is not ``journal_opened``, or a later header
        disagrees with the first.
        """
        kind = type(event)
        if kind is ev.JournalOpened or self.header is None:
            problem = ev.header_problem(self.header, event)
            if problem is not None:
                raise RecordError(problem, seq=seq)
        out: Out = []
        self.records += 1
        self.last_seq, self.last_kind = seq, event.kind
        parking = self.parking
        if parking is not None:
            parking.bring_back(event)
        if kind in _SCHEDULER_KINDS:
            if step < self.step:
                why = f"scheduler step went back from {self.step} to {step}"
                out.append(finding(Code.STEP_REGRESSED, seq, why))
            else:
                if step > self.step:
                    self.offload.step_began(seq, out)
                self.step = step
        self._dispatch[kind](seq, event, out)
        if parking is not None and self.records % parking.sweep_every == 0:
            parking.sweep()
        return out

    def end(self) -> list[Violation]:
        """The journal ends here: warn if it ends before the engine did
        (docs/events.md, "Complete and incomplete journals")."""
        return check_ended(self)

    # -- requests --------------------------------------------------------------------

    def _incarnation(self, seq: int, kind: str, req: str, gen: int, out: Out) -> Incarnation | None:
        request = self.requests.get(req)
        inc = request.incarnations.get(gen) if request is not None else None
        if inc is None:
            why = f"{kind} names {req}/{gen}, which was never admitted or resumed"
            out.append(finding(Code.CAUSALITY, seq, why, req=req, gen=gen))
        return inc

    def _new_generation(self, seq: int, kind: str, req: str, gen: int, out: Out) -> Incarnation:
        request = self.requests.get(req)
        if request is None:
            request = self.requests[req] = RequestState(req, gen, seq)
        elif gen <= request.newest_gen:
            why = (
                f"{kind} gives {req} generation {gen}, not greater than its "
                f"generation {request.newest_gen}"
            )
            out.append(finding(Code.ID_REUSED, seq, why, request.newest_seq, req=req, gen=gen))
        else:
            request.newest_gen, request.newest_seq = gen, seq
        inc = Incarnation(req, gen, seq)
        request.incarnations[gen] = inc
        return inc

    def _on_journal_opened(self, seq: int, event: ev.JournalOpened, out: Out) -> None:
        # A later header (journals of one run merged) was checked in apply().
        if self.header is None:
            self.header = event
            self.offload.on = event.protocol == tier.OFFLOADING

    def _on_admitted(self, seq: int, event: ev.RequestAdmitted, out: Out) -> None:
        inc = self._new_generation(seq, event.kind, event.req, event.gen, out)
        inc.prompt_tokens = event.prompt_tokens

    def _on_resumed(self, seq: int, event: ev.RequestResumed, out: Out) -> None:
        if event.req not in self.requests:
            why = f"request_resumed for {event.req}, which was never admitted"
            out.append(finding(Code.CAUSALITY, seq, why, req=event.req, gen=event.gen))
        self._new_generation(seq, event.kind, event.req, event.gen, out)
        self.offload.resumed_at(seq, event.req, event.gen)
        self.transfers.resumed_at(event.req, event.gen)

    def _on_blocks_assigned(self, seq: int, event: ev.BlocksAssigned, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        self.transfers.assigned(seq, inc, event.blocks, event.cached, event.mode, out)
        cached = set(event.cached)
        holder = inc.name
        # Take the new refs before dropping the old table: a block that stays
        # in a replaced table never passes through refs == 0, so it keeps its
        # epoch.
        for block in event.blocks:
            assign(self.blocks, block, seq, block in cached, holder)
        readers = self.offload.readers
        if readers:
            for block in event.blocks:
                if block in readers and self.blocks[block].epoch_seq == seq:
                    self.offload.reused(seq, self.step, block, self.jobs, out)
        if event.mode == "replace":
            for block in inc.table:
                drop(self.blocks, block, seq, out, f"replacing the table of {holder}")
            inc.table = list(event.blocks)
        else:
            inc.table.extend(event.blocks)
        inc.table_seq = seq

    def _drop_table(self, seq: int, inc: Incarnation, out: Out, why: str) -> None:
        for block in inc.table:
            drop(self.blocks, block, seq, out, why)
        inc.table = []
        inc.table_seq = seq

    def _on_preempted(self, seq: int, event: ev.RequestPreempted, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        self.transfers.dropped(seq, inc, "was preempted", out)
        self._drop_table(seq, inc, out, f"preempting {inc.name}")
        inc.state, inc.ended_seq = PREEMPTED, seq
        self.offload.preempted(event.req)

    def _on_finished(self, seq: int, event: ev.RequestFinished, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        if inc.state == FINISHED:
            # One finish per incarnation (vLLM #50297): a second one frees,
            # or reports, what the first already did.
            why = f"a second request_finished for {inc.name}"
            out.append(finding(Code.DOUBLE_FINISH, seq, why, inc.ended_seq,
                               req=event.req, gen=event.gen))  # fmt: skip
        inc.final_table = tuple(inc.table)
        if event.hold:
            inc.held = bool(inc.table)
            self.transfers.held_by(seq, inc)
        else:
            self.transfers.dropped(seq, inc, "finished", out)
            self._drop_table(seq, inc, out, f"finishing {inc.name}")
            inc.held = False
        inc.state, inc.ended_seq = FINISHED, seq
        self.offload.finished(event.req, event.gen)

    def _on_held_released(self, seq: int, event: ev.HeldBlocksReleased, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        if not inc.held:
            why = f"held_blocks_released for {inc.name}, which holds no blocks"
            out.append(
                finding(Code.NOTHING_HELD, seq, why, inc.ended_seq, req=event.req, gen=event.gen)
            )
            return
        self.transfers.released(inc)
        self._drop_table(seq, inc, out, f"releasing the held blocks of {inc.name}")
        inc.held = False

    # -- jobs --------------------------------------------------------------------------

    def _on_job_enqueued(self, seq: int, event: ev.JobEnqueued, out: Out) -> None:
        self._new_job(seq, event, out)
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is not None:
            check_enqueued_reads(self, seq, event, inc, out)
        for block in event.pins:
            # A pin holds the block without writing it: no epoch change.
            block_state(self.blocks, block).refs += 1
        blocks = self.blocks
        read_epochs = tuple(blocks[b].epoch if b in blocks else 0 for b in event.reads)
        job = self.jobs[event.job] = StoreJobState(
            event.job,
            event.req,
            event.gen,
            event.token_start,
            event.token_end,
            event.reads,
            read_epochs,
            event.pins,
            event.keys,
            event.parent,
            event.world_size,
            seq,
        )
        if event.pins:
            self.pinned[event.job] = None
        if inc is None and self.parking is not None:
            self.parking.unparkable.add(event.req)
        key_written = self.archive.key_written
        for key in event.keys:
            key_written(key, seq, event.job)
        self.offload.enqueued(seq, job, self.jobs, out)

    def _on_load_enqueued(self, seq: int, event: tier.LoadEnqueued, out: Out) -> None:
        self._new_job(seq, event, out)
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        # A load reads and pins no device block: it writes ``writes`` from the tier.
        job, req, gen, keys, world = event.job, event.req, event.gen, event.keys, event.world_size
        load = StoreJobState(job, req, gen, 0, 0, (), (), (), keys, None, world, seq)
        load.load, load.writes = True, event.writes
        self.jobs[job] = load
        if inc is None and self.parking is not None:
            self.parking.unparkable.add(event.req)
        self.offload.enqueued(seq, load, self.jobs, out)

    def _new_job(self, seq: int, event: ev.JobEnqueued | tier.LoadEnqueued, out: Out) -> None:
        """A job id must be new, and its world the engine's (store and load jobs alike)."""
        header = self.header
        if header is not None and event.world_size != header.world_size:
            # Every completion and report count is judged against the job's
            # world_size: one that contradicts the engine's is not a journal
            # of that engine (two runs merged, or a writer's bug).
            raise RecordError(
                f"{event.kind} says world_size={event.world_size} for job {event.job}; "
                f"journal_opened says world_size={header.world_size}",
                seq=seq,
            )
        if self.last_job is not None and event.job <= self.last_job:
            earlier = self.jobs.get(event.job)
            why = f"job id {event.job} is not greater than the earlier job id {self.last_job}"
            out.append(
                finding(
                    Code.ID_REUSED,
                    seq,
                    why,
                    self.last_job_seq,
                    earlier.enqueued_seq if earlier else None,
                    of=event,
                )
            )
        else:
            self.last_job, self.last_job_seq = event.job, seq

    def _job(self, seq: int, kind: str, job: int, out: Out) -> StoreJobState | None:
        state = self.jobs.get(job)
        if state is None:
            why = f"{kind} names job {job}, which was never enqueued"
            out.append(finding(Code.CAUSALITY, seq, why, job=job))
        return state

    def _on_completions(self, seq: int, event: ev.CompletionsReceived, out: Out) -> None:
        job = self._job(seq, event.kind, event.job, out)
        if job is None or self.offload.stale_completion(seq, job, out):
            return
        job.completions += event.count
        chain = chain_of(job.enqueued_seq, *job.completion_seqs)
        job.completion_seqs.append(seq)
        reported = job.reported_ranks
        if self.observes_workers and job.completions > reported:
            problem = f"only {reported} rank(s) have reported it"
        elif job.completions > job.world_size:
            problem = f"the world has only {job.world_size} rank(s)"
        else:
            return
        why = f"{job.completions} completion(s) received for job {job.job}, but {problem}"
        out.append(
            finding(
                Code.PHANTOM_COMPLETION,
                seq,
                why,
                *chain,
                *(rj.reported_seq for rj in job.ranks.values()),
                of=job,
            )
        )

    def _on_pins_released(self, seq: int, event: ev.PinsReleased, out: Out) -> None:
        job = self._job(seq, event.kind, event.job, out)
        if job is None:
            return
        if job.released_seq is not None:
            why = f"job {job.job} released a second time"
            out.append(
                finding(Code.PIN_MISMATCH, seq, why, job.enqueued_seq, job.released_seq, of=job)
            )
            return
        if job.completions < job.world_size:
            why = (
                f"job {job.job}'s pins released after {job.completions} of "
                f"{job.world_size} completions: a rank may still be reading them"
            )
            out.append(
                finding(
                    Code.EARLY_RELEASE, seq, why, job.enqueued_seq, *job.completion_seqs, of=job
                )
            )
        if Counter(event.blocks) != Counter(job.pins):
            why = f"job {job.job} releases blocks {list(event.blocks)} but pinned {list(job.pins)}"
            out.append(finding(Code.PIN_MISMATCH, seq, why, job.enqueued_seq, of=job))
        elif list(event.blocks) != list(reversed(job.pins)):
            why = (
                f"job {job.job} frees {list(event.blocks)}, not tail first "
                f"{list(reversed(job.pins))}"
            )
            out.append(finding(Code.RELEASE_ORDER, seq, why, job.enqueued_seq, of=job))
        for block in event.blocks:
            drop(self.blocks, block, seq, out, f"releasing job {job.job}'s pins")
        job.released_seq = seq
        self.pinned.pop(job.job, None)
        self.offload.ended(job)

    # -- worker side -------------------------------------------------------------------

    def _on_worker(self, seq: int, event: Any, out: Out) -> None:
        kind = type(event)
        job = None
        if kind in _WORKER_JOB_KINDS:
            job_id = event.job
            job = self.jobs.get(job_id)
            if job is None:
                self._job(seq, event.kind, job_id, out)  # flags the unknown job
                return
            if event.rank >= job.world_size:
                why = (
                    f"{event.kind} from rank {event.rank}, outside job {job_id}'s world "
                    f"of {job.world_size} rank(s)"
                )
                out.append(
                    finding(Code.CAUSALITY, seq, why, job.enqueued_seq, job=job_id, rank=event.rank)
                )
                return
        elif self._incarnation(seq, event.kind, event.req, event.gen, out) is None:
            return
        rank = event.rank
        ledger = self.ranks.get(rank) or self.rank(rank)
        rank_job = ledger.apply(seq, event, out)
        if job is None or rank_job is None:
            return
        job.ranks[rank] = rank_job
        if kind in _DMA_KINDS:
            check_epochs(self, seq, event, job, out)
        elif kind is ev.JobReported and self.offload.read_done:
            self.offload.finished_reading(job, rank)

    # -- flushes and the offload tier (kvstate.tier_events) ----------------------------

    def _on_flush_requested(self, seq: int, event: tier.FlushRequested, out: Out) -> None:
        for job_id in event.jobs:
            self._job(seq, event.kind, job_id, out)
        self.offload.flush_requested(seq, self.step, event.jobs)

    def _on_flush_done(self, seq: int, event: tier.FlushDone, out: Out) -> None:
        for job_id in event.jobs:
            job = self._job(seq, event.kind, job_id, out)
            if job is not None:
                self.offload.finished_reading(job, event.rank)

    def _on_tier_stored(self, seq: int, event: tier.TierStored, out: Out) -> None:
        self._job(seq, event.kind, event.job, out)
        self.offload.tier_stored(seq, event.keys, self.jobs, out)

    def _on_tier_promoted(self, seq: int, event: tier.TierPromoted, out: Out) -> None:
        self.offload.tier_promoted(seq, event.keys, self.jobs, out)

    def _on_tier_evicted(self, seq: int, event: tier.TierEvicted, out: Out) -> None:
        self.offload.tier_evicted(seq, event.keys, self.jobs, out)

    # -- engine and audit --------------------------------------------------------------

    # -- the lifecycle at vLLM's connector boundary (kvstate._transfers) ----------------

    def _on_kv_matched(self, seq: int, event: tx.KvMatched, out: Out) -> None:
        self.transfers.matched(seq, event, out)

    def _on_remote_load(self, seq: int, event: tx.RemoteLoadStarted, out: Out) -> None:
        if self._incarnation(seq, event.kind, event.req, event.gen, out) is not None:
            self.transfers.load_started(seq, event)

    def _on_transfer_finished(self, seq: int, event: tx.TransferFinished, out: Out) -> None:
        if self._incarnation(seq, event.kind, event.req, event.gen, out) is not None:
            self.transfers.finished_transfer(seq, event, out)

    def _on_blocks_invalid(self, seq: int, event: tx.BlocksInvalid, out: Out) -> None:
        self.transfers.invalid(seq, event, out)

    def _on_transfer_params(self, seq: int, event: tx.TransferParams, out: Out) -> None:
        """Nothing to judge in one journal: the parameters relate two engines'
        journals of one request (a prefill's delayed free, a decode's load)."""

    def _on_cache_reset(self, seq: int, event: tx.CacheReset, out: Out) -> None:
        # The jobs the reset discarded end here: no completion will come for
        # them. A store among them still reads its blocks on a rank until the
        # rank reports it, so under the offloading protocol those blocks stay
        # guarded (UNFLUSHED_REUSE) until then.
        for job_id in event.jobs:
            job = self._job(seq, event.kind, job_id, out)
            if job is None or job.released_seq is not None:
                continue
            for block in job.pins:
                drop(self.blocks, block, seq, out, f"discarding job {job.job}")
            job.released_seq = seq
            self.pinned.pop(job.job, None)
            self.offload.discarded(seq, job)

    def _on_crashed(self, seq: int, event: ev.EngineCrashed, out: Out) -> None:
        self.crashes.append(seq)
        why = f"engine crashed: {event.error}"
        out.append(finding(Code.CRASH, seq, why))

    def _on_refused(self, seq: int, event: ev.RecordRefused, out: Out) -> None:
        """A record the writer refused: what it said is lost, so the run is not clean."""
        why = f"a {event.refused} record was refused and not journaled: {event.error}"
        out.append(finding(Code.RECORD_REFUSED, seq, why))

    def _on_stood_down(self, seq: int, event: ev.ObserverStoodDown, out: Out) -> None:
        if self.stood_down is None:
            self.stood_down = f"seq {seq}: {event.reason}"

    def _on_idle(self, seq: int, event: ev.EngineIdle, out: Out) -> None:
        if self.stood_down is not None:
            # The observer journaled nothing after it stood down: pins,
            # reports and tables it never saw end are not leaks.
            return
        if self.offload.due:
            self.offload.steps_end(seq, out)
        check_quiescent(self, seq, out)

    def _on_key_verified(self, seq: int, event: ev.KeyVerified, out: Out) -> None:
        check_key(self, seq, event, out)

    def _on_key_missing(self, seq: int, event: ev.KeyMissing, out: Out) -> None:
        """Evicted or unreadable: counted, never a violation (nothing wrong was read)."""
        self.keys_missing += 1

    def _on_load_verified(self, seq: int, event: ev.LoadVerified, out: Out) -> None:
        if self._incarnation(seq, event.kind, event.req, event.gen, out) is not None:
            check_load(self, seq, event, out)

    def _on_key_loaded(self, seq: int, event: ev.KeyLoaded, out: Out) -> None:
        """A load of another engine's key: nothing to judge in this run (a
        fleet check joins it with the writer's audit); counted."""
        if self._incarnation(seq, event.kind, event.req, event.gen, out) is not None:
            self.foreign_loads += 1

    # -- views (written out in kvstate._copies) ---------------------------------------

    def snapshot(self) -> Ledger:
        """An independent copy to fold on from (time travel keeps a few of these)."""
        return _copies.snapshot(self)

    def whole(self) -> Ledger:
        """This ledger with every parked job and request back in place.

        For ``--at``, the inspector's exports and equality: views that must
        show history, not just live state. Costs what parking saved.
        """
        return _copies.whole(self)

    def to_dict(self) -> dict[str, Any]:
        """The ledger as plain data (for ``--at`` and the inspector), parked state included."""
        return _copies.to_dict(self)

    def __eq__(self, other: object) -> bool:
        """Two ledgers are equal when every piece of folded state is, parked or not."""
        if not isinstance(other, Ledger):
            return NotImplemented
        return folded_state(self.whole()) == folded_state(other.whole())

    __hash__ = None  # type: ignore[assignment]  # mutable

    def request(self, req: str) -> RequestState | None:
        """The state of ``req``, brought back first if it was parked (for callers
        outside the fold: a connector's questions about a request)."""
        if req not in self.requests and self.parking is not None:
            self.parking.request(req)
        return self.requests.get(req)

    def job(self, job_id: int) -> StoreJobState | None:
        """The state of job ``job_id``, brought back first if it was parked."""
        job = self.jobs.get(job_id)
        if job is None and self.parking is not None:
            job = self.parking.job(job_id)
        return job
