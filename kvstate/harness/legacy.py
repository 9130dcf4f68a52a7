"""The legacy policy: the store connector as it behaved before the fixes.

For the bug zoo only; never for production. Two policy objects
(:mod:`kvstate.policy`) plug into the plain ledgers and replace the fixed
decisions with the old code paths, so the journal written is what the old
connector would have written. Replay must flag it; the same script without
a policy must come out clean. ``docs/bug-zoo.md`` cites each upstream vLLM
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

from collections.abc import Sequence

from kvstate import events as ev
from kvstate.jobspec import JobSpec
from kvstate.policy import SchedulerPolicy, SchedulerView, WorkerPolicy, WorkerView

#: the policies a harness can run: the fixed connector, and the old one
POLICIES = ("kvstate", "legacy")

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


class LegacyScheduler(SchedulerPolicy):
    """``MooncakeStoreScheduler`` before #43281, #46595, #52372 and #54853."""

    def __init__(self, bugs: frozenset[str] = BUGS) -> None:
        self.bugs = _check(bugs)
        # One RequestTracker per request, popped at preemption (the #43281 crash).
        self._trackers: set[str] = set()
        # Connector-local preempted ids, added at preemption and never
        # cleared (#46595): the engine's resumed flag is ignored.
        self._preempted_ids: set[str] = set()
        # The step's block-state snapshot: only requests given new blocks
        # (#54853), as req -> the step it last got blocks.
        self._assigned: dict[str, int] = {}

    def observe(self, ledger: SchedulerView, event: ev.Event) -> None:
        kind = type(event)
        if kind is ev.RequestAdmitted or kind is ev.RequestResumed:
            self._trackers.add(event.req)  # type: ignore[attr-defined]
        elif kind is ev.RequestPreempted:
            self._trackers.discard(event.req)  # type: ignore[attr-defined]
            self._preempted_ids.add(event.req)  # type: ignore[attr-defined]
        elif kind is ev.RequestFinished:
            self._trackers.discard(event.req)  # type: ignore[attr-defined]
        elif kind is ev.BlocksAssigned:
            self._assigned[event.req] = ledger.step  # type: ignore[attr-defined]

    def finish_hold(self, ledger: SchedulerView, req: str, fixed: bool) -> bool:
        if "tracker-assert" in self.bugs and req not in self._trackers:
            raise LegacyCrash("AssertionError: assert tracker is not None (request_finished)")
        if "no-pins" not in self.bugs:
            return fixed
        # delay_free_blocks: only the normal finish path keeps blocks while
        # saves are outstanding; preemption has no such hook.
        return fixed or ledger.outstanding(req)

    def finished_sending(self, ledger: SchedulerView, req: str) -> None:
        """The worker reported ``req`` done: the delayed free finally happens."""
        ledger.current_gen(req, "finished_sending")
        for gen in ledger.held_generations(req):
            ledger.release_held(req, gen)

    def assign_mode(self, ledger: SchedulerView, req: str, fixed: ev.Mode) -> ev.Mode:
        if "local-preempted-set" not in self.bugs:
            return fixed
        return "replace" if req in self._preempted_ids else "append"

    def job_table(self, ledger: SchedulerView, req: str, fixed: list[int]) -> list[int]:
        if "new-blocks-snapshot" in self.bugs and self._assigned.get(req) != ledger.step:
            raise LegacyCrash(
                f"AssertionError: no block ids for {req} in kv_connector_block_state "
                "(a block filled on a step that allocated none)"
            )
        return fixed

    def job_pins(self, ledger: SchedulerView, req: str, fixed: tuple[int, ...]) -> tuple[int, ...]:
        if "no-pins" not in self.bugs:
            return fixed
        return ()  # nothing pins a job's blocks: preemption frees them under the PUT


class LegacyWorker(WorkerPolicy):
    """``KVCacheStoreSendingThread`` before #52372 and #52466."""

    def __init__(self, bugs: frozenset[str] = BUGS) -> None:
        self.bugs = _check(bugs)
        # req_id -> jobs queued: the counter of #51637. A request id is reused
        # after resume, so an old generation's job decrements the new one.
        self._count: dict[str, int] = {}

    def observe(self, ledger: WorkerView, event: ev.Event) -> None:
        kind = type(event)
        if kind is ev.JobReceived or kind is ev.JobReported:
            spec = ledger.spec(event.job)  # type: ignore[attr-defined]
            if spec is None:
                return
            if kind is ev.JobReceived:
                self._count[spec.req] = self._count.get(spec.req, 0) + 1
            elif "req-id-counter" in self.bugs and spec.req in self._count:
                self._count[spec.req] -= 1
        elif kind is ev.PreemptionSeen or kind is ev.RequestRetired:
            self._count.pop(event.req, None)  # type: ignore[attr-defined]

    def retire_blocked(self, ledger: WorkerView, req: str, gen: int, fixed: bool) -> bool:
        """``finished_sending`` once the request's counter reaches zero."""
        if "req-id-counter" not in self.bugs:
            return fixed
        return self._count.get(req, 0) > 0

    def live_at_start(self, ledger: WorkerView, job: int, fixed: bool) -> bool:
        if "req-id-counter" not in self.bugs:
            return fixed
        spec = ledger.spec(job)
        return spec is not None and spec.req in self._count

    def effect_allowed(self, ledger: WorkerView, job: int, fixed: bool) -> bool:
        if self.bugs.isdisjoint({"req-id-counter", "unguarded-effects"}):
            return fixed
        return True

    def kv_event_parents(
        self, spec: JobSpec, stored: Sequence[str], fixed: list[str | None]
    ) -> list[str | None]:
        if "store-order-parents" not in self.bugs:
            return fixed
        # The previous key *stored in this batch*: after dedup skipped the
        # prefix, the first stored key is published as a root.
        return [None, *stored[:-1]] if stored else []


def scheduler_policy(name: str, bugs: frozenset[str] = BUGS) -> LegacyScheduler | None:
    """The scheduler policy of a harness run: None for ``kvstate`` (the fixed connector)."""
    return LegacyScheduler(bugs) if _is_legacy(name) else None


def worker_policy(name: str, bugs: frozenset[str] = BUGS) -> LegacyWorker | None:
    """The worker policy of a harness run, one per rank: None for ``kvstate``."""
    return LegacyWorker(bugs) if _is_legacy(name) else None


def _is_legacy(name: str) -> bool:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    return name == "legacy"
