"""Minimal reproduction of a journal's first violation.

Two stages. First a slice: the header, and the records up to the violation
that touch its jobs, its requests and (inside its causal window) its blocks
and keys, closed over the requests they bring in. Then delta debugging
(Zeller's ddmin) removes every record whose absence still leaves the same
code as the first violation. The result keeps the original seqs, so it can
be compared with the full journal record for record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs

from journal import RecordError
from kvstate import events as ev
from kvstate.codec import Entry
from kvstate.folder import Folder
from kvstate.ledger import Ledger
from kvstate.violations import Code, Violation

T = TypeVar("T")

#: codes found at engine_idle: the slice keeps the idle record itself
_IDLE_CODES = {Code.LEAKED_PIN, Code.MISSING_REPORT, Code.HELD_FOREVER}


@attrs.frozen
class Minimized:
    target: Violation
    original: int
    sliced: int
    entries: list[Entry]
    tests: int


def first_violation(entries: Sequence[Entry]) -> Violation | None:
    """The first non-warning violation of a journal, or None (also for unusable input)."""
    try:
        for _entry, found in Folder(Ledger()).entries(entries):
            for v in found:
                if not v.is_warning:
                    return v
    except RecordError:
        return None
    return None


def _job_of(event: Any) -> int | None:
    return getattr(event, "job", None)


def slice_for(target: Violation, entries: Sequence[Entry]) -> list[Entry]:
    """The records up to ``target`` that touch its entities, closed over requests."""
    upto = [e for e in entries if e.seq <= target.seq]
    by_seq = {e.seq: e for e in upto}
    window_start = min((*target.chain, target.seq))
    jobs: set[int] = set()
    reqs: set[str] = set()
    blocks: set[int] = set()
    keys: set[str] = set()
    for seq in (*target.chain, target.seq):
        event: Any = by_seq[seq].event if seq in by_seq else None
        if event is None:
            continue
        for name, bucket in (("job", jobs), ("req", reqs), ("key", keys)):
            value = getattr(event, name, None)
            if value is not None:
                bucket.add(value)
        blocks.update(getattr(event, "blocks", ()) or ())
    if target.job is not None:
        jobs.add(target.job)
    if target.req is not None:
        reqs.add(target.req)
    if target.block is not None:
        blocks.add(target.block)
    if target.key is not None:
        keys.add(target.key)
    # Requests of the jobs, and jobs of the requests, until nothing new appears.
    enqueued: dict[int, ev.JobEnqueued] = {
        e.event.job: e.event for e in upto if isinstance(e.event, ev.JobEnqueued)
    }
    while True:
        before = (len(jobs), len(reqs))
        reqs.update(enqueued[j].req for j in jobs if j in enqueued)
        jobs.update(j for j, e in enqueued.items() if e.req in reqs)
        for entry in upto:
            current: Any = entry.event
            if (
                type(current) is ev.BlocksAssigned
                and entry.seq >= window_start
                and blocks.intersection(current.blocks)
            ):
                reqs.add(current.req)
            if type(current) is ev.JobEnqueued and keys.intersection(current.keys):
                jobs.add(current.job)
        if (len(jobs), len(reqs)) == before:
            break

    def keep(entry: Entry) -> bool:
        event: Any = entry.event
        if event.side == ev.SIDE_JOURNAL or entry.seq == target.seq:
            return True
        if type(event) is ev.EngineIdle:
            return target.code in _IDLE_CODES
        job = _job_of(event)
        if job is not None:
            return job in jobs
        if getattr(event, "req", None) in reqs:
            return True
        return getattr(event, "key", None) in keys

    return [e for e in upto if keep(e)]


def ddmin(items: list[T], test: Callable[[list[T]], bool], *, budget: int = 20_000) -> list[T]:
    """Zeller's delta debugging: a 1-minimal sublist for which ``test`` holds.

    Order is preserved. ``budget`` bounds the number of tests; past it the
    smallest list found so far is returned.
    """
    n = 2
    tests = 0
    while len(items) >= 2 and tests < budget:
        size = -(-len(items) // n)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        found: tuple[list[T], int] | None = None
        for chunk in chunks:
            tests += 1
            if test(chunk):
                found = (chunk, 2)
                break
        if found is None and len(chunks) > 2:
            for i in range(len(chunks)):
                complement = [x for j, chunk in enumerate(chunks) if j != i for x in chunk]
                tests += 1
                if test(complement):
                    found = (complement, max(n - 1, 2))
                    break
        if found is not None:
            items, n = found
        elif n >= len(items):
            break
        else:
            n = min(len(items), 2 * n)
    return items


def minimize(entries: Sequence[Entry]) -> Minimized | None:
    """The smallest journal (by ddmin) whose first violation has the same code.

    Returns None when the journal is clean.
    """
    entries = list(entries)
    target = first_violation(entries)
    if target is None:
        return None
    header, body = entries[0], entries[1:]
    tests = 0

    def reproduces(candidate: list[Entry]) -> bool:
        nonlocal tests
        tests += 1
        found = first_violation([header, *candidate])
        return found is not None and found.code is target.code

    sliced = slice_for(target, entries)[1:]
    if not reproduces(sliced):
        sliced = [e for e in body if e.seq <= target.seq]
    minimal = ddmin(sliced, reproduces)
    return Minimized(target, len(entries), len(sliced) + 1, [header, *minimal], tests)
