"""The per-rank fold: what one worker rank knows, and the checks that need
only that.

A :class:`RankLedger` applies the worker-side records of one rank. It is used
twice, which is the point: the reference :class:`~kvstate.ledger.Ledger` keeps
one per rank while replaying a journal, and a live
:class:`~kvstate.worker.WorkerLedger` keeps one for its own rank. Liveness,
staleness and every rank-local invariant are therefore defined once, here.

The rank learns what a job is (its request, generation and key chain) from a
``jobs`` mapping it is given: the reference ledger's enqueued jobs during
replay, the connector's metadata in a live worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs

from . import events as ev
from .state import RankJobState, StoreRequestState
from .violations import Code, JobLike, Violation, finding


class JobInfo(JobLike, Protocol):
    """What a rank must know about a job to judge its records (read only)."""

    @property
    def keys(self) -> tuple[str, ...]: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def enqueued_seq(self) -> int | None: ...


Out = list[Violation]


#: how a field of :class:`RankState` is keyed, which decides how it is parked
BY = "kvstate.by"
#: the state-row class of a field's values (copied with ``.copy()``, parked as rows)
ROW = "kvstate.row"


@attrs.define(slots=False)
class RankState:
    """The folded state of one rank, declared once.

    Equality is attrs', and :meth:`RankLedger.clone` and the parking of a
    settled request (:mod:`kvstate._parking`) walk these fields, each by how
    it is keyed: a new field is one line here.
    """

    jobs: dict[int, RankJobState] = attrs.field(
        factory=dict, metadata={BY: "job", ROW: RankJobState}
    )
    requests: dict[str, StoreRequestState] = attrs.field(
        factory=dict, metadata={BY: "req", ROW: StoreRequestState}
    )
    #: (req, gen) -> seq of the preemption_seen that ended it on this rank
    ended: dict[tuple[str, int], int] = attrs.field(
        factory=dict, metadata={BY: "incarnation", ROW: None}
    )
    #: (req, gen) -> (last saved offset, its seq), for OFFSET_REWOUND
    offsets: dict[tuple[str, int], tuple[int, int]] = attrs.field(
        factory=dict, metadata={BY: "incarnation", ROW: None}
    )
    #: req -> (greatest gen of a job received here, the seq of that receipt)
    newest_received: dict[str, tuple[int, int]] = attrs.field(
        factory=dict, metadata={BY: "req", ROW: None}
    )
    #: req -> (greatest gen any record here named, its seq): receipts and preemption notices
    newest_seen: dict[str, tuple[int, int]] = attrs.field(
        factory=dict, metadata={BY: "req", ROW: None}
    )
    #: (req, gen) -> jobs of that incarnation received here (tuples: snapshots share them)
    by_incarnation: dict[tuple[str, int], tuple[int, ...]] = attrs.field(
        factory=dict, metadata={BY: "incarnation", ROW: None}
    )


class RankLedger(RankState):
    """The folded state of one rank (:class:`RankState`) and the records that change it."""

    def __init__(
        self, rank: int, jobs: Mapping[int, JobInfo], *, knows_all_jobs: bool = True
    ) -> None:
        super().__init__()
        self.rank = rank
        self._info = jobs
        #: replay sees every enqueue, so a job missing from ``jobs`` was never
        #: enqueued (CAUSALITY); a live worker knows only the jobs it
        #: registered, so there a missing job ran unregistered (UNLEDGERED_JOB)
        self.knows_all_jobs = knows_all_jobs
        #: job -> its key chain as key -> first position, built at the job's
        #: first KV event (a lookup per event, not a scan: a job may have
        #: hundreds of thousands of keys); a cache, not folded state
        self._key_positions: dict[int, tuple[tuple[str, ...], dict[str, int]]] = {}
        self._dispatch: dict[type, Callable[[int, Any, Out], RankJobState | None]] = {
            ev.JobReceived: self._on_received,
            ev.PreemptionSeen: self._on_preemption_seen,
            ev.JobStarted: self._on_started,
            ev.JobSkipped: self._on_skipped,
            ev.DmaStarted: self._on_dma,
            ev.DmaDone: self._on_dma,
            ev.PutDone: self._on_put,
            ev.PutFailed: self._on_put,
            ev.OffsetSaved: self._on_offset_saved,
            ev.RequestMarkedSkipped: self._on_marked_skipped,
            ev.RetryTokensSet: self._on_retry_set,
            ev.RetryTokensCleared: self._on_retry_cleared,
            ev.KvBlockStored: self._on_kv_block_stored,
            ev.RequestRetired: self._on_retired,
            ev.JobReported: self._on_reported,
        }

    # -- decisions (functions of folded state) --------------------------------------

    def stale_since(self, info: JobInfo) -> int | None:
        """The seq from which ``info``'s job is stale on this rank, or None if it is not.

        Stale (docs/events.md, "Worker side"): the rank saw ``preemption_seen`` for the job's
        incarnation, or received a job of the same request with a greater gen.
        """
        received = self.newest_received.get(info.req)
        if received is not None and received[0] > info.gen:
            return received[1]
        return self.ended.get((info.req, info.gen))

    def _saw(self, seen: dict[str, tuple[int, int]], req: str, gen: int, seq: int) -> None:
        current = seen.get(req)
        if current is None or gen > current[0]:
            seen[req] = (gen, seq)

    def is_live(self, job: int) -> bool:
        """Registered here, of the newest generation, not ended, not yet reported."""
        info = self._info.get(job)
        if info is None:
            return False
        state = self.requests.get(info.req)
        return state is not None and job in state.live_jobs

    def pending_jobs(self, req: str, gen: int) -> list[int]:
        """Jobs of ``(req, gen)`` received on this rank and not reported yet.

        A job missing from ``jobs`` was parked by the reference ledger, which
        parks only jobs that every rank holding them has reported.
        """
        jobs = self.jobs
        return [
            job
            for job in self.by_incarnation.get((req, gen), ())
            if job in jobs and jobs[job].reported_seq is None
        ]

    # -- the fold ----------------------------------------------------------------------

    def apply(self, seq: int, event: ev.Event, out: Out) -> RankJobState | None:
        """Fold one worker record of this rank; breaches are appended to ``out``.

        Returns the rank's state of the job the record names, if any.
        """
        return self._dispatch[type(event)](seq, event, out)

    def _job(self, seq: int, event: Any, out: Out) -> tuple[JobInfo, RankJobState] | None:
        """The job a record names; flags an unknown or unregistered job."""
        info = self._info.get(event.job)
        if info is None:
            if self.knows_all_jobs:
                code, why = Code.CAUSALITY, "which was never enqueued"
            else:
                code, why = Code.UNLEDGERED_JOB, "which the rank never registered (job_received)"
            why = f"{event.kind} on rank {self.rank} names job {event.job}, {why}"
            out.append(finding(code, seq, why, job=event.job, rank=self.rank))
            return None
        rj = self.jobs.get(event.job)
        if rj is None or rj.received_seq is None:
            why = (
                f"{event.kind} for job {event.job} on rank {self.rank} before the rank "
                "registered it (job_received): it ran unledgered"
            )
            out.append(
                finding(Code.UNLEDGERED_JOB, seq, why, info.enqueued_seq, of=info, rank=self.rank)
            )
            if rj is None:
                rj = self._track(info, RankJobState(event.job, self.rank))
        return info, rj

    def _phase_job(self, seq: int, event: Any, out: Out) -> RankJobState | None:
        """:meth:`_job` for records that need only the rank's state of the job
        (the common, clean case costs two lookups)."""
        job = event.job
        rj = self.jobs.get(job)
        if rj is not None and rj.received_seq is not None and job in self._info:
            return rj
        found = self._job(seq, event, out)
        return None if found is None else found[1]

    def _track(self, info: JobInfo, rj: RankJobState) -> RankJobState:
        self.jobs[info.job] = rj
        key = (info.req, info.gen)
        self.by_incarnation[key] = (*self.by_incarnation.get(key, ()), info.job)
        return rj

    def _on_received(self, seq: int, event: ev.JobReceived, out: Out) -> RankJobState | None:
        info = self._info.get(event.job)
        if info is None:
            self._job(seq, event, out)  # flags the unknown job
            return None
        rj = self.jobs.get(event.job)
        if rj is not None and rj.received_seq is not None:
            why = f"job {event.job} received twice on rank {self.rank}"
            out.append(
                finding(
                    Code.DUPLICATE_RECEIVE, seq, why, rj.received_seq, job=event.job, rank=self.rank
                )
            )
            return rj
        if rj is None:
            rj = self._track(info, RankJobState(event.job, self.rank, received_seq=seq))
        else:  # records arrived before the registration; they were flagged then
            rj.received_seq = seq
        self._saw(self.newest_received, info.req, info.gen, seq)
        self._saw(self.newest_seen, info.req, info.gen, seq)
        state = self.requests.get(info.req)
        if state is None or info.gen > state.gen:
            # A newer generation replaces the request's state wholesale: the
            # old generation's jobs are no longer in live_jobs, so they can
            # neither retire it nor write its offset (the req_id ABA).
            state = StoreRequestState(info.req, info.gen, seq)
            self.requests[info.req] = state
        if info.gen == state.gen and (info.req, info.gen) not in self.ended:
            state.live_jobs.add(event.job)
        return rj

    def _on_preemption_seen(self, seq: int, event: ev.PreemptionSeen, out: Out) -> None:
        self.ended.setdefault((event.req, event.gen), seq)
        self._saw(self.newest_seen, event.req, event.gen, seq)
        state = self.requests.get(event.req)
        if state is None or event.gen > state.gen:
            state = StoreRequestState(event.req, event.gen, seq)
            self.requests[event.req] = state
        if event.gen == state.gen:
            # Like the fixed connector: the ended generation's ledger entry,
            # offset and pressure mark go at once, so queued jobs turn stale.
            state.live_jobs.clear()
            state.saved_offset = 0
            state.skipped = False
            state.retry_tokens = None
            state.ended = True
        return None

    def _on_started(self, seq: int, event: ev.JobStarted, out: Out) -> RankJobState | None:
        rj = self._phase_job(seq, event, out)
        if rj is None:
            return None
        rj.phase, rj.started_seq = "started", seq
        return rj

    def _on_skipped(self, seq: int, event: ev.JobSkipped, out: Out) -> RankJobState | None:
        rj = self._phase_job(seq, event, out)
        if rj is None:
            return None
        rj.phase, rj.skip_reason = "skipped", event.reason
        return rj

    def _on_dma(self, seq: int, event: ev.DmaStarted | ev.DmaDone, out: Out) -> RankJobState | None:
        rj = self._phase_job(seq, event, out)
        if rj is None:
            return None
        rj.phase, rj.dma_seq = event.kind, seq
        return rj

    def _on_put(self, seq: int, event: ev.PutDone | ev.PutFailed, out: Out) -> RankJobState | None:
        rj = self._phase_job(seq, event, out)
        if rj is None:
            return None
        rj.phase, rj.put_seq = event.kind, seq
        rj.put_ok = type(event) is ev.PutDone
        return rj

    # -- effects: the records a stale job must never write ----------------------------

    def _effect(self, seq: int, event: Any, out: Out) -> StoreRequestState | None:
        """Common checks of the job-carrying effects; returns the state they change."""
        found = self._job(seq, event, out)
        if found is None:
            return None
        info, rj = found
        if event.req != info.req:
            why = (
                f"{event.kind} by job {info.job} names request {event.req!r}, "
                f"but the job belongs to {info.req!r}"
            )
            out.append(
                finding(
                    Code.CAUSALITY,
                    seq,
                    why,
                    info.enqueued_seq,
                    job=info.job,
                    req=event.req,
                    rank=self.rank,
                )
            )
            return None
        stale = self.stale_since(info)
        if stale is not None:
            received = self.newest_received.get(info.req)
            why = (
                f"the rank had received a job of generation {received[0]}"
                if received is not None and received[1] == stale
                else "the rank had seen it preempted or finished"
            )
            why = (
                f"{event.kind} by stale job {info.job} of {info.req}/{info.gen} on rank "
                f"{self.rank}: {why} (seq {stale})"
            )
            out.append(
                finding(
                    Code.STALE_GENERATION,
                    seq,
                    why,
                    info.enqueued_seq,
                    rj.received_seq,
                    stale,
                    of=info,
                    rank=self.rank,
                )
            )
        state = self.requests.get(info.req)
        if state is None:
            state = StoreRequestState(info.req, info.gen, seq)
            self.requests[info.req] = state
        # Applied even when stale: the reference ledger records what the
        # engine did, so the damage (a rewound offset of the new generation)
        # is visible in --at and the inspector.
        return state

    def _on_offset_saved(self, seq: int, event: ev.OffsetSaved, out: Out) -> None:
        state = self._effect(seq, event, out)
        if state is None:
            return None
        gen = self._info[event.job].gen
        last = self.offsets.get((event.req, gen))
        if last is not None and event.offset < last[0]:
            why = (
                f"rank {self.rank} saved offset {event.offset} for {event.req}/{gen}, "
                f"below its earlier {last[0]}"
            )
            out.append(
                finding(
                    Code.OFFSET_REWOUND,
                    seq,
                    why,
                    last[1],
                    job=event.job,
                    req=event.req,
                    gen=gen,
                    rank=self.rank,
                )
            )
        self.offsets[(event.req, gen)] = (event.offset, seq)
        state.saved_offset = event.offset
        return None

    def _on_marked_skipped(self, seq: int, event: ev.RequestMarkedSkipped, out: Out) -> None:
        state = self._effect(seq, event, out)
        if state is not None:
            state.skipped = True
        return None

    def _on_retry_set(self, seq: int, event: ev.RetryTokensSet, out: Out) -> None:
        state = self._effect(seq, event, out)
        if state is not None:
            state.retry_tokens = (event.start, event.count)
        return None

    def _on_retry_cleared(self, seq: int, event: ev.RetryTokensCleared, out: Out) -> None:
        state = self._effect(seq, event, out)
        if state is not None:
            state.retry_tokens = None
        return None

    def _on_retired(self, seq: int, event: ev.RequestRetired, out: Out) -> None:
        state = self.requests.get(event.req)
        seen = self.newest_seen.get(event.req)
        if seen is not None and event.gen < seen[0]:
            why = (
                f"rank {self.rank} retired {event.req}/{event.gen} after it had seen "
                f"generation {seen[0]} (seq {seen[1]})"
            )
            out.append(
                finding(
                    Code.STALE_GENERATION,
                    seq,
                    why,
                    seen[1],
                    req=event.req,
                    gen=event.gen,
                    rank=self.rank,
                )
            )
        pending = self.pending_jobs(event.req, event.gen)
        if pending:
            first = self.jobs[pending[0]]
            listed = ", ".join(map(str, pending))
            why = (
                f"rank {self.rank} retired {event.req}/{event.gen} while job(s) {listed} "
                "received there were not reported"
            )
            out.append(
                finding(
                    Code.PREMATURE_RETIRE,
                    seq,
                    why,
                    *(self.jobs[j].received_seq for j in pending),
                    job=first.job,
                    req=event.req,
                    gen=event.gen,
                    rank=self.rank,
                )
            )
        if state is not None and event.gen == state.gen:
            state.retired = True
        return None

    # -- KV events and the report --------------------------------------------------------

    def _on_kv_block_stored(
        self, seq: int, event: ev.KvBlockStored, out: Out
    ) -> RankJobState | None:
        found = self._job(seq, event, out)
        if found is None:
            return None
        info, rj = found
        keys = info.keys
        cached = self._key_positions.get(info.job)
        if cached is None or cached[0] is not keys:  # new, or the id was reused
            positions: dict[str, int] = {}
            for n, key in enumerate(keys):
                positions.setdefault(key, n)
            cached = self._key_positions[info.job] = (keys, positions)
        i = cached[1].get(event.key)
        if i is not None:
            expected = keys[i - 1] if i else info.parent
            if event.parent != expected:
                why = (
                    f"KV event for {event.key!r} names parent {event.parent!r}; the "
                    f"request's hash chain says {expected!r}"
                )
                out.append(
                    finding(
                        Code.PARENT_CHAIN_BROKEN,
                        seq,
                        why,
                        info.enqueued_seq,
                        of=info,
                        rank=self.rank,
                        key=event.key,
                    )
                )
        else:
            why = f"KV event for {event.key!r}, which is not in job {info.job}'s key chain"
            out.append(
                finding(
                    Code.PARENT_CHAIN_BROKEN,
                    seq,
                    why,
                    info.enqueued_seq,
                    of=info,
                    rank=self.rank,
                    key=event.key,
                )
            )
        return rj

    def _on_reported(self, seq: int, event: ev.JobReported, out: Out) -> RankJobState | None:
        found = self._job(seq, event, out)
        if found is None:
            return None
        info, rj = found
        rj.reports += 1
        if rj.reported_seq is not None:
            why = f"job {info.job} reported a second time by rank {self.rank}"
            out.append(
                finding(Code.DOUBLE_REPORT, seq, why, rj.reported_seq, of=info, rank=self.rank)
            )
            return rj
        rj.phase, rj.reported_seq = "reported", seq
        self._key_positions.pop(info.job, None)
        state = self.requests.get(info.req)
        if state is not None:
            state.live_jobs.discard(info.job)
        return rj

    def __eq__(self, other: object) -> bool:
        """Equal when every field of :class:`RankState` is, and the rank (the job
        descriptions are the ledger's, compared there)."""
        if not isinstance(other, RankLedger):
            return NotImplemented
        same = (self.rank, self.knows_all_jobs) == (other.rank, other.knows_all_jobs)
        return same and RankState.__eq__(self, other) is True

    __hash__ = None  # mutable

    def clone(self, jobs: Mapping[int, JobInfo]) -> RankLedger:
        """A copy of this rank's state, reading job descriptions from ``jobs``."""
        new = RankLedger(self.rank, jobs, knows_all_jobs=self.knows_all_jobs)
        for field in attrs.fields(RankState):
            value = getattr(self, field.name)
            if field.metadata[ROW] is not None:
                value = {key: row.copy() for key, row in value.items()}
            else:
                value = dict(value)
            setattr(new, field.name, value)
        return new

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "requests": {req: s.to_dict() for req, s in sorted(self.requests.items())},
        }


class RanksAlone:
    """The fold of ranks that record without their scheduler (an audit of a
    worker process's recorder): each rank's records go to that rank's
    ledger, and a record of a rank that registered nothing here is not
    this fold's."""

    def __init__(self, ranks: dict[int, RankLedger]) -> None:
        self.ranks = ranks

    def apply(self, seq: int, step: int, event: ev.Event) -> list[Violation]:
        found: list[Violation] = []
        rank = ev.rank_of(event)
        ledger = self.ranks.get(rank) if rank is not None else None
        if ledger is not None:
            ledger.apply(seq, event, found)
        return found
