"""The one place each event kind is built: a function per kind, named as the kind is.

The ledgers (:mod:`kvstate.scheduler`, :mod:`kvstate.worker`,
:mod:`kvstate.jobrun`), the vLLM observers (:mod:`kvstate.vllm`), the
writer process, the harness and the codec all build their records here:
``build.job_enqueued(job=..., ...)`` makes a ``job_enqueued``. What each
caller decides (the generation, the blocks, the keys) stays with the
caller; how a record is made of those decisions is here, once: every
sequence a record holds becomes a tuple, so a record never shares a list
with the engine that may change it after the record was taken (a table
vLLM appends to in place; a block list it reuses). A new field, or a
changed default, is one edit here, not one per caller.
``tests/test_build.py`` fails on a record built anywhere else in the
library, and on a kind with no function here.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import events as ev
from . import tier_events as tier
from . import transfer_events as tx
from ._event_base import Mode, Scalar, SkipReason


# -- the journal itself, and its end ---------------------------------------------
def journal_opened(
    *,
    version: int,
    block_size: int,
    world_size: int,
    policy: Scalar = None,
    engine: Scalar = None,
    created: Scalar = None,
    run: Scalar = None,
    role: Scalar = None,
    protocol: Scalar = None,
) -> ev.JournalOpened:
    return ev.JournalOpened(
        version=version,
        block_size=block_size,
        world_size=world_size,
        policy=policy,
        engine=engine,
        created=created,
        run=run,
        role=role,
        protocol=protocol,
    )


def record_refused(*, refused: str, error: str) -> ev.RecordRefused:
    return ev.RecordRefused(refused=refused, error=error)


def observer_stood_down(*, reason: str) -> ev.ObserverStoodDown:
    return ev.ObserverStoodDown(reason=reason)


def engine_idle() -> ev.EngineIdle:
    return ev.EngineIdle()


def engine_crashed(*, error: str) -> ev.EngineCrashed:
    return ev.EngineCrashed(error=error)


# -- a request's incarnations and tables (the scheduler) -------------------------
def request_admitted(
    *, req: str, gen: int, prompt_tokens: int, hashes: Iterable[str | int] | None = None
) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        req=req,
        gen=gen,
        prompt_tokens=prompt_tokens,
        hashes=None if hashes is None else tuple(hashes),
    )


def request_resumed(*, req: str, gen: int) -> ev.RequestResumed:
    return ev.RequestResumed(req=req, gen=gen)


def request_preempted(*, req: str, gen: int) -> ev.RequestPreempted:
    return ev.RequestPreempted(req=req, gen=gen)


def request_finished(
    *, req: str, gen: int, hold: bool = False, aborted: bool = False
) -> ev.RequestFinished:
    return ev.RequestFinished(req=req, gen=gen, hold=hold, aborted=aborted)


def blocks_assigned(
    *, req: str, gen: int, blocks: Iterable[int], mode: Mode, cached: Iterable[int] = ()
) -> ev.BlocksAssigned:
    return ev.BlocksAssigned(
        req=req, gen=gen, blocks=tuple(blocks), mode=mode, cached=tuple(cached)
    )


def held_blocks_released(*, req: str, gen: int) -> ev.HeldBlocksReleased:
    return ev.HeldBlocksReleased(req=req, gen=gen)


# -- store jobs (the scheduler) --------------------------------------------------
def job_enqueued(
    *,
    job: int,
    req: str,
    gen: int,
    token_start: int,
    token_end: int,
    reads: Iterable[int],
    pins: Iterable[int],
    keys: Iterable[str],
    world_size: int,
    parent: str | None = None,
) -> ev.JobEnqueued:
    return ev.JobEnqueued(
        job=job,
        req=req,
        gen=gen,
        token_start=token_start,
        token_end=token_end,
        reads=tuple(reads),
        pins=tuple(pins),
        keys=tuple(keys),
        world_size=world_size,
        parent=parent,
    )


def completions_received(*, job: int, count: int) -> ev.CompletionsReceived:
    return ev.CompletionsReceived(job=job, count=count)


def pins_released(*, job: int, blocks: Iterable[int]) -> ev.PinsReleased:
    return ev.PinsReleased(job=job, blocks=tuple(blocks))


# -- a job on a rank, and a rank's view of requests (the workers) ----------------
def job_received(*, job: int, rank: int) -> ev.JobReceived:
    return ev.JobReceived(job=job, rank=rank)


def job_started(*, job: int, rank: int) -> ev.JobStarted:
    return ev.JobStarted(job=job, rank=rank)


def job_skipped(*, job: int, rank: int, reason: SkipReason) -> ev.JobSkipped:
    return ev.JobSkipped(job=job, rank=rank, reason=reason)


def dma_started(*, job: int, rank: int, blocks: Iterable[int] | None = None) -> ev.DmaStarted:
    return ev.DmaStarted(job=job, rank=rank, blocks=None if blocks is None else tuple(blocks))


def dma_done(
    *,
    job: int,
    rank: int,
    digest: Scalar = None,
    blocks: Iterable[int] | None = None,
    expected: Scalar = None,
) -> ev.DmaDone:
    return ev.DmaDone(
        job=job,
        rank=rank,
        digest=digest,
        blocks=None if blocks is None else tuple(blocks),
        expected=expected,
    )


def put_done(*, job: int, rank: int, stored: int, existed: int) -> ev.PutDone:
    return ev.PutDone(job=job, rank=rank, stored=stored, existed=existed)


def put_failed(*, job: int, rank: int, error: str) -> ev.PutFailed:
    return ev.PutFailed(job=job, rank=rank, error=error)


def kv_block_stored(*, job: int, rank: int, key: str, parent: str | None) -> ev.KvBlockStored:
    return ev.KvBlockStored(job=job, rank=rank, key=key, parent=parent)


def offset_saved(*, job: int, rank: int, req: str, offset: int) -> ev.OffsetSaved:
    return ev.OffsetSaved(job=job, rank=rank, req=req, offset=offset)


def request_marked_skipped(*, job: int, rank: int, req: str) -> ev.RequestMarkedSkipped:
    return ev.RequestMarkedSkipped(job=job, rank=rank, req=req)


def retry_tokens_set(*, job: int, rank: int, req: str, start: int, count: int) -> ev.RetryTokensSet:
    return ev.RetryTokensSet(job=job, rank=rank, req=req, start=start, count=count)


def retry_tokens_cleared(*, job: int, rank: int, req: str) -> ev.RetryTokensCleared:
    return ev.RetryTokensCleared(job=job, rank=rank, req=req)


def job_reported(*, job: int, rank: int) -> ev.JobReported:
    return ev.JobReported(job=job, rank=rank)


def preemption_seen(*, req: str, gen: int, rank: int) -> ev.PreemptionSeen:
    return ev.PreemptionSeen(req=req, gen=gen, rank=rank)


def request_retired(*, req: str, gen: int, rank: int) -> ev.RequestRetired:
    return ev.RequestRetired(req=req, gen=gen, rank=rank)


# -- the store read back ---------------------------------------------------------
def key_verified(
    *, key: str, ok: bool, expected: Scalar = None, actual: Scalar = None, job: int | None = None
) -> ev.KeyVerified:
    return ev.KeyVerified(key=key, ok=ok, expected=expected, actual=actual, job=job)


def key_missing(*, key: str, reason: str) -> ev.KeyMissing:
    return ev.KeyMissing(key=key, reason=reason)


def key_loaded(*, req: str, gen: int, key: str, digest: str) -> ev.KeyLoaded:
    return ev.KeyLoaded(req=req, gen=gen, key=key, digest=digest)


def load_verified(
    *, req: str, gen: int, key: str, ok: bool, job: int | None = None
) -> ev.LoadVerified:
    return ev.LoadVerified(req=req, gen=gen, key=key, ok=ok, job=job)


# -- a connector that loads as well as stores (kvstate.tier_events) --------------
def flush_requested(*, jobs: Iterable[int]) -> tier.FlushRequested:
    return tier.FlushRequested(jobs=tuple(jobs))


def flush_done(*, jobs: Iterable[int], rank: int) -> tier.FlushDone:
    return tier.FlushDone(jobs=tuple(jobs), rank=rank)


def load_enqueued(
    *, job: int, req: str, gen: int, writes: Iterable[int], keys: Iterable[str], world_size: int
) -> tier.LoadEnqueued:
    return tier.LoadEnqueued(
        job=job, req=req, gen=gen, writes=tuple(writes), keys=tuple(keys), world_size=world_size
    )


def tier_stored(*, job: int, keys: Iterable[str]) -> tier.TierStored:
    return tier.TierStored(job=job, keys=tuple(keys))


def tier_evicted(*, keys: Iterable[str]) -> tier.TierEvicted:
    return tier.TierEvicted(keys=tuple(keys))


def tier_promoted(*, keys: Iterable[str]) -> tier.TierPromoted:
    return tier.TierPromoted(keys=tuple(keys))


# -- the lifecycle at vLLM's connector boundary (kvstate.transfer_events) --------
def kv_matched(*, req: str, computed: int, matched: int, load_async: bool = False) -> tx.KvMatched:
    return tx.KvMatched(req=req, computed=computed, matched=matched, load_async=load_async)


def remote_load_started(
    *, req: str, gen: int, blocks: Iterable[int], tokens: int
) -> tx.RemoteLoadStarted:
    return tx.RemoteLoadStarted(req=req, gen=gen, blocks=tuple(blocks), tokens=tokens)


def transfer_params(
    *, req: str, at: tx.ParamsAt, params: str, gen: int | None = None
) -> tx.TransferParams:
    return tx.TransferParams(req=req, at=at, params=params, gen=gen)


def transfer_finished(
    *, req: str, gen: int, direction: tx.Direction, failed: bool = False
) -> tx.TransferFinished:
    return tx.TransferFinished(req=req, gen=gen, direction=direction, failed=failed)


def blocks_invalid(*, blocks: Iterable[int]) -> tx.BlocksInvalid:
    return tx.BlocksInvalid(blocks=tuple(blocks))


def cache_reset(*, accepted: bool = True, jobs: Iterable[int] = ()) -> tx.CacheReset:
    return tx.CacheReset(accepted=accepted, jobs=tuple(jobs))
