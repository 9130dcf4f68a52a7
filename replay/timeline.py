"""Timelines: every record of one request (all its generations) or one job,
across the scheduler and every rank, in journal order."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from journal import JournalError
from kvstate import events as ev
from kvstate.codec import Entry, to_dict
from kvstate.ledger import Ledger
from kvstate.violations import Violation

from .explain import describe, lane
from .sources import entries
from .verdict import replay


@attrs.frozen
class Timeline:
    """The selected records and the violations raised at them."""

    title: str
    entries: list[Entry]
    violations: dict[int, list[Violation]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "records": [
                {
                    "seq": e.seq,
                    "step": e.step,
                    "lane": lane(e.event),
                    "text": describe(e.event),
                    "record": to_dict(e),
                    "violations": [v.code.value for v in self.violations.get(e.seq, [])],
                }
                for e in self.entries
            ],
            "violations": [v.to_dict() for vs in self.violations.values() for v in vs],
        }


#: the records that begin a job: a store or a load (kvstate.tier_events)
_ENQUEUES = (ev.JobEnqueued, ev.tier_events.LoadEnqueued)


def selector(req: str | None, job: int | None) -> Callable[[Any], bool]:
    """A stateful predicate: which records belong to a request's (all generations)
    or a job's timeline, fed the events in journal order."""
    jobs: set[int] = set()
    incarnation: list[tuple[str, int]] = []  # the job's (req, gen), once enqueued

    def wanted(event: Any) -> bool:
        if type(event) in _ENQUEUES:
            if job is not None and event.job == job:
                incarnation.append((event.req, event.gen))
                return True
            if req is not None and event.req == req:
                jobs.add(event.job)
                return True
            return False
        event_job = getattr(event, "job", None)
        if event_job is not None:
            return event_job == job or event_job in jobs
        flushed = getattr(event, "jobs", None)  # flush_requested, flush_done
        if flushed is not None:
            return job in flushed or not jobs.isdisjoint(flushed)
        if req is not None:
            return getattr(event, "req", None) == req
        # a job's timeline also shows what happened to its incarnation
        pair = (getattr(event, "req", None), getattr(event, "gen", None))
        return bool(incarnation) and pair == incarnation[0]

    return wanted


def build(paths: Sequence[str], *, req: str | None = None, job: int | None = None) -> Timeline:
    """The timeline of ``req`` (all generations) or of ``job``."""
    if (req is None) == (job is None):
        raise ValueError("give exactly one of req and job")
    result = replay(list(paths))
    wanted = selector(req, job)
    selected = [e for e in entries(paths, resumed=True) if wanted(e.event)]
    seqs = {e.seq for e in selected}
    marks: dict[int, list[Violation]] = {}
    for v in result.violations:
        if v.seq in seqs:
            marks.setdefault(v.seq, []).append(v)
    title = f"request {req}" if req is not None else f"job {job}"
    if not selected:
        raise JournalError(
            f"{', '.join(paths)}: no record names {title}; "
            + near_matches(result.ledger, req=req, job=job)
        )
    return Timeline(title, selected, marks)


def near_matches(ledger: Ledger, *, req: str | None, job: int | None) -> str:
    """A hint listing the ids closest to one the journal does not have."""
    if req is not None:
        close = difflib.get_close_matches(req, list(ledger.requests), n=5, cutoff=0.5)
        if not close:
            close = sorted(ledger.requests)[:5]
        return ("near matches: " + ", ".join(close)) if close else "the journal has no request"
    ids = sorted(ledger.jobs, key=lambda j: (abs(j - (job or 0)), j))[:5]
    return (
        ("near matches: " + ", ".join(map(str, sorted(ids)))) if ids else "the journal has no job"
    )
