"""Copies of a :class:`~kvstate.ledger.Ledger` and its state as plain data.

Time travel keeps snapshots to fold on from; ``--at``, the inspector and
ledger equality need the whole state, parked jobs and requests included.
Each field is copied as its declaration says (:mod:`kvstate._copying`)
rather than with ``copy.deepcopy``: on a million-record journal the generic
copy takes seconds, this a fraction of that.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ._copying import copy_fields
from ._ledger_state import LedgerState

L = TypeVar("L", bound=LedgerState)


def snapshot(ledger: L) -> L:
    """An independent copy to fold on from, each field copied as
    :class:`~kvstate._ledger_state.LedgerState` declares it.

    Events and tuples are immutable and shared; every mutable row is copied,
    and each job's per-rank states are the very copies its rank ledger
    holds. Parked state is copied packed (see :meth:`Archive.copy`).
    """
    return copy_fields(ledger, type(ledger)(), LedgerState)


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
