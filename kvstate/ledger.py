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
``engine_idle``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from journal import RecordError

from . import events as ev
from ._layered import LayeredSet
from ._parking import (
    PARK_AFTER,
    SWEEP_EVERY,
    pack_job,
    pack_request,
    sweep,
    unpack_job,
    unpack_request,
)
from .archive import Archive
from .codec import Entry
from .rank import RankLedger
from .state import (
    FINISHED,
    PREEMPTED,
    BlockState,
    Incarnation,
    RequestState,
    StoreJobState,
)
from .violations import Code, Violation, chain_of, finding

Out = list[Violation]
K = TypeVar("K")

#: kinds whose ``job`` names a job the fold must have at hand (the audit kinds
#: only name the job a key's value came from; an enqueue creates its job)
_JOB_RECORDS = frozenset(
    cls
    for cls in ev.EVENT_TYPES.values()
    if "job" in cls.payload_fields and cls not in (ev.KeyVerified, ev.LoadVerified, ev.JobEnqueued)
)


class Ledger:
    """The whole engine as the journal describes it.

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
        self.observes_workers = observes_workers
        self.archive = archive if archive is not None else Archive()
        #: whether settled entities are parked (only when an archive was given)
        self.parks = archive is not None
        self.park_after = park_after
        self.sweep_every = sweep_every
        # Jobs and requests by the record count at which a record last named
        # them, oldest first: a sweep parks from the front.
        self._named_jobs: OrderedDict[int, int] = OrderedDict()
        self._named_requests: OrderedDict[str, int] = OrderedDict()
        #: requests with a job enqueued for an incarnation that does not exist:
        #: their ranks' state is keyed by gens the request does not list, so
        #: they are never parked
        self._unparkable: set[str] = set()
        self.header: ev.JournalOpened | None = None
        self.requests: dict[str, RequestState] = {}
        self.blocks: dict[int, BlockState] = {}
        self.jobs: dict[int, StoreJobState] = {}
        self.ranks: dict[int, RankLedger] = {}
        self.last_job: int | None = None
        self.last_job_seq: int | None = None
        self.step = 0
        self.records = 0
        #: the last record folded: its seq and kind (for the end-of-journal check)
        self.last_seq: int | None = None
        self.last_kind: str | None = None
        self.crashes: list[int] = []
        #: key_missing records: keys the store no longer had when read back
        self.keys_missing = 0
        #: jobs whose pins are still held, in enqueue order
        self.pinned: dict[int, None] = {}
        #: (code, entity) of the findings reported once (copies share it, see _layered)
        self._reported_once = LayeredSet()
        self._dispatch: dict[type, Callable[[int, Any, Out], None]] = {
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
            ev.KeyMissing: self._on_key_missing,
        }

    # -- geometry --------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.header.block_size if self.header is not None else 1

    @property
    def world_size(self) -> int:
        return self.header.world_size if self.header is not None else 1

    # -- the transition function ---------------------------------------------------

    def apply(self, seq: int, step: int, event: ev.Event) -> list[Violation]:
        """Fold one record; return the violations (and warnings) it causes.

        Raises :class:`journal.RecordError` when the input is unusable as a
        journal: the first record is not ``journal_opened``, or a later header
        disagrees with the first.
        """
        out: Out = []
        if self.header is None or type(event) is ev.JournalOpened:
            problem = ev.header_problem(self.header, event)
            if problem is not None:
                raise RecordError(problem, seq=seq)
        self.records += 1
        self.last_seq, self.last_kind = seq, event.kind
        if self.parks:
            self._unpark_named(event)
        if event.side == ev.SIDE_SCHEDULER:
            if step < self.step:
                why = f"scheduler step went back from {self.step} to {step}"
                out.append(finding(Code.STEP_REGRESSED, seq, why))
            else:
                self.step = step
        if event.side == ev.SIDE_WORKER:
            self._on_worker(seq, event, out)
        else:
            self._dispatch[type(event)](seq, event, out)
        if self.parks and self.records % self.sweep_every == 0:
            self._park_settled()
        return out

    def fold(self, entries: Iterable[Entry]) -> list[Violation]:
        """Apply entries in order, then the end-of-journal check; return every finding."""
        found: list[Violation] = []
        for entry in entries:
            found.extend(self.apply(entry.seq, entry.step, entry.event))
        found.extend(self.end())
        return found

    def end(self) -> list[Violation]:
        """The journal ends here: warn if it ends before the engine did (spec section 8).

        The quiescence checks run only at ``engine_idle``. A journal that
        stops elsewhere (a killed process, a truncated file, a removed tail)
        was never checked for leaked pins, missing reports or held blocks,
        so it must not read as plainly clean.
        """
        if self.last_kind in ("engine_idle", "engine_crashed") or self.last_seq is None:
            return []
        return [
            finding(
                Code.UNFINISHED,
                self.last_seq,
                f"the journal ends at seq {self.last_seq} ({self.last_kind}) without "
                "engine_idle or engine_crashed: the end-of-run checks (LEAKED_PIN, "
                "MISSING_REPORT, HELD_FOREVER) did not run",
            )
        ]

    # -- blocks ------------------------------------------------------------------------

    def _block(self, block: int) -> BlockState:
        state = self.blocks.get(block)
        if state is None:
            state = self.blocks[block] = BlockState(block)
        return state

    def _assign(self, block: int, seq: int, cached: bool, holder: str) -> None:
        """A table takes a block; a free block not offered as a cache hit gets a new epoch."""
        state = self._block(block)
        if state.refs == 0 and not cached:
            state.epoch += 1
            state.epoch_seq = seq
            state.epoch_holder = holder
            state.prior_free_seq = state.freed_seq
        state.refs += 1

    def _drop(self, block: int, seq: int, out: Out, why: str) -> None:
        state = self._block(block)
        if state.refs == 0:
            why = f"{why} drops block {block}, which has no holder left"
            out.append(finding(Code.REFCOUNT_UNDERFLOW, seq, why, state.freed_seq, block=block))
            return
        state.refs -= 1
        if state.refs == 0:
            state.freed_seq = seq

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

    def _on_admitted(self, seq: int, event: ev.RequestAdmitted, out: Out) -> None:
        inc = self._new_generation(seq, event.kind, event.req, event.gen, out)
        inc.prompt_tokens = event.prompt_tokens

    def _on_resumed(self, seq: int, event: ev.RequestResumed, out: Out) -> None:
        if event.req not in self.requests:
            why = f"request_resumed for {event.req}, which was never admitted"
            out.append(finding(Code.CAUSALITY, seq, why, req=event.req, gen=event.gen))
        self._new_generation(seq, event.kind, event.req, event.gen, out)

    def _on_blocks_assigned(self, seq: int, event: ev.BlocksAssigned, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        cached = set(event.cached)
        holder = inc.name
        # Take the new refs before dropping the old table: a block that stays
        # in a replaced table never passes through refs == 0, so it keeps its
        # epoch.
        for block in event.blocks:
            self._assign(block, seq, block in cached, holder)
        if event.mode == "replace":
            for block in inc.table:
                self._drop(block, seq, out, f"replacing the table of {holder}")
            inc.table = list(event.blocks)
        else:
            inc.table.extend(event.blocks)
        inc.table_seq = seq

    def _drop_table(self, seq: int, inc: Incarnation, out: Out, why: str) -> None:
        for block in inc.table:
            self._drop(block, seq, out, why)
        inc.table = []
        inc.table_seq = seq

    def _on_preempted(self, seq: int, event: ev.RequestPreempted, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        self._drop_table(seq, inc, out, f"preempting {inc.name}")
        inc.state, inc.ended_seq = PREEMPTED, seq

    def _on_finished(self, seq: int, event: ev.RequestFinished, out: Out) -> None:
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is None:
            return
        inc.final_table_len = len(inc.table)
        if event.hold:
            inc.held = bool(inc.table)
        else:
            self._drop_table(seq, inc, out, f"finishing {inc.name}")
            inc.held = False
        inc.state, inc.ended_seq = FINISHED, seq

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
        self._drop_table(seq, inc, out, f"releasing the held blocks of {inc.name}")
        inc.held = False

    # -- jobs --------------------------------------------------------------------------

    def _on_job_enqueued(self, seq: int, event: ev.JobEnqueued, out: Out) -> None:
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
        inc = self._incarnation(seq, event.kind, event.req, event.gen, out)
        if inc is not None:
            self._check_reads(seq, event, inc, out)
        for block in event.pins:
            # A pin holds the block without writing it: no epoch change.
            self._block(block).refs += 1
        blocks = self.blocks
        read_epochs = tuple(blocks[b].epoch if b in blocks else 0 for b in event.reads)
        self.jobs[event.job] = StoreJobState(
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
        if inc is None:
            self._unparkable.add(event.req)
        key_written = self.archive.key_written
        for key in event.keys:
            key_written(key, seq, event.job)

    def _check_reads(self, seq: int, event: ev.JobEnqueued, inc: Incarnation, out: Out) -> None:
        table = set(inc.table)
        pins = set(event.pins)
        for block in event.reads:
            if block not in table and block not in pins:
                state = self.blocks.get(block)
                why = (
                    f"job {event.job} of {inc.name} would read block {block}, which is "
                    "neither in the request's table nor pinned by the job"
                )
                out.append(
                    finding(
                        Code.FOREIGN_BLOCK_READ,
                        seq,
                        why,
                        inc.table_seq,
                        state.freed_seq if state else None,
                        of=event,
                        block=block,
                    )
                )
        # A finish-time job (enqueued after request_finished, pinning what it
        # reads) saves from the table the request had when it finished.
        blocks = inc.final_table_len if inc.state == FINISHED and not inc.held else len(inc.table)
        capacity = blocks * self.block_size
        if event.token_end > capacity:
            why = (
                f"job {event.job} saves tokens up to {event.token_end}, but the table of "
                f"{inc.name} has {len(inc.table)} blocks ({capacity} tokens)"
            )
            out.append(finding(Code.TABLE_OVERRUN, seq, why, inc.table_seq, of=event))

    def _job(self, seq: int, kind: str, job: int, out: Out) -> StoreJobState | None:
        state = self.jobs.get(job)
        if state is None:
            why = f"{kind} names job {job}, which was never enqueued"
            out.append(finding(Code.CAUSALITY, seq, why, job=job))
        return state

    def _on_completions(self, seq: int, event: ev.CompletionsReceived, out: Out) -> None:
        job = self._job(seq, event.kind, event.job, out)
        if job is None:
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
            self._drop(block, seq, out, f"releasing job {job.job}'s pins")
        job.released_seq = seq
        self.pinned.pop(job.job, None)

    # -- worker side -------------------------------------------------------------------

    def rank(self, rank: int) -> RankLedger:
        ledger = self.ranks.get(rank)
        if ledger is None:
            ledger = self.ranks[rank] = RankLedger(rank, self.jobs)
        return ledger

    def _on_worker(self, seq: int, event: Any, out: Out) -> None:
        job_id = getattr(event, "job", None)
        job = None
        if job_id is not None:
            job = self._job(seq, event.kind, job_id, out)
            if job is None:
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
        rank_job = self.rank(event.rank).apply(seq, event, out)
        if job is None or rank_job is None:
            return
        job.ranks[event.rank] = rank_job
        if type(event) in (ev.DmaStarted, ev.DmaDone):
            self._check_epochs(seq, event, job, out)

    def _check_epochs(self, seq: int, event: Any, job: StoreJobState, out: Out) -> None:
        """A transfer must see each read block at the epoch recorded at enqueue.

        With ``blocks`` on the record only the blocks it names are checked
        (keys already stored are not read again). A ``dma_done`` carrying both
        ``digest`` and ``expected`` is also checked by bytes: different
        fingerprints are a poisoned read even where the epochs agree.
        """
        blocks = self.blocks
        only = set(event.blocks) if event.blocks else None
        for block, epoch in zip(job.reads, job.read_epochs, strict=True):
            if only is not None and block not in only:
                continue
            state = blocks.get(block)
            if state is None or state.epoch == epoch:
                continue
            self._reported_once.add((Code.POISONED_READ, (job.job, event.rank)))
            key = (Code.POISONED_READ, (job.job, event.rank, block, state.epoch))
            if key in self._reported_once:
                continue  # already flagged at dma_started for this epoch
            self._reported_once.add(key)
            holder = f" and handed to {state.epoch_holder}" if state.epoch_holder else ""
            freed = f"freed at seq {state.prior_free_seq}" if state.prior_free_seq else "reassigned"
            why = (
                f"job {job.job} of {job.req}/{job.gen} read block {block} on rank "
                f"{event.rank} at epoch {state.epoch}, but enqueued it at epoch {epoch}: "
                f"the block was {freed}{holder} at seq {state.epoch_seq}"
            )
            out.append(
                finding(
                    Code.POISONED_READ,
                    seq,
                    why,
                    job.enqueued_seq,
                    state.prior_free_seq,
                    state.epoch_seq,
                    of=job,
                    rank=event.rank,
                    block=block,
                )
            )
        if type(event) is ev.DmaDone:
            self._check_digest(seq, event, job, out)

    def _check_digest(self, seq: int, event: ev.DmaDone, job: StoreJobState, out: Out) -> None:
        if event.digest is None or event.expected is None or event.digest == event.expected:
            return
        key = (Code.POISONED_READ, (job.job, event.rank))
        if key in self._reported_once:
            return  # the epochs already told this transfer's story
        self._reported_once.add(key)
        why = (
            f"job {job.job} of {job.req}/{job.gen} on rank {event.rank} copied bytes with "
            f"fingerprint {event.digest}, but its blocks held {event.expected} when the "
            "save was requested: it read KV that another request wrote since"
        )
        out.append(finding(Code.POISONED_READ, seq, why, job.enqueued_seq, of=job, rank=event.rank))

    # -- engine and audit --------------------------------------------------------------

    def _on_crashed(self, seq: int, event: ev.EngineCrashed, out: Out) -> None:
        self.crashes.append(seq)
        why = f"engine crashed: {event.error}"
        out.append(finding(Code.CRASH, seq, why))

    def _on_idle(self, seq: int, event: ev.EngineIdle, out: Out) -> None:
        """Quiescence: nothing may be outstanding. Each finding is reported once."""
        for job in self.jobs.values():
            if job.job in self.pinned and self._first(Code.LEAKED_PIN, job.job):
                why = (
                    f"engine idle while job {job.job} still pins {list(job.pins)} "
                    f"({job.completions} of {job.world_size} completions received)"
                )
                out.append(
                    finding(
                        Code.LEAKED_PIN, seq, why, job.enqueued_seq, *job.completion_seqs, of=job
                    )
                )
            if not self.observes_workers:
                continue  # a live scheduler cannot see the ranks' records
            # Ranks that received the job: one finding each. Ranks that never
            # did: one finding per job naming them, so the work here follows
            # the records, never the world_size a header declares.
            for rank, rj in sorted(job.ranks.items()):
                if rj.reported_seq is not None or not self._first(
                    Code.MISSING_REPORT, (job.job, rank)
                ):
                    continue
                why = (
                    f"engine idle, and rank {rank} received job {job.job} but never "
                    f"reported it (last phase: {rj.phase})"
                )
                out.append(
                    finding(
                        Code.MISSING_REPORT,
                        seq,
                        why,
                        job.enqueued_seq,
                        rj.received_seq,
                        rank=rank,
                        of=job,
                    )
                )
            absent = job.world_size - len(job.ranks)
            if absent > 0 and self._first(Code.MISSING_REPORT, (job.job, None)):
                first = next(r for r in range(job.world_size) if r not in job.ranks)
                which = f"rank {first}" if absent == 1 else f"{absent} ranks (first: rank {first})"
                why = f"engine idle, and {which} never received job {job.job}"
                out.append(
                    finding(Code.MISSING_REPORT, seq, why, job.enqueued_seq, rank=first, of=job)
                )
        for request in self.requests.values():
            for inc in request.incarnations.values():
                if inc.held and self._first(Code.HELD_FOREVER, (inc.req, inc.gen)):
                    why = (
                        f"engine idle while {inc.name} still holds blocks {inc.table} "
                        "from a hold finish"
                    )
                    out.append(
                        finding(
                            Code.HELD_FOREVER, seq, why, inc.ended_seq, req=inc.req, gen=inc.gen
                        )
                    )

    def _first(self, code: Code, entity: Any) -> bool:
        key = (code, entity)
        if key in self._reported_once:
            return False
        self._reported_once.add(key)
        return True

    def _on_key_verified(self, seq: int, event: ev.KeyVerified, out: Out) -> None:
        if event.ok:
            return
        detail = ""
        if event.expected is not None or event.actual is not None:
            detail = f" (expected {event.expected}, found {event.actual})"
        why = f"store key {event.key!r} holds KV that is not the KV of its tokens{detail}"
        writers, job = self._writers(seq, event.job, event.key)
        out.append(finding(Code.POISONED_KEY, seq, why, *writers, job=job, key=event.key))

    def _writers(self, seq: int, job: int | None, key: str) -> tuple[tuple[int, ...], int | None]:
        """The enqueues before ``seq`` that wrote ``key``, and the job behind its
        value: as the audit names it, else the key's first writer."""
        writers, first = self.archive.key_writers(key, seq)
        return writers, job if job is not None else first

    def _on_key_missing(self, seq: int, event: ev.KeyMissing, out: Out) -> None:
        """Evicted or unreadable: counted, never a violation (nothing wrong was read)."""
        self.keys_missing += 1

    def _on_load_verified(self, seq: int, event: ev.LoadVerified, out: Out) -> None:
        if self._incarnation(seq, event.kind, event.req, event.gen, out) is None:
            return
        if event.ok:
            return
        why = (
            f"{event.req}/{event.gen} loaded {event.key!r} and got KV that is not "
            "what the key names"
        )
        writers, job = self._writers(seq, event.job, event.key)
        out.append(
            finding(
                Code.WRONG_KV_LOADED,
                seq,
                why,
                *writers,
                job=job,
                req=event.req,
                gen=event.gen,
                key=event.key,
            )
        )

    # -- views -------------------------------------------------------------------------

    def snapshot(self) -> Ledger:
        """An independent copy to fold on from (time travel keeps a few of these).

        Written out rather than ``copy.deepcopy``: on a million-record journal
        the generic copy takes seconds, this a fraction of that. Events and
        tuples are immutable and shared; every mutable row is copied, and
        each job's per-rank states are the very copies its rank ledger holds.
        Parked state is copied packed (see :meth:`Archive.copy`).
        """
        new = Ledger(
            observes_workers=self.observes_workers,
            archive=self.archive.copy(),
            park_after=self.park_after,
            sweep_every=self.sweep_every,
        )
        new.parks = self.parks
        new.header = self.header
        new.requests = {req: r.copy() for req, r in self.requests.items()}
        new.blocks = {b: s.copy() for b, s in self.blocks.items()}
        new.ranks = {rank: rl.clone(new.jobs) for rank, rl in self.ranks.items()}
        for job_id, job in self.jobs.items():
            ranks = {rank: new.ranks[rank].jobs[job_id] for rank in job.ranks}
            new.jobs[job_id] = job.copy(ranks)
        new.last_job, new.last_job_seq = self.last_job, self.last_job_seq
        new.step, new.records = self.step, self.records
        new.last_seq, new.last_kind = self.last_seq, self.last_kind
        new.crashes = list(self.crashes)
        new.keys_missing = self.keys_missing
        new.pinned = dict(self.pinned)
        new._reported_once = self._reported_once.copy()
        new._named_jobs = OrderedDict(self._named_jobs)
        new._named_requests = OrderedDict(self._named_requests)
        new._unparkable = set(self._unparkable)
        return new

    def whole(self) -> Ledger:
        """This ledger with every parked job and request back in place.

        For ``--at``, the inspector's exports and equality: views that must
        show history, not just live state. Costs what parking saved.
        """
        if not self.parks or not len(self.archive):
            return self
        new = self.snapshot()
        for kind, name in list(new.archive.keys()):
            if kind == "job" and isinstance(name, int):
                new._unpark_job(name)
            elif kind == "request" and isinstance(name, str):
                new._unpark_request(name)
        return new

    def _state(self) -> tuple[Any, ...]:
        """Everything the fold has folded, for equality (the dispatch table is not
        state, and neither is where parked state happens to be kept)."""
        return (
            self.observes_workers, self.header, self.requests, self.blocks, self.jobs,
            self.ranks, self.last_job, self.last_job_seq, self.step, self.records,
            self.last_seq, self.last_kind, self.crashes, self.keys_missing, self.pinned,
            self.archive.key_log(self.last_seq or 0), self._reported_once,
        )  # fmt: skip

    def __eq__(self, other: object) -> bool:
        """Two ledgers are equal when every piece of folded state is, parked or not."""
        if not isinstance(other, Ledger):
            return NotImplemented
        return self.whole()._state() == other.whole()._state()

    __hash__ = None  # type: ignore[assignment]  # mutable

    # -- parking settled state (see kvstate.archive) -------------------------------------

    def request(self, req: str) -> RequestState | None:
        """The state of ``req``, brought back first if it was parked (for callers
        outside the fold: a connector's questions about a request)."""
        request = self.requests.get(req)
        if request is None and self.parks:
            self._unpark_request(req)
            request = self.requests.get(req)
        return request

    def job(self, job_id: int) -> StoreJobState | None:
        """The state of job ``job_id``, brought back first if it was parked."""
        job = self.jobs.get(job_id)
        if job is None and self.parks:
            job = self._unpark_job(job_id)
        return job

    def _unpark_named(self, event: ev.Event) -> None:
        """Bring back, before the fold reads it, whatever this record names.

        A worker record's checks read its job and the job's request (on every
        rank); a scheduler record's read its request; an enqueue of an id not
        greater than the last reads the earlier job under that id.
        """
        now = self.records
        kind = type(event)
        req: str | None
        if kind in _JOB_RECORDS:
            job_id: int = event.job  # type: ignore[attr-defined]
            job = self.jobs.get(job_id)
            if job is None:
                job = self._unpark_job(job_id)
            if job is None:
                return  # never enqueued: the fold flags it
            self._named_jobs[job_id] = now
            self._named_jobs.move_to_end(job_id)
            req = job.req
        elif kind is ev.JobEnqueued:
            enq: ev.JobEnqueued = event  # type: ignore[assignment]
            if self.last_job is not None and enq.job <= self.last_job and enq.job not in self.jobs:
                self._unpark_job(enq.job)
            self._named_jobs[enq.job] = now
            self._named_jobs.move_to_end(enq.job)
            req = enq.req
        else:
            req = getattr(event, "req", None)
        if req is None:
            return
        if req not in self.requests:
            self._unpark_request(req)
        self._named_requests[req] = now
        self._named_requests.move_to_end(req)

    def _park_settled(self) -> None:
        """Park what has settled and has not been named for ``park_after`` records.

        Settled means no end-of-run check could flag it (engine_idle skips
        parked state): a job with no pins held and every rank of its world
        having received and reported it (for a live scheduler, which sees no
        rank records: every completion received); a request none of whose
        incarnations holds blocks. Anything else is looked at again later.
        """
        self._sweep(self._named_jobs, self._job_settled, self._park_job)
        self._sweep(self._named_requests, self._request_settled, self._park_request)

    def _sweep(
        self,
        named: OrderedDict[K, int],
        settled: Callable[[K], bool | None],
        park: Callable[[K], None],
    ) -> None:
        sweep(named, self.records - self.park_after, self.records, settled, park)

    def _job_settled(self, job_id: int) -> bool | None:
        """True: park it; False: not yet; None: nothing to park (gone or replaced)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job_id in self.pinned:
            return False
        if not self.observes_workers:
            # A live scheduler sees no rank records: its job is done once every
            # completion arrived (and no pin is held).
            return job.completions >= job.world_size
        if len(job.ranks) < job.world_size:
            return False
        for rl in self.ranks.values():
            rj = rl.jobs.get(job_id)
            if rj is not None and rj.reported_seq is None:
                return False
        return True

    def _request_settled(self, req: str) -> bool | None:
        request = self.requests.get(req)
        if request is None or req in self._unparkable:
            return None
        for inc in request.incarnations.values():
            if inc.held or inc.table:
                return False
        for rl in self.ranks.values():
            st = rl.requests.get(req)
            if st is not None and st.live_jobs:
                return False
        return True

    def _park_job(self, job_id: int) -> None:
        job = self.jobs.pop(job_id)
        on_ranks = {r: rl.jobs.pop(job_id) for r, rl in self.ranks.items() if job_id in rl.jobs}
        # Packed together, so job.ranks[r] comes back as the very object ranks hold.
        self.archive.put(("job", job_id), pack_job(job, on_ranks))

    def _unpark_job(self, job_id: int) -> StoreJobState | None:
        blob = self.archive.take(("job", job_id))
        if blob is None:
            return None
        job, on_ranks = unpack_job(blob)
        self.jobs[job_id] = job
        for r, rj in on_ranks.items():
            self.rank(r).jobs[job_id] = rj
        return job

    def _park_request(self, req: str) -> None:
        request = self.requests.pop(req)
        gens = list(request.incarnations)
        on_ranks = {r: rl.take_request(req, gens) for r, rl in self.ranks.items()}
        self.archive.put(("request", req), pack_request(request, on_ranks))

    def _unpark_request(self, req: str) -> None:
        blob = self.archive.take(("request", req))
        if blob is None:
            return
        request, on_ranks = unpack_request(blob)
        self.requests[req] = request
        for r, part in on_ranks.items():
            self.rank(r).put_request(req, part)

    def to_dict(self) -> dict[str, Any]:
        """The ledger as plain data (for ``--at`` and the inspector), parked state included."""
        if self.parks and len(self.archive):
            return self.whole().to_dict()
        return {
            "step": self.step,
            "records": self.records,
            "requests": {
                req: {str(g): inc.to_dict() for g, inc in sorted(r.incarnations.items())}
                for req, r in sorted(self.requests.items())
            },
            "blocks": {
                str(b): s.to_dict() for b, s in sorted(self.blocks.items()) if s.refs or s.epoch
            },
            "jobs": {str(j): s.to_dict() for j, s in sorted(self.jobs.items())},
            "ranks": {str(r): rl.to_dict() for r, rl in sorted(self.ranks.items())},
        }
