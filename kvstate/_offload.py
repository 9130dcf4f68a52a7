"""The fold's part for connectors that load as well as store (:mod:`kvstate.tier_events`).

:class:`OffloadState` holds what the four checks of the offloading protocol
need and nothing else; the ledger calls it from the records that change it.
It knows jobs only as :class:`~kvstate.state.StoreJobState` rows, so it is a
leaf: it imports no ledger.

- ``LOAD_STORE_OVERLAP`` (vLLM #46014): a request re-admitted while a store
  from before its preemption is still in flight gets a load, and the
  connector's one-transfer-per-request bookkeeping breaks. Checked wherever
  loads are journaled.
- ``TIER_READ_STALE``: a load reads tier keys from its enqueue to its end;
  an eviction or a new store of one of them in that window hands the load
  other bytes. Under the protocol a load of a key the tier does not hold at
  enqueue is one too (the journal then records every store and eviction).
- ``UNFLUSHED_REUSE`` (vLLM #29870, under the protocol only): a store pins
  nothing, so when a block it still reads is handed to a new holder (a new
  epoch), the store must be in that step's ``flush_requested`` or have
  finished reading on every rank (``job_reported`` or ``flush_done``);
  otherwise the new holder's writes race the store's reads.
- ``STALE_COMPLETION`` (vLLM #39186, under the protocol only): a completion
  counted for a job that already ended was meant for some other job.
- ``PROMOTED_UNDER_LATE_WRITE`` (vLLM 0.33.0's reset fence): a cache reset
  releases every tier chunk at once, the chunks of the stores it discarded
  too, but a worker may still write one of them (a late DMA) until it
  reports or flushes that store. A worker's own next copy is ordered after
  the flush; a promotion (the tier's own copy from a lower tier) is not,
  and may fill that chunk meanwhile. 0.33.0 holds promotions until the
  workers reported every job the reset flushed.
- ``STORE_CURSOR_PAST_TABLE`` (vLLM #52211, under the protocol only): a
  resumed request's table starts empty, and so must the connector's store
  cursor: its first store begins where what it loaded ends, or at a chunk
  the tier still holds or a live store is writing. A store whose ``parent``
  (the tier key of the chunk before its first) this incarnation neither
  loaded nor stored, and that the tier neither holds nor is getting, was
  built from a cursor left where the last incarnation's table ended: the
  chunks between are never stored again, and no prefix lookup crosses that
  hole to the keys this store writes.

A finish-time store: the connector builds a finished request's last stores
at the next step, after vLLM freed its blocks, and fences them by the flush
alone. Under the protocol such a store may read its request's final table;
a block of it that a new holder got since the finish must be flushed in
the step that hands it over (``flush_requested`` of that step, recorded
after the store), else ``UNFLUSHED_REUSE``: the new holder's forward pass
writes it while the store still reads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from ._copying import NESTED, PLAIN, SHARED, copied, copied_by
from .state import BlockState, Incarnation, StoreJobState
from .violations import Code, Violation, finding

Out = list[Violation]


def _RESUMED(value: dict[str, tuple[int, int, set[str]]], _new: Any) -> dict[str, Any]:
    """req -> (gen, seq, keys): the keys' set copied."""
    return {req: (gen, seq, set(keys)) for req, (gen, seq, keys) in value.items()}


#: evicted keys remembered, the newest: only a finding's wording ("evicted",
#: not "never held") and its chain read them, and a tier that cycles through
#: prefixes for weeks evicts keys without end (the fold, and every retention
#: checkpoint, would grow with them)
EVICTED_KEPT = 100_000


@attrs.define(slots=True)
class OffloadState:
    """The offloading protocol's folded state (see the module docstring)."""

    #: the header declared ``protocol: "offloading"``
    on: bool = attrs.field(default=False, metadata=copied_by(SHARED))
    #: req -> its jobs enqueued and not yet ended (job -> True for a load)
    live: dict[str, dict[int, bool]] = attrs.field(factory=dict, metadata=copied_by(NESTED))
    #: block -> live stores still reading it on some rank (protocol only)
    readers: dict[int, dict[int, None]] = attrs.field(factory=dict, metadata=copied_by(NESTED))
    #: store job -> ranks on which it finished reading (protocol only)
    read_done: dict[int, set[int]] = attrs.field(factory=dict, metadata=copied_by(NESTED))
    #: the step of the last flush_requested, and the jobs it flushed so far
    flush_step: int = attrs.field(default=-1, metadata=copied_by(SHARED))
    flushed: dict[int, int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: tier key -> the seq of the tier_stored that holds it now
    held: dict[str, int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: tier key -> the seq of the tier_evicted that dropped it last, for the
    #: newest EVICTED_KEPT keys evicted and not stored since
    evicted: dict[str, int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: tier key -> live loads reading it
    reading: dict[str, dict[int, None]] = attrs.field(factory=dict, metadata=copied_by(NESTED))
    #: the seq of the current scheduler step's first record
    step_seq: int = attrs.field(default=0, metadata=copied_by(SHARED))
    #: finish-time store -> (its job_enqueued, that record's seq, a block handed
    #: over this step, the hand-over's seq): to be flushed before the step ends
    due: dict[int, tuple[Any, int, int, int]] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: req -> (gen, the resume's seq, tier keys that incarnation loaded or
    #: stored) while an incarnation begun by ``request_resumed`` runs (protocol only)
    resumed: dict[str, tuple[int, int, set[str]]] = attrs.field(
        factory=dict, metadata=copied_by(_RESUMED)
    )
    #: resumed incarnations that finished in this step, and in the step
    #: before: their finish-time stores come the step after the finish
    finished_now: list[tuple[str, int]] = attrs.field(factory=list, metadata=copied_by(PLAIN))
    finished_before: list[tuple[str, int]] = attrs.field(factory=list, metadata=copied_by(PLAIN))
    #: tier key -> live store jobs writing it (protocol only): the connector
    #: skips a key another store is already writing, as one the tier holds
    storing: dict[str, dict[int, None]] = attrs.field(factory=dict, metadata=copied_by(NESTED))
    #: store job a cache reset discarded -> the reset's seq, while it may still
    #: copy into its released tier chunk on some rank and no promotion was
    #: flagged against it yet
    late: dict[int, int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))

    def copy(self) -> OffloadState:
        return copied(self)

    # -- jobs begin and end --------------------------------------------------------------

    def enqueued(
        self, seq: int, job: StoreJobState, jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        """A store or load job was enqueued: it must not overlap the other kind."""
        mine = self.live.setdefault(job.req, {})
        other = next((j for j, is_load in mine.items() if is_load != job.load), None)
        if other is not None:
            earlier = jobs.get(other)
            what = "load" if job.load else "store"
            then = "store" if job.load else "load"
            why = (
                f"{what} job {job.job} of {job.req!r} enqueued while its {then} job {other} "
                f"(of gen {earlier.gen if earlier else '?'}) is still in flight: a load and "
                f"a store of one request at once"
            )
            out.append(
                finding(
                    Code.LOAD_STORE_OVERLAP,
                    seq,
                    why,
                    earlier.enqueued_seq if earlier else None,
                    of=job,
                )
            )
        mine[job.job] = job.load
        if self.resumed:
            self._cursor(seq, job, out)
        if job.load:
            self._load_reads(seq, job, out)
        elif self.on:
            for key in job.keys:
                self.storing.setdefault(key, {})[job.job] = None
        if self.on and not job.load and job.reads:
            self.read_done[job.job] = set()
            for block in job.reads:
                self.readers.setdefault(block, {})[job.job] = None

    def _load_reads(self, seq: int, job: StoreJobState, out: Out) -> None:
        for key in job.keys:
            if self.on and key not in self.held:
                gone = self.evicted.get(key)
                why = f"load job {job.job} reads tier key {key!r}, which the tier " + (
                    "evicted" if gone is not None else "never held"
                )
                out.append(finding(Code.TIER_READ_STALE, seq, why, gone, of=job, key=key))
            self.reading.setdefault(key, {})[job.job] = None

    # -- the store cursor of a resumed request -----------------------------------------

    def resumed_at(self, seq: int, req: str, gen: int) -> None:
        """``req`` runs again as ``gen``: a table, and a store cursor, from nothing."""
        if self.on:
            self.resumed[req] = (gen, seq, set())

    def preempted(self, req: str) -> None:
        """``req`` was preempted: its incarnation stores no more."""
        if self.resumed:
            self.resumed.pop(req, None)

    def finished(self, req: str, gen: int) -> None:
        """``req`` finished: its last stores are built in the next step, then it stores no more."""
        mine = self.resumed.get(req)
        if mine is not None and mine[0] == gen:
            self.finished_now.append((req, gen))

    def _forget_finished(self) -> None:
        for req, gen in self.finished_before:
            mine = self.resumed.get(req)
            if mine is not None and mine[0] == gen:
                del self.resumed[req]
        self.finished_before, self.finished_now = self.finished_now, []

    def _cursor(self, seq: int, job: StoreJobState, out: Out) -> None:
        mine = self.resumed.get(job.req)
        if mine is None or mine[0] != job.gen:
            return
        _, resumed_seq, covered = mine
        parent = job.parent
        if not job.load and parent is not None and parent not in covered:
            self._past_the_table(seq, job, parent, resumed_seq, out)
        covered.update(job.keys)

    def _past_the_table(
        self, seq: int, job: StoreJobState, parent: str, resumed_seq: int, out: Out
    ) -> None:
        """A resumed request's store begins after ``parent``, a chunk it never
        loaded or stored: right only while the tier holds it or a live store
        writes it (the connector skips what the tier has or is getting)."""
        if parent in self.held or parent in self.storing:
            return
        gone = self.evicted.get(parent)
        why = (
            f"store job {job.job} of {job.req}/{job.gen} begins after tier key "
            f"{parent!r}, which this incarnation neither loaded nor stored and the "
            "tier " + ("evicted" if gone is not None else "does not hold") + ": its "
            "store cursor was left where the last incarnation's table ended when the "
            "table was cleared at the resume, so the chunks before are never stored "
            "again and no prefix lookup reaches the keys this job stores"
        )
        code = Code.STORE_CURSOR_PAST_TABLE
        out.append(finding(code, seq, why, resumed_seq, gone, of=job, key=parent))

    def ended(self, job: StoreJobState) -> None:
        """The job's end (``pins_released``): it reads and races nothing any more."""
        self._end(job)
        if not job.load:
            self._stop_reading(job)

    def discarded(self, seq: int, job: StoreJobState) -> None:
        """The job ends without its copies' end: the cache reset at ``seq``
        discarded it, and a store may still read its blocks and write its tier
        chunk on a rank until that rank reports it (``_stop_reading`` then runs
        from the report or the flush, as for a live store)."""
        self._end(job)
        if not job.load and job.job in self.read_done:
            self.late[job.job] = seq

    def _end(self, job: StoreJobState) -> None:
        mine = self.live.get(job.req)
        if mine is not None:
            mine.pop(job.job, None)
            if not mine:
                del self.live[job.req]
        if job.load:
            for key in job.keys:
                self._forget(self.reading, key, job.job)
        elif self.storing:
            for key in job.keys:
                self._forget(self.storing, key, job.job)

    def _stop_reading(self, job: StoreJobState) -> None:
        if self.read_done.pop(job.job, None) is None:
            return
        self.late.pop(job.job, None)
        for block in job.reads:
            self._forget(self.readers, block, job.job)

    @staticmethod
    def _forget(index: dict[Any, dict[int, None]], name: Any, job: int) -> None:
        holders = index.get(name)
        if holders is not None:
            holders.pop(job, None)
            if not holders:
                del index[name]

    # -- flushes and completions ---------------------------------------------------------

    def flush_requested(self, seq: int, step: int, job_ids: tuple[int, ...]) -> None:
        if step != self.flush_step:
            self.flush_step, self.flushed = step, {}
        due = self.due
        for job in job_ids:
            self.flushed.setdefault(job, seq)
            if due:
                due.pop(job, None)

    def fenced_reads(
        self,
        seq: int,
        event: Any,
        blocks: Iterable[int],
        inc: Incarnation,
        states: dict[int, BlockState],
        out: Out,
    ) -> None:
        """A finish-time store reads ``blocks`` of its request's final table
        (see the module docstring): each one handed over since the finish must
        be flushed in this step."""
        finished = inc.ended_seq or 0
        for block in sorted(blocks):
            state = states.get(block)
            given = state.epoch_seq if state is not None else None
            if given is None or given <= finished:
                continue  # still free: a later hand-over is checked by reused()
            if given >= self.step_seq:
                self.due.setdefault(event.job, (event, seq, block, given))
                continue
            why = (
                f"store job {event.job} of {inc.name} reads block {block} of the "
                f"finished request's table, but the block was handed to "
                f"{state.epoch_holder if state else 'another holder'} in an earlier "
                f"step (seq {given}): its new holder may have written it already"
            )
            out.append(
                finding(Code.UNFLUSHED_REUSE, seq, why, finished, given, of=event, block=block)
            )

    def step_began(self, seq: int, out: Out) -> None:
        """A new scheduler step: the last one's due flushes are late now."""
        if self.due:
            self.steps_end(seq, out)
        if self.finished_before or self.finished_now:
            self._forget_finished()
        self.step_seq = seq

    def steps_end(self, seq: int, out: Out) -> None:
        """The step ended (a new one, or ``engine_idle``): report what it did not flush."""
        for job, (event, enqueued, block, given) in sorted(self.due.items()):
            why = (
                f"store job {job} of {event.req}/{event.gen} reads block {block} of "
                f"its finished request's table; "
                f"the block was handed to a new holder in the same step (seq {given}), "
                f"and that step ended without a flush of the job: the new holder's "
                f"writes race the store's reads"
            )
            out.append(
                finding(Code.UNFLUSHED_REUSE, seq, why, enqueued, given, of=event, block=block)
            )
        self.due.clear()

    def finished_reading(self, job: StoreJobState, rank: int) -> None:
        """Rank ``rank`` is done with the store's blocks (reported, or waited for)."""
        done = self.read_done.get(job.job)
        if done is None:
            return
        done.add(rank)
        if len(done) >= job.world_size:
            self._stop_reading(job)

    def reused(
        self, seq: int, step: int, block: int, jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        """``block`` got a new epoch at ``seq``: every store still reading it
        must have been flushed in this step."""
        flushed = self.flushed if step == self.flush_step else {}
        for job_id in list(self.readers.get(block, ())):
            if job_id in flushed:
                continue
            job = jobs.get(job_id)
            if job is None:
                continue
            done = self.read_done.get(job_id, set())
            why = (
                f"block {block}, still read by store job {job_id} (finished on "
                f"{len(done)} of {job.world_size} rank(s)), handed to a new holder "
                f"without a flush of that job in step {step}: the new holder's "
                f"writes race the store's reads"
            )
            out.append(
                finding(Code.UNFLUSHED_REUSE, seq, why, job.enqueued_seq, of=job, block=block)
            )
            # Reported once per job: its later reuses are the same race.
            self._stop_reading(job)

    def stale_completion(self, seq: int, job: StoreJobState, out: Out) -> bool:
        """Under the protocol, a completion of a job that ended is stale."""
        if not self.on or job.released_seq is None:
            return False
        why = (
            f"completion received for job {job.job} of {job.req!r}, which ended at "
            f"seq {job.released_seq}: it was meant for another transfer"
        )
        out.append(
            finding(Code.STALE_COMPLETION, seq, why, job.enqueued_seq, job.released_seq, of=job)
        )
        return True

    # -- the tier ------------------------------------------------------------------------

    def tier_stored(
        self, seq: int, keys: tuple[str, ...], jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        for key in keys:
            self._under_a_load(seq, key, "rewritten", jobs, out)
            self.held[key] = seq
            self.evicted.pop(key, None)

    def tier_promoted(
        self, seq: int, keys: tuple[str, ...], jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        """The tier filled chunks by its own copy: checked against the late
        writes of the stores a cache reset discarded, then held as stored."""
        # once per discarded store, as UNFLUSHED_REUSE is: its later
        # promotions race the same late write
        flagged, self.late = self.late, {}
        for job_id, reset_seq in flagged.items():
            job = jobs.get(job_id)
            why = (
                f"the tier promoted {len(keys)} key(s) into its chunks while store job "
                f"{job_id}, discarded by the cache reset at seq {reset_seq}, may still "
                "write the tier chunk it had (a late DMA): its rank(s) have neither "
                "reported nor flushed it, and the reset released that chunk at once"
            )
            code = Code.PROMOTED_UNDER_LATE_WRITE
            enqueued = job.enqueued_seq if job is not None else None
            first = keys[0] if keys else None
            out.append(finding(code, seq, why, reset_seq, enqueued, of=job, job=job_id, key=first))
        self.tier_stored(seq, keys, jobs, out)

    def tier_evicted(
        self, seq: int, keys: tuple[str, ...], jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        for key in keys:
            self._under_a_load(seq, key, "evicted", jobs, out)
            self.held.pop(key, None)
            self.evicted.pop(key, None)  # the newest eviction last
            self.evicted[key] = seq
            if len(self.evicted) > EVICTED_KEPT:
                del self.evicted[next(iter(self.evicted))]  # the oldest

    def _under_a_load(
        self, seq: int, key: str, how: str, jobs: dict[int, StoreJobState], out: Out
    ) -> None:
        for job_id in self.reading.get(key, ()):
            load = jobs.get(job_id)
            if load is None:
                continue
            why = f"tier key {key!r} {how} while load job {job_id} still reads it"
            out.append(
                finding(
                    Code.TIER_READ_STALE,
                    seq,
                    why,
                    load.enqueued_seq,
                    self.held.get(key),
                    of=load,
                    key=key,
                )
            )
