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
from typing import Any, TypeVar

import attrs

from .state import Incarnation, RankJobState, RequestState, StoreJobState, StoreRequestState

_PROTOCOL = pickle.HIGHEST_PROTOCOL
K = TypeVar("K")


def _names(cls: type) -> tuple[str, ...]:
    return tuple(a.name for a in attrs.fields(cls))


_RANK_JOB = _names(RankJobState)
_INCARNATION = _names(Incarnation)
_JOB = tuple(n for n in _names(StoreJobState) if n != "ranks")
_REQUEST = tuple(n for n in _names(RequestState) if n != "incarnations")
_RANK_REQUEST = _names(StoreRequestState)


def _row(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(getattr(obj, n) for n in names)


def pack_job(job: StoreJobState, on_ranks: dict[int, RankJobState]) -> bytes:
    """A job and every rank's state of it (``job.ranks`` are among ``on_ranks``)."""
    ranks = {r: _row(rj, _RANK_JOB) for r, rj in on_ranks.items()}
    # Ranks whose state the job holds are the rank ledgers' objects (shared);
    # any other is packed on its own (kept for exactness, never seen in practice).
    own = {r: _row(rj, _RANK_JOB) for r, rj in job.ranks.items() if on_ranks.get(r) is not rj}
    shared = tuple(r for r in job.ranks if r not in own)
    return pickle.dumps((_row(job, _JOB), ranks, shared, own), _PROTOCOL)


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
    incarnations = {g: _row(inc, _INCARNATION) for g, inc in request.incarnations.items()}
    parts = {
        r: None if part is None else (_row_or_none(part[0], _RANK_REQUEST), *part[1:])
        for r, part in on_ranks.items()
    }
    return pickle.dumps((_row(request, _REQUEST), incarnations, parts), _PROTOCOL)


def unpack_request(blob: bytes) -> tuple[RequestState, dict[int, Any]]:
    row, incarnations, parts = pickle.loads(blob)
    fields = dict(zip(_REQUEST, row, strict=True))
    incs = {g: Incarnation(*values) for g, values in incarnations.items()}
    on_ranks = {
        r: None
        if part is None
        else (None if part[0] is None else StoreRequestState(*part[0]), *part[1:])
        for r, part in parts.items()
    }
    return RequestState(**fields, incarnations=incs), on_ranks


def _row_or_none(obj: Any, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    return None if obj is None else _row(obj, names)


def sweep(
    named: OrderedDict[K, int],
    horizon: int,
    now: int,
    settled: Callable[[K], bool | None],
    park: Callable[[K], None],
) -> None:
    """Park what was last named at or before ``horizon`` and has settled.

    ``named`` maps each key to when a record last named it, oldest first (a
    naming moves the key to the end), so the sweep stops at the first key
    named after ``horizon``. ``settled`` answers True (park it), False (not
    yet: look again ``park_after`` records from ``now``) or None (nothing
    left to park: forget the key).
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
