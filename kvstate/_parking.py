"""The packed form of a parked job or request, and when to park (see
:mod:`kvstate.archive`).

Rows are plain tuples of field values in declaration order, pickled: a
settled job with two ranks packs into about a hundred bytes, a tenth of
pickling the objects themselves (which repeats every field name). Unpacking
builds the very same objects, so a job's per-rank states come back shared
with the rank ledgers that hold them.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import attrs

from .state import Incarnation, RankJobState, RequestState, StoreJobState, StoreRequestState

_PROTOCOL = pickle.HIGHEST_PROTOCOL
K = TypeVar("K")

#: records between two sweeps that park settled jobs and requests
SWEEP_EVERY = 4096
#: a settled job or request is parked once it has waited this many records in
#: its ledger's queue (since last named, or since it came: see each ledger)
PARK_AFTER = 8192


def _names(cls: type) -> tuple[str, ...]:
    return tuple(a.name for a in attrs.fields(cls))


_RANK_JOB = _names(RankJobState)
_INCARNATION = _names(Incarnation)
_JOB = tuple(n for n in _names(StoreJobState) if n != "ranks")
_REQUEST = tuple(n for n in _names(RequestState) if n != "incarnations")
_RANK_REQUEST = _names(StoreRequestState)


def _rows(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The field values named, as a tuple (``attrgetter`` of two names or more
    returns one, built in C: parking runs on the connector's threads)."""
    if len(names) < 2:
        raise ValueError(f"a packed row needs at least two fields, not {names}")
    return attrgetter(*names)


_rank_job_row = _rows(_RANK_JOB)
_incarnation_row = _rows(_INCARNATION)
_job_row = _rows(_JOB)
_request_row = _rows(_REQUEST)
_rank_request_row = _rows(_RANK_REQUEST)


def pack_job(job: StoreJobState, on_ranks: dict[int, RankJobState]) -> bytes:
    """A job and every rank's state of it (``job.ranks`` are among ``on_ranks``)."""
    ranks = {r: _rank_job_row(rj) for r, rj in on_ranks.items()}
    # Ranks whose state the job holds are the rank ledgers' objects (shared);
    # any other is packed on its own (kept for exactness, never seen in practice).
    own = {r: _rank_job_row(rj) for r, rj in job.ranks.items() if on_ranks.get(r) is not rj}
    shared = tuple(r for r in job.ranks if r not in own)
    return pickle.dumps((_job_row(job), ranks, shared, own), _PROTOCOL)


def unpack_job(blob: bytes) -> tuple[StoreJobState, dict[int, RankJobState]]:
    row, ranks, shared, own = pickle.loads(blob)
    on_ranks = {r: RankJobState(*values) for r, values in ranks.items()}
    job_ranks = {r: on_ranks[r] for r in shared}
    job_ranks.update((r, RankJobState(*values)) for r, values in own.items())
    fields = dict(zip(_JOB, row, strict=True))
    return StoreJobState(**fields, ranks=job_ranks), on_ranks


def pack_request(request: RequestState, on_ranks: dict[int, Any]) -> bytes:
    """A request, its incarnations, and what each rank keeps for it
    (:meth:`~kvstate.rank.RankLedger.take_request` parts, None where a rank has none)."""
    incarnations = {g: _incarnation_row(inc) for g, inc in request.incarnations.items()}
    parts = {r: _part_row(part) for r, part in on_ranks.items()}
    return pickle.dumps((_request_row(request), incarnations, parts), _PROTOCOL)


def unpack_request(blob: bytes) -> tuple[RequestState, dict[int, Any]]:
    row, incarnations, parts = pickle.loads(blob)
    fields = dict(zip(_REQUEST, row, strict=True))
    incs = {g: Incarnation(*values) for g, values in incarnations.items()}
    on_ranks = {r: _part(part) for r, part in parts.items()}
    return RequestState(**fields, incarnations=incs), on_ranks


def pack_rank_job(spec: tuple[Any, ...], rj: RankJobState) -> bytes:
    """A live rank's job: the fields of its spec, and the rank's state of it."""
    return pickle.dumps((spec, _rank_job_row(rj)), _PROTOCOL)


def unpack_rank_job(blob: bytes) -> tuple[tuple[Any, ...], RankJobState]:
    spec, row = pickle.loads(blob)
    return spec, RankJobState(*row)


def pack_rank_request(gens: tuple[int, ...], part: Any) -> bytes:
    """A live rank's request: the generations it has seen and what it keeps
    for them (a :meth:`~kvstate.rank.RankLedger.take_request` part)."""
    return pickle.dumps((gens, _part_row(part)), _PROTOCOL)


def unpack_rank_request(blob: bytes) -> tuple[tuple[int, ...], Any]:
    gens, part = pickle.loads(blob)
    return gens, _part(part)


def _part_row(part: Any) -> Any:
    if part is None:
        return None
    return (None if part[0] is None else _rank_request_row(part[0]), *part[1:])


def _part(row: Any) -> Any:
    if row is None:
        return None
    return (None if row[0] is None else StoreRequestState(*row[0]), *row[1:])


def sweep(
    named: OrderedDict[K, int],
    horizon: int,
    now: int,
    settled: Callable[[K], bool | None],
    park: Callable[[K], None],
) -> None:
    """Park what was queued at or before ``horizon`` and has settled.

    ``named`` maps each key to the record count when it was queued, oldest
    first (the reference ledger requeues a key each time a record names it),
    so the sweep stops at the
    first key queued after ``horizon``. ``settled`` answers True (park it),
    False (not yet: queued again at ``now``) or None (nothing left to park:
    forget the key).
    """
    later = []
    while named:
        key, when = named.popitem(last=False)
        if when > horizon:
            named[key] = when
            named.move_to_end(key, last=False)
            break
        verdict = settled(key)
        if verdict is True:
            park(key)
        elif verdict is False:
            later.append(key)
    for key in later:
        named[key] = now
