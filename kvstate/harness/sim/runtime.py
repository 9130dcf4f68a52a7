"""Running the simulator: time, the audit and the summary (the run itself: :mod:`.config`).

Two modes run the same engine, connector and jobs:

* ``deterministic``: virtual time in one thread. Engine steps happen every
  ``step_ms``; each rank's sending thread is a coroutine whose store calls
  take seeded latencies; the loop interleaves them by virtual time. The
  recorder's clock is the virtual clock, so one seed gives one journal, byte
  for byte.
* ``threaded``: each rank's sending thread is a real thread sleeping through
  the same latencies while the engine steps on the main thread.

After the engine is idle, the audit reads every stored key back and compares
it with the KV its key names (``key_verified``); loads were checked as they
happened (``load_verified``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import queue
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from typing import Any

from journal import JournalError, segments
from journal.rotation import Rotation
from kvstate import build
from kvstate.checkpoint import restore, resumed_at
from kvstate.codec import from_stored
from kvstate.folder import Folder, fold_all
from kvstate.harness.legacy import (
    LegacyCrash,
    scheduler_policy,
    worker_policy,
)
from kvstate.ledger import Ledger
from kvstate.recorder import Recorder
from kvstate.scheduler import SchedulerLedger
from kvstate.spill import SpillArchive
from kvstate.violations import Violation
from kvstate.worker import WorkerLedger

from . import store as st
from .batching import EngineScheduler, sampler
from .config import SimConfig, Summary, workload
from .connector import StoreConnectorScheduler, StoreConnectorWorker
from .device import BlockMemory, HostBlocks
from .faults import FaultyStore
from .pool import BlockPool
from .readback import read_back


class Simulation:
    """One run: the engine, its connector, the ranks, the store and the journal."""

    def __init__(
        self,
        config: SimConfig,
        *,
        journal: str | os.PathLike[str] | None = None,
        stores: list[st.Store] | None = None,
        memory: BlockMemory | None = None,
        clock: Callable[[], int] | None = None,
        run: str | None = None,
        bulk: bool = False,
        rotation: Rotation | None = None,
    ) -> None:
        """``bulk`` writes the journal from a writer thread without the
        writer's audit, for runs made as inputs (benchmarks, fleets to check):
        the same records, about 3 times faster here, because no step waits for
        another process's answer. Such a run is checked by replaying it.
        ``rotation`` rotates the journal into segments, and with a retention
        budget removes the oldest (``Recorder.open``'s ``rotate_*`` and
        ``retain_*``; retention needs the writer process, so not ``bulk``)."""
        self.config = config
        self.rng = random.Random(config.seed)
        self.virtual_ns = 0
        if clock is None and config.mode == "deterministic":
            clock = self._virtual_clock
        # Unless the caller names it (one of several engines of one config):
        # deterministic, one config is one journal byte for byte, so the run
        # is named by the config; threaded runs differ each time.
        if run is None and config.mode == "deterministic":
            # against a real store (the live Mooncake demo) it is not a simulated run
            kind = "sim" if stores is None else "live"
            run = f"{kind}-" + hashlib.sha256(repr(config).encode()).hexdigest()[:16]
        elif run is None:
            run = uuid.uuid4().hex
        header = build.journal_opened(
            version=1,
            block_size=config.block_size,
            world_size=config.world_size,
            policy=config.policy,
            engine=f"kvstate simulator ({config.mode}, seed {config.seed})",
            run=run,
        )
        if journal is not None:
            self.recorder = Recorder.open(
                journal,
                block_size=config.block_size,
                world_size=config.world_size,
                policy=config.policy,
                engine=str(header.engine or ""),
                run=run,
                # Not kept: the summary folds the journal back from disk, so
                # a run of any length holds what is live, not its history.
                clock=clock or time.monotonic_ns,
                process=not bulk,
                audit="off" if bulk else "commit",
                rotate_bytes=None if rotation is None else rotation.max_bytes,
                rotate_seconds=None if rotation is None else rotation.max_seconds,
                retain_bytes=None if rotation is None else rotation.keep_bytes,
                retain_seconds=None if rotation is None else rotation.keep_seconds,
            )
        else:
            self.recorder = Recorder(header, keep=True, clock=clock or time.monotonic_ns)
        self.journal = None if journal is None else os.fspath(journal)
        # One store client per rank (a real store puts each rank in its own
        # segment); the in-memory store is one object shared by every rank.
        if stores is None:
            stores = [st.MemoryStore(config.store_capacity_bytes)] * config.world_size
        if len(stores) != config.world_size:
            raise ValueError(f"{len(stores)} store clients for {config.world_size} ranks")
        self.base_stores = stores
        faults = config.effective_faults
        fault_rng = random.Random(config.seed + 1)
        self.stores: list[st.Store] = [
            FaultyStore(s, faults, fault_rng, lambda: self.engine.step) if faults else s
            for s in stores
        ]
        self.store = self.stores[0]
        self.memory = memory or HostBlocks(config.blocks, config.block_bytes, config.world_size)
        self.pool = BlockPool(config.blocks)
        # The legacy policy runs with the set of old behaviours the config names.
        bugs = frozenset(config.legacy_bugs)
        self.sched_ledger = SchedulerLedger(
            self.recorder, strict=False, policy=scheduler_policy(config.policy, bugs)
        )
        self.engine = EngineScheduler(
            self.pool,
            self.memory,
            block_size=config.block_size,
            world_size=config.world_size,
            token_budget=config.token_budget,
        )
        self.connector = StoreConnectorScheduler(
            self.sched_ledger,
            self.store,
            model=config.model,
            world_size=config.world_size,
            save_decode_cache=config.save_decode_cache,
            kv_role=config.kv_role,
        )
        self.connector.bind_gpu_block_pool(self.pool)
        self.engine.external_lookup = self.connector.get_num_new_matched_tokens
        self.engine.load_external = lambda r, b, s, n: self.connector.load(r, b, s, n, self.memory)
        self.engine.on_finished = self.connector.request_finished
        latency_rng = random.Random(config.seed + 2)
        self._latency_lock = threading.Lock()

        def latency() -> float:
            if config.store_latency_ms <= 0:
                return 0.0
            with self._latency_lock:
                return latency_rng.expovariate(1.0 / config.store_latency_ms)

        self.workers = [
            StoreConnectorWorker(
                rank,
                WorkerLedger(
                    rank, self.recorder, strict=False, policy=worker_policy(config.policy, bugs)
                ),
                self.stores[rank],
                self.memory,
                model=config.model,
                block_size=config.block_size,
                latency=latency,
                # one sending thread crashes: rank 0's
                crash_at=faults.thread_crash if rank == 0 else None,
            )
            for rank in range(config.world_size)
        ]
        workers = self.workers
        self.connector.writer_of = lambda key: next(
            (w.stored_keys[key] for w in workers if key in w.stored_keys), None
        )
        self.pending = workload(config)
        self.sample = sampler(config.seed)
        self.summary = Summary(config.policy, config.mode, requests=config.requests)
        self._abort_rng = random.Random(config.seed + 3)
        self.crashed = False
        self._retired: dict[tuple[str, int], set[int]] = {}
        #: deterministic mode: each rank's suspended job, if any (closed at the end)
        self._ranks_left: list[tuple[Generator[float, None, None] | None, int]] = []

    def _virtual_clock(self) -> int:
        return self.virtual_ns

    # -- one engine step -------------------------------------------------------------------

    def engine_step(self) -> None:
        """Arrivals, schedule, connector metadata, forward, finishes, completions."""
        for _ in range(self.config.arrivals_per_step):
            if self.pending:
                self.engine.add_request(self.pending.pop(0))
        if self.config.abort_rate:
            for request in list(self.engine.waiting) + list(self.engine.running):
                if self._abort_rng.random() < self.config.abort_rate:
                    self.engine.abort(request.req_id)
        output = self.engine.schedule()
        self.sched_ledger.begin_step(output.step)  # commits the previous step's records
        meta = self.connector.build_connector_meta(output)
        for worker in self.workers:
            worker.handle_metadata(meta)  # registered before the sending thread can see them
        self.engine.forward(output, self.sample)
        self.engine.update_from_output()
        completed = WorkerLedger.aggregate(w.build_connector_worker_meta() for w in self.workers)
        self.connector.update_connector_output(completed)
        # Like vLLM's output aggregator: a request has finished sending once
        # every rank has retired it, in whatever steps they did.
        for worker in self.workers:
            for incarnation in worker.get_finished():
                ranks = self._retired.setdefault(incarnation, set())
                ranks.add(worker.rank)
                if len(ranks) == len(self.workers):
                    del self._retired[incarnation]
                    if self.connector.finished_sending(incarnation[0]):
                        self.engine.release_delayed(incarnation[0])

    def busy(self) -> bool:
        return bool(
            self.pending
            or self.engine.has_unfinished()
            or self.connector.has_pending_push_work()
            or self._retired
            or any(w.queue or w.finishing for w in self.workers)
        )

    # -- modes --------------------------------------------------------------------------------

    def run(self, progress: Callable[[Summary], None] | None = None) -> Summary:
        """Run to the end and audit the store; the summary says how it ended.

        ``engine_idle`` is recorded only when the engine really ran out of
        work. A run stopped at ``max_steps`` or stalled records nothing more
        (its journal replays as UNFINISHED); a run that raised records
        ``engine_crashed`` with the error. A KeyboardInterrupt propagates
        after the records so far are flushed.
        """
        started = time.perf_counter()
        try:
            if self.config.mode == "deterministic":
                outcome = self._run_virtual(progress)
            else:
                outcome = self._run_threaded(progress)
        except LegacyCrash as crash:
            outcome = "crashed"
            self._crash(str(crash))
        except st.StoreError as exc:
            outcome = "crashed"
            self._crash(f"the store failed: {exc}")
        except Exception as exc:
            outcome = "crashed"
            self._crash(f"{type(exc).__name__}: {exc}")
        except BaseException:
            self.recorder.flush_before_raising()
            raise
        self.summary.elapsed_s = time.perf_counter() - started
        if outcome == "idle":
            # The audit reads the store of an engine with no work left, so it
            # belongs before engine_idle: that record closes the journal.
            self.audit()
            self.sched_ledger.idle()
        else:
            self.summary.stopped = outcome
        self.recorder.flush()
        self._count()
        return self.summary

    def _crash(self, error: str) -> None:
        self.crashed = True
        self.summary.error = error
        self.sched_ledger.crashed(error)

    def _stalled(self) -> Callable[[], bool]:
        """A check that is True once the run made no progress for ``stall_steps`` steps."""
        last: tuple[int, ...] = ()
        still = 0

        def check() -> bool:
            nonlocal last, still
            mark = (
                self.engine.tokens_computed,
                self.summary.finished,
                sum(w.ledger.jobs_received for w in self.workers),
                self.sched_ledger.pinned_jobs,
            )
            if mark != last:
                last, still = mark, 0
                return False
            still += 1
            return still >= self.config.stall_steps

        return check

    def _steps(self) -> Iterator[int]:
        limit = self.config.max_steps
        return itertools.count() if limit is None else iter(range(limit))

    def _run_virtual(self, progress: Callable[[Summary], None] | None) -> str:
        step_ns = int(self.config.step_ms * 1e6)
        ranks: list[tuple[Generator[float, None, None] | None, int]] = [
            (None, 0) for _ in self.workers
        ]
        next_step = 0
        stalled = self._stalled()
        try:
            return self._virtual_steps(ranks, next_step, step_ns, stalled, progress)
        finally:
            # Jobs still suspended in a store call when the run ends (a crash,
            # the step limit, Ctrl-C) are abandoned now, while the journal is
            # open: each passes its finally and is reported, before any final record.
            self._abandon_jobs()

    def _abandon_jobs(self) -> None:
        """Close each job still suspended in a store call; each reports as it closes.

        A job is taken off the list as it is closed, so a close that raises
        (Ctrl-C arriving while an earlier job's report is flushed) leaves the
        others listed, and :meth:`close` abandons them before the journal
        closes. A job generator left suspended would otherwise be finalized
        by the garbage collector after the journal closed, its report refused
        by the closed journal and printed as a traceback.
        """
        left = self._ranks_left
        while left:
            gen, _at = left.pop(0)
            if gen is not None:
                gen.close()

    def _virtual_steps(
        self,
        ranks: list[tuple[Generator[float, None, None] | None, int]],
        next_step: int,
        step_ns: int,
        stalled: Callable[[], bool],
        progress: Callable[[Summary], None] | None,
    ) -> str:
        self._ranks_left = ranks
        for _ in self._steps():
            # Sending threads run until the next engine step, in virtual-time order.
            while True:
                ranks = [
                    self._start_next(i, gen, at, next_step) for i, (gen, at) in enumerate(ranks)
                ]
                due = [
                    (at, i)
                    for i, (gen, at) in enumerate(ranks)
                    if gen is not None and at < next_step
                ]
                if not due:
                    break
                at, i = min(due)
                self.virtual_ns = at
                gen = ranks[i][0]
                if gen is None:  # not due: only ranks with a job in flight are
                    continue
                self._ranks_left = ranks
                try:
                    delay = next(gen)
                    ranks[i] = (gen, at + int(delay * 1e6))
                except StopIteration:
                    ranks[i] = (None, at)
                except BaseException:
                    ranks[i] = (None, at)  # this one has finished, by raising
                    raise
            self._ranks_left = ranks
            self.virtual_ns = next_step
            self.engine_step()
            self._progress(progress)
            next_step += step_ns
            if not self.busy() and all(g is None for g, _ in ranks):
                return "idle"
            if stalled():
                return "stalled"
        return "max-steps"

    def _start_next(
        self, rank: int, gen: Generator[float, None, None] | None, at: int, now: int
    ) -> tuple[Generator[float, None, None] | None, int]:
        if gen is not None or not self.workers[rank].queue:
            return gen, at
        job = self.workers[rank].queue.popleft()
        return self.workers[rank].run_job(job), max(at, now - int(self.config.step_ms * 1e6))

    def _run_threaded(self, progress: Callable[[Summary], None] | None) -> str:
        stop = threading.Event()
        inboxes: list[queue.Queue[Any]] = [queue.Queue() for _ in self.workers]
        # An exception on a sending thread ends the run: the job was reported
        # on the way out, and the main loop re-raises it here.
        errors: queue.Queue[BaseException] = queue.Queue()

        abandon = threading.Event()  # the run failed: stop without draining the inboxes

        def sending_thread(worker: StoreConnectorWorker, inbox: queue.Queue[Any]) -> None:
            while not abandon.is_set() and (not stop.is_set() or not inbox.empty()):
                try:
                    job = inbox.get(timeout=0.01)
                except queue.Empty:
                    continue
                try:
                    for delay in worker.run_job(job):
                        time.sleep(delay / 1000.0)
                except BaseException as exc:
                    errors.put(exc)
                finally:
                    inbox.task_done()

        threads = [
            threading.Thread(target=sending_thread, args=(w, q), daemon=True, name=f"send-{w.rank}")
            for w, q in zip(self.workers, inboxes, strict=True)
        ]
        for thread in threads:
            thread.start()
        stalled = self._stalled()
        try:
            for _ in self._steps():
                if not errors.empty():
                    raise errors.get()
                self.engine_step()
                for worker, inbox in zip(self.workers, inboxes, strict=True):
                    while worker.queue:
                        inbox.put(worker.queue.popleft())
                self._progress(progress)
                time.sleep(self.config.step_ms / 1000.0)
                if not self.busy() and all(q.unfinished_tasks == 0 for q in inboxes):
                    if not errors.empty():
                        raise errors.get()
                    return "idle"
                if stalled():
                    return "stalled"
            return "max-steps"
        except BaseException:
            abandon.set()
            raise
        finally:
            stop.set()
            # No deadline: a thread still in a job after one would record its
            # report into a journal the caller is about to close. Each store
            # call returns (the simulator's stores never block), so a thread
            # ends after its current job (abandon) or its inbox (stop).
            for thread in threads:
                thread.join()

    def _progress(self, progress: Callable[[Summary], None] | None) -> None:
        self.summary.steps = self.engine.step
        self.summary.finished = self.engine.finished_count
        if progress is not None:
            progress(self.summary)

    # -- the audit ------------------------------------------------------------------------------

    def audit(self) -> None:
        """Read every stored key back and compare it with the KV its key names
        (:func:`.readback.read_back`)."""
        writers = {key: job for w in self.workers for key, job in w.stored_keys.items()}
        found = read_back(
            self.recorder, self.base_stores[0], writers, self.memory.block_bytes,
            self.sched_ledger.step,
        )  # fmt: skip
        self.recorder.commit()
        self.summary.keys_stored = len(writers)
        self.summary.poisoned_keys = found.poisoned
        self.summary.keys_missing = found.missing

    def _count(self) -> None:
        s = self.summary
        requests = self.engine.requests.values()
        s.finished = sum(1 for r in requests if r.status == "finished" and not r.aborted)
        s.aborted = sum(1 for r in requests if r.aborted) - len(self.engine.rejected)
        s.steps = self.engine.step
        s.store_jobs = self.connector.jobs
        s.preemptions = self.engine.preemptions
        s.bytes_moved = sum(w.bytes_moved for w in self.workers)
        s.loads = len(self.connector.load_checks)
        s.wrong_kv_requests = len({req for req, _g, _k, ok in self.connector.load_checks if not ok})
        s.crashes = int(self.crashed)
        s.rejected = len(self.engine.rejected)
        s.journal = self.journal
        ledger = Ledger(archive=SpillArchive())
        try:
            findings = [v for v in self._fold(ledger) if not v.is_warning]
        finally:
            ledger.archive.close()
        found = Counter(v.code.value for v in findings)
        s.violations = dict(sorted(found.items()))
        s.first_violation_req = next((v.req for v in findings if v.req is not None), None)
        s.leaked_pins = found.get("LEAKED_PIN", 0)

    def _fold(self, ledger: Ledger) -> list[Violation]:
        """Every finding of the run, folded into ``ledger``: from the records
        kept in memory without a journal, else from the journal (flushed
        first), across its segments, and from its checkpoint where retention
        removed its head (the findings of the removed records come first)."""
        if self.journal is None:
            return fold_all(self.recorder.entries or [], ledger)
        self.recorder.flush()
        check_journal(self.journal)
        found: list[Violation] = []
        folder = Folder(ledger)
        for index, journal in enumerate(segments.segments(self.journal)):
            with journal:
                start = resumed_at(journal) if index == 0 else None
                if start is not None:
                    found += restore(ledger, start)
                for seq, kind, step, rank, ts, payload in journal.stored_rows():
                    entry = from_stored(seq, kind, step, rank, ts, payload, journal.path)
                    found += folder.fold(entry.seq, entry.step, entry.event)
        return found + ledger.end()

    def close(self) -> None:
        """Abandon any job a run left suspended (it reports now), then close the journal."""
        try:
            self._abandon_jobs()
        finally:
            self.recorder.close()


class JournalGone(JournalError):
    """The journal a run wrote is not where it was written (the message names it)."""


def check_journal(path: str) -> None:
    """Raise :class:`JournalGone` when the journal at ``path`` was deleted or
    moved while the run wrote it.

    The writer does not notice: it goes on writing to the file it opened,
    wherever that is now, so the run itself ends well, and only a reader of
    ``path`` afterwards finds nothing. Retention removes a journal's first
    segment as it goes; the journal is then its later segments.
    """
    if os.path.lexists(path) or segments.later_segments(path):
        return
    raise JournalGone(
        f"{path}: the journal was deleted or moved while the run wrote it: the run wrote "
        "on into the file wherever it went, so a moved journal is whole where it is now "
        f"(replay it there) and a deleted one is lost; there is nothing at {path} to replay"
    )


def simulate(config: SimConfig, journal: str | None = None, **kwargs: Any) -> Summary:
    """Run one simulation to the end and close its journal."""
    sim = Simulation(config, journal=journal, **kwargs)
    try:
        return sim.run()
    finally:
        sim.close()
