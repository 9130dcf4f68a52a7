"""The scheduler half of vLLM's OffloadingConnector, journaled (see :mod:`._hooks`).

Tier keys and store keys are vLLM's ``OffloadKey`` bytes, in hex.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any
from unittest.mock import NonCallableMock

from kvstate import build
from kvstate.recorder import Recorder
from kvstate.vllm._lifecycle import group0
from kvstate.vllm._shapes import Shapes
from kvstate.vllm._store_jobs import SchedulerObserver


def hex_of(key: Any) -> str:
    return key.hex() if hasattr(key, "hex") else str(key)


def _ids(spec: Any) -> tuple[int, ...]:
    return tuple(int(b) for b in getattr(spec, "block_ids", ()))


def specs(transfer: Any) -> tuple[Any, Any]:
    """A transfer job's (source, destination) specs: two fields in vLLM 0.32,
    one ``transfer_spec`` pair in 0.23 and 0.24."""
    if hasattr(transfer, "src_spec"):
        return transfer.src_spec, transfer.dst_spec
    src, dst = transfer.transfer_spec
    return src, dst


class ManagerTap:
    """What the scheduler's tier manager's ``prepare_*`` decided, kept for the journal.

    Its two methods are put on the manager object itself (instance
    attributes shadowing the class's), so the manager stays the object vLLM
    made: vLLM's own tests check ``isinstance(connector_scheduler.manager,
    MagicMock)``, and a proxy in its place failed 114 of them. A manager
    that is a test's mock is not tapped at all (the test configures and
    asserts its calls); its stores are then journaled without keys.
    """

    def __init__(self, manager: Any, sched: Any) -> None:
        self._sched = sched
        self.manager = manager
        self._prepare_store = manager.prepare_store
        self._prepare_load = manager.prepare_load
        self._lookup = manager.lookup
        #: (the next job id when it ran, keys to store, keys evicted, the first
        #: key to store as vLLM has it), this step
        self.stores: list[tuple[int, list[str], list[str], Any]] = []
        self.last_load: list[str] = []
        #: keys a lookup found still being written into the tier, this step (a
        #: tiering manager answers so where it has just begun a promotion)
        self.pending: dict[str, None] = {}

    @classmethod
    def attach(cls, sched: Any) -> ManagerTap | None:
        """Tap ``sched.manager``; None where it is a mock or takes no attributes."""
        manager = getattr(sched, "manager", None)
        if manager is None or isinstance(manager, NonCallableMock):
            return None
        tap = cls(manager, sched)
        try:
            manager.prepare_store = tap.prepare_store
            manager.prepare_load = tap.prepare_load
            manager.lookup = tap.lookup
        except AttributeError:  # a manager with __slots__: observed without keys
            return None
        return tap

    def prepare_store(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._prepare_store(keys, *args, **kwargs)
        if result is not None:
            self.stores.append(
                (
                    self._sched._job_counter,
                    [hex_of(k) for k in result.keys_to_store],
                    [hex_of(k) for k in result.evicted_keys],
                    next(iter(result.keys_to_store), None),
                )
            )
        return result

    def prepare_load(self, keys: Any, *args: Any, **kwargs: Any) -> Any:
        self.last_load = [hex_of(k) for k in keys]
        return self._prepare_load(keys, *args, **kwargs)

    def lookup(self, key: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._lookup(key, *args, **kwargs)
        # HIT_PENDING: the key is being written into the tier, by a store job
        # or (vLLM's tiering manager, the lookup that began it) a promotion
        if getattr(result, "name", None) == "HIT_PENDING":
            self.pending[hex_of(key)] = None
        return result


def _parent(status: Any, first: Any) -> str | None:
    """The tier key of the chunk before ``first`` in its request's chain (None at
    the first chunk, or where the request's keys are not at hand): what
    STORE_CURSOR_PAST_TABLE checks a resumed request's store against."""
    groups = getattr(status, "group_states", None)
    if not groups or first is None:
        return None
    chain = groups[0].offload_keys
    try:
        at = chain.index(first)
    except ValueError:
        return None
    return hex_of(chain[at - 1]) if at else None


def tap_of(sched: Any) -> ManagerTap | None:
    """The tap on the manager ``sched`` holds now: a manager put in place after
    the connector was built (a test swapping its mock for vLLM's real one) is
    tapped when first seen."""
    state = sched.__dict__
    manager = getattr(sched, "manager", None)
    if state.get("_kvstate_tapped") is not manager:
        state["_kvstate_tap"] = ManagerTap.attach(sched)
        state["_kvstate_tapped"] = manager
    tap: ManagerTap | None = state.get("_kvstate_tap")
    return tap


class OffloadingSchedulerObserver(SchedulerObserver):
    """Journals one ``OffloadingConnectorScheduler`` (see the module docstring)."""

    def __init__(
        self, recorder: Recorder, *, block_size: int, world_size: int, shapes: Shapes | None = None
    ) -> None:
        super().__init__(recorder, block_size=block_size, world_size=world_size, numbering=False)
        #: vLLM's classes, to stand down on a test's hand-built scheduler output
        self.shapes = shapes
        #: the ranks beside it were compared with its world (at its first completions)
        self.world_checked = False
        #: load job -> (req, the request's table, its locally cached tokens, prompt
        #: tokens, tier keys), from ``update_state_after_alloc``
        self.loads: dict[int, tuple[str, list[int], int, int, list[str]]] = {}
        #: live job -> its keys (a store's, in the order it stores them)
        self.keys: dict[int, tuple[str, ...]] = {}
        #: the tier's keys as journaled (tier_stored in, tier_evicted out): what a
        #: cache reset releases
        self.tier: dict[str, None] = {}
        #: job -> reports still due of a job a cache reset discarded (its copy
        #: may still run on a worker: the engine is not idle until they came)
        self.discarded: dict[int, int] = {}
        self._flush_first: tuple[int, ...] = ()
        #: this step's jobs: job -> (req, gen, keys, of a finished request)
        self.step_jobs: dict[int, tuple[str, int, tuple[str, ...], bool]] = {}

    # -- one scheduler step ---------------------------------------------------------

    def load_issued(self, sched: Any, request: Any, blocks: Any, job: int) -> None:
        """``update_state_after_alloc`` issued load job ``job`` into ``blocks``."""
        tap = tap_of(sched)
        keys = list(tap.last_load) if tap is not None else []
        status = sched._req_status.get(request.request_id)
        local = getattr(status, "num_locally_computed_tokens", 0) if status else 0
        self.issued(job, request, group0(blocks.get_block_ids()), local, keys)

    def issued(self, job: int, request: Any, table: list[int], local: int, keys: list[str]) -> None:
        """Load ``job`` of ``request`` into ``table``, after ``local`` tokens the
        engine's own prefix cache held: journaled with the step that carries it."""
        self.loads[job] = (request.request_id, table, local, request.num_prompt_tokens, keys)

    def load_refused(self, sched: Any, job: int) -> None:
        """vLLM raised in ``update_state_after_alloc`` right after it made load
        ``job``: the step it belonged to is never built, so the load is
        journaled now, with the admission or resume that goes with it."""
        transfer = sched._current_batch_load_jobs.get(job)
        if transfer is None:
            return
        self.step += 1
        self._load(job, transfer)
        self.commit()

    def after_build(self, sched: Any, out: Any, meta: Any, before: dict[str, Any]) -> None:
        # Runs on the engine thread every step, most steps with little to
        # journal: each part is skipped at once where it has nothing (the
        # cost row in docs/offloading.md).
        if self.shapes is not None:
            self.shapes.check_output(out)  # before anything of it is journaled
        self.step += 1
        flush = set(meta.jobs_to_flush) if meta.jobs_to_flush else None
        keys = self.keys
        if flush:
            self._flush_first = tuple(sorted(j for j in flush if j in keys))
        status = getattr(sched, "_req_status", None) or {}  # per-job releases (0.21 on)

        def local(req: str, computed: int) -> int:
            state = status.get(req)
            return (
                int(getattr(state, "num_locally_computed_tokens", computed)) if state else computed
            )

        tap = tap_of(sched)
        if tap is not None and tap.pending:
            # before the step's flushes reach the workers: a promotion begun
            # while a store the last cache reset discarded may still write
            # its released chunk is PROMOTED_UNDER_LATE_WRITE
            self._promoted(tap)
        restarted, _ = self.record_requests(out, local)
        if meta.load_jobs:
            for job in sorted(meta.load_jobs):
                self._load(job, meta.load_jobs[job], restarted)
        if tap is not None and tap.stores:
            stores, tap.stores = tap.stores, []
            self._stores(meta.store_jobs, stores, status)
        elif meta.store_jobs:
            self._stores(meta.store_jobs, [], status)
        if flush:
            first = self._flush_first
            late = sorted(j for j in flush if j in keys and j not in first)
            if late:
                self._record(build.flush_requested(jobs=late))
            # a job the last cache reset discarded is flushed too (vLLM flushes
            # every job in flight at a reset): known, not begun before the journal
            gone = self.discarded
            self.met_in_flight += sum(1 for j in flush if j not in keys and j not in gone)
            self._flush_first = ()
        meta._kvstate_step = self.step
        # What the ranks' tier audit needs of this step's jobs (a job of a
        # finished request reads blocks the step's forward pass may reuse).
        meta._kvstate_jobs, self.step_jobs = self.step_jobs, {}
        self.commit()

    def _stores(
        self,
        jobs: dict[int, Any],
        stores: list[tuple[int, list[str], list[str], Any]],
        status: dict[str, Any],
    ) -> None:
        """The step's store jobs, each after the tier evictions its
        ``prepare_store`` made (a ``prepare_store`` that made no job may
        still have evicted)."""
        for job in sorted(jobs):
            while stores and stores[0][0] < job:
                self._evicted(stores.pop(0)[2])
            keys: list[str] = []
            parent = None
            transfer = jobs[job]
            if stores and stores[0][0] == job:
                _, keys, evicted, first = stores.pop(0)
                self._evicted(evicted)
                parent = _parent(status.get(transfer.req_id), first)
            self._store(job, transfer, keys, parent)
        for _, _, evicted, _ in stores:
            self._evicted(evicted)

    def after_preemptions(self) -> None:
        # Before the step's tables: these jobs' blocks may be handed on below.
        if self._flush_first:
            self._record(build.flush_requested(jobs=self._flush_first))

    def _load(self, job: int, transfer: Any, scheduled: Collection[str] = ()) -> None:
        """Load ``job``, issued this step; ``scheduled`` are the requests this
        step's output (re)started with a table."""
        issued = self.loads.pop(job, None)
        if issued is None:
            self.met_in_flight += 1
            return
        req, table, local, prompt, keys = issued
        gen = self.gens.get(req)
        if req in scheduled and gen is not None:
            # A synchronous load (vLLM 0.33.0's ``sync_load_budget_bytes``): the
            # request runs in the step that loads it, its admission or resume
            # and its table already journaled above. It waits for nothing, and
            # the load belongs to that incarnation; journaling it as a resume
            # made a second incarnation that never ran and left the first
            # holding its blocks (LEAKED_BLOCKS).
            self._load_enqueued(job, req, gen, transfer, keys)
            return
        if gen is None:
            gen = self.gens[req] = 0
            self._record(build.request_admitted(req=req, gen=0, prompt_tokens=prompt))
        elif req in self.finished or req in self.waiting:
            self.met_in_flight += 1
            return
        else:  # preempted earlier; its load is its resume
            gen = self.gens[req] = gen + 1
            self._record(build.request_resumed(req=req, gen=gen))
        self.waiting.add(req)
        cached = tuple(table[: local // self.block_size])
        self._record(
            build.blocks_assigned(req=req, gen=gen, blocks=table, mode="replace", cached=cached)
        )
        self._load_enqueued(job, req, gen, transfer, keys)

    def _load_enqueued(self, job: int, req: str, gen: int, transfer: Any, keys: list[str]) -> None:
        self.keys[job] = tuple(keys)
        self.step_jobs[job] = (req, gen, tuple(keys), False)
        self._record(
            build.load_enqueued(
                job=job,
                req=req,
                gen=gen,
                writes=_ids(specs(transfer)[1]),
                keys=keys,
                world_size=self.world_size,
            )
        )

    def _promoted(self, tap: ManagerTap) -> None:
        """The keys being written into the tier that no live store job writes
        and the tier did not hold: the tier's own copies (promotions)."""
        # A lookup on another thread (a tiering manager's asynchronous
        # lookups) may land in the dict taken here after the swap: that
        # promotion goes unjournaled (a check missed), never a false finding.
        pending, tap.pending = tap.pending, {}
        new = [k for k in pending if k not in self.tier]
        if not new:  # a promotion journaled already, looked up again while it copies
            return
        storing = {k for keys in self.keys.values() for k in keys}
        promoted = tuple(k for k in new if k not in storing)
        if promoted:
            self._record(build.tier_promoted(keys=promoted))
            self.tier.update(dict.fromkeys(promoted))

    def _store(self, job: int, transfer: Any, stored: list[str], parent: str | None) -> None:
        req = transfer.req_id
        gen = self.gens.get(req)
        if gen is None:
            self.met_in_flight += 1
            return
        keys = self.keys[job] = tuple(stored)
        self.step_jobs[job] = (req, gen, keys, req in self.finished)
        self._record(
            build.job_enqueued(
                job=job,
                req=req,
                gen=gen,
                token_start=0,
                token_end=0,
                reads=_ids(specs(transfer)[0]),
                pins=(),
                keys=keys,
                world_size=self.world_size,
                parent=parent,
            )
        )

    def _evicted(self, keys: list[str]) -> None:
        if keys:
            self._record(build.tier_evicted(keys=keys))
            for key in keys:
                self.tier.pop(key, None)

    def quiescent(self) -> bool:
        return super().quiescent() and not self.discarded

    def reset(self, discarded: list[int], accepted: bool) -> None:
        """vLLM's ``reset_cache``: the jobs in flight are discarded (their
        workers' reports are dropped, no completion comes) and every chunk of
        the tier is released at once (vLLM 0.32.0)."""
        jobs = tuple(sorted(job for job in discarded if job in self.keys))
        for job in jobs:
            del self.keys[job]
            # its workers may still copy it, and report it: vLLM drops the report
            self.discarded[job] = self.world_size
        self.met_in_flight += len(discarded) - len(jobs)  # begun before this journal
        self._record(build.cache_reset(accepted=accepted, jobs=jobs))
        if accepted and self.tier:
            self._evicted(list(self.tier))
        self.commit()

    # -- between steps --------------------------------------------------------------

    def jobs_completed(self, completed: dict[int, int], ended: dict[int, bool]) -> None:
        """Per-job counts summed over ranks; then, for each job that ended, its end.

        ``ended`` maps a job that vLLM retired to whether it was a store.
        """
        for job, count in sorted(completed.items()):
            if job in self.discarded:  # a late report of a job a reset discarded
                self.discarded[job] -= count
                if self.discarded[job] <= 0:
                    del self.discarded[job]
                continue
            if job not in self.keys:
                self.met_in_flight += 1  # enqueued before this journal began
                continue
            self._record(build.completions_received(job=job, count=count))
        for job, is_store in sorted(ended.items()):
            keys = self.keys.pop(job, None)
            if keys is None:
                continue
            if is_store and keys:
                self._record(build.tier_stored(job=job, keys=keys))
                self.tier.update(dict.fromkeys(keys))
            self._record(build.pins_released(job=job, blocks=()))
