"""One run's per-process journals interleaved into one order.

The scheduler and each rank journal in their own process, each file in its
own order, each record stamped with ``ts`` from the machine's monotonic
clock. Replay needs one order. It is ``ts``, and where ``ts`` does not decide
(records of several files with equal ``ts``: a coarse clock, or a simulator's
virtual one) the protocol's causality decides, never the order the files were
named on the command line:

* a rank's records about a job come after the scheduler's ``job_enqueued`` of
  that job (a rank cannot receive a job that was not sent);
* ``completions_received`` for a job comes after the ranks' ``job_reported``
  for it (the scheduler counts reports that were made);
* ``preemption_seen`` and ``request_retired`` for an incarnation come after the
  scheduler's ``request_preempted`` or ``request_finished`` of it;
* ``engine_idle`` and ``engine_crashed`` come after every other file's records
  (the end of the run is the end).

Records with no causal link between them and equal ``ts`` go scheduler first,
then by rank, then by file name: a fixed rule, so every order of the same
files gives the same merged journal. Within one file the order is the file's
own, and ``ts`` must not go backwards there: such a file cannot be placed
among the others by time, so it is refused (exit 2) and can be replayed alone.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from journal import RecordError
from kvstate import events as ev
from kvstate.codec import Entry


class _Item(Protocol):
    """What the interleaving reads of a located record."""

    @property
    def entry(self) -> Entry: ...
    @property
    def path(self) -> str: ...
    @property
    def seq(self) -> int: ...
    @property
    def line(self) -> int | None: ...


class _Stamped(NamedTuple):
    ts: int
    item: _Item


def _stamped(stream: Iterator[_Item]) -> Iterator[_Stamped]:
    """A file's records with their ``ts``; a record without one keeps its place
    right after the file's previous record."""
    last: int | None = None
    for item in stream:
        ts = item.entry.ts
        if ts is None:
            ts = 0 if last is None else last
        elif last is not None and ts < last:
            raise RecordError(
                f"ts goes backwards ({ts} after {last}): this file's clock is not monotonic, "
                "so its records cannot be merged by time with other files; replay it alone",
                path=item.path,
                line=item.line,
                seq=item.seq,
            )
        last = ts
        yield _Stamped(ts, item)


def _preference(item: _Item) -> tuple[int, int, str]:
    """Tie order for records with no causal link: scheduler, ranks, file name."""
    rank = ev.rank_of(item.entry.event)
    return (0, 0, item.path) if rank is None else (1, rank, item.path)


_ENDS = (ev.RequestPreempted, ev.RequestFinished)
_LEARNED = (ev.PreemptionSeen, ev.RequestRetired)
_TERMINAL = (ev.EngineIdle, ev.EngineCrashed)


class _Tie:
    """Records of several files at one ``ts``, put in causal order."""

    def __init__(self, segments: list[deque[tuple[int, _Item]]]) -> None:
        self.segments = segments
        # What is still to come in this tie, for the waits below.
        self.enqueues: Counter[int] = Counter()
        self.reports: Counter[int] = Counter()
        self.ends: Counter[tuple[str, int]] = Counter()
        for segment in segments:
            for _, item in segment:
                self._count(item.entry.event, 1)

    def _count(self, event: ev.Event, delta: int) -> None:
        if isinstance(event, ev.JobEnqueued):
            self.enqueues[event.job] += delta
        elif isinstance(event, ev.JobReported):
            self.reports[event.job] += delta
        elif isinstance(event, _ENDS):
            self.ends[(event.req, event.gen)] += delta

    def _waits(self, index: int, event: ev.Event) -> bool:
        """Whether ``event`` (head of segment ``index``) must wait for a record
        still to come in another segment of this tie."""
        if isinstance(event, _TERMINAL):
            return any(s for i, s in enumerate(self.segments) if i != index)
        if isinstance(event, ev.CompletionsReceived):
            return self.reports[event.job] > 0
        if event.side != ev.SIDE_WORKER:
            return False
        if isinstance(event, _LEARNED) and self.ends[(event.req, event.gen)] > 0:
            return True
        job = getattr(event, "job", None)
        return job is not None and self.enqueues[job] > 0

    def __iter__(self) -> Iterator[tuple[int, _Item]]:
        while True:
            heads = [(_preference(s[0][1]), i) for i, s in enumerate(self.segments) if s]
            if not heads:
                return
            heads.sort()
            # The first head that waits for nothing; if every head waits (a
            # cycle: the journals themselves break causality), the first one,
            # and the fold reports what is wrong.
            chosen = next(
                (i for _, i in heads if not self._waits(i, self.segments[i][0][1].entry.event)),
                heads[0][1],
            )
            file_index, item = self.segments[chosen].popleft()
            self._count(item.entry.event, -1)
            yield file_index, item


def interleave(streams: Sequence[Iterator[_Item]]) -> Iterator[tuple[int, _Item]]:
    """The records of ``streams`` (one per file) in merged order, each with the
    index of its stream."""
    stamped = [_stamped(s) for s in streams]
    # (ts, tie preference, stream index, item): the heap orders by time only
    # in effect; ties are taken out together below.
    heap: list[tuple[int, tuple[int, int, str], int, _Item]] = []

    def push(index: int, head: _Stamped | None) -> None:
        if head is not None:
            heapq.heappush(heap, (head.ts, _preference(head.item), index, head.item))

    for index, stream in enumerate(stamped):
        push(index, next(stream, None))
    while heap:
        ts, _, index, item = heapq.heappop(heap)
        if not heap or heap[0][0] != ts:
            # The common case on a real clock: no other file at this ts.
            yield index, item
            push(index, next(stamped[index], None))
            continue
        # Several files at this ts: take each one's records at it, in order.
        tied = [(index, item)]
        while heap and heap[0][0] == ts:
            _, _, other, other_item = heapq.heappop(heap)
            tied.append((other, other_item))
        segments: list[deque[tuple[int, _Item]]] = []
        for file_index, first in tied:
            segment = deque([(file_index, first)])
            following = next(stamped[file_index], None)
            while following is not None and following.ts == ts:
                segment.append((file_index, following.item))
                following = next(stamped[file_index], None)
            segments.append(segment)
            push(file_index, following)
        yield from _Tie(segments)
