"""One rank of vLLM's OffloadingConnector, journaled (see :mod:`kvstate.vllm.offloading._hooks`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstate import build
from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit
from kvstate.vllm.offloading._tier_audit import TierAudit


class OffloadingWorkerObserver:
    """Journals one rank's ``OffloadingConnectorWorker`` (see the module docstring)."""

    def __init__(self, recorder: Recorder, *, rank: int, audit: TierAudit | None) -> None:
        self.recorder = recorder
        self.rank = rank
        self.step = 0
        #: its journal was ended (finish(), or the observer stood down)
        self.closed = False
        self.group = GroupCommit(recorder)
        #: jobs received and not yet reported (kvstate.vllm.outstanding)
        self.unreported: set[int] = set()
        self.received: set[int] = set()
        #: the tier audited by bytes (None: fingerprints off, or a tier it cannot read)
        self.audit = audit
        #: job -> (req, gen, keys, of a finished request), as the scheduler named it
        self.jobs: dict[int, tuple[str, int, tuple[str, ...], bool]] = {}
        #: jobs this rank met that no observed scheduler named
        self.met_in_flight = 0
        #: with no tier audit, a step is journaled from two of vLLM's calls
        #: (:meth:`step_seen`, :meth:`finished`), not four
        self.lean = audit is None
        #: (lean) the stores vLLM queued last step: this step starts them
        self.queued: list[int] = []
        #: (lean) the rank's completion counts as last journaled, and their object
        self._counted: tuple[Any, dict[int, int]] = (None, {})

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

    # -- around vLLM's calls (what :class:`~kvstate.vllm.offloading._hooks.OffloadingHooks` calls)

    @staticmethod
    def completed(worker: Any) -> dict[int, int]:
        """The rank's completion counts so far this step (vLLM resets them each step)."""
        return dict(worker._connector_worker_meta.completed_jobs)

    def before_store(self, worker: Any, meta: Any) -> dict[int, int]:
        """``prepare_store_kv``: after the forward pass that computed their tokens,
        this step's stores are due (and queued for the copy worker)."""
        self.saw(meta)
        self.saves_due(meta, finished_only=False)
        if meta.store_jobs:
            self.receive(sorted(meta.store_jobs))
        return self.completed(worker)

    def before_preemptions(self, worker: Any, meta: Any) -> dict[int, int]:
        """``handle_preemptions``: a finished request's stores are due before this
        step's forward pass may write the blocks vLLM freed (a new holder's, this
        very step); stores flushed in the step that built them go straight to
        the copy worker, with what was queued."""
        self.saw(meta)
        self.saves_due(meta, finished_only=True)
        before = self.completed(worker)
        flush = meta.jobs_to_flush
        popped = sorted(j for j in flush if j in meta.store_jobs) if flush else []
        if popped:
            self.receive(popped)
        if getattr(worker, "_is_store_writer", True):  # vLLM 0.32; every rank before
            queued = [entry[0] for entry in worker._unsubmitted_store_jobs]
            if queued or popped:
                self.start(queued + popped)
        return before

    def before_transfers(self, worker: Any, meta: Any) -> None:
        """``start_kv_transfers``: this step's loads, and the queued stores, start."""
        self.saw(meta)
        queued = [entry[0] for entry in worker._unsubmitted_store_jobs]
        if meta.load_jobs:
            loads = sorted(meta.load_jobs)
            self.loads_received(meta)
            self.receive(loads)
            queued += loads
        if queued:
            self.start(queued)

    def after_call(
        self,
        worker: Any,
        before: dict[int, int] | None,
        flushed: Iterable[int] | None = None,
        step_ended: bool = False,
    ) -> None:
        """What one vLLM call completed (``before``: the counts it began with;
        None when taking them failed), the flush it waited for, the step's end."""
        if before is not None:
            after = worker._connector_worker_meta.completed_jobs
            if after != before:
                self.reported(before, dict(after))
        if flushed:
            self.flushed(flushed)
        if step_ended:
            self.step_ended()

    # -- lean: without a tier audit nothing needs the moment of the first two calls

    def step_seen(self, worker: Any, meta: Any) -> None:
        """After ``prepare_store_kv``, the step so far, in the order the four
        calls would have journaled it: ``handle_preemptions`` started the
        stores queued last step and those flushed as they were built, then
        waited for the flush; ``start_kv_transfers`` started the loads;
        ``prepare_store_kv`` queued the step's stores."""
        self.step = getattr(meta, "_kvstate_step", self.step)
        if not (
            meta.store_jobs
            or meta.load_jobs
            or meta.jobs_to_flush
            or self.queued
            or worker._unsubmitted_store_jobs
            or worker._connector_worker_meta.completed_jobs
            or getattr(meta, "_kvstate_jobs", None)
        ):
            # Most steps: this rank received, started, flushed and completed
            # nothing. Checked first, because this runs on the engine thread
            # every step (the cost row in docs/offloading.md).
            return
        self.saw(meta)
        named = getattr(meta, "_kvstate_jobs", None) or {}
        flush = meta.jobs_to_flush or ()
        # a store built and flushed this step: popped off the metadata by vLLM
        popped = sorted(
            j for j in flush if j in named and j not in meta.store_jobs and j not in meta.load_jobs
        )
        if popped:
            self.receive(popped)
        if getattr(worker, "_is_store_writer", True):
            self.start(self.queued + popped)
        before, after = self._counts(worker)
        self.reported(before, after)  # a flushed store of a rank that writes none
        if flush:
            self.flushed(flush)
        if meta.load_jobs:
            loads = sorted(meta.load_jobs)
            self.receive(loads)
            self.start(loads)
        if meta.store_jobs:
            self.receive(sorted(meta.store_jobs))
            self.reported(before, after)
        self.queued = [entry[0] for entry in worker._unsubmitted_store_jobs]

    def finished(self, worker: Any) -> None:
        """After ``get_finished``: what the rank completed, and the step's end."""
        if not worker._connector_worker_meta.completed_jobs:
            # Nothing completed on this rank this step (the common case): no
            # counts to compare, and none kept, since a fresh object (or an
            # empty one) compares as no count at all (see _counts).
            self.step_ended()
            return
        before, after = self._counts(worker)
        if after != before:
            self.reported(before, after)
        self.step_ended()

    def _counts(self, worker: Any) -> tuple[dict[int, int], dict[int, int]]:
        """The counts last journaled and the rank's now (vLLM starts a new
        object for them each step it hands them over)."""
        meta = worker._connector_worker_meta
        seen, counted = self._counted
        now = dict(meta.completed_jobs)
        self._counted = (meta, now)
        return (counted if seen is meta else {}), now

    def saw(self, meta: Any) -> None:
        self.step = getattr(meta, "_kvstate_step", self.step)
        self.jobs.update(getattr(meta, "_kvstate_jobs", None) or {})

    def saves_due(self, meta: Any, *, finished_only: bool) -> None:
        """Fingerprint the store jobs whose blocks hold what they are to store now."""
        if self.audit is None or not meta.store_jobs:
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
            if job not in self.jobs:
                # No observed scheduler named it (a test that drives a worker
                # with metadata of its own, or a job from before the journal
                # began): journaled, it would be an effect of a job never
                # enqueued.
                self.met_in_flight += 1
                continue
            if job not in self.received:
                self.received.add(job)
                self.unreported.add(job)
                self._record(build.job_received(job=job, rank=self.rank))

    def start(self, jobs: Iterable[int]) -> None:
        for job in jobs:
            if job in self.received:
                self._record(build.job_started(job=job, rank=self.rank))

    def reported(self, before: dict[int, int], after: dict[int, int]) -> None:
        """The jobs whose completion count this rank raised during one vLLM call."""
        for job in sorted(after):
            if after[job] > before.get(job, 0) and job in self.unreported:
                self.unreported.discard(job)
                self._record(build.job_reported(job=job, rank=self.rank))
                self.jobs.pop(job, None)
                if self.audit is not None:
                    for verdict in self.audit.done(job):
                        self._record(verdict)

    def flushed(self, jobs: Iterable[int]) -> None:
        mine = tuple(sorted(j for j in jobs if j in self.received))
        if mine:
            self._record(build.flush_done(jobs=mine, rank=self.rank))

    def step_ended(self) -> None:
        self.group.step_ended()

    def close(self) -> None:
        if self.closed:  # stood down, or ended by an error of ours
            return
        self.closed = True
        self.recorder.close()
