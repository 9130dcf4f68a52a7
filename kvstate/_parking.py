"""Parking: the reference ledger's settled jobs and requests, moved out of
memory into its :class:`~kvstate.archive.Archive` and brought back whole.

This is the one component that parks the fold's state; the ledger calls it
at two points only. Before a record is folded, :meth:`Parking.bring_back`
restores whatever the record names, so every check sees exactly the state it
would have seen had nothing been parked. Every ``sweep_every`` records,
:meth:`Parking.sweep` parks what has stayed settled for ``park_after``
records.

Which ids were parked is kept in memory in a few bits each
(:class:`~kvstate._maybe.MaybeSet`), so a record naming a new job or request
costs no archive lookup, which for a :class:`~kvstate.spill.SpillArchive`
would be a SQL query, and memory still follows live state, not history.

Rows are packed as plain tuples of field values in declaration order,
pickled: a settled job with two ranks packs into about a hundred bytes, a
tenth of pickling the objects themselves. Unpacking builds the very same
objects, so a job's per-rank states come back shared with the rank ledgers
that hold them.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import attrs

from . import _pickles
from . import events as ev
from ._maybe import MaybeSet
from .rank import BY, ROW, RankState
from .state import Incarnation, RankJobState, RequestState, StoreJobState, StoreRequestState

if TYPE_CHECKING:
    from ._ledger_state import LedgerState
    from .rank import RankLedger


#: records between two sweeps that park settled jobs and requests
SWEEP_EVERY = 4096
#: a job or request is parked once it has stayed settled this many records
PARK_AFTER = 8192

#: kinds whose ``job`` names a job the fold must have at hand (the audit kinds
#: only name the job a key's value came from; an enqueue creates its job)
_JOB_RECORDS = frozenset(
    cls
    for cls in ev.EVENT_TYPES.values()
    if "job" in cls.payload_fields and cls not in (ev.KeyVerified, ev.LoadVerified, ev.JobEnqueued)
)

#: kinds that name several jobs (``jobs``), each read by the fold
_JOBS_RECORDS = frozenset(cls for cls in ev.EVENT_TYPES.values() if "jobs" in cls.payload_fields)


class Parking:
    """Parks one :class:`~kvstate.ledger.Ledger`'s settled state in its archive.

    Settled means no end-of-run check could flag it (``engine_idle`` looks
    only at what is in memory): a job with no pins held and every rank of its
    world having received and reported it (for a live scheduler, which sees
    no rank records: every completion received); a request none of whose
    incarnations holds blocks and with no live job on any rank.
    """

    def __init__(self, ledger: LedgerState, park_after: int, sweep_every: int) -> None:
        self.ledger = ledger
        self.park_after = park_after
        self.sweep_every = sweep_every
        #: ids perhaps in the archive (a new id is told from a parked one without
        #: a lookup; a copy shares these, see kvstate._maybe)
        self.jobs = MaybeSet()
        self.requests = MaybeSet()
        #: how many jobs and requests are parked now
        self.parked = 0
        #: requests with a job enqueued for an incarnation that does not exist:
        #: their ranks' state is keyed by gens the request does not list, so
        #: they are never parked
        self.unparkable: set[str] = set()
        # id -> the record count at the sweep that first found it settled
        self._settled_jobs: dict[int, int] = {}
        self._settled_requests: dict[str, int] = {}

    def copy(self, ledger: LedgerState) -> Parking:
        """The same parking state for ``ledger`` (a snapshot of the one this serves)."""
        new = Parking(ledger, self.park_after, self.sweep_every)
        new.jobs, new.requests = self.jobs, self.requests  # grow-only: shared
        new.parked = self.parked
        new.unparkable = set(self.unparkable)
        new._settled_jobs = dict(self._settled_jobs)
        new._settled_requests = dict(self._settled_requests)
        return new

    # -- a checkpoint (kvstate.checkpoint) ---------------------------------------------

    def settled(self) -> tuple[set[str], dict[int, int], dict[str, int]]:
        """What this parking knows beyond the archive: requests never parked,
        and since when each job and request has been settled."""
        return set(self.unparkable), dict(self._settled_jobs), dict(self._settled_requests)

    def resume(self, settled: tuple[set[str], dict[int, int], dict[str, int]]) -> None:
        """Take back :meth:`settled`'s values (a ledger restored from a checkpoint)."""
        self.unparkable, self._settled_jobs, self._settled_requests = settled

    def put_parked(self, key: tuple[str, Any], blob: bytes) -> None:
        """An entity parked before a checkpoint, parked here again as it was."""
        kind, name = key
        if kind not in ("job", "request"):
            raise ValueError(f"a parked entity is a job or a request, not {kind!r}")
        self.ledger.archive.put((kind, name), blob)
        (self.jobs if kind == "job" else self.requests).add(name)
        self.parked += 1

    # -- the two calls the fold makes ----------------------------------------------

    def bring_back(self, event: ev.Event) -> None:
        """Restore, before the fold reads it, whatever this record names.

        A worker record's checks read its job and the job's request (on every
        rank); a scheduler record's read its request; an enqueue of an id
        already used reads the earlier job under that id.
        """
        ledger = self.ledger
        kind = type(event)
        req: str | None
        if kind in _JOB_RECORDS:
            job_id: int = event.job  # type: ignore[attr-defined]
            job = ledger.jobs.get(job_id)
            if job is None:
                job = self._unpark_job(job_id) if job_id in self.jobs else None
                if job is None:
                    return  # never enqueued: the fold flags it
            req = job.req
        elif kind in _JOBS_RECORDS:
            # a flush names its jobs in a list; the fold reads each
            for job_id in event.jobs:  # type: ignore[attr-defined]
                if job_id not in ledger.jobs and job_id in self.jobs:
                    self._unpark_job(job_id)
            req = None
        elif kind is ev.JobEnqueued:
            enq: ev.JobEnqueued = event  # type: ignore[assignment]
            if enq.job not in ledger.jobs and enq.job in self.jobs:
                self._unpark_job(enq.job)
            req = enq.req
        else:
            req = getattr(event, "req", None)
        if req is not None and req not in ledger.requests and req in self.requests:
            self._unpark_request(req)

    def sweep(self) -> None:
        """Park what has stayed settled since a sweep ``park_after`` records ago."""
        ledger = self.ledger
        now = ledger.records
        horizon = now - self.park_after
        since = self._settled_jobs
        for job_id, job in list(ledger.jobs.items()):
            if not self._job_settled(job):
                since.pop(job_id, None)
            elif since.setdefault(job_id, now) <= horizon:
                del since[job_id]
                self._park_job(job_id)
        since_req = self._settled_requests
        for req, request in list(ledger.requests.items()):
            if not self._request_settled(req, request):
                since_req.pop(req, None)
            elif since_req.setdefault(req, now) <= horizon:
                del since_req[req]
                self._park_request(req)

    def restore_all(self) -> None:
        """Bring every parked job and request back (views that show history)."""
        for kind, name in list(self.ledger.archive.keys()):
            if kind == "job" and isinstance(name, int):
                self._unpark_job(name)
            elif kind == "request" and isinstance(name, str):
                self._unpark_request(name)

    def job(self, job_id: int) -> StoreJobState | None:
        """Job ``job_id`` brought back if it was parked (None if it never was)."""
        return self._unpark_job(job_id) if job_id in self.jobs else None

    def request(self, req: str) -> None:
        """Bring ``req`` back if it was parked."""
        if req not in self.ledger.requests and req in self.requests:
            self._unpark_request(req)

    # -- settled? ------------------------------------------------------------------

    def _job_settled(self, job: StoreJobState) -> bool:
        ledger = self.ledger
        if job.job in ledger.pinned:
            return False
        if ledger.offload.on and job.released_seq is None:
            # Under the offloading protocol a job pins nothing: until its end
            # it may still be flushed, completed or race a block's new holder.
            return False
        if not ledger.observes_workers:
            # A live scheduler sees no rank records: its job is done once every
            # completion arrived (and no pin is held).
            return job.completions >= job.world_size
        if len(job.ranks) < job.world_size:
            return False
        for rl in ledger.ranks.values():
            rj = rl.jobs.get(job.job)
            if rj is not None and rj.reported_seq is None:
                return False
        return True

    def _request_settled(self, req: str, request: RequestState) -> bool:
        if req in self.unparkable:
            return False
        for inc in request.incarnations.values():
            if inc.held or inc.table:
                return False
        for rl in self.ledger.ranks.values():
            st = rl.requests.get(req)
            if st is not None and st.live_jobs:
                return False
        return True

    # -- moving state out and back -------------------------------------------------

    def _park_job(self, job_id: int) -> None:
        ledger = self.ledger
        job = ledger.jobs.pop(job_id)
        on_ranks = {r: rl.jobs.pop(job_id) for r, rl in ledger.ranks.items() if job_id in rl.jobs}
        # Packed together, so job.ranks[r] comes back as the very object ranks hold.
        ledger.archive.put(("job", job_id), pack_job(job, on_ranks))
        self.jobs.add(job_id)
        self.parked += 1

    def _unpark_job(self, job_id: int) -> StoreJobState | None:
        ledger = self.ledger
        blob = ledger.archive.take(("job", job_id))
        if blob is None:
            return None  # a wrong "maybe"
        self.parked -= 1
        job, on_ranks = unpack_job(blob)
        ledger.jobs[job_id] = job
        for r, rj in on_ranks.items():
            ledger.rank(r).jobs[job_id] = rj
        return job

    def _park_request(self, req: str) -> None:
        ledger = self.ledger
        request = ledger.requests.pop(req)
        gens = list(request.incarnations)
        on_ranks = {r: _take_rank_request(rl, req, gens) for r, rl in ledger.ranks.items()}
        ledger.archive.put(("request", req), pack_request(request, on_ranks))
        self.requests.add(req)
        self.parked += 1

    def _unpark_request(self, req: str) -> None:
        ledger = self.ledger
        blob = ledger.archive.take(("request", req))
        if blob is None:
            return  # a wrong "maybe"
        self.parked -= 1
        request, on_ranks = unpack_request(blob)
        ledger.requests[req] = request
        for r, part in on_ranks.items():
            _put_rank_request(ledger.rank(r), req, part)


# -- what a rank keeps for one request --------------------------------------------------

#: what a rank keeps for one request: a value per field of RankState keyed by
#: request, a {gen: value} per field keyed by incarnation, in field order
RankRequestPart = tuple[Any, ...]
#: the fields parked with a request (a job's state is parked with the job)
_PARKED = tuple(f for f in attrs.fields(RankState) if f.metadata[BY] != "job")


def _take_rank_request(rl: RankLedger, req: str, gens: list[int]) -> RankRequestPart | None:
    """Remove and return everything ``rl`` keeps for ``req`` and its ``gens``."""
    part: list[Any] = []
    for field in _PARKED:
        held = getattr(rl, field.name)
        if field.metadata[BY] == "req":
            part.append(held.pop(req, None))
        else:
            part.append({g: held.pop((req, g)) for g in gens if (req, g) in held})
    return tuple(part) if any(v is not None and v != {} for v in part) else None


def _put_rank_request(rl: RankLedger, req: str, part: RankRequestPart | None) -> None:
    """Put back what :func:`_take_rank_request` took."""
    if part is None:
        return
    for field, value in zip(_PARKED, part, strict=True):
        held = getattr(rl, field.name)
        if field.metadata[BY] == "req":
            if value is not None:
                held[req] = value
        else:
            for g, v in value.items():
                held[(req, g)] = v


# -- the packed rows ----------------------------------------------------------------------


def _names(cls: type) -> tuple[str, ...]:
    return tuple(a.name for a in attrs.fields(cls))


_RANK_JOB = _names(RankJobState)
_INCARNATION = _names(Incarnation)
_JOB = tuple(n for n in _names(StoreJobState) if n != "ranks")
_REQUEST = tuple(n for n in _names(RequestState) if n != "incarnations")
_RANK_REQUEST = _names(StoreRequestState)


def _rows(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The field values named, as a tuple (``attrgetter`` of two names or more
    returns one, built in C)."""
    if len(names) < 2:
        raise ValueError(f"a packed row needs at least two fields, not {names}")
    return attrgetter(*names)


_rank_job_row = _rows(_RANK_JOB)
_incarnation_row = _rows(_INCARNATION)
_job_row = _rows(_JOB)
_request_row = _rows(_REQUEST)
_rank_request_row = _rows(_RANK_REQUEST)
#: a state row as the plain tuple it is parked as, by its class
_ROW_OF: dict[type, Callable[[Any], tuple[Any, ...]]] = {StoreRequestState: _rank_request_row}


def pack_job(job: StoreJobState, on_ranks: dict[int, RankJobState]) -> bytes:
    """A job and every rank's state of it (``job.ranks`` are among ``on_ranks``)."""
    ranks = {r: _rank_job_row(rj) for r, rj in on_ranks.items()}
    # Ranks whose state the job holds are the rank ledgers' objects (shared);
    # any other is packed on its own (kept for exactness, never seen in practice).
    own = {r: _rank_job_row(rj) for r, rj in job.ranks.items() if on_ranks.get(r) is not rj}
    shared = tuple(r for r in job.ranks if r not in own)
    return _pickles.dumps((_job_row(job), ranks, shared, own))


def unpack_job(blob: bytes) -> tuple[StoreJobState, dict[int, RankJobState]]:
    row, ranks, shared, own = _pickles.loads(blob)
    on_ranks = {r: RankJobState(*values) for r, values in ranks.items()}
    job_ranks = {r: on_ranks[r] for r in shared}
    job_ranks.update((r, RankJobState(*values)) for r, values in own.items())
    fields = dict(zip(_JOB, row, strict=True))
    return StoreJobState(**fields, ranks=job_ranks), on_ranks


def pack_request(request: RequestState, on_ranks: dict[int, RankRequestPart | None]) -> bytes:
    """A request, its incarnations, and what each rank keeps for it."""
    incarnations = {g: _incarnation_row(inc) for g, inc in request.incarnations.items()}
    parts = {r: _part_row(part) for r, part in on_ranks.items()}
    return _pickles.dumps((_request_row(request), incarnations, parts))


def unpack_request(blob: bytes) -> tuple[RequestState, dict[int, RankRequestPart | None]]:
    row, incarnations, parts = _pickles.loads(blob)
    fields = dict(zip(_REQUEST, row, strict=True))
    incs = {g: Incarnation(*values) for g, values in incarnations.items()}
    on_ranks = {r: _part(part) for r, part in parts.items()}
    return RequestState(**fields, incarnations=incs), on_ranks


def _part_row(part: RankRequestPart | None) -> Any:
    """A part with its state rows as plain tuples (what pickle packs small)."""
    if part is None:
        return None
    return tuple(
        _ROW_OF[f.metadata[ROW]](v) if f.metadata[ROW] is not None and v is not None else v
        for f, v in zip(_PARKED, part, strict=True)
    )


def _part(row: Any) -> Any:
    if row is None:
        return None
    return tuple(
        f.metadata[ROW](*v) if f.metadata[ROW] is not None and v is not None else v
        for f, v in zip(_PARKED, row, strict=True)
    )
