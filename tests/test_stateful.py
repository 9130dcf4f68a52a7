"""Random interleavings of a scheduler and its ranks, checked after every step.

A hypothesis ``RuleBasedStateMachine`` drives a :class:`SchedulerLedger` and
one :class:`WorkerLedger` per rank the way an engine and its sending threads
would (admit, grow, enqueue, preempt, resume, finish, deliver metadata to a
rank, run a job with any outcome, consume completions, release, retire) in
strict mode, and after every step checks that:

* no invariant was broken (strict mode would raise; replay finds nothing);
* block refs equal the holders counted independently from tables and pins;
* folding the journal written so far reproduces the live ledgers exactly.

At teardown it drains the engine and declares it idle: nothing may leak.
"""

from __future__ import annotations

from collections import Counter, deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvstate import JobSpec, Ledger, Recorder, SchedulerLedger, WorkerLedger

BLOCK_SIZE = 4
POOL = 12
WORLD = 2
OUTCOMES = ("ok", "put_failed", "pressure", "error")


class Boom(Exception):
    """An exception inside a job body."""


class LedgerMachine(RuleBasedStateMachine):
    #: steps checked over all runs (the test asserts it reaches thousands)
    steps_checked = 0

    def __init__(self) -> None:
        super().__init__()
        self.rec = Recorder.in_memory(block_size=BLOCK_SIZE, world_size=WORLD)
        self.sched = SchedulerLedger(self.rec)
        self.workers = [WorkerLedger(r, self.rec) for r in range(WORLD)]
        # what each rank has yet to learn from the scheduler, in order
        self.inbox: list[deque[tuple]] = [deque() for _ in range(WORLD)]
        # jobs each rank's sending thread has queued
        self.queue: list[deque[int]] = [deque() for _ in range(WORLD)]
        # finished incarnations each rank has yet to retire
        self.to_retire: list[list[tuple[str, int]]] = [[] for _ in range(WORLD)]
        self.status: dict[str, str] = {}
        self.held: set[tuple[str, int]] = set()
        self.next_req = 0
        self.replay = Ledger()
        self.folded = 0

    # -- the engine's block pool: a block is free when nothing holds it ------------

    def free_blocks(self) -> list[int]:
        blocks = self.sched.ledger.blocks
        return [b for b in range(POOL) if b not in blocks or blocks[b].refs == 0]

    def running(self) -> list[str]:
        return sorted(r for r, s in self.status.items() if s == "running")

    def preempted(self) -> list[str]:
        return sorted(r for r, s in self.status.items() if s == "preempted")

    def notify(self, item: tuple) -> None:
        for box in self.inbox:
            box.append(item)

    # -- scheduler rules ---------------------------------------------------------------

    @rule(n=st.integers(1, 3), reuse=st.booleans())
    def admit(self, n: int, reuse: bool) -> None:
        free = self.free_blocks()
        if len(free) < n:
            return
        finished = sorted(r for r, s in self.status.items() if s == "finished")
        if reuse and finished:
            req = finished[0]  # a finished id admitted again gets a greater gen
        else:
            req, self.next_req = f"r{self.next_req}", self.next_req + 1
        self.sched.admit(req, n * BLOCK_SIZE)
        self.sched.assign_blocks(req, free[:n], resumed=False)
        self.status[req] = "running"

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        free = self.free_blocks()
        if free:
            req = data.draw(st.sampled_from(self.running()))
            self.sched.assign_blocks(req, free[:1], resumed=False)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def enqueue(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running()))
        table = self.sched.table(req)
        gen = self.sched.current_gen(req)
        keys = [f"{req}@{i}" for i in range(len(table))]
        job = self.sched.enqueue_store_job(req, 0, len(table) * BLOCK_SIZE, keys, parent=None)
        self.notify(("job", JobSpec(job, req, gen, tuple(keys), None)))

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running()))
        gen = self.sched.current_gen(req)
        self.sched.preempt(req)
        self.status[req] = "preempted"
        self.notify(("ended", req, gen))

    @precondition(lambda self: self.preempted())
    @rule(data=st.data(), n=st.integers(1, 3))
    def resume(self, data: st.DataObject, n: int) -> None:
        free = self.free_blocks()
        if len(free) < n:
            return
        req = data.draw(st.sampled_from(self.preempted()))
        self.sched.resume(req)
        self.sched.assign_blocks(req, free[:n], resumed=True)
        self.status[req] = "running"

    @precondition(lambda self: self.running() or self.preempted())
    @rule(data=st.data(), hold=st.booleans())
    def finish(self, data: st.DataObject, hold: bool) -> None:
        req = data.draw(st.sampled_from(self.running() + self.preempted()))
        gen = self.sched.current_gen(req)
        hold = hold and self.status[req] == "running"
        self.sched.request_finished(req, hold=hold)
        if hold:
            self.held.add((req, gen))
        self.status[req] = "finished"
        self.notify(("ended", req, gen))
        for pending in self.to_retire:
            pending.append((req, gen))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_held(self, data: st.DataObject) -> None:
        req, gen = data.draw(st.sampled_from(sorted(self.held)))
        self.sched.release_held(req, gen)
        self.held.discard((req, gen))

    @rule()
    def step(self) -> None:
        """End of an engine step: completions come back with the step's output."""
        done = WorkerLedger.aggregate(w.take_completed() for w in self.workers)
        self.sched.update_connector_output(done)
        self.sched.release_ready()
        self.sched.begin_step()

    # -- worker rules ------------------------------------------------------------------

    @rule(rank=st.integers(0, WORLD - 1))
    def deliver(self, rank: int) -> None:
        if not self.inbox[rank]:
            return
        item = self.inbox[rank].popleft()
        worker = self.workers[rank]
        if item[0] == "job":
            worker.register(item[1])  # registered before it is queued
            self.queue[rank].append(item[1].job)
        else:
            worker.preemption_seen(item[1], item[2])

    @rule(rank=st.integers(0, WORLD - 1), outcome=st.sampled_from(OUTCOMES))
    def work(self, rank: int, outcome: str) -> None:
        if not self.queue[rank]:
            return
        job = self.queue[rank].popleft()
        worker = self.workers[rank]
        spec = worker.state._info[job]
        try:
            with worker.run(job) as run:
                if not run.live:
                    return
                if outcome == "pressure":
                    run.skip("pressure")
                if outcome == "error":
                    raise Boom
                run.dma_started()
                run.dma_done(digest=f"{job}")
                if outcome == "put_failed":
                    run.put_failed("-200 no space")
                    run.mark_skipped()
                    run.set_retry_tokens(0, len(spec.keys) * BLOCK_SIZE)
                    return
                run.put_done(stored=len(spec.keys), existed=0)
                run.save_offset(len(spec.keys) * BLOCK_SIZE)
                parent = spec.parent
                for key in spec.keys:
                    run.kv_block_stored(key, parent)
                    parent = key
                run.clear_retry_tokens()
        except Boom:
            pass

    @rule(rank=st.integers(0, WORLD - 1))
    def retire(self, rank: int) -> None:
        worker = self.workers[rank]
        for req, gen in list(self.to_retire[rank]):
            state = worker.state.requests.get(req)
            if state is not None and state.gen > gen:
                self.to_retire[rank].remove((req, gen))  # a newer generation owns the id now
            elif worker.retire(req, gen):
                self.to_retire[rank].remove((req, gen))

    # -- checks --------------------------------------------------------------------------

    @invariant()
    def no_violation_anywhere(self) -> None:
        LedgerMachine.steps_checked += 1
        assert self.sched.violations == []
        assert all(w.violations == [] for w in self.workers)
        entries = self.rec.entries or []
        for entry in entries[self.folded :]:
            found = self.replay.apply(entry.seq, entry.step, entry.event)
            assert found == [], found
        self.folded = len(entries)

    @invariant()
    def refs_count_the_holders(self) -> None:
        ledger = self.sched.ledger
        holders: Counter[int] = Counter()
        for request in ledger.requests.values():
            for inc in request.incarnations.values():
                if inc.state == "running" or inc.held:
                    holders.update(inc.table)
        for job in ledger.jobs.values():
            if job.released_seq is None:
                holders.update(job.pins)
        refs = {b: s.refs for b, s in ledger.blocks.items() if s.refs}
        assert refs == dict(holders)

    @invariant()
    def replay_reproduces_the_live_ledgers(self) -> None:
        live, replayed = self.sched.ledger, self.replay
        assert replayed.requests == live.requests
        assert replayed.blocks == live.blocks
        assert replayed.pinned == live.pinned
        assert replayed.jobs.keys() == live.jobs.keys()
        for job, state in live.jobs.items():
            mine = replayed.jobs[job]
            # the live scheduler sees no rank records; everything else must match
            assert attrs_without_ranks(mine) == attrs_without_ranks(state)
        for worker in self.workers:
            rank = replayed.ranks.get(worker.rank)
            if rank is None:
                assert worker.state.jobs == {}
                continue
            assert rank.jobs == worker.state.jobs
            assert rank.requests == worker.state.requests
            assert rank.ended == worker.state.ended
            assert rank.offsets == worker.state.offsets

    def teardown(self) -> None:
        # Drain: every message delivered, every job run, every completion
        # consumed, every request finished and retired. Then the engine is
        # idle and strict mode would raise on any leak.
        for req in self.running() + self.preempted():
            self.finish_now(req)
        for req, gen in sorted(self.held):
            self.sched.release_held(req, gen)
        self.held.clear()
        for _ in range(3):
            for rank in range(WORLD):
                while self.inbox[rank] or self.queue[rank]:
                    self.deliver(rank)
                    self.work(rank, "ok")
                self.retire(rank)
            self.step()
        assert not self.sched.has_pending_push_work()
        assert all(not pending for pending in self.to_retire)
        self.sched.idle()
        self.no_violation_anywhere()

    def finish_now(self, req: str) -> None:
        gen = self.sched.current_gen(req)
        self.sched.request_finished(req)
        self.status[req] = "finished"
        self.notify(("ended", req, gen))
        for pending in self.to_retire:
            pending.append((req, gen))


def attrs_without_ranks(job: object) -> dict:
    import attrs

    fields = attrs.asdict(job, recurse=False)
    fields.pop("ranks")
    return fields


def test_thousands_of_interleaved_steps_keep_every_invariant() -> None:
    LedgerMachine.steps_checked = 0
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            max_examples=400,
            stateful_step_count=80,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert LedgerMachine.steps_checked >= 5_000, LedgerMachine.steps_checked
