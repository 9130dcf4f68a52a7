"""What vLLM's core does with any connector's requests, journaled as it happens.

vLLM makes every decision; this only writes down what it decided, once per
step, in the order the engine did it: preemptions (the core already freed
those blocks), admissions and resumes with their block tables, appended
blocks. Finishes are written when the connector's ``request_finished``
answers, with the hold decision; the end of a held finish when the core
frees its blocks. :class:`LifecycleObserver` is the base every connector's
scheduler observer builds on (:mod:`kvstate.vllm.generic` for any
connector, :mod:`kvstate.vllm._store_jobs` for the Mooncake store's jobs):
one record per transition in one journal.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from kvstate import build
from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit


def group0(block_ids: Any) -> list[int]:
    """Group 0 of a per-group block table (a bare list in older shapes)."""
    if not block_ids:
        return []
    first = block_ids[0]
    if isinstance(first, int):
        return list(block_ids)
    return list(first)


def hex_of(block_hash: Any) -> str:
    return block_hash.hex() if hasattr(block_hash, "hex") else str(block_hash)


class LifecycleObserver:
    """Journals the lifecycle vLLM's core gives one connector's requests."""

    def __init__(self, recorder: Recorder, *, block_size: int, world_size: int) -> None:
        self.recorder = recorder
        self.world_size = world_size
        self.block_size = block_size
        #: its journal was ended (finish()): the connector is observed no more
        self.closed = False
        self.step = 0
        self.group = GroupCommit(recorder)
        self.gens: dict[str, int] = {}
        self.finished: set[str] = set()
        #: admitted for a load, not yet scheduled
        self.waiting: set[str] = set()
        #: requests whose finish held their blocks
        self.holding: dict[str, int] = {}
        #: lifecycles met in flight: requests and jobs that began before this
        #: observer existed (vLLM's unit tests, an install() in a running
        #: engine). Nothing is recorded about them, and the journal then ends
        #: without engine_idle: replay says UNFINISHED, never a violation the
        #: run did not contain.
        self.met_in_flight = 0

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

    # -- one scheduler step ---------------------------------------------------------

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
            self._record(build.request_preempted(req=req, gen=gen))
            preempted[req] = gen
        self.after_preemptions()
        for new in out.scheduled_new_reqs:
            req = new.req_id
            table = group0(new.block_ids)
            cached_tokens = local(req, new.num_computed_tokens)
            cached = table[: cached_tokens // bs]
            if req in self.waiting:  # admitted when its load was issued
                self.waiting.discard(req)
            elif req in self.gens and req not in self.finished:
                self.gens[req] += 1  # the v2 runner resumes a request as "new"
                self._record(build.request_resumed(req=req, gen=self.gens[req]))
            else:
                self.admit(req, len(new.prompt_token_ids or ()))
            restarted.add(req)
            self.replaced(req, table, cached)
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
            table = group0(new_ids)
            if req in resumed:
                if req in self.waiting:  # resumed when its load was issued
                    self.waiting.discard(req)
                else:
                    self.gens[req] += 1
                    self._record(build.request_resumed(req=req, gen=self.gens[req]))
                restarted.add(req)
                computed = cached_reqs.num_computed_tokens[i]
                self.replaced(req, table, table[: local(req, computed) // bs])
            elif table:
                self._record(
                    build.blocks_assigned(req=req, gen=self.gens[req], blocks=table, mode="append")
                )
        return restarted, preempted

    def replaced(self, req: str, table: list[int], cached: Sequence[int]) -> None:
        """``req``'s current incarnation has the whole table ``table`` now; the
        blocks ``cached`` kept their content (the engine's own prefix hits)."""
        gen = self.gens[req]
        blocks, kept = tuple(table), tuple(cached)
        self._record(
            build.blocks_assigned(req=req, gen=gen, blocks=blocks, mode="replace", cached=kept)
        )

    def admit(self, req: str, prompt: int) -> None:
        """A new request; an id vLLM finished before (a client may reuse one)
        is a new incarnation of it, at the next generation."""
        gen = self.gens[req] + 1 if req in self.gens else 0
        self.gens[req] = gen
        self.finished.discard(req)
        self._record(build.request_admitted(req=req, gen=gen, prompt_tokens=prompt))

    def after_preemptions(self) -> None:
        """Between the step's preemptions and its new tables (a connector's flush goes here)."""

    # -- between steps --------------------------------------------------------------

    def request_finished(self, request: Any, hold: bool) -> None:
        req = request.request_id
        gen = self.gens.get(req)
        if gen is None or req in self.finished:
            return  # never scheduled: it held nothing
        self.finished.add(req)
        status = str(getattr(request, "status", ""))
        aborted = "ABORT" in status.upper()
        self._record(build.request_finished(req=req, gen=gen, hold=bool(hold), aborted=aborted))
        if hold:
            self.holding[req] = gen

    def finished_sending(self, reqs: Any) -> None:
        """Before #52372: the core frees a held request's blocks when a worker reports it."""
        for req in sorted(reqs or ()):
            gen = self.holding.pop(req, None)
            if gen is not None:
                self._record(build.held_blocks_released(req=req, gen=gen))

    def commit(self) -> None:
        """A step boundary: commit in groups (see :mod:`kvstate.vllm._commit`)."""
        self.group.step_ended()

    def quiescent(self) -> bool:
        """Nothing this journal saw begin is still outstanding, and it met
        nothing begun before it: ``engine_idle`` may be claimed."""
        return not self.met_in_flight and not self.running()

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
            self._record(build.engine_crashed(error=error))
        elif idle and self.quiescent():
            self._record(build.engine_idle())
        self.recorder.close()
