"""Copies of a :class:`~kvstate.ledger.Ledger` and its state as plain data.

Time travel keeps snapshots to fold on from; ``--at``, the inspector and
ledger equality need the whole state, parked jobs and requests included.
Each is written out field by field rather than with ``copy.deepcopy``: on a
million-record journal the generic copy takes seconds, this a fraction of
that.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ._ledger_state import LedgerState

L = TypeVar("L", bound=LedgerState)


def snapshot(ledger: L) -> L:
    """An independent copy to fold on from.

    Events and tuples are immutable and shared; every mutable row is copied,
    and each job's per-rank states are the very copies its rank ledger
    holds. Parked state is copied packed (see :meth:`Archive.copy`).
    """
    new = type(ledger)(observes_workers=ledger.observes_workers, archive=ledger.archive.copy())
    new.parking = None if ledger.parking is None else ledger.parking.copy(new)
    new.header = ledger.header
    new.requests = {req: r.copy() for req, r in ledger.requests.items()}
    new.blocks = {b: s.copy() for b, s in ledger.blocks.items()}
    new.ranks = {rank: rl.clone(new.jobs) for rank, rl in ledger.ranks.items()}
    for job_id, job in ledger.jobs.items():
        ranks = {rank: new.ranks[rank].jobs[job_id] for rank in job.ranks}
        new.jobs[job_id] = job.copy(ranks)
    new.last_job, new.last_job_seq = ledger.last_job, ledger.last_job_seq
    new.step, new.records = ledger.step, ledger.records
    new.last_seq, new.last_kind = ledger.last_seq, ledger.last_kind
    new.crashes = list(ledger.crashes)
    new.stood_down = ledger.stood_down
    new.keys_missing = ledger.keys_missing
    new.foreign_loads = ledger.foreign_loads
    new.pinned = dict(ledger.pinned)
    new.reported_once = ledger.reported_once.copy()
    new.offload = ledger.offload.copy()
    new.transfers = ledger.transfers.copy()
    return new


def _parked(ledger: LedgerState) -> bool:
    return ledger.parking is not None and ledger.parking.parked > 0


def whole(ledger: L) -> L:
    """``ledger`` itself when nothing is parked, else a copy with everything back."""
    if not _parked(ledger):
        return ledger
    new = snapshot(ledger)
    if new.parking is not None:
        new.parking.restore_all()
    return new


def to_dict(ledger: LedgerState) -> dict[str, Any]:
    """The ledger as plain data, parked state included."""
    if _parked(ledger):
        ledger = whole(ledger)
    return {
        "step": ledger.step,
        "records": ledger.records,
        "requests": {
            req: {str(g): inc.to_dict() for g, inc in sorted(r.incarnations.items())}
            for req, r in sorted(ledger.requests.items())
        },
        "blocks": {
            str(b): s.to_dict() for b, s in sorted(ledger.blocks.items()) if s.refs or s.epoch
        },
        "jobs": {str(j): s.to_dict() for j, s in sorted(ledger.jobs.items())},
        "ranks": {str(r): rl.to_dict() for r, rl in sorted(ledger.ranks.items())},
    }
