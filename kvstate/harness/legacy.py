"""The legacy policy: the store connector as it behaved before the fixes.

For the bug zoo only; never for production. Each override below is the old
code path, rewritten against our ledgers, so the journal it writes is what
the old connector would have written. Replay must flag it; the fixed policy
(the plain :class:`SchedulerLedger` / :class:`WorkerLedger`) running the same
script must come out clean. ``docs/bug-zoo.md`` cites each upstream vLLM
issue and PR.

The behaviours, their upstream history, and what replay says:

- no pins; blocks held only by a delayed free on the normal finish path
  (#52360, fixed by #52372): ``POISONED_READ``, ``POISONED_KEY``;
- completions counted per ``req_id`` (#51637, fixed by #52372):
  ``STALE_GENERATION``, ``PREMATURE_RETIRE``;
- ``assert tracker is not None`` at finish, the tracker popped at
  preemption (#43281): ``CRASH``;
- a connector-local preempted-ids set decides append vs replace (#46595):
  ``TABLE_OVERRUN``;
- the block-table snapshot covers only requests that got new blocks
  (#54853): ``CRASH``;
- KV-event parents taken from store order (#52466 review):
  ``PARENT_CHAIN_BROKEN``;
- retry tokens and other effects not guarded by job liveness (#52466):
  ``STALE_GENERATION``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.scheduler import SchedulerLedger
from kvstate.worker import JobSpec, WorkerLedger

#: every old behaviour, by name (the bug zoo turns them all on)
BUGS = frozenset(
    {
        "no-pins",  # #52360: jobs pin nothing; only a finish delays the free
        "req-id-counter",  # #51637: worker counts jobs per req_id; liveness by req_id
        "tracker-assert",  # #43281: assert tracker is not None at finish
        "local-preempted-set",  # #46595: append vs replace from a local set
        "new-blocks-snapshot",  # #54853: tables offered only for requests with new blocks
        "store-order-parents",  # #52466 review: KV-event parents from store order
        "unguarded-effects",  # #52466: retry tokens (and effects) not guarded by liveness
    }
)

#: the connector as it was just before #52372, as deployed by default: the
#: poisoning and ABA era. (#43281 and #46595 were fixed by then; #54853's
#: snapshot came later; KV events are off by default in vLLM, so the
#: store-order parents stayed unseen unless they were turned on.)
BEFORE_52372 = frozenset({"no-pins", "req-id-counter", "unguarded-effects"})


def _check(bugs: frozenset[str]) -> frozenset[str]:
    unknown = set(bugs) - BUGS
    if unknown:
        raise ValueError(f"unknown legacy bug(s): {', '.join(sorted(unknown))}")
    return frozenset(bugs)


class LegacyCrash(Exception):
    """An old ``assert`` that killed EngineCore. The engine records ``engine_crashed``."""


class LegacySchedulerLedger(SchedulerLedger):
    """``MooncakeStoreScheduler`` before #43281, #46595, #52372 and #54853."""

    def __init__(
        self, recorder: Recorder, *, strict: bool = False, bugs: frozenset[str] = BUGS
    ) -> None:
        super().__init__(recorder, strict=strict)
        self.bugs = _check(bugs)
        # One RequestTracker per request, popped at preemption (the #43281 crash).
        self._trackers: set[str] = set()
        # Connector-local preempted ids, added at preemption and never
        # cleared (#46595): the engine's resumed flag is ignored.
        self._preempted_ids: set[str] = set()
        # This step's block-state snapshot: only requests given new blocks (#54853).
        self._snapshot: set[str] = set()

    def begin_step(self, step: int | None = None) -> int:
        self._snapshot = set()
        return super().begin_step(step)

    def admit(self, req: str, prompt_tokens: int, hashes: Sequence[str | int] | None = None) -> int:
        gen = super().admit(req, prompt_tokens, hashes)
        self._trackers.add(req)
        return gen

    def resume(self, req: str) -> int:
        gen = super().resume(req)
        self._trackers.add(req)
        return gen

    def preempt(self, req: str) -> None:
        super().preempt(req)
        self._trackers.discard(req)
        self._preempted_ids.add(req)

    def request_finished(self, req: str, *, hold: bool = False, aborted: bool = False) -> None:
        if "tracker-assert" in self.bugs and req not in self._trackers:
            raise LegacyCrash("AssertionError: assert tracker is not None (request_finished)")
        self._trackers.discard(req)
        super().request_finished(req, hold=hold, aborted=aborted)

    finish = request_finished

    def assign_blocks(
        self, req: str, blocks: Iterable[int], *, resumed: bool, cached: Iterable[int] = ()
    ) -> None:
        super().assign_blocks(req, blocks, resumed=resumed, cached=cached)
        self._snapshot.add(req)

    def finished_sending(self, req: str) -> None:
        """The worker reported ``req`` done: the delayed free finally happens."""
        self.current_gen(req, "finished_sending")
        for gen in self.held_generations(req):
            self.release_held(req, gen)

    # -- the old decisions ---------------------------------------------------------------

    def _assign_mode(self, req: str, resumed: bool) -> ev.Mode:
        if "local-preempted-set" not in self.bugs:
            return super()._assign_mode(req, resumed)
        return "replace" if req in self._preempted_ids else "append"

    def _job_table(self, req: str) -> list[int]:
        if "new-blocks-snapshot" in self.bugs and req not in self._snapshot:
            raise LegacyCrash(
                f"AssertionError: no block ids for {req} in kv_connector_block_state "
                "(a block filled on a step that allocated none)"
            )
        return super()._job_table(req)

    def _job_pins(self, cow_blocks: Sequence[int], table: Sequence[int]) -> tuple[int, ...]:
        if "no-pins" not in self.bugs:
            return super()._job_pins(cow_blocks, table)
        return ()  # nothing pins a job's blocks: preemption frees them under the PUT

    def _finish_hold(self, req: str, hold: bool) -> bool:
        if "no-pins" not in self.bugs:
            return super()._finish_hold(req, hold)
        # delay_free_blocks: only the normal finish path keeps blocks while
        # saves are outstanding; preemption has no such hook.
        return hold or self.outstanding(req)


class LegacyWorkerLedger(WorkerLedger):
    """``KVCacheStoreSendingThread`` before #52372 and #52466."""

    def __init__(
        self, rank: int, recorder: Recorder, *, strict: bool = False, bugs: frozenset[str] = BUGS
    ) -> None:
        super().__init__(rank, recorder, strict=strict)
        self.bugs = _check(bugs)
        # req_id -> jobs queued: the counter of #51637. A request id is reused
        # after resume, so an old generation's job decrements the new one.
        self._count: dict[str, int] = {}

    def register(self, spec: JobSpec) -> None:
        with self._lock:
            super().register(spec)
            self._count[spec.req] = self._count.get(spec.req, 0) + 1

    def preemption_seen(self, req: str, gen: int) -> None:
        with self._lock:
            super().preemption_seen(req, gen)
            self._count.pop(req, None)

    def retire(self, req: str, gen: int) -> bool:
        """``finished_sending`` once the request's counter reaches zero."""
        if "req-id-counter" not in self.bugs:
            return super().retire(req, gen)
        with self._lock:
            if self._superseded(req, gen):
                return True
            if self._count.get(req, 0) > 0:
                return False
            self._count.pop(req, None)
            self._emit(ev.RequestRetired(req=req, gen=gen, rank=self.rank))
            return True

    def _live_at_start(self, job: int) -> bool:
        if "req-id-counter" not in self.bugs:
            return super()._live_at_start(job)
        spec = self.spec(job)
        return spec is not None and spec.req in self._count

    def _effect_allowed(self, job: int) -> bool:
        if self.bugs.isdisjoint({"req-id-counter", "unguarded-effects"}):
            return super()._effect_allowed(job)
        return True

    def _kv_event_parents(self, spec: JobSpec, stored: Sequence[str]) -> list[str | None]:
        if "store-order-parents" not in self.bugs:
            return super()._kv_event_parents(spec, stored)
        # The previous key *stored in this batch*: after dedup skipped the
        # prefix, the first stored key is published as a root.
        return [None, *stored[:-1]] if stored else []

    def _after_report(self, job: int) -> None:
        if "req-id-counter" not in self.bugs:
            return
        spec = self.spec(job)
        if spec is not None and spec.req in self._count:
            self._count[spec.req] -= 1


POLICIES: dict[str, tuple[type[SchedulerLedger], type[WorkerLedger]]] = {
    "kvstate": (SchedulerLedger, WorkerLedger),
    "legacy": (LegacySchedulerLedger, LegacyWorkerLedger),
}
