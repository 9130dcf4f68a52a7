"""The bug zoo's cases for vLLM's OffloadingConnector: one interleaving per upstream fix.

Each script runs on an :class:`OffloadStage`, a tiny engine that follows
the connector's protocol (journal header ``protocol: "offloading"``): a
block pool with least-recently-freed reuse, KV content per block, stores
that pin nothing and copy a step after they are built, an offload tier of
a few chunks with LRU eviction, and loads from it. One block is one chunk.

The script is the interleaving; where the upstream fix changed what the
connector decides, the script asks :attr:`OffloadStage.legacy` and takes
the release's path before the fix or after it. The legacy journal must be
flagged with the case's code at the right kind of record, the fixed one
must replay clean (``tests/test_zoo.py``). Content is by prompt: two
requests with one prompt compute the same KV and share its tier keys, so a
load reads what another request stored, and the audit records
(``key_verified``, ``load_verified``) say whether the bytes were right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal

import attrs

from kvstate import build
from kvstate import events as ev
from kvstate.recorder import Recorder

BLOCK_SIZE = 4
#: what a block holds before any request computed it, or a key before its copy
UNWRITTEN = "-"


@attrs.define
class _Job:
    req: str
    gen: int
    blocks: list[int]
    keys: list[str]
    load: bool = False
    #: the copy ran on every rank (reported there) and what it read or wrote
    copied: bool = False
    data: list[str] = attrs.Factory(list)


class OffloadStage:
    """A scripted engine speaking the OffloadingConnector's protocol (see the module)."""

    def __init__(self, policy: str, recorder: Recorder, *, world_size: int, pool: int) -> None:
        #: the release before the case's fix (the script takes its path)
        self.legacy = policy == "legacy"
        self.recorder = recorder
        self.world_size = world_size
        self.step_no = 0
        self.next_job = 0
        self.free: list[int] = list(range(pool))  # reuse order: head first
        self.content: dict[int, str] = {}
        self.gens: dict[str, int] = {}
        self.prompts: dict[str, str] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}  # blocks of its table the request computed
        self.jobs: dict[int, _Job] = {}
        self.live: set[int] = set()  # enqueued, not yet ended by the scheduler
        self.tier: dict[str, str] = {}  # key -> value, least recently stored first
        self.tier_chunks = pool

    def play(self, script: Callable[[OffloadStage], None]) -> None:
        """Run ``script``, then finish what runs, settle every job, audit the tier, go idle."""
        script(self)
        for req in sorted(self.tables):
            self.finish(req)
        for job in sorted(self.live):
            self.transfer(job)
        self.audit()
        self._record(build.engine_idle())

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step_no)

    # -- the scheduler's side ----------------------------------------------------------

    def step(self) -> None:
        self.step_no += 1

    def _alloc(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise RuntimeError(f"the zoo's pool has {len(self.free)} free blocks, not {n}")
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _release(self, req: str) -> None:
        self.free.extend(self.tables.pop(req, []))
        self.computed.pop(req, None)

    def admit(self, req: str, n: int, *, prompt: str | None = None, load: int = 0) -> int | None:
        """``req`` is admitted (generation 0) with ``n`` blocks of the prompt
        ``prompt``; the tier's first ``load`` chunks of it are loaded into them.
        Returns the load job, if any."""
        self.prompts[req] = prompt or req
        self.gens[req] = 0
        self._record(build.request_admitted(req=req, gen=0, prompt_tokens=n * BLOCK_SIZE))
        self._assign(req, self._alloc(n), "append")
        return self._load(req, load) if load else None

    def grow(self, req: str, n: int) -> None:
        """A decode step gives the running ``req`` ``n`` more blocks."""
        self._assign(req, self._alloc(n), "append")

    def _assign(self, req: str, blocks: list[int], mode: Literal["append", "replace"]) -> None:
        gen = self.gens[req]
        self._record(build.blocks_assigned(req=req, gen=gen, blocks=blocks, mode=mode))
        if mode == "replace":
            self.tables[req], self.computed[req] = list(blocks), 0
        else:
            self.tables.setdefault(req, []).extend(blocks)

    def preempt(self, req: str, *, flush: bool) -> None:
        """``req`` is preempted and its blocks freed; with ``flush`` its live
        stores are flushed first (vLLM #29870): every rank copies them now."""
        self._record(build.request_preempted(req=req, gen=self.gens[req]))
        stores = sorted(j for j in self.live if self.jobs[j].req == req and not self.jobs[j].load)
        if flush and stores:
            self._record(build.flush_requested(jobs=stores))
            for job in stores:
                self.copy(job)
            for rank in range(self.world_size):
                self._record(build.flush_done(jobs=stores, rank=rank))
        self._release(req)

    def resume(self, req: str, n: int, *, load: int = 0) -> int | None:
        """``req`` runs again as a new generation with ``n`` fresh blocks; the
        tier's first ``load`` chunks of its prompt are loaded into them.
        Returns the load job, if any."""
        self.gens[req] += 1
        self._record(build.request_resumed(req=req, gen=self.gens[req]))
        self._assign(req, self._alloc(n), "replace")
        return self._load(req, load) if load else None

    def _load(self, req: str, n: int) -> int:
        job = self._new_job(req, list(range(n)), load=True)
        spec = self.jobs[job]
        self._record(
            build.load_enqueued(
                job=job,
                req=req,
                gen=spec.gen,
                writes=spec.blocks,
                keys=spec.keys,
                world_size=self.world_size,
            )
        )
        self._receive(job)
        return job

    def finish(self, req: str) -> None:
        self._record(build.request_finished(req=req, gen=self.gens[req]))
        self._release(req)

    def key(self, req: str, i: int) -> str:
        return f"{self.prompts[req]}.{i}"

    def _new_job(self, req: str, chunks: list[int], *, load: bool = False) -> int:
        job, self.next_job = self.next_job, self.next_job + 1
        table = self.tables[req]
        keys = [self.key(req, i) for i in chunks]
        self.jobs[job] = _Job(req, self.gens[req], [table[i] for i in chunks], keys, load)
        self.live.add(job)
        return job

    def store(self, req: str, first: int, last: int) -> int:
        """A store job of chunks ``[first, last)`` of ``req``; the tier makes
        room first (LRU), and the ranks copy it when :meth:`copy` says."""
        job = self._new_job(req, list(range(first, last)))
        spec = self.jobs[job]
        self._make_room(len(spec.keys))
        self._record(
            build.job_enqueued(
                job=job,
                req=req,
                gen=spec.gen,
                token_start=first * BLOCK_SIZE,
                token_end=last * BLOCK_SIZE,
                reads=spec.blocks,
                pins=(),
                keys=spec.keys,
                world_size=self.world_size,
                parent=self.key(req, first - 1) if first else None,
            )
        )
        self._receive(job)
        return job

    def evict(self, keys: Iterable[str]) -> None:
        gone = [k for k in keys if self.tier.pop(k, None) is not None]
        if gone:
            self._record(build.tier_evicted(keys=gone))

    def _make_room(self, n: int) -> None:
        over = len(self.tier) + n - self.tier_chunks
        if over > 0:
            self.evict(list(self.tier)[:over])

    def complete(self, job: int, *, count: int | None = None) -> None:
        """The scheduler consumes ``count`` completions of ``job`` (every rank's
        by default); with all of them the job ends, and a store's keys are the tier's."""
        n = self.world_size if count is None else count
        self._record(build.completions_received(job=job, count=n))
        if job not in self.live:
            return
        spec = self.jobs[job]
        self.live.discard(job)
        self._record(build.pins_released(job=job, blocks=()))
        if not spec.load:
            self._record(build.tier_stored(job=job, keys=spec.keys))
            # A key whose copy has not run yet holds nothing written.
            data = spec.data if spec.copied else [UNWRITTEN] * len(spec.keys)
            for key, value in zip(spec.keys, data, strict=True):
                self.tier.pop(key, None)
                self.tier[key] = value

    # -- the ranks' side ---------------------------------------------------------------

    def _receive(self, job: int) -> None:
        for rank in range(self.world_size):
            self._record(build.job_received(job=job, rank=rank))

    def forward(self) -> None:
        """The step's forward pass: each request computes the blocks it has not yet."""
        for req, table in self.tables.items():
            done = self.computed.get(req, 0)
            for i in range(done, len(table)):
                self.content[table[i]] = f"{self.prompts[req]}#{i}"
            self.computed[req] = len(table)

    def copy(self, job: int) -> None:
        """Every rank runs ``job``'s copy now and reports it."""
        spec = self.jobs[job]
        if spec.copied:
            return
        spec.copied = True
        for rank in range(self.world_size):
            self._record(build.job_started(job=job, rank=rank))
        if spec.load:
            for key, block in zip(spec.keys, spec.blocks, strict=True):
                value = self.tier.get(key, UNWRITTEN)
                self.content[block] = value
                ok = value == self._expected(key)
                self._record(build.load_verified(req=spec.req, gen=spec.gen, key=key, ok=ok))
            self.computed[spec.req] = len(spec.blocks)
        else:
            spec.data = [self.content.get(b, UNWRITTEN) for b in spec.blocks]
            for key, value in zip(spec.keys, spec.data, strict=True):
                if key in self.tier:  # completed before its copy ran: the slot is written now
                    self.tier[key] = value
        for rank in range(self.world_size):
            self._record(build.job_reported(job=job, rank=rank))

    def transfer(self, job: int) -> None:
        """``job`` copied on every rank, then its completions consumed."""
        self.copy(job)
        self.complete(job)

    def audit(self) -> None:
        """Read the tier back against what each key's tokens should hold."""
        for key, value in self.tier.items():
            expected = self._expected(key)
            self._record(
                build.key_verified(key=key, ok=value == expected, expected=expected, actual=value)
            )

    @staticmethod
    def _expected(key: str) -> str:
        prompt, _, i = key.rpartition(".")
        return f"{prompt}#{i}"


# -- the cases (their histories are in kvstate.harness.zoo.CASES) ---------------------------


def unflushed_preemption(s: OffloadStage) -> None:
    s.admit("r1", 2)
    s.forward()
    job = s.store("r1", 0, 2)  # the worker copies a store a step after it is built
    s.step()
    s.preempt("r1", flush=not s.legacy)  # vLLM #29870 flushes a preempted request's stores
    s.admit("r2", 2)  # r2 gets r1's freed blocks
    s.forward()  # and writes them
    s.transfer(job)  # r1's store copies only now


def per_request_completion(s: OffloadStage) -> None:
    s.admit("r1", 2, prompt="A")
    s.forward()
    first = s.store("r1", 0, 2)
    s.copy(first)  # done on the rank; its completion comes with the step's output
    s.step()
    s.preempt("r1", flush=True)
    s.resume("r1", 3)  # nothing stored yet: r1 recomputes, one block further
    s.forward()
    second = s.store("r1", 2, 3)  # A.0 and A.1 are being stored already
    s.step()
    s.complete(first)
    if s.legacy:  # #39186's draft: the ack names r1, and ends each of r1's stores
        s.complete(second)
    load = s.admit("r2", 3, prompt="A", load=3 if s.legacy else 2)  # the tier's prefix
    if load is not None:
        s.transfer(load)
    s.forward()
    s.copy(second)
    if s.legacy:  # second's own ack, for a job that ended
        s.complete(second)


def load_under_store(s: OffloadStage) -> None:
    s.admit("r1", 2, prompt="A")
    s.forward()
    s.transfer(s.store("r1", 0, 1))  # A.0 is in the tier
    s.step()
    held = s.store("r1", 1, 2)
    s.step()
    s.preempt("r1", flush=True)  # copied now; its completion comes with the step's output
    s.step()
    if s.legacy:  # before vLLM #46014 the re-admission looked its prefix up at once
        s.resume("r1", 2, load=1)
        s.complete(held)
    else:  # the request waits until its transfers are done
        s.complete(held)
        s.resume("r1", 2, load=2)


def stale_store_cursor(s: OffloadStage) -> None:
    s.tier_chunks = 4
    s.admit("r1", 4, prompt="A")
    s.forward()
    s.transfer(s.store("r1", 0, 4))  # A.0 to A.3 in the tier
    s.step()
    s.preempt("r1", flush=True)
    s.admit("r2", 4, prompt="B")
    s.forward()
    s.transfer(s.store("r2", 0, 4))  # the tier (4 chunks) evicts r1's
    s.finish("r2")
    s.step()
    s.resume("r1", 5)  # nothing to load: A.0 is gone
    s.forward()
    if s.legacy:  # the cursor stayed at chunk 4 (vLLM #52211, still so in 0.32.0)
        s.store("r1", 4, 5)
    else:
        s.store("r1", 0, 5)
