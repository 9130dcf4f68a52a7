"""Violations in words: what happened, in what order, and what should have
prevented it.

The fold's one-line message says *what* broke. For the engineer on call this
module adds the story: it looks up the records in the violation's ``chain``
and tells, for the first violation, which job of which generation touched
what, which record took it away, and which record (or missing record) should
have stopped it. It also groups violations that share one root cause.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvstate import events as ev
from kvstate.codec import Entry
from kvstate.violations import CODE_ORDER, Code, Violation

Records = Mapping[int, Entry]


def lane(event: ev.Event) -> str:
    """The timeline lane of an event: the scheduler, a rank, or the audit."""
    if event.side == ev.SIDE_WORKER:
        return f"rank {ev.rank_of(event)}"
    return "audit" if event.side == ev.SIDE_AUDIT else "scheduler"


def describe(event: ev.Event) -> str:
    """A short, literal description of one event."""
    e: Any = event
    kind = event.kind
    if kind == "journal_opened":
        return f"journal opened (block_size {e.block_size}, world_size {e.world_size})"
    if kind in ("request_admitted", "request_resumed", "request_preempted"):
        return f"{kind.split('_')[1]} {e.req}/{e.gen}"
    if kind == "request_finished":
        how = " (abort)" if e.aborted else ""
        hold = ", holding its blocks" if e.hold else ""
        return f"finished {e.req}/{e.gen}{how}{hold}"
    if kind == "held_blocks_released":
        return f"released the held blocks of {e.req}/{e.gen}"
    if kind == "blocks_assigned":
        cached = f" (cached {list(e.cached)})" if e.cached else ""
        return f"{e.req}/{e.gen} {e.mode}s blocks {list(e.blocks)}{cached}"
    if kind == "job_enqueued":
        return (
            f"job {e.job} of {e.req}/{e.gen} enqueued: tokens {e.token_start}-{e.token_end}, "
            f"reads {list(e.reads)}, pins {list(e.pins)}"
        )
    if kind == "load_enqueued":
        return f"load job {e.job} of {e.req}/{e.gen} enqueued: {list(e.keys)} into {list(e.writes)}"
    if kind == "flush_requested":
        return f"flush of jobs {list(e.jobs)} requested"
    if kind == "flush_done":
        return f"waited for jobs {list(e.jobs)}"
    if kind == "tier_stored":
        return f"tier holds {list(e.keys)} of job {e.job}"
    if kind == "tier_evicted":
        return f"tier evicted {list(e.keys)}"
    if kind == "completions_received":
        return f"{e.count} completion(s) of job {e.job}"
    if kind == "pins_released":
        return f"job {e.job} released pins {list(e.blocks)}"
    if kind == "engine_crashed":
        return f"engine crashed: {e.error}"
    if kind == "engine_idle":
        return "engine idle"
    if kind == "preemption_seen":
        return f"learned {e.req}/{e.gen} ended"
    if kind == "job_skipped":
        return f"job {e.job} skipped ({e.reason})"
    if kind == "put_done":
        return f"job {e.job} put: {e.stored} stored, {e.existed} existed"
    if kind == "put_failed":
        return f"job {e.job} put failed: {e.error}"
    if kind == "offset_saved":
        return f"job {e.job} saved offset {e.offset} for {e.req}"
    if kind == "request_marked_skipped":
        return f"job {e.job} marked {e.req} skipped"
    if kind == "retry_tokens_set":
        return f"job {e.job} kept retry tokens {e.start}+{e.count} for {e.req}"
    if kind == "retry_tokens_cleared":
        return f"job {e.job} cleared retry tokens of {e.req}"
    if kind == "kv_block_stored":
        return f"job {e.job} published {e.key} (parent {e.parent})"
    if kind == "request_retired":
        return f"retired {e.req}/{e.gen}"
    if kind == "key_verified":
        return f"key {e.key} verified: {'ok' if e.ok else 'WRONG'}"
    if kind == "load_verified":
        return f"{e.req}/{e.gen} loaded {e.key}: {'ok' if e.ok else 'WRONG'}"
    simple = {
        "job_received": "received job {}",
        "job_started": "started job {}",
        "dma_started": "DMA of job {} started",
        "dma_done": "DMA of job {} done",
        "job_reported": "reported job {}",
    }
    if kind in simple:
        return simple[kind].format(e.job)
    return kind


def _at(records: Records, seq: int | None) -> str:
    if seq is None or seq not in records:
        return f"seq {seq}" if seq is not None else "an earlier record"
    return f"seq {seq} ({describe(records[seq].event)})"


def _find(records: Records, chain: tuple[int, ...], kind: str) -> Entry | None:
    for seq in chain:
        entry = records.get(seq)
        if entry is not None and entry.event.kind == kind:
            return entry
    return None


def explain(v: Violation, records: Records) -> str:
    """The violation as a paragraph for someone who never saw the code."""
    c = v.code
    inc = f"{v.req}/{v.gen}" if v.req is not None and v.gen is not None else v.req
    enq = _find(records, v.chain, "job_enqueued")
    if c is Code.POISONED_READ:
        # chain: the enqueue, the free that dropped the last holder, the new holder's assignment
        rest = [s for s in v.chain if enq is None or s != enq.seq]
        taken = rest[-1] if rest else None
        freed = rest[-2] if len(rest) > 1 else None
        pins = list(enq.event.pins) if enq and isinstance(enq.event, ev.JobEnqueued) else []
        return (
            f"Job {v.job} of request {v.req} (generation {v.gen}) read block {v.block} on rank "
            f"{v.rank}, but the block no longer held {inc}'s KV: at {_at(records, freed)} it lost "
            f"its last holder, and at {_at(records, taken)} it was handed to another request, "
            f"which wrote its own KV there. Whatever this transfer stores goes under {inc}'s "
            f"keys, and every later prefix hit on those keys reads it. The job pinned {pins} when "
            f"it was "
            f"enqueued; a pin on block {v.block} until every rank reported would have kept the "
            f"block out of the free pool."
        )
    if c is Code.STALE_GENERATION:
        stale = v.chain[-1] if v.chain else None
        if v.job is None:
            return (
                f"Rank {v.rank} retired {inc} after {_at(records, stale)}: it declared an old "
                "generation's saves done on a request id that a newer generation now uses."
            )
        return (
            f"On rank {v.rank}, job {v.job} of {inc} changed request state for {v.req} although "
            f"the rank already knew that generation was over: {_at(records, stale)}. The request "
            f"id is reused by the newer generation, so the old job's effect lands on the new "
            f"generation's state. Liveness must be a property of the job id (is it in the "
            f"request's live set?), checked again right before every effect."
        )
    if c is Code.PREMATURE_RETIRE:
        return (
            f"Rank {v.rank} declared every save of {inc} done while job {v.job} of that "
            f"incarnation, received at {_at(records, v.chain[0] if v.chain else None)}, had not "
            "been reported. Counting outstanding jobs per request id lets a stale job's "
            "completion count for the new generation; the rest of its saves are dropped."
        )
    if c is Code.TABLE_OVERRUN:
        return (
            f"Job {v.job} of {inc} was built to save more tokens than the request's block table "
            f"holds. The table last changed at {_at(records, v.chain[-1] if v.chain else None)}. "
            "A running request's new blocks must be appended and only a resumed request's "
            "replace the table, decided from the engine's resumed flag."
        )
    if c is Code.FOREIGN_BLOCK_READ:
        return (
            f"Job {v.job} of {inc} would read block {v.block}, which is neither in the "
            "request's table nor pinned by the job: nothing guarantees what that block holds."
        )
    if c in (Code.EARLY_RELEASE, Code.LEAKED_PIN):
        what = "released" if c is Code.EARLY_RELEASE else "still held at idle"
        return (
            f"Job {v.job}'s pins were {what} with completions from fewer ranks than the world "
            f"size: {v.message}. Pins must drop exactly when every rank has reported."
        )
    if c is Code.MISSING_REPORT:
        return (
            f"The engine went idle, yet rank {v.rank} never reported job {v.job} of {inc}. Some "
            "path out of the job skipped the report; every exit must pass one finally."
        )
    if c is Code.CRASH:
        before = records.get(v.seq - 1)
        prior = f" The record before it: {_at(records, before.seq)}." if before else ""
        return f"The engine crashed: {v.message.removeprefix('engine crashed: ')}.{prior}"
    if c is Code.PARENT_CHAIN_BROKEN:
        return (
            f"Rank {v.rank} published a KV event for {v.key} with the wrong parent: "
            f"{v.message}. Parents must come from the request's hash chain, not from the order "
            "in which keys happened to be stored (deduplicated keys leave holes)."
        )
    if c is Code.POISONED_KEY:
        writers = ", ".join(_at(records, s) for s in v.chain) or "no recorded job"
        return f"Store key {v.key} holds KV of other tokens. It was written by {writers}."
    caused = "; ".join(_at(records, s) for s in v.chain)
    return v.message + (f". Depends on: {caused}." if caused else ".")


@attrs.frozen
class Group:
    """Violations with one root cause: what a connector engineer would fix once.

    One poisoned job is one root cause, however many blocks, ranks, keys and
    loads its wrong read spread to; one stale job likewise.
    """

    key: tuple[Any, ...]
    members: tuple[Violation, ...]

    @property
    def first(self) -> Violation:
        return self.members[0]

    @property
    def code(self) -> Code:
        """The code of the first violation: the root cause's kind."""
        return self.first.code

    def codes(self) -> list[tuple[Code, int]]:
        """Every code among the members with its count, in the documented order."""
        counts: dict[Code, int] = {}
        for v in self.members:
            counts[v.code] = counts.get(v.code, 0) + 1
        return sorted(counts.items(), key=lambda item: CODE_ORDER[item[0]])

    @property
    def title(self) -> str:
        """The root cause in a few words."""
        first = self.first
        kind = self.key[0]
        if kind == "job":
            what = {
                Code.POISONED_READ: "poisoned job",
                Code.POISONED_KEY: "poisoned job",
                Code.WRONG_KV_LOADED: "poisoned job",
                Code.STALE_GENERATION: "stale job",
            }.get(first.code, "job")
            owner = f" of {first.req}/{first.gen}" if first.req is not None else ""
            return f"{what} {self.key[1]}{owner}"
        if kind == "incarnation":
            return f"{self.key[1]}/{self.key[2]}"
        return f"{first.code.value} at seq {first.seq}"


def root_cause(v: Violation) -> tuple[Any, ...]:
    """The key that groups ``v`` with the other violations one fix would remove."""
    if v.job is not None and v.code not in (Code.PREMATURE_RETIRE, Code.ID_REUSED):
        return ("job", v.job)
    if v.req is not None and v.gen is not None:
        return ("incarnation", v.req, v.gen)
    return ("record", v.code, v.seq)


def group(violations: list[Violation]) -> list[Group]:
    """Group violations by root cause, in order of first appearance."""
    groups: dict[tuple[Any, ...], list[Violation]] = {}
    for v in violations:
        groups.setdefault(root_cause(v), []).append(v)
    return [Group(key, tuple(members)) for key, members in groups.items()]
