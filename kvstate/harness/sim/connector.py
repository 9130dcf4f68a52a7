"""A store connector on the ledgers, driven through vLLM's hook names.

Scheduler side (:class:`StoreConnectorScheduler`): ``bind_gpu_block_pool``,
``get_num_new_matched_tokens`` (prefix hits in the store),
``build_connector_meta`` (turns a step's scheduler output into ledger
transitions and store jobs), ``update_connector_output`` (completions,
then pins freed tail first), ``request_finished``, ``has_pending_push_work``.

Worker side (:class:`StoreConnectorWorker`, one per rank): registering the
step's jobs before queueing them, the sending thread's job
(:meth:`StoreConnectorWorker.run_job`), ``get_finished`` (retiring finished
requests) and ``build_connector_worker_meta`` (completion counts).

Keys are formed like Mooncake's: ``{model}@tp_rank:{r}@{hash}`` per rank,
from the request's chained prefix hashes. The journal names the rank-neutral
key ``{model}@{hash}`` (one chain per job, as journal v1 has one ``keys``
list per job).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Generator

import attrs

from kvstate import build
from kvstate.scheduler import SchedulerLedger
from kvstate.worker import JobSpec, WorkerLedger

from . import store as st
from .batching import Request, SchedulerOutput
from .content import full_block_kv, short
from .device import BlockMemory
from .faults import InjectedCrash
from .pool import BlockPool


def journal_key(model: str, block_hash: bytes) -> str:
    return f"{model}@{block_hash.hex()}"


def rank_key(model: str, rank: int, block_hash: bytes) -> str:
    return f"{model}@tp_rank:{rank}@{block_hash.hex()}"


@attrs.frozen
class JobMeta:
    """One store job as the metadata carries it to every rank."""

    job: int
    req: str
    gen: int
    token_end: int
    hashes: tuple[bytes, ...]  # chained hashes of the blocks [0, token_end)
    reads: tuple[int, ...]  # the blocks to DMA from, block i for hash i
    keys: tuple[str, ...]  # the journal's key chain


@attrs.frozen
class ConnectorMetadata:
    """What the scheduler side hands the workers each step."""

    step: int
    jobs: tuple[JobMeta, ...]
    ended: tuple[tuple[str, int], ...]  # preempted (and aborted) incarnations
    finished: tuple[tuple[str, int], ...]  # incarnations to retire once their jobs drain


@attrs.define
class _Tracker:
    gen: int
    saved: int = 0  # tokens handed to store jobs so far (optimistic: ranks track their own)


class StoreConnectorScheduler:
    """The scheduler half: every decision goes through a :class:`SchedulerLedger`."""

    def __init__(
        self,
        ledger: SchedulerLedger,
        store: st.Store,
        *,
        model: str,
        world_size: int,
        save_decode_cache: bool = False,
        kv_role: str = "kv_producer",
    ) -> None:
        if kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"unknown kv_role {kv_role!r}")
        self.ledger = ledger
        self.kv_role = kv_role
        self.store = store
        self.model = model
        self.block_size = ledger.block_size
        self.world_size = world_size
        self.save_decode_cache = save_decode_cache
        self.pool: BlockPool | None = None
        self._trackers: dict[str, _Tracker] = {}
        self._finished: list[tuple[str, int]] = []
        self._loads: list[tuple[str, list[tuple[str, bool]]]] = []
        self._missing: list[tuple[str, str]] = []
        self.jobs = 0
        self.load_checks: list[tuple[str, int, str, bool]] = []
        #: which job put a key, when the runtime knows (named in load_verified)
        self.writer_of: Callable[[str], int | None] = lambda _key: None

    def bind_gpu_block_pool(self, pool: BlockPool) -> None:
        self.pool = pool

    # -- lookups and loads ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, local_tokens: int) -> int:
        """Tokens beyond the local hit whose blocks every rank finds in the store."""
        bs = self.block_size
        hashes = request.full_hashes(bs)[: (request.num_tokens - 1) // bs]
        candidates = hashes[local_tokens // bs :]
        if not candidates:
            return 0
        present = [True] * len(candidates)
        for rank in range(self.world_size):
            keys = [rank_key(self.model, rank, h) for h in candidates]
            present = [p and e for p, e in zip(present, self.store.batch_exist(keys), strict=True)]
        hits = 0
        for found in present:
            if not found:
                break
            hits += 1
        return hits * bs

    def load(
        self, request: Request, blocks: list[int], start: int, tokens: int, memory: BlockMemory
    ) -> int:
        """Copy stored KV into freshly allocated blocks and check it against its key.

        Returns the tokens really loaded: the blocks before the first one that
        some rank could not read (evicted since the lookup, or a failed get).
        The engine computes the rest again; a missing key is journaled as
        ``key_missing``, never as a wrong load.
        """
        bs = self.block_size
        hashes = request.full_hashes(bs)[start // bs : (start + tokens) // bs]
        usable = len(hashes)
        fetched = []
        for rank in range(self.world_size):
            keys = [rank_key(self.model, rank, h) for h in hashes]
            buffers = [bytearray(memory.block_bytes) for _ in keys]
            codes = self.store.batch_get_into(keys, [memoryview(b) for b in buffers])
            for i, (key, code) in enumerate(zip(keys, codes, strict=True)):
                if code < 0:
                    usable = min(usable, i)
                    self._missing.append((key, st.describe_missing(code)))
            fetched.append(buffers)
        checks = []
        for rank, buffers in enumerate(fetched):
            for block, block_hash, buffer in zip(
                blocks[:usable], hashes[:usable], buffers, strict=False
            ):
                memory.write(rank, block, bytes(buffer))
                expected = full_block_kv(block_hash, rank, memory.block_bytes)
                checks.append((rank_key(self.model, rank, block_hash), bytes(buffer) == expected))
        # Recorded once the step's admission is journaled (load_verified names the incarnation).
        self._loads.append((request.req_id, checks))
        return usable * bs

    # -- the step's metadata -------------------------------------------------------------

    def build_connector_meta(self, out: SchedulerOutput) -> ConnectorMetadata:
        """Journal the step in the order it happened, then build its store jobs.

        Preemptions first: the engine freed those blocks before it handed any
        to another request this step, and the journal must say so or a reuse
        would look like sharing.
        """
        ledger = self.ledger
        for request in out.rejected:
            # Refused at admission (it can never fit the pool): an aborted finish.
            ledger.admit(request.req_id, len(request.prompt))
            ledger.request_finished(request.req_id, aborted=True)
        ended = []
        for req, gen in out.preempted:
            ledger.preempt(req)
            self._trackers.pop(req, None)
            ended.append((req, gen))
        for request in out.scheduled_new_reqs:
            ledger.admit(request.req_id, len(request.prompt))
            self._assign(request, out, resumed=False)
        for request in out.scheduled_cached_reqs:
            if request.req_id in out.resumed_req_ids:
                ledger.resume(request.req_id)
                self._assign(request, out, resumed=True)
            elif out.new_block_ids.get(request.req_id):
                ledger.assign_blocks(
                    request.req_id, out.new_block_ids[request.req_id], resumed=False
                )
        self._journal_loads()
        jobs = []
        for request in (*out.scheduled_new_reqs, *out.scheduled_cached_reqs):
            job = self._save(request, out.num_scheduled_tokens[request.req_id], out)
            if job is not None:
                jobs.append(job)
        finished, self._finished = tuple(self._finished), []
        return ConnectorMetadata(out.step, tuple(jobs), tuple(ended), finished)

    def _assign(self, request: Request, out: SchedulerOutput, *, resumed: bool) -> None:
        cached = out.cached_block_ids.get(request.req_id, [])
        self.ledger.assign_blocks(request.req_id, request.blocks, resumed=resumed, cached=cached)
        self._trackers[request.req_id] = _Tracker(request.gen)

    def _journal_loads(self) -> None:
        for key, reason in self._missing:
            self.ledger.recorder.record(build.key_missing(key=key, reason=reason), self.ledger.step)
        self._missing = []
        for req, checks in self._loads:
            gen = self.ledger.current_gen(req)
            for key, ok in checks:
                self.ledger.recorder.record(
                    build.load_verified(req=req, gen=gen, key=key, ok=ok, job=self.writer_of(key)),
                    self.ledger.step,
                )
                self.load_checks.append((req, gen, key, ok))
        self._loads = []

    def _save(self, request: Request, scheduled: int, out: SchedulerOutput) -> JobMeta | None:
        """A store job when this step completes a block: the step that fills it,
        whether or not it allocates one. Only full blocks.

        A producer saves its prefill; with ``save_decode_cache`` decode blocks
        too. A consumer saves nothing during prefill; with
        ``save_decode_cache`` its first decode save backfills the block-aligned
        prompt, then each save covers only the new blocks.
        """
        bs = self.block_size
        tracker = self._trackers.setdefault(request.req_id, _Tracker(request.gen))
        done = request.num_computed + scheduled
        decoding = request.num_computed >= request.prefill_end
        if self.kv_role == "kv_consumer" and not (self.save_decode_cache and decoding):
            return None
        limit = done if self.save_decode_cache else min(done, request.prefill_end)
        token_end = limit // bs * bs
        if token_end <= tracker.saved:
            return None
        hashes = tuple(request.full_hashes(bs)[: token_end // bs])
        keys = tuple(journal_key(self.model, h) for h in hashes)
        # The engine's current table, offered for every scheduled request: the
        # DMA reads these. Pins come from the ledger's table; if the two ever
        # disagree, replay reports the read as FOREIGN_BLOCK_READ.
        table = out.block_state.get_block_ids(request.req_id) or []
        reads = table[: token_end // bs]
        job = self.ledger.enqueue_store_job(
            request.req_id, tracker.saved, token_end, keys, reads=reads
        )
        state = self.ledger.job(job)
        if self.pool is not None and state.pins:
            self.pool.touch(state.pins)  # held until every rank reports the job
        tracker.saved = token_end
        self.jobs += 1
        return JobMeta(job, request.req_id, state.gen, token_end, hashes, state.reads, keys)

    # -- completions and finishes ---------------------------------------------------------

    def update_connector_output(self, completed: dict[int, int]) -> None:
        """Count the ranks' completions; free every fully reported job's pins, tail first."""
        self.ledger.update_connector_output(completed)
        for _job, blocks in self.ledger.release_ready():
            if self.pool is not None:
                self.pool.free_blocks(blocks)

    def request_finished(self, request: Request) -> bool:
        """The engine finished (or aborted) a request; True asks it to delay the free."""
        self.ledger.request_finished(request.req_id, aborted=request.aborted)
        self._trackers.pop(request.req_id, None)
        self._finished.append((request.req_id, request.gen))
        return self.ledger.holds_blocks(request.req_id, request.gen)

    def finished_sending(self, req: str) -> bool:
        """Every rank retired ``req``; returns True if blocks held for it may be freed now."""
        held = self.ledger.holds_blocks(req)
        self.ledger.finished_sending(req)
        return held

    def has_pending_push_work(self) -> bool:
        return self.ledger.has_pending_push_work()


class StoreConnectorWorker:
    """One rank's half: its ledger, its queue, and the sending thread's job."""

    def __init__(
        self,
        rank: int,
        ledger: WorkerLedger,
        store: st.Store,
        memory: BlockMemory,
        *,
        model: str,
        block_size: int,
        latency: Callable[[], float],
        crash_at: int | None = None,
    ) -> None:
        self.rank = rank
        #: the ``thread-crash`` fault: the first job at this step or later raises
        self.crash_at = crash_at
        self.ledger = ledger
        self.store = store
        self.memory = memory
        self.model = model
        self.block_size = block_size
        self.latency = latency
        self.queue: deque[JobMeta] = deque()
        #: finished incarnations this rank has not retired yet
        self.finishing: set[tuple[str, int]] = set()
        self.bytes_moved = 0
        #: keys this rank put (the audit reads every one of them back)
        #: key -> the job that put it (the audit reads every one back and names the job)
        self.stored_keys: dict[str, int] = {}

    def handle_metadata(self, meta: ConnectorMetadata) -> None:
        """Learn of ended incarnations first, then register each job before queueing it."""
        self.ledger.begin_step(meta.step)
        for req, gen in meta.ended:
            self.ledger.preemption_seen(req, gen)
        for job in meta.jobs:
            self.ledger.register(JobSpec(job.job, job.req, job.gen, job.keys))
            self.queue.append(job)
        self.finishing.update(meta.finished)

    def get_finished(self) -> set[tuple[str, int]]:
        """Finished incarnations whose saves are all done on this rank (retired now)."""
        done = set()
        for req, gen in sorted(self.finishing):
            if self.ledger.retire(req, gen):  # a superseded generation retires as a no-op
                done.add((req, gen))
        self.finishing -= done
        return done

    def build_connector_worker_meta(self) -> dict[int, int]:
        return self.ledger.take_completed()

    def run_job(self, job: JobMeta) -> Generator[float, None, None]:
        """The sending thread's work on one job; yields the time each store call takes.

        One ``with`` block is the job's single exit: whatever happens inside,
        the job is reported exactly once.
        """
        bs = self.block_size
        ledger = self.ledger
        with ledger.run(job.job) as run:
            if not run.live:
                return
            if self.crash_at is not None and ledger.step >= self.crash_at:
                self.crash_at = None
                raise InjectedCrash(f"injected crash in rank {self.rank}'s sending thread")
            # Resume from this rank's own saved offset: it may lag the
            # scheduler's view, which is why the job pins the whole table.
            start = ledger.saved_offset(job.req, job.gen)
            first, last = start // bs, job.token_end // bs
            if first >= last:
                run.skip("empty")
            keys = [rank_key(self.model, self.rank, h) for h in job.hashes[first:last]]
            yield self.latency()
            try:
                exists = self.store.batch_exist(keys)
            except st.StoreError as exc:
                # The store is unreachable as a whole: journal the failure,
                # then let the run end (the job is still reported on the way out).
                run.put_failed(str(exc))
                raise
            missing = [i for i, present in enumerate(exists) if not present]
            if not missing:
                run.put_done(stored=0, existed=len(keys))
                run.save_offset(job.token_end)
                return
            blocks = [job.reads[first + i] for i in missing]
            run.dma_started()
            yield self.latency() / 4
            views = self.memory.stage(self.rank, blocks)  # what the blocks hold *now*
            digest = hashlib.blake2b(digest_size=8)
            for view in views:
                digest.update(view)
            run.dma_done(digest=short(digest.digest()))
            yield self.latency()
            put_keys = [keys[i] for i in missing]
            codes = self.store.batch_put_from(put_keys, views)
            failed = [c for c in codes if c < 0]
            if st.RPC_FAIL in failed:
                run.put_failed(st.describe(st.RPC_FAIL))
                raise st.StoreError(st.RPC_FAIL, "batch_put_from")
            if failed:
                run.put_failed(st.describe(failed[0]))
                if st.NO_AVAILABLE_HANDLE in failed:
                    run.mark_skipped()
                run.set_retry_tokens(start, job.token_end - start)
                return
            self.bytes_moved += sum(len(v) for v in views)
            self.stored_keys.update(dict.fromkeys(put_keys, job.job))
            run.put_done(stored=len(missing), existed=len(keys) - len(missing))
            run.publish_kv_events([job.keys[first + i] for i in missing])
            run.save_offset(job.token_end)
            if ledger.has_retry_tokens(job.req, job.gen):
                run.clear_retry_tokens()
