"""The reference ledger's folded state, declared once: :class:`LedgerState`.

:class:`~kvstate.ledger.Ledger` is this state plus the transition function.
The fold's helpers (``_reads``, ``_quiescence``, ``_parking``, ``_copies``)
work on this declaration, not on the ledger, so each is a leaf that imports
neither :mod:`kvstate.ledger` nor anything that does. Equality of two
ledgers is the fields marked ``folded`` (see :func:`folded_state`).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from . import events as ev
from ._copying import OWN, PLAIN, ROWS, SHARED, Copier, copied_by
from ._layered import LayeredSet
from ._offload import OffloadState
from ._transfers import TransferState
from .archive import Archive
from .rank import RankLedger
from .state import BlockState, RequestState, StoreJobState
from .violations import Code

#: metadata: the field is folded state, compared by ledger equality
FOLDED = "kvstate.folded"


class Parks(Protocol):
    """What parks settled state (:class:`kvstate._parking.Parking`), as the state sees it."""

    parked: int
    sweep_every: int
    #: requests that must never be parked
    unparkable: set[str]

    def copy(self, ledger: Any) -> Parks: ...
    def bring_back(self, event: ev.Event) -> None: ...
    def sweep(self) -> None: ...
    def restore_all(self) -> None: ...
    def request(self, req: str) -> None: ...
    def job(self, job_id: int) -> StoreJobState | None: ...


def _folded(how: Copier) -> dict[str, Any]:
    """Metadata of a folded field, copied by ``how`` (see :mod:`kvstate._copying`)."""
    return {FOLDED: True, **copied_by(how)}


def _parking(parking: Parks | None, new: Any) -> Parks | None:
    """The copy's parking, parking into the copy (its archive is copied by then)."""
    return None if parking is None else parking.copy(new)


def _ranks(ranks: dict[int, RankLedger], new: Any) -> dict[int, RankLedger]:
    """Each rank's fold, reading job descriptions from the copy's own jobs."""
    return {rank: rl.clone(new.jobs) for rank, rl in ranks.items()}


def _jobs(jobs: dict[int, StoreJobState], new: Any) -> dict[int, StoreJobState]:
    """Each job's row, its per-rank states the very copies its rank ledgers
    hold; filled in place, the mapping the ranks' copies read."""
    for job_id, job in jobs.items():
        ranks = {rank: new.ranks[rank].jobs[job_id] for rank in job.ranks}
        new.jobs[job_id] = job.copy(ranks)
    return new.jobs


@attrs.define(slots=False, eq=False)
class LedgerState:
    """Everything the fold folds (see :class:`~kvstate.ledger.Ledger` for what each means)."""

    observes_workers: bool = attrs.field(default=True, metadata=_folded(SHARED))
    archive: Archive = attrs.field(factory=Archive, metadata=copied_by(OWN))
    #: what parks settled state (only when an archive was given to the ledger)
    parking: Parks | None = attrs.field(default=None, metadata=copied_by(_parking))
    header: ev.JournalOpened | None = attrs.field(default=None, metadata=_folded(SHARED))
    requests: dict[str, RequestState] = attrs.field(factory=dict, metadata=_folded(ROWS))
    blocks: dict[int, BlockState] = attrs.field(factory=dict, metadata=_folded(ROWS))
    #: each rank's fold; declared before ``jobs``, whose copy reads the ranks' copies
    ranks: dict[int, RankLedger] = attrs.field(factory=dict, metadata=_folded(_ranks))
    jobs: dict[int, StoreJobState] = attrs.field(factory=dict, metadata=_folded(_jobs))
    last_job: int | None = attrs.field(default=None, metadata=_folded(SHARED))
    last_job_seq: int | None = attrs.field(default=None, metadata=_folded(SHARED))
    step: int = attrs.field(default=0, metadata=_folded(SHARED))
    records: int = attrs.field(default=0, metadata=_folded(SHARED))
    #: the last record folded: its seq and kind (for the end-of-journal check)
    last_seq: int | None = attrs.field(default=None, metadata=_folded(SHARED))
    last_kind: str | None = attrs.field(default=None, metadata=_folded(SHARED))
    crashes: list[int] = attrs.field(factory=list, metadata=_folded(PLAIN))
    #: "seq N: reason" of the first observer_stood_down: the journal is incomplete from there
    stood_down: str | None = attrs.field(default=None, metadata=_folded(SHARED))
    #: key_missing records: keys the store no longer had when read back
    keys_missing: int = attrs.field(default=0, metadata=_folded(SHARED))
    #: key_loaded records: loads of keys another engine wrote (judged across runs)
    foreign_loads: int = attrs.field(default=0, metadata=_folded(SHARED))
    #: jobs whose pins are still held, in enqueue order
    pinned: dict[int, None] = attrs.field(factory=dict, metadata=_folded(PLAIN))
    #: (code, entity) of the findings reported once (copies share it, see _layered)
    reported_once: LayeredSet = attrs.field(factory=LayeredSet, metadata=_folded(OWN))
    #: loads, flushes and the offload tier (kvstate.tier_events)
    offload: OffloadState = attrs.field(factory=OffloadState, metadata=_folded(OWN))
    #: delayed frees, asynchronous loads and transfers (kvstate.transfer_events)
    transfers: TransferState = attrs.field(factory=TransferState, metadata=_folded(OWN))

    @property
    def block_size(self) -> int:
        return self.header.block_size if self.header is not None else 1

    @property
    def world_size(self) -> int:
        return self.header.world_size if self.header is not None else 1

    def rank(self, rank: int) -> RankLedger:
        """The fold of one rank, made at its first record."""
        ledger = self.ranks.get(rank)
        if ledger is None:
            ledger = self.ranks[rank] = RankLedger(rank, self.jobs)
        return ledger

    def first_report(self, code: Code, entity: Any) -> bool:
        """True the first time ``(code, entity)`` is asked: a finding reported once."""
        key = (code, entity)
        if key in self.reported_once:
            return False
        self.reported_once.add(key)
        return True


def folded_state(ledger: LedgerState) -> tuple[Any, ...]:
    """Everything the fold has folded, for equality: each ``folded`` field, and
    the archive's key log (where parked state happens to be kept is not state)."""
    values = tuple(
        getattr(ledger, f.name) for f in attrs.fields(LedgerState) if f.metadata.get(FOLDED)
    )
    return (*values, ledger.archive.key_log(ledger.last_seq or 0))
