"""One worker rank of a vLLM process, journaled as it happens.

The sending thread is observed at the points where vLLM itself acts: a job
entering the thread's ledger (``add_request``), the store calls (through a
transparent proxy around the thread's store handle), the effects on the
rank's per-request state (``_record_saved``, the pressure mark), the ledger
entry leaving (``delete_finished_stored_request``: a preemption seen, or a
finished request retired), and the end of ``_handle_request``, which every
job passes exactly once. The observer never changes what vLLM does: a stale
job that vLLM lets run (before #52372) runs, and the journal shows it.

With fingerprints on, the rank hashes each job's blocks when the save is
requested and again right before the put reads them; the two agree unless
the blocks changed hands in between (a poisoned read, proven by bytes). The
store's copy is audited at the end against the request-time fingerprint.
One job in ``every`` is fingerprinted (its id divisible by it); the keys
the others put are neither read back nor compared when loaded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvstate import build
from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.vllm._commit import GroupCommit
from kvstate.vllm.mooncake import _fingerprint
from kvstate.vllm.mooncake._memory import KvMemory, UnreadableMemory

_log = logging.getLogger("kvstate.vllm")


def _key_hex(key: str) -> str:
    """The chunk hash at the end of a vLLM store key: the journal's key name."""
    return key.rsplit("@", 1)[-1]


_LOW_64 = (1 << 64) - 1


class _Job:
    """What the sending thread is doing for one job, while it does it."""

    __slots__ = ("chunk_of", "existed", "id", "meta", "reason", "started")

    def __init__(self, job: int, meta: Any, reason: ev.SkipReason) -> None:
        self.id = job
        self.meta = meta
        self.reason = reason
        self.started = False
        self.existed = 0
        self.chunk_of: dict[str, int] | None = None

    def event_names(self) -> Any:
        """Names for the hashes in KV events, as the journal names keys (hex).

        vLLM publishes a hash as bytes, or (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)
        as the low 64 bits of its big-endian value; the request's own hash
        chain maps the latter back. A hash outside the chain keeps a name that
        says what it was, and replay flags it.
        """
        by_int = {
            int.from_bytes(h, "big") & _LOW_64: h.hex()
            for h in (self.meta.block_hashes or ())
            if isinstance(h, bytes)
        }

        def name(block_hash: Any) -> str:
            if isinstance(block_hash, int):
                return by_int.get(block_hash, f"int:{block_hash}")
            return block_hash.hex() if hasattr(block_hash, "hex") else str(block_hash)

        return name

    def chunk(self, key_hex: str) -> int | None:
        if self.chunk_of is None:
            hashes = self.meta.block_hashes or ()
            self.chunk_of = {
                (h.hex() if hasattr(h, "hex") else str(h)): i for i, h in enumerate(hashes)
            }
        return self.chunk_of.get(key_hex)


class WorkerObserver:
    """Journals one rank: its sending thread, its loads, and the store audit."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        rank: int,
        fingerprint: bool,
        every: int = 1,
        memory: KvMemory | None = None,
    ) -> None:
        self.recorder = recorder
        self.rank = rank
        #: the KV cache tensors the rank registered, read for fingerprints
        self.memory = memory
        self.fingerprint = fingerprint
        #: the sample: store jobs whose id this divides are fingerprinted
        self.every = every
        if fingerprint and memory is None:
            self._no_fingerprints("the KV cache tensors were not seen registered")
        self.step = 0
        #: its journal was ended (finish(), or the observer stood down)
        self.closed = False
        self.group = GroupCommit(recorder)
        self.current = threading.local()
        #: job -> chunk index -> digest at save-request time
        self.requested: dict[int, dict[int, str]] = {}
        #: key -> (job, full store key, digest at request time) of the put that wrote it
        self.written: dict[str, tuple[int, str, str]] = {}
        #: keys put by jobs outside the sample: a load of one is not compared
        #: (nor taken for another engine's key)
        self.unsampled: set[str] = set()
        #: req -> newest generation this rank received a job of
        self.newest: dict[str, int] = {}
        self.preempting: dict[str, int] = {}
        self.store: Any = None
        #: jobs received and not yet reported: a sending thread still owes
        #: their records (finish() waits for them; see kvstate.vllm.outstanding)
        self.unreported: set[int] = set()

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step)

    def _no_fingerprints(self, why: str) -> None:
        """Turn this rank's fingerprint audit off, saying why: it reads the
        blocks' bytes only through the tensors vLLM registered
        (kvstate.vllm.mooncake._memory), never a raw address it cannot place."""
        self.fingerprint = False
        _log.warning(
            "rank %d of %s: fingerprint audit off (%s); the journal goes on",
            self.rank, getattr(self.recorder.writer, "path", "its journal"), why,
        )  # fmt: skip

    def _digest(self, addrs: Sequence[int], sizes: Sequence[int]) -> str | None:
        """The fingerprint of one key's segments (None: the audit is off now)."""
        if not self.fingerprint or self.memory is None:
            return None
        try:
            return _fingerprint.of_segments(self.memory, addrs, sizes)
        except UnreadableMemory as exc:
            self._no_fingerprints(str(exc))
            return None

    # -- the worker's step -----------------------------------------------------------

    def before_step(self, meta: Any) -> None:
        self.step = getattr(meta, "_kvstate_step", self.step)
        self.preempting = dict(getattr(meta, "_kvstate_preempted", {}) or {})

    def after_step(self) -> None:
        self.preempting = {}
        # Sending-thread records land between steps; step boundaries commit them in groups.
        self.group.step_ended()

    def ledger_entry_dropped(self, req: str) -> None:
        """``delete_finished_stored_request``: a preemption seen, or a finished request retired."""
        gen = self.preempting.get(req)
        if gen is not None:
            self._record(build.preemption_seen(req=req, gen=gen, rank=self.rank))
            return
        newest = self.newest.get(req)
        if newest is not None:
            self._record(build.request_retired(req=req, gen=newest, rank=self.rank))

    # -- the sending thread ----------------------------------------------------------

    def received(self, thread: Any, meta: Any) -> None:
        """``add_request``: the job enters the rank's ledger, before it is queued."""
        job = getattr(meta, "_kvstate_job", None)
        if job is None:
            return
        gen = getattr(meta, "_kvstate_gen", None)
        if gen is not None and gen > self.newest.get(meta.req_id, -1):
            self.newest[meta.req_id] = gen
        self._record(build.job_received(job=job, rank=self.rank))
        self.unreported.add(job)
        if self.fingerprint and job % self.every == 0:
            self.requested[job] = self._fingerprint_blocks(thread, meta)

    def _fingerprint_blocks(self, thread: Any, meta: Any) -> dict[int, str]:
        """Chunk index -> digest of the block that holds it, as the put would read it."""
        db = thread.token_databases[0]
        end = meta.token_len_chunk // thread.block_size
        table = meta.block_ids[0]
        digests = {}
        for i, block in enumerate(table[:end]):
            digest = self._digest(*db.prepare_value_for_block(block))
            if digest is None:
                return {}
            digests[i] = digest
        return digests

    def begin_job(self, meta: Any, reason: ev.SkipReason) -> _Job | None:
        job = getattr(meta, "_kvstate_job", None)
        if job is None:
            return None
        run = _Job(job, meta, reason)
        self.current.job = run
        return run

    def started(self) -> _Job | None:
        """The job passed vLLM's liveness and pressure checks (it touched the store)."""
        run: _Job | None = getattr(self.current, "job", None)
        if run is not None and not run.started:
            run.started = True
            self._record(build.job_started(job=run.id, rank=self.rank))
        return run

    def end_job(self, run: _Job) -> None:
        """The single exit of every job: skipped if it never started, then reported."""
        self.current.job = None
        if not run.started:
            self._record(build.job_skipped(job=run.id, rank=self.rank, reason=run.reason))
        self._record(build.job_reported(job=run.id, rank=self.rank))
        self.unreported.discard(run.id)
        self.requested.pop(run.id, None)

    def offset_saved(self, req: str, offset: int) -> None:
        run = self.started()
        if run is not None:
            self._record(build.offset_saved(job=run.id, rank=self.rank, req=req, offset=offset))

    def marked_skipped(self, req: str) -> None:
        run = self.started()
        if run is not None:
            self._record(build.request_marked_skipped(job=run.id, rank=self.rank, req=req))

    def kv_events(self, events: Any) -> None:
        """``BlockStored`` events the job publishes: each key and the parent vLLM gave it."""
        run = self.started()
        if run is None:
            return
        name = run.event_names()
        for stored in events:
            parent = stored.parent_block_hash
            for block_hash in stored.block_hashes:
                self._record(
                    build.kv_block_stored(
                        job=run.id,
                        rank=self.rank,
                        key=name(block_hash),
                        parent=None if parent is None else name(parent),
                    )
                )
                parent = block_hash

    def retry_tokens(self, req: str, state: tuple[int, list[int]] | None) -> None:
        """vLLM kept (or dropped) the token ids of a range whose KV events must be retried."""
        run = self.started()
        if run is None:
            return
        if state is None:
            self._record(build.retry_tokens_cleared(job=run.id, rank=self.rank, req=req))
        else:
            start, tokens = state
            self._record(
                build.retry_tokens_set(
                    job=run.id, rank=self.rank, req=req, start=start, count=len(tokens)
                )
            )

    def before_put(self, keys: list[str], addrs: Any, sizes: Any) -> tuple[Any, ...] | None:
        """``batch_put_from_multi_buffers`` is about to read the blocks."""
        run = self.started()
        if run is None:
            return None
        table = run.meta.block_ids[0]
        chunks = [run.chunk(_key_hex(k)) for k in keys]
        blocks = [table[c] for c in chunks if c is not None and c < len(table)]
        self._record(build.dma_started(job=run.id, rank=self.rank, blocks=blocks))
        digest = expected = None
        now = []
        sampled = run.id % self.every == 0
        if self.fingerprint and not sampled:
            self.unsampled.update(_key_hex(k) for k in keys)
        elif self.fingerprint:
            now = [self._digest(a, z) for a, z in zip(addrs, sizes, strict=True)]
        if self.fingerprint and sampled and None not in now:
            requested = self.requested.get(run.id, {})
            before = [requested.get(c, "") if c is not None else "" for c in chunks]
            digest = _fingerprint.combine(d for d in now if d is not None)
            expected = _fingerprint.combine(before)
            for key, want in zip(keys, before, strict=True):
                if want:
                    self.written.setdefault(_key_hex(key), (run.id, key, want))
        return run, blocks, digest, expected, len(keys)

    def after_put(self, pre: tuple[Any, ...], result: Any, error: BaseException | None) -> None:
        """The put returned (per-key codes) or raised."""
        run, blocks, digest, expected, count = pre
        self._record(
            build.dma_done(
                job=run.id, rank=self.rank, digest=digest, blocks=blocks, expected=expected
            )
        )
        if error is not None:
            self._record(build.put_failed(job=run.id, rank=self.rank, error=repr(error)[:200]))
            return
        failed = sorted({code for code in result if code < 0})
        if failed:
            self._record(build.put_failed(job=run.id, rank=self.rank, error=f"codes {failed}"))
        else:
            self._record(
                build.put_done(job=run.id, rank=self.rank, stored=count, existed=run.existed)
            )

    def exist_checked(self, states: Any) -> None:
        """``batch_is_exist``: keys already stored are not put (nor read) again."""
        run = self.started()
        if run is not None:
            run.existed = sum(1 for state in states if state == 1)

    # -- loads and the audit ---------------------------------------------------------

    def loaded(self, meta: Any, keys: list[str], addrs: Any, sizes: Any, result: Any) -> None:
        """``batch_get_into_multi_buffers`` filled blocks: compare with what was saved."""
        gen = getattr(meta, "_kvstate_gen", None)
        if not self.fingerprint or gen is None:
            return
        for key, a, z, code in zip(keys, addrs, sizes, result, strict=True):
            if code < 0:
                continue
            name = _key_hex(key)
            if name in self.unsampled:
                continue  # this rank put it outside the sample: nothing to compare
            wrote = self.written.get(name)
            digest = self._digest(a, z)
            if digest is None:
                return  # the audit went off: nothing more is compared
            if wrote is None:
                # Another engine sharing the store wrote it: this run cannot
                # judge the bytes; a fleet check joins the digest with the
                # writer's audit (a mixed-release fleet mid-upgrade).
                self._record(build.key_loaded(req=meta.req_id, gen=gen, key=name, digest=digest))
                continue
            ok = digest == wrote[2]
            self._record(
                build.load_verified(req=meta.req_id, gen=gen, key=name, ok=ok, job=wrote[0])
            )

    def read_back(self) -> dict[str, int]:
        """Read every key this rank wrote back from the store; returns counts."""
        counts = {"verified": 0, "poisoned": 0, "missing": 0}
        if self.store is None:
            return counts
        for name, (job, key, want) in sorted(self.written.items()):
            try:
                value = self.store.get(key)
            except Exception as exc:  # a failed read is reported, never hidden
                self._record(build.key_missing(key=name, reason=f"read failed: {exc!r}"[:200]))
                counts["missing"] += 1
                continue
            if not value:
                self._record(build.key_missing(key=name, reason="evicted"))
                counts["missing"] += 1
                continue
            actual = _fingerprint.of_bytes(value)
            ok = actual == want
            self._record(build.key_verified(key=name, ok=ok, expected=want, actual=actual, job=job))
            counts["verified"] += 1
            counts["poisoned"] += not ok
        return counts

    def close(self) -> None:
        if self.closed:  # stood down, or ended by an error of ours
            return
        self.closed = True
        self.recorder.close()
