"""The read checks of the fold: did each read see the KV it asked for?

Four moments, one definition each:

- at ``job_enqueued``: every block a job will read is in its request's table
  or pinned by the job (FOREIGN_BLOCK_READ), and the tokens it saves fit the
  table (TABLE_OVERRUN);
- at ``dma_started`` and ``dma_done``: each block read is still at the epoch
  recorded at enqueue (POISONED_READ: vLLM #47213, a queued PUT reading blocks
  already handed to another request);
- at ``dma_done`` with fingerprints: the bytes copied are the bytes the
  blocks held when the save was requested (POISONED_READ by content);
- at the audit records: a stored key holds the KV of its tokens
  (POISONED_KEY), and a load got what its key names (WRONG_KV_LOADED).

These are functions of the fold's state (:class:`~kvstate._ledger_state.LedgerState`), called only
by its fold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import events as ev
from .state import FINISHED, Incarnation, StoreJobState
from .violations import Code, Violation, finding

if TYPE_CHECKING:
    from ._ledger_state import LedgerState

Out = list[Violation]


def check_enqueued_reads(
    ledger: LedgerState, seq: int, event: ev.JobEnqueued, inc: Incarnation, out: Out
) -> None:
    """FOREIGN_BLOCK_READ and TABLE_OVERRUN for a job as it is enqueued."""
    foreign = set(event.reads)
    foreign.difference_update(inc.table)  # set algebra in C: no per-block loop when clean
    if foreign:
        foreign.difference_update(event.pins)
    if foreign and inc.state == FINISHED and not inc.held and ledger.offload.on:
        # The offloading connector builds a finished request's last stores the
        # step after its blocks were freed: a flush fences them, not pins
        # (see kvstate._offload, "a finish-time store").
        fenced = foreign.intersection(inc.final_table)
        if fenced:
            foreign.difference_update(fenced)
            ledger.offload.fenced_reads(seq, event, fenced, inc, ledger.blocks, out)
    if foreign:
        for block in event.reads:
            if block not in foreign:
                continue
            state = ledger.blocks.get(block)
            why = (
                f"job {event.job} of {inc.name} would read block {block}, which is "
                "neither in the request's table nor pinned by the job"
            )
            chain = (inc.table_seq, state.freed_seq if state else None)
            out.append(finding(Code.FOREIGN_BLOCK_READ, seq, why, *chain, of=event, block=block))
    # A finish-time job (enqueued after request_finished, pinning what it
    # reads) saves from the table the request had when it finished.
    blocks = len(inc.final_table) if inc.state == FINISHED and not inc.held else len(inc.table)
    capacity = blocks * ledger.block_size
    if event.token_end > capacity:
        why = (
            f"job {event.job} saves tokens up to {event.token_end}, but the table of "
            f"{inc.name} has {len(inc.table)} blocks ({capacity} tokens)"
        )
        out.append(finding(Code.TABLE_OVERRUN, seq, why, inc.table_seq, of=event))


def check_epochs(
    ledger: LedgerState, seq: int, event: ev.DmaStarted | ev.DmaDone, job: StoreJobState, out: Out
) -> None:
    """A transfer must see each read block at the epoch recorded at enqueue.

    With ``blocks`` on the record only the blocks it names are checked
    (keys already stored are not read again). A ``dma_done`` carrying both
    ``digest`` and ``expected`` is also checked by bytes: different
    fingerprints are a poisoned read even where the epochs agree.
    """
    blocks = ledger.blocks
    only = None if event.blocks is None else set(event.blocks)  # [] reads nothing
    once = ledger.reported_once
    for block, epoch in zip(job.reads, job.read_epochs, strict=True):
        state = blocks.get(block)
        if state is None or state.epoch == epoch or (only is not None and block not in only):
            continue
        once.add((Code.POISONED_READ, (job.job, event.rank)))
        key = (Code.POISONED_READ, (job.job, event.rank, block, state.epoch))
        if key in once:
            continue  # already flagged at dma_started for this epoch
        once.add(key)
        holder = f" and handed to {state.epoch_holder}" if state.epoch_holder else ""
        freed = f"freed at seq {state.prior_free_seq}" if state.prior_free_seq else "reassigned"
        why = (
            f"job {job.job} of {job.req}/{job.gen} read block {block} on rank "
            f"{event.rank} at epoch {state.epoch}, but enqueued it at epoch {epoch}: "
            f"the block was {freed}{holder} at seq {state.epoch_seq}"
        )
        chain = (job.enqueued_seq, state.prior_free_seq, state.epoch_seq)
        out.append(
            finding(Code.POISONED_READ, seq, why, *chain, of=job, rank=event.rank, block=block)
        )
    if type(event) is ev.DmaDone:
        _check_digest(ledger, seq, event, job, out)


def _check_digest(
    ledger: LedgerState, seq: int, event: ev.DmaDone, job: StoreJobState, out: Out
) -> None:
    if event.digest is None or event.expected is None or event.digest == event.expected:
        return
    key = (Code.POISONED_READ, (job.job, event.rank))
    if key in ledger.reported_once:
        return  # the epochs already told this transfer's story
    ledger.reported_once.add(key)
    why = (
        f"job {job.job} of {job.req}/{job.gen} on rank {event.rank} copied bytes with "
        f"fingerprint {event.digest}, but its blocks held {event.expected} when the "
        "save was requested: it read KV that another request wrote since"
    )
    out.append(finding(Code.POISONED_READ, seq, why, job.enqueued_seq, of=job, rank=event.rank))


def check_key(ledger: LedgerState, seq: int, event: ev.KeyVerified, out: Out) -> None:
    """POISONED_KEY: the store holds KV under a key that is not that key's KV."""
    if event.ok:
        return
    detail = ""
    if event.expected is not None or event.actual is not None:
        detail = f" (expected {event.expected}, found {event.actual})"
    why = f"store key {event.key!r} holds KV that is not the KV of its tokens{detail}"
    writers, job = _writers(ledger, seq, event.job, event.key)
    out.append(finding(Code.POISONED_KEY, seq, why, *writers, job=job, key=event.key))


def check_load(ledger: LedgerState, seq: int, event: ev.LoadVerified, out: Out) -> None:
    """WRONG_KV_LOADED: a request loaded a key and got KV the key does not name."""
    if event.ok:
        return
    why = f"{event.req}/{event.gen} loaded {event.key!r} and got KV that is not what the key names"
    writers, job = _writers(ledger, seq, event.job, event.key)
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


def _writers(
    ledger: LedgerState, seq: int, job: int | None, key: str
) -> tuple[tuple[int, ...], int | None]:
    """The enqueues before ``seq`` that wrote ``key``, and the job behind its
    value: as the audit names it, else the key's first writer."""
    writers, first = ledger.archive.key_writers(key, seq)
    return writers, job if job is not None else first
