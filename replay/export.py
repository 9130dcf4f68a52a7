"""Export a journal as a Chrome trace-event file that Perfetto opens.

Layout: one process for the scheduler and one per rank.

* scheduler: instant markers for admit, preempt, resume and finish, and an
  async span per job from enqueue to pin release ("pins of job J");
* rank r: an async span per job from ``job_received`` to ``job_reported``,
  and on the sending-thread track, slices for the DMA (``dma_started`` to
  ``dma_done``) and the put (``dma_done`` to ``put_done`` / ``put_failed``);
* every violation: an instant marker on the lane of the record that raised
  it, carrying code, message and chain.

Times come from the records' ``ts`` (nanoseconds, shown relative to the
first); records without ``ts`` are placed at ``seq`` microseconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvstate import events as ev
from kvstate.checkpoint import Resumed
from kvstate.codec import Entry
from kvstate.folder import Folder
from kvstate.ledger import Ledger
from kvstate.spill import SpillArchive

from .explain import describe
from .sources import open_stream

SCHEDULER_PID = 1
SENDING_TID = 1
_MARKERS = {"request_admitted", "request_resumed", "request_preempted", "request_finished"}


def _pid(event: ev.Event) -> int:
    rank = ev.rank_of(event)
    return SCHEDULER_PID if rank is None else 2 + rank


class _Trace:
    """Turns records into trace events, handing each to ``sink`` as it is made."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sink = sink
        self.count = 0
        self.origin: int | None = None
        self.last_us = 0.0
        self.open_jobs: dict[tuple[int, int], float] = {}
        self.dma: dict[tuple[int, int], float] = {}
        self.put_from: dict[tuple[int, int], float] = {}
        self.pins_open: set[int] = set()
        self.ranks: set[int] = set()
        self.pid_of_last = SCHEDULER_PID

    def time(self, entry: Entry) -> float:
        if entry.ts is None:
            us = float(entry.seq)
        else:
            if self.origin is None:
                self.origin = entry.ts
            us = (entry.ts - self.origin) / 1000.0
        self.last_us = max(self.last_us, us)
        return us

    def add(self, **fields: Any) -> None:
        self.count += 1
        self.sink(fields)

    def instant(self, pid: int, us: float, name: str, cat: str, args: dict[str, Any]) -> None:
        self.add(ph="i", s="t", pid=pid, tid=SENDING_TID, ts=us, name=name, cat=cat, args=args)

    def span(self, pid: int, start: float, end: float, name: str, args: dict[str, Any]) -> None:
        self.add(
            ph="X", pid=pid, tid=SENDING_TID, ts=start, dur=max(0.0, end - start),
            name=name, cat="transfer", args=args,
        )  # fmt: skip

    def job_async(self, phase: str, pid: int, us: float, job: int, rank: int | None) -> None:
        ident = f"job{job}" if rank is None else f"job{job}.r{rank}"
        name = f"pins of job {job}" if rank is None else f"job {job}"
        cat = "pins" if rank is None else "job"
        self.add(ph=phase, pid=pid, tid=SENDING_TID, ts=us, name=name, cat=cat, id=ident)

    def feed(self, entry: Entry, violations: Sequence[Any]) -> None:
        e: Any = entry.event
        us = self.time(entry)
        pid = self.pid_of_last = _pid(e)
        kind = e.kind
        args = {"seq": entry.seq, "step": entry.step, "what": describe(e)}
        if e.side == ev.SIDE_WORKER:
            self.ranks.add(e.rank)
            key = (getattr(e, "job", -1), e.rank)
            if kind == "job_received":
                self.open_jobs[key] = us
                self.job_async("b", pid, us, e.job, e.rank)
            elif kind == "job_reported" and key in self.open_jobs:
                del self.open_jobs[key]
                self.job_async("e", pid, us, e.job, e.rank)
            elif kind == "dma_started":
                self.dma[key] = us
            elif kind == "dma_done":
                start = self.dma.pop(key, us)
                self.span(pid, start, us, f"DMA job {e.job}", args)
                self.put_from[key] = us
            elif kind in ("put_done", "put_failed"):
                start = self.put_from.pop(key, us)
                name = f"put job {e.job}" + (" FAILED" if kind == "put_failed" else "")
                self.span(pid, start, us, name, args)
            else:
                self.instant(pid, us, describe(e), "worker", args)
        elif kind == "job_enqueued":
            if e.pins:
                self.pins_open.add(e.job)
                self.job_async("b", pid, us, e.job, None)
            self.instant(pid, us, describe(e), "scheduler", args)
        elif kind == "pins_released":
            if e.job in self.pins_open:
                self.pins_open.discard(e.job)
                self.job_async("e", pid, us, e.job, None)
        elif kind in _MARKERS or kind in ("engine_crashed", "engine_idle"):
            self.instant(pid, us, describe(e), "request", args)
        for v in violations:
            self.instant(
                pid,
                us,
                f"{'WARNING' if v.is_warning else 'VIOLATION'} {v.code.value}",
                "violation",
                {"seq": v.seq, "message": v.message, "chain": list(v.chain)},
            )

    def close(self) -> None:
        """End spans still open at the end of the journal (they are findings too)."""
        end = self.last_us
        for job, rank in list(self.open_jobs):
            self.job_async("e", 2 + rank, end, job, rank)
        for job in sorted(self.pins_open):
            self.job_async("e", SCHEDULER_PID, end, job, None)

    def metadata(self) -> list[dict[str, Any]]:
        names = [(SCHEDULER_PID, "scheduler", 0)] + [
            (2 + r, f"rank {r}", r + 1) for r in sorted(self.ranks)
        ]
        meta: list[dict[str, Any]] = []
        for pid, name, order in names:
            meta.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                         "args": {"name": name}})  # fmt: skip
            meta.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index",
                         "args": {"sort_index": order}})  # fmt: skip
            thread = "scheduler" if pid == SCHEDULER_PID else "sending thread"
            meta.append({"ph": "M", "pid": pid, "tid": SENDING_TID, "name": "thread_name",
                         "args": {"name": thread}})  # fmt: skip
        return meta


def write_perfetto(paths: Sequence[str], out: TextIO) -> tuple[int, str]:
    """Write the trace of one journal (or several merged) to ``out`` as it is read.

    One pass: each record is folded (for its violations) and turned into
    trace events, which are written at once, so memory stays that of the
    fold, whatever the journal's length. Returns the number of trace events
    and the verdict.
    """
    stream, _origin = open_stream(list(paths))
    out.write('{"displayTimeUnit": "ns", "traceEvents": [\n')
    first = True

    def write(event: dict[str, Any]) -> None:
        nonlocal first
        if not first:
            out.write(",\n")
        first = False
        out.write(json.dumps(event, ensure_ascii=False, allow_nan=False))

    trace = _Trace(write)
    ledger = Ledger(archive=SpillArchive())
    violations = 0
    resumed: Resumed | None = None
    for entry, found in Folder(ledger).located(stream):
        violations += sum(1 for v in found if not v.is_warning)
        if type(entry.event) is Resumed:
            resumed = entry.event  # the head was removed: no record to draw
            continue
        trace.feed(entry, found)
    end = ledger.end()
    if end and ledger.last_seq is not None:
        # The journal stops before the engine did: mark where
        # (docs/events.md, "Complete and incomplete journals").
        for v in end:
            trace.instant(trace.pid_of_last, trace.last_us, f"WARNING {v.code.value}",
                          "violation", {"seq": v.seq, "message": v.message})  # fmt: skip
    trace.close()
    meta = trace.metadata()
    for event in meta:
        write(event)
    verdict = "violations" if violations else "clean"
    other: dict[str, Any] = {"source": ", ".join(paths), "verdict": verdict}
    if resumed is not None:
        other["from_checkpoint"] = {"after_seq": resumed.seq, "message": resumed.describe()}
    out.write(f'\n], "otherData": {json.dumps(other, ensure_ascii=False)}}}\n')
    return trace.count + len(meta), verdict
