"""The scheduler side of a connector that emits store jobs, journaled as it happens.

The base of the Mooncake store's and the OffloadingConnector's scheduler
observers (the lifecycle itself is :mod:`kvstate.vllm._lifecycle`'s). vLLM
makes every decision; this only writes down what it decided, once per
step, in the order the engine did it: preemptions (the core already freed
those blocks), admissions and resumes with their block tables, appended
blocks, then the store jobs the connector emitted. Finishes are written from
the connector's ``request_finished`` hook, with vLLM's hold decision;
completions and pin releases from ``update_connector_output``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstate import build
from kvstate.recorder import Recorder
from kvstate.vllm._lifecycle import LifecycleObserver, group0, hex_of


class SchedulerObserver(LifecycleObserver):
    """Journals one ``MooncakeStoreScheduler``.

    ``numbering`` is True for the connector before vLLM #52372, whose jobs
    have no ids: kvstate numbers them, in enqueue order, and hands the
    number (and the incarnation's generation) to the workers on the
    ``ReqMeta`` itself, so both sides name the same job.
    """

    def __init__(
        self, recorder: Recorder, *, block_size: int, world_size: int, numbering: bool
    ) -> None:
        super().__init__(recorder, block_size=block_size, world_size=world_size)
        self.numbering = numbering
        self.next_job = 0
        #: jobs this journal enqueued whose pins vLLM still holds (store-job flavor)
        self.jobs: set[int] = set()

    # -- one scheduler step ---------------------------------------------------------

    def before_build(self, sched: Any) -> dict[str, Any]:
        """What the connector's own bookkeeping is about to overwrite."""
        trackers = getattr(sched, "_request_trackers", {})
        specs = getattr(sched, "load_specs", {})
        return {
            "saved": {r: t.num_saved_tokens for r, t in trackers.items()},
            "local": {r: s.vllm_cached_tokens for r, s in specs.items() if s.can_load},
        }

    def after_build(self, sched: Any, out: Any, meta: Any, before: dict[str, Any]) -> None:
        self.step += 1
        local = before["local"]
        restarted, preempted = self.record_requests(out, lambda req, n: local.get(req, n))
        pinned = getattr(sched, "_pinned_saves", None)
        for req_meta in meta.requests:
            self._job(sched, req_meta, before, restarted, pinned)
        # What the workers need to name the incarnations this step ended.
        meta._kvstate_step = self.step
        meta._kvstate_preempted = preempted
        self.commit()

    def _job(
        self,
        sched: Any,
        req_meta: Any,
        before: dict[str, Any],
        restarted: set[str],
        pinned: dict[int, Any] | None,
    ) -> None:
        req = req_meta.req_id
        spec = req_meta.load_spec
        loading = spec is not None and spec.can_load
        if loading and req not in self.gens:
            self._admit_waiting(sched, req_meta, spec)
        gen = self.gens.get(req)
        req_meta._kvstate_gen = gen
        if not req_meta.can_save:
            return
        if gen is None:
            self.met_in_flight += 1
            return
        if self.numbering:
            job = self.next_job
            self.next_job += 1
        else:
            job = req_meta.store_job_id
            self.jobs.add(job)
        req_meta._kvstate_job = job
        bs = self.block_size
        start = 0 if req in restarted else before["saved"].get(req, 0)
        end = req_meta.token_len_chunk // bs * bs
        start = min(start, end)
        table = group0(req_meta.block_ids)
        hashes: Sequence[Any] = req_meta.block_hashes or ()
        keys = [hex_of(hashes[e // bs - 1]) for e in range(start + bs, end + 1, bs)]
        parent = hex_of(hashes[start // bs - 1]) if start > 0 else None
        pins: list[int] = []
        if pinned is not None and job in pinned:
            pins = list(pinned[job][0])
        reads = table[start // bs : end // bs] if end > start else pins
        self._record(
            build.job_enqueued(
                job=job,
                req=req,
                gen=gen,
                token_start=start,
                token_end=end,
                reads=reads,
                pins=pins,
                keys=keys,
                parent=parent,
                world_size=self.world_size,
            )
        )

    def _admit_waiting(self, sched: Any, req_meta: Any, spec: Any) -> None:
        """A request waiting for an asynchronous load holds blocks before it is scheduled.

        The load writes into them, so the incarnation starts here; when the
        request is scheduled later its full table replaces this one (blocks
        kept keep their epoch).
        """
        req = req_meta.req_id
        table = group0(req_meta.block_ids)
        self.gens[req] = 0
        self.waiting.add(req)
        entry = getattr(sched, "_unfinished_requests", {}).get(req)
        prompt = entry[0].num_prompt_tokens if entry else spec.kvpool_cached_tokens
        self._record(build.request_admitted(req=req, gen=0, prompt_tokens=prompt))
        self.replaced(req, table, table[: spec.vllm_cached_tokens // self.block_size])

    # -- between steps --------------------------------------------------------------

    def completions(self, completed: dict[int, int], released: dict[int, list[int]]) -> None:
        """After #52372: reports summed over ranks, then the pins vLLM freed (tail first)."""
        for job, count in sorted(completed.items()):
            if job not in self.jobs:
                self.met_in_flight += 1  # enqueued before this journal began
                continue
            self._record(build.completions_received(job=job, count=count))
        for job, blocks in released.items():
            if job not in self.jobs:
                continue
            self.jobs.discard(job)
            self._record(build.pins_released(job=job, blocks=reversed(blocks)))
