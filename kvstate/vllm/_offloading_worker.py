"""One rank of vLLM's OffloadingConnector, journaled (see :mod:`kvstate.vllm._offloading`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstate import events as ev
from kvstate import tier_events as tier
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit
from kvstate.vllm._tier_audit import TierAudit


class OffloadingWorkerObserver:
    """Journals one rank's ``OffloadingConnectorWorker`` (see the module docstring)."""

    def __init__(self, recorder: Recorder, *, rank: int, audit: TierAudit | None) -> None:
        self.recorder = recorder
        self.rank = rank
        self.step = 0
        self.group = GroupCommit(recorder)
        #: jobs received and not yet reported (kvstate.vllm.outstanding)
        self.unreported: set[int] = set()
        self.received: set[int] = set()
        #: the tier audited by bytes (None: fingerprints off, or a tier it cannot read)
        self.audit = audit
        #: job -> (req, gen, keys, of a finished request), as the scheduler named it
        self.jobs: dict[int, tuple[str, int, tuple[str, ...], bool]] = {}

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

    def saw(self, meta: Any) -> None:
        self.step = getattr(meta, "_kvstate_step", self.step)
        self.jobs.update(getattr(meta, "_kvstate_jobs", None) or {})

    def saves_due(self, meta: Any, *, finished_only: bool) -> None:
        """Fingerprint the store jobs whose blocks hold what they are to store now."""
        if self.audit is None:
            return
        for job, transfer in meta.store_jobs.items():
            named = self.jobs.get(job)
            if named is not None and (named[3] or not finished_only):
                self.audit.store_due(job, transfer, named[2])

    def loads_received(self, meta: Any) -> None:
        if self.audit is None:
            return
        for job, transfer in meta.load_jobs.items():
            named = self.jobs.get(job)
            if named is not None:
                self.audit.load_received(job, transfer, named[0], named[1], named[2])

    def receive(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            if job not in self.received:
                self.received.add(job)
                self.unreported.add(job)
                self._record(ev.JobReceived(job=job, rank=self.rank))

    def start(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            if job in self.received:
                self._record(ev.JobStarted(job=job, rank=self.rank))

    def reported(self, before: dict[int, int], after: dict[int, int]) -> None:
        """The jobs whose completion count this rank raised during one vLLM call."""
        for job in sorted(after):
            if after[job] > before.get(job, 0) and job in self.unreported:
                self.unreported.discard(job)
                self._record(ev.JobReported(job=job, rank=self.rank))
                self.jobs.pop(job, None)
                if self.audit is not None:
                    for verdict in self.audit.done(job):
                        self._record(verdict)

    def flushed(self, jobs: Iterable[int]) -> None:
        mine = tuple(sorted(j for j in jobs if j in self.received))
        if mine:
            self._record(tier.FlushDone(jobs=mine, rank=self.rank))

    def step_ended(self) -> None:
        self.group.step_ended()

    def close(self) -> None:
        self.recorder.close()
