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
from .verdict import ReplayResult, replay


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
        raise JournalError(f"{', '.join(paths)}: {_missing(result, title, req=req, job=job)}")
    return Timeline(title, selected, marks)


def _missing(result: ReplayResult, title: str, *, req: str | None, job: int | None) -> str:
    """Why no record names ``req`` or ``job``: its records were removed by
    retention (the journal begins at a checkpoint), or it is not in the
    journal, with the ids closest to it."""
    resumed = result.from_checkpoint
    if resumed is None:
        return f"no record names {title}; " + near_matches(result.ledger, req=req, job=job)
    begins = f"the journal now begins after seq {resumed.seq}, from its checkpoint"
    if _known(result.ledger, req=req, job=job):
        return f"the records naming {title} were removed by retention: {begins}, which knows it"
    return (
        f"no record left names {title}; records 1..{resumed.seq} were removed by retention "
        f"({begins}), and any naming it with them; " + near_matches(result.ledger, req=req, job=job)
    )


def _known(ledger: Ledger, *, req: str | None, job: int | None) -> bool:
    """Whether the fold knows ``req`` or ``job`` (in memory, or parked: brought back)."""
    parking = ledger.parking
    if req is not None:
        if parking is not None:
            parking.request(req)
        return req in ledger.requests
    if parking is not None and job is not None:
        parking.job(job)
    return job in ledger.jobs


def near_matches(ledger: Ledger, *, req: str | None, job: int | None) -> str:
    """A hint listing the ids closest to one the journal does not have (never
    the id itself: a checkpoint may know an id no record left names)."""
    if req is not None:
        names = [name for name in ledger.requests if name != req]
        close = difflib.get_close_matches(req, names, n=5, cutoff=0.5)
        if not close:
            close = sorted(names)[:5]
        return ("near matches: " + ", ".join(close)) if close else "the journal has no request"
    ids = sorted((j for j in ledger.jobs if j != job), key=lambda j: (abs(j - (job or 0)), j))[:5]
    return (
        ("near matches: " + ", ".join(map(str, sorted(ids)))) if ids else "the journal has no job"
    )
