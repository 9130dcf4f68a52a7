"""The folded state: plain mutable records, owned and changed only by the fold.

These are the ledgers' rows. :class:`~kvstate.ledger.Ledger` and
:class:`~kvstate.rank.RankLedger` create and update them as records are
applied; everything else (connectors, replay reports, the inspector) only
reads them.
"""

from __future__ import annotations

from typing import Any

import attrs

RUNNING = "running"
PREEMPTED = "preempted"
FINISHED = "finished"


@attrs.define(slots=True)
class Incarnation:
    """One ``(req, gen)``: its state and block table."""

    req: str
    gen: int
    started_seq: int
    state: str = RUNNING
    table: list[int] = attrs.Factory(list)
    #: the last record that changed the table (an assignment, preempt, finish)
    table_seq: int | None = None
    #: finished with ``hold``: the table refs are kept until released
    held: bool = False
    ended_seq: int | None = None
    prompt_tokens: int | None = None
    #: the table when the incarnation finished: a finish-time job (a partial
    #: tail saved as the request ends, an offloading store built the step
    #: after) is measured against it
    final_table: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.req}/{self.gen}"

    def copy(self) -> Incarnation:
        return attrs.evolve(self, table=list(self.table))

    def to_dict(self) -> dict[str, Any]:
        return {
            "req": self.req,
            "gen": self.gen,
            "state": self.state,
            "table": list(self.table),
            "held": self.held,
        }


@attrs.define(slots=True)
class RequestState:
    """A request id and every incarnation it has had."""

    req: str
    newest_gen: int
    newest_seq: int
    incarnations: dict[int, Incarnation] = attrs.Factory(dict)

    @property
    def current(self) -> Incarnation:
        return self.incarnations[self.newest_gen]

    def copy(self) -> RequestState:
        incarnations = {gen: inc.copy() for gen, inc in self.incarnations.items()}
        return attrs.evolve(self, incarnations=incarnations)


@attrs.define(slots=True)
class BlockState:
    """A physical block: holders (``refs``) and content epoch.

    The provenance fields explain an epoch change: which record freed the
    block last (``freed_seq``) and which assignment started the current epoch
    (``epoch_seq``, handing it to ``epoch_holder``) after the free at
    ``prior_free_seq``.
    """

    block: int
    refs: int = 0
    epoch: int = 0
    epoch_seq: int | None = None
    epoch_holder: str | None = None
    freed_seq: int | None = None
    prior_free_seq: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"block": self.block, "refs": self.refs, "epoch": self.epoch}

    def copy(self) -> BlockState:
        return attrs.evolve(self)


@attrs.define(slots=True)
class RankJobState:
    """One job as one rank saw it: the phase it reached and when."""

    job: int
    rank: int
    received_seq: int | None = None
    phase: str = "received"
    started_seq: int | None = None
    skip_reason: str | None = None
    dma_seq: int | None = None
    put_seq: int | None = None
    put_ok: bool | None = None
    reported_seq: int | None = None
    reports: int = 0

    def copy(self) -> RankJobState:
        return attrs.evolve(self)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase, "reports": self.reports}
        if self.skip_reason is not None:
            out["skip_reason"] = self.skip_reason
        return out


@attrs.define(slots=True)
class StoreJobState:
    """A store job from enqueue to release, across every rank.

    ``read_epochs`` are the epochs of ``reads`` at enqueue: a transfer that
    sees another epoch read someone else's KV.
    """

    job: int
    req: str
    gen: int
    token_start: int
    token_end: int
    reads: tuple[int, ...]
    read_epochs: tuple[int, ...]
    pins: tuple[int, ...]
    keys: tuple[str, ...]
    parent: str | None
    world_size: int
    enqueued_seq: int | None
    ranks: dict[int, RankJobState] = attrs.Factory(dict)
    completions: int = 0
    completion_seqs: list[int] = attrs.Factory(list)
    released_seq: int | None = None
    #: a load job (``load_enqueued``): it writes ``writes`` from the tier's
    #: ``keys`` and reads and pins no device block
    load: bool = False
    writes: tuple[int, ...] = ()

    def copy(self, ranks: dict[int, RankJobState]) -> StoreJobState:
        """A copy whose per-rank states are ``ranks`` (the copies the rank ledgers hold)."""
        return attrs.evolve(self, ranks=ranks, completion_seqs=list(self.completion_seqs))

    @property
    def reported_ranks(self) -> int:
        return sum(1 for rj in self.ranks.values() if rj.reported_seq is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "req": self.req,
            "gen": self.gen,
            "tokens": [self.token_start, self.token_end],
            "reads": list(self.reads),
            "pins": list(self.pins),
            "keys": list(self.keys),
            "world_size": self.world_size,
            "ranks": {str(r): rj.to_dict() for r, rj in sorted(self.ranks.items())},
            "completions": self.completions,
            "released": self.released_seq is not None,
            **({"load": True, "writes": list(self.writes)} if self.load else {}),
        }


@attrs.define(slots=True)
class StoreRequestState:
    """What one rank keeps for a request id: the state of its newest generation.

    ``gen`` is the newest generation the rank has seen. A newer generation
    resets the rest, which is exactly what makes an older job's effects
    detectable: they would land on a state that is no longer theirs.
    """

    req: str
    gen: int
    gen_seq: int
    live_jobs: set[int] = attrs.Factory(set)
    saved_offset: int = 0
    skipped: bool = False
    retry_tokens: tuple[int, int] | None = None
    ended: bool = False
    retired: bool = False

    def copy(self) -> StoreRequestState:
        return attrs.evolve(self, live_jobs=set(self.live_jobs))

    def to_dict(self) -> dict[str, Any]:
        return {
            "req": self.req,
            "gen": self.gen,
            "live_jobs": sorted(self.live_jobs),
            "saved_offset": self.saved_offset,
            "skipped": self.skipped,
            "retry_tokens": None if self.retry_tokens is None else list(self.retry_tokens),
            "ended": self.ended,
            "retired": self.retired,
        }
