"""Requests and a continuous-batching scheduler shaped like vLLM v1's.

Each :meth:`EngineScheduler.schedule` spends a token budget: running
requests first (a decode token each, or the next prefill chunk), then
waiting ones (preempted before new, first come first served). When the pool
cannot give a running request the blocks it needs, the newest running
request is preempted in recompute mode: its blocks go back to the pool and
it waits to run again from scratch as a new generation with the same id.
Admission takes prefix-cache hits first. The step's
:class:`SchedulerOutput` carries what a connector sees in vLLM, including a
:class:`BlockState` that resolves any scheduled request's table on demand.

:meth:`EngineScheduler.forward` is the model: it writes each computed
block's KV fingerprint into block memory and samples the next token.
:meth:`EngineScheduler.update_from_output` finishes requests.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable

import attrs

from .content import block_hashes, full_block_kv, partial_block_kv
from .device import BlockMemory
from .pool import BlockPool

WAITING = "waiting"
RUNNING = "running"
PREEMPTED = "preempted"
FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One request. ``gen`` grows each time it is scheduled from waiting."""

    req_id: str
    prompt: list[int]
    max_tokens: int
    output: list[int] = attrs.Factory(list)
    num_computed: int = 0
    blocks: list[int] = attrs.Factory(list)
    status: str = WAITING
    gen: int = -1
    aborted: bool = False
    hashes: list[bytes] = attrs.Factory(list)
    #: tokens the current generation recomputes as prefill (prompt + output so far)
    prefill_end: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def full_hashes(self, block_size: int) -> list[bytes]:
        """Chained hashes of every full block of the tokens known so far."""
        if len(self.hashes) < self.num_tokens // block_size:
            self.hashes = block_hashes(self.tokens, block_size, self.hashes)
        return self.hashes


@attrs.frozen
class BlockState:
    """The tables of every request scheduled this step, resolved on demand.

    Offering every scheduled request, not only those that got new blocks,
    matters: a save lands on the step that fills a block, which may allocate
    none (vLLM #54853).
    """

    req_ids: frozenset[str]
    resolve: Callable[[str], list[int]]

    def get_block_ids(self, req_id: str) -> list[int] | None:
        return self.resolve(req_id) if req_id in self.req_ids else None


@attrs.frozen
class SchedulerOutput:
    step: int
    scheduled_new_reqs: list[Request]
    scheduled_cached_reqs: list[Request]
    resumed_req_ids: frozenset[str]
    new_block_ids: dict[str, list[int]]
    cached_block_ids: dict[str, list[int]]
    preempted: list[tuple[str, int]]
    finished: list[tuple[str, int]]
    num_scheduled_tokens: dict[str, int]
    block_state: BlockState
    #: requests refused at admission (they never fit the pool)
    rejected: list[Request] = attrs.Factory(list)


class EngineScheduler:
    """Continuous batching over a :class:`BlockPool`."""

    def __init__(
        self,
        pool: BlockPool,
        memory: BlockMemory,
        *,
        block_size: int,
        world_size: int,
        token_budget: int,
        max_running: int = 64,
    ) -> None:
        self.pool = pool
        self.memory = memory
        self.block_size = block_size
        self.world_size = world_size
        self.token_budget = token_budget
        self.max_running = max_running
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step = 0
        self.preemptions = 0
        #: tokens computed so far (the run's progress, for stall detection)
        self.tokens_computed = 0
        #: requests that reached FINISHED (finished, aborted or refused)
        self.finished_count = 0
        #: requests refused at admission because they can never fit the pool
        self.rejected: list[Request] = []
        self._rejected_since_last: list[Request] = []
        self._finished_since_last: list[tuple[str, int]] = []
        self._preempted_since_last: list[tuple[str, int]] = []
        #: set by the connector: (request, local hit tokens) -> extra tokens loaded from the store
        self.external_lookup: Callable[[Request, int], int] | None = None
        #: set by the connector: writes the loaded blocks (called after allocation)
        #: and returns how many tokens it really loaded
        self.load_external: Callable[[Request, list[int], int, int], int] | None = None
        #: set by the connector: (request) -> whether to delay freeing its blocks
        self.on_finished: Callable[[Request], bool] | None = None

    # -- requests --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it at once if it can never fit the pool.

        Like vLLM refusing a prompt longer than the model can hold: a request
        whose prompt and output need more blocks than the pool has would
        otherwise preempt itself forever.
        """
        self.requests[request.req_id] = request
        need = self._blocks_for(len(request.prompt) + request.max_tokens)
        if need > self.pool.num_blocks:
            request.status = FINISHED
            request.aborted = True
            self.finished_count += 1
            self.rejected.append(request)
            self._rejected_since_last.append(request)
            return
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req_id: str) -> None:
        """End a request wherever it is (running, waiting or preempted)."""
        request = self.requests[req_id]
        if request.status == FINISHED:
            return
        request.aborted = True
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request)

    def _finish(self, request: Request) -> None:
        was_scheduled = request.gen >= 0
        request.status = FINISHED
        self.finished_count += 1
        delay = self.on_finished(request) if self.on_finished and was_scheduled else False
        if not delay and request.blocks:
            self.pool.free_blocks(reversed(request.blocks))
        if not delay:
            request.blocks = []
        if was_scheduled:
            self._finished_since_last.append((request.req_id, request.gen))

    def release_delayed(self, req_id: str) -> None:
        """Free the blocks of a finished request whose free was delayed."""
        request = self.requests[req_id]
        if request.blocks:
            self.pool.free_blocks(reversed(request.blocks))
            request.blocks = []

    # -- scheduling ------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def preempt(self, req_id: str) -> None:
        """Preempt a running request now (recompute mode). The next scheduler output
        reports it; within a step the engine preempts only from :meth:`schedule`,
        whose output the connector sees at once."""
        self._preempt(self.requests[req_id])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free_blocks(reversed(request.blocks))
        self._preempted_since_last.append((request.req_id, request.gen))
        request.blocks = []
        request.num_computed = 0
        request.status = PREEMPTED
        self.waiting.appendleft(request)
        self.preemptions += 1

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        budget = self.token_budget
        new_reqs: list[Request] = []
        cached_reqs: list[Request] = []
        resumed: set[str] = set()
        new_blocks: dict[str, list[int]] = {}
        cached_blocks: dict[str, list[int]] = {}
        scheduled: dict[str, int] = {}

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RUNNING:
                continue  # preempted earlier in this loop
            n = min(request.num_tokens - request.num_computed, budget)
            need = self._blocks_for(request.num_computed + n) - len(request.blocks)
            while need > self.pool.num_free and request.status == RUNNING:
                self._preempt(self.running[-1])  # the newest goes back to waiting
            if request.status != RUNNING:
                continue
            allocated = self.pool.allocate(need) or []
            request.blocks += allocated
            new_blocks[request.req_id] = allocated
            cached_reqs.append(request)
            scheduled[request.req_id] = n
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            if not self._admit(request, budget, cached_blocks):
                break
            self.waiting.popleft()
            room = len(request.blocks) * self.block_size - request.num_computed
            n = min(request.num_tokens - request.num_computed, budget, room)
            scheduled[request.req_id] = n
            budget -= n
            if request.status == PREEMPTED:
                resumed.add(request.req_id)
                cached_reqs.append(request)
            else:
                new_reqs.append(request)
            new_blocks[request.req_id] = list(request.blocks)
            request.status = RUNNING
            self.running.append(request)

        finished, self._finished_since_last = self._finished_since_last, []
        preempted, self._preempted_since_last = self._preempted_since_last, []
        rejected, self._rejected_since_last = self._rejected_since_last, []
        tables = {r.req_id: r.blocks for r in self.running}
        return SchedulerOutput(
            self.step,
            new_reqs,
            cached_reqs,
            frozenset(resumed),
            new_blocks,
            cached_blocks,
            preempted,
            finished,
            scheduled,
            BlockState(frozenset(scheduled), lambda req_id: list(tables[req_id])),
            rejected,
        )

    def _admit(self, request: Request, budget: int, cached_blocks: dict[str, list[int]]) -> bool:
        """Give a waiting request its blocks: cache hits, store loads, then fresh ones."""
        bs = self.block_size
        hashes = request.full_hashes(bs)
        # A full hit is cut one block short so the last token is recomputed.
        usable = hashes[: (request.num_tokens - 1) // bs]
        hit = self.pool.cached_prefix(usable)
        self.pool.touch(hit)
        computed = len(hit) * bs
        loaded = 0
        if self.external_lookup is not None:
            loaded = self.external_lookup(request, computed)
        n = min(request.num_tokens - computed - loaded, budget)
        need = self._blocks_for(computed + loaded + max(n, 1)) - len(hit)
        fresh = self.pool.allocate(need)
        if fresh is None:
            self.pool.free_blocks(reversed(hit))
            return False
        request.gen += 1
        request.blocks = hit + fresh
        request.num_computed = computed
        request.prefill_end = request.num_tokens
        cached_blocks[request.req_id] = hit
        if loaded and self.load_external is not None:
            load_blocks = fresh[: loaded // bs]
            # A key can vanish between the lookup and the load (evicted):
            # what was not loaded is computed again.
            request.num_computed += self.load_external(request, load_blocks, computed, loaded)
        return True

    # -- the model ---------------------------------------------------------------------

    def forward(self, output: SchedulerOutput, sample: Callable[[str, int], int]) -> None:
        """Compute the scheduled tokens: write KV into blocks, sample next tokens."""
        bs = self.block_size
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            start, end = request.num_computed, request.num_computed + n
            tokens = request.tokens
            hashes = block_hashes(tokens[:end], bs, request.hashes)
            for index in range(start // bs, self._blocks_for(end)):
                block = request.blocks[index]
                full = (index + 1) * bs <= end
                for rank in range(self.world_size):
                    if full:
                        data = full_block_kv(hashes[index], rank, self.memory.block_bytes)
                    else:
                        previous = hashes[index - 1] if index else b""
                        chunk = tokens[index * bs : end]
                        data = partial_block_kv(previous, chunk, rank, self.memory.block_bytes)
                    self.memory.write(rank, block, data)
                if full:
                    self.pool.cache(block, hashes[index])
            request.num_computed = end
            self.tokens_computed += n
            if end == request.num_tokens and len(request.output) < request.max_tokens:
                request.output.append(sample(req_id, request.num_tokens))

    def update_from_output(self) -> list[Request]:
        """Finish requests that produced all their tokens."""
        done = [r for r in self.running if len(r.output) >= r.max_tokens]
        for request in done:
            self.running.remove(request)
            self._finish(request)
        return done


def sampler(seed: int, vocab: int = 32000) -> Callable[[str, int], int]:
    """Deterministic next tokens: a function of the seed, the request and the position."""

    def sample(req_id: str, position: int) -> int:
        digest = hashlib.blake2b(f"{seed}:{req_id}:{position}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % vocab

    return sample
