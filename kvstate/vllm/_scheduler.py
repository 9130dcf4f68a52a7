"""The scheduler side of a vLLM process, journaled as it happens.

vLLM makes every decision; this only writes down what it decided, once per
step, in the order the engine did it: preemptions (the core already freed
those blocks), admissions and resumes with their block tables, appended
blocks, then the store jobs the connector emitted. Finishes are written from
the connector's ``request_finished`` hook, with vLLM's hold decision;
completions and pin releases from ``update_connector_output``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit


def _table(block_ids: Any) -> list[int]:
    """Group 0 of a per-group block table (a bare list in older shapes)."""
    if not block_ids:
        return []
    first = block_ids[0]
    if isinstance(first, int):
        return list(block_ids)
    return list(first)


def _hex(block_hash: Any) -> str:
    return block_hash.hex() if hasattr(block_hash, "hex") else str(block_hash)


class SchedulerObserver:
    """Journals one ``MooncakeStoreScheduler``.

    ``numbering`` is True for the connector before vLLM #52372, whose jobs
    have no ids: kvstate numbers them, in enqueue order, and hands the
    number (and the incarnation's generation) to the workers on the
    ``ReqMeta`` itself, so both sides name the same job.
    """

    def __init__(
        self, recorder: Recorder, *, block_size: int, world_size: int, numbering: bool
    ) -> None:
        self.recorder = recorder
        self.world_size = world_size
        self.block_size = block_size
        self.numbering = numbering
        #: its journal was ended (finish()): the connector is observed no more
        self.closed = False
        self.step = 0
        self.group = GroupCommit(recorder)
        self.gens: dict[str, int] = {}
        self.finished: set[str] = set()
        #: admitted for a load, not yet scheduled
        self.waiting: set[str] = set()
        #: requests whose finish held their blocks (before #52372)
        self.holding: dict[str, int] = {}
        self.next_job = 0
        #: jobs this journal enqueued whose pins vLLM still holds (store-job flavor)
        self.jobs: set[int] = set()
        #: lifecycles met in flight: requests and jobs that began before this
        #: observer existed (vLLM's unit tests, an install() in a running
        #: engine). Nothing is recorded about them, and the journal then ends
        #: without engine_idle: replay says UNFINISHED, never a violation the
        #: run did not contain.
        self.met_in_flight = 0

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

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

    def record_requests(
        self, out: Any, local: Callable[[str, int], int]
    ) -> tuple[set[str], dict[str, int]]:
        """The step's preemptions, admissions, resumes and block tables, in vLLM's order.

        ``local(req, computed)`` is how many of a request's tokens the engine's
        own prefix cache held (its blocks keep their content). Returns the
        requests that (re)started with a new table, and the incarnations
        preempted.
        """
        bs = self.block_size
        restarted: set[str] = set()
        preempted: dict[str, int] = {}
        for req in sorted(out.preempted_req_ids) if out.preempted_req_ids else ():
            gen = self.gens.get(req)
            if gen is None:
                self.met_in_flight += 1
                continue
            if req in self.finished:
                continue
            self._record(ev.RequestPreempted(req=req, gen=gen))
            preempted[req] = gen
        self.after_preemptions()
        for new in out.scheduled_new_reqs:
            req = new.req_id
            table = _table(new.block_ids)
            cached_tokens = local(req, new.num_computed_tokens)
            cached = table[: cached_tokens // bs]
            if req in self.waiting:  # admitted when its load was issued
                self.waiting.discard(req)
            elif req in self.gens:  # the v2 runner resumes a request as "new"
                self.gens[req] += 1
                self._record(ev.RequestResumed(req=req, gen=self.gens[req]))
            else:
                self.gens[req] = 0
                prompt = len(new.prompt_token_ids or ())
                self._record(ev.RequestAdmitted(req=req, gen=0, prompt_tokens=prompt))
            restarted.add(req)
            self._record(
                ev.BlocksAssigned(
                    req=req,
                    gen=self.gens[req],
                    blocks=tuple(table),
                    mode="replace",
                    cached=tuple(cached),
                )
            )
        cached_reqs = out.scheduled_cached_reqs
        resumed: Collection[str] = getattr(cached_reqs, "resumed_req_ids", None) or ()
        # Most decode steps allocate nothing: skip those requests at C speed.
        for i, new_ids in enumerate(cached_reqs.new_block_ids):
            if not new_ids or not new_ids[0]:
                continue
            req = cached_reqs.req_ids[i]
            if req not in self.gens:
                self.met_in_flight += 1
                continue
            table = _table(new_ids)
            if req in resumed:
                if req in self.waiting:  # resumed when its load was issued
                    self.waiting.discard(req)
                else:
                    self.gens[req] += 1
                    self._record(ev.RequestResumed(req=req, gen=self.gens[req]))
                restarted.add(req)
                computed = cached_reqs.num_computed_tokens[i]
                cached_tokens = local(req, computed)
                self._record(
                    ev.BlocksAssigned(
                        req=req,
                        gen=self.gens[req],
                        blocks=tuple(table),
                        mode="replace",
                        cached=tuple(table[: cached_tokens // bs]),
                    )
                )
            elif table:
                self._record(
                    ev.BlocksAssigned(
                        req=req, gen=self.gens[req], blocks=tuple(table), mode="append"
                    )
                )
        return restarted, preempted

    def after_preemptions(self) -> None:
        """Between the step's preemptions and its new tables (a connector's flush goes here)."""

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
        table = _table(req_meta.block_ids)
        hashes: Sequence[Any] = req_meta.block_hashes or ()
        keys = [_hex(hashes[e // bs - 1]) for e in range(start + bs, end + 1, bs)]
        parent = _hex(hashes[start // bs - 1]) if start > 0 else None
        pins: list[int] = []
        if pinned is not None and job in pinned:
            pins = list(pinned[job][0])
        reads = table[start // bs : end // bs] if end > start else pins
        self._record(
            ev.JobEnqueued(
                job=job,
                req=req,
                gen=gen,
                token_start=start,
                token_end=end,
                reads=tuple(reads),
                pins=tuple(pins),
                keys=tuple(keys),
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
        table = _table(req_meta.block_ids)
        self.gens[req] = 0
        self.waiting.add(req)
        entry = getattr(sched, "_unfinished_requests", {}).get(req)
        prompt = entry[0].num_prompt_tokens if entry else spec.kvpool_cached_tokens
        self._record(ev.RequestAdmitted(req=req, gen=0, prompt_tokens=prompt))
        cached = table[: spec.vllm_cached_tokens // self.block_size]
        self._record(
            ev.BlocksAssigned(
                req=req, gen=0, blocks=tuple(table), mode="replace", cached=tuple(cached)
            )
        )

    # -- between steps --------------------------------------------------------------

    def request_finished(self, request: Any, hold: bool) -> None:
        req = request.request_id
        gen = self.gens.get(req)
        if gen is None or req in self.finished:
            return  # never scheduled: it held nothing
        self.finished.add(req)
        status = str(getattr(request, "status", ""))
        aborted = "ABORT" in status.upper()
        self._record(ev.RequestFinished(req=req, gen=gen, hold=bool(hold), aborted=aborted))
        if hold:
            self.holding[req] = gen

    def finished_sending(self, reqs: Any) -> None:
        """Before #52372: the core frees a held request's blocks when a worker reports it."""
        for req in sorted(reqs or ()):
            gen = self.holding.pop(req, None)
            if gen is not None:
                self._record(ev.HeldBlocksReleased(req=req, gen=gen))

    def completions(self, completed: dict[int, int], released: dict[int, list[int]]) -> None:
        """After #52372: reports summed over ranks, then the pins vLLM freed (tail first)."""
        for job, count in sorted(completed.items()):
            if job not in self.jobs:
                self.met_in_flight += 1  # enqueued before this journal began
                continue
            self._record(ev.CompletionsReceived(job=job, count=count))
        for job, blocks in released.items():
            if job not in self.jobs:
                continue
            self.jobs.discard(job)
            self._record(ev.PinsReleased(job=job, blocks=tuple(reversed(blocks))))

    def commit(self) -> None:
        """A step boundary: commit in groups (see :mod:`kvstate.vllm._commit`)."""
        self.group.step_ended()

    def running(self) -> set[str]:
        """Requests this journal admitted that vLLM has not finished."""
        return set(self.gens) - self.finished

    def close(self, *, idle: bool = True, error: str | None = None) -> None:
        """End the journal; ``engine_idle`` only where the engine had no work left.

        engine_idle claims quiescence, and replay then judges every pin and
        report still outstanding. A journal ended while a request it admitted
        is still running (a unit test that stops mid-lifecycle, an engine
        stopped with work queued) or that met lifecycles begun before it
        cannot claim that: it ends without engine_idle and replay says
        UNFINISHED. A request that finished while its job's pins are still
        held is the pre-fix leak, and stays a LEAKED_PIN. A journal already
        ended (its observer stood down) is left as it is.
        """
        if self.closed:
            return
        self.closed = True
        if error is not None:
            self._record(ev.EngineCrashed(error=error))
        elif idle and not self.met_in_flight and not self.running():
            self._record(ev.EngineIdle())
        self.recorder.close()
