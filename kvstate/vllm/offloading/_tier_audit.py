"""The offload tier audited by bytes: what each store copied, what each load got.

A rank fingerprints a store job's source blocks when the save is due (a
job of a running request once the forward pass that computed its tokens
has run; a job of a finished request before the forward pass of the step
that built it, which may hand its freed blocks to another request). Once
the rank reports the copy done, it reads the tier's copy back: bytes other
than the fingerprint are a ``key_verified {ok: false}`` (``POISONED_KEY``),
the store read blocks that had changed hands. A load, once reported, is
compared block by block with the fingerprint of the store that wrote each
key: a mismatch is a ``load_verified {ok: false}`` (``WRONG_KV_LOADED``)
naming the request that got another request's KV.

It reads the tier through the copy worker: kvstate's host tier
(:mod:`kvstate.harness.vllm_engine.host_tier`) offers ``device_digest`` and
``host_digest``; a tier without them (vLLM's CUDA one) is not audited.
Only KV-cache group 0 is read (the models vLLM's CPU engine runs here have
one group); a job over several groups is left unaudited.
"""

from __future__ import annotations

from typing import Any

from kvstate import build
from kvstate import events as ev
from kvstate.vllm.offloading._scheduler import specs

#: one block of a job: (key, device block, tier chunk, the block's place in the chunk)
Row = tuple[str, int, int, int]


def layout(device: Any, host: Any, keys: tuple[str, ...], per: int) -> list[Row] | None:
    """Which device block goes to which chunk and key, as the copy plan has it
    (the first block may start inside a chunk: ``block_indices``)."""
    sizes = [int(n) for n in getattr(device, "group_sizes", None) or ()]
    if not sizes or any(sizes[1:]):
        return None  # several KV-cache groups
    blocks = [int(b) for b in device.block_ids]
    chunks = [int(c) for c in host.block_ids]
    skip = int(device.block_indices[0]) % per
    rows: list[Row] = []
    for i, block in enumerate(blocks[: sizes[0]]):
        k = (skip + i) // per
        if k >= len(keys) or k >= len(chunks):
            return None  # not the shape this audit knows
        rows.append((keys[k], block, chunks[k], (skip + i) % per))
    return rows


class TierAudit:
    """One rank's fingerprints of its store and load jobs (see the module docstring)."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier
        self.per = int(tier.blocks_per_chunk)
        #: store job -> its rows, each with the block's digest when the save was due
        self.requested: dict[int, list[tuple[Row, str]]] = {}
        #: key -> (the store job that wrote it, its block digests by place in the chunk)
        self.expected: dict[str, tuple[int, dict[int, str]]] = {}
        #: load job -> (req, gen, rows)
        self.loads: dict[int, tuple[str, int, list[Row]]] = {}

    def store_due(self, job: int, transfer: Any, keys: tuple[str, ...]) -> None:
        if job in self.requested:
            return
        rows = layout(*specs(transfer), keys, self.per)
        if rows is not None:
            digest = self.tier.device_digest
            self.requested[job] = [(row, digest(row[1])) for row in rows]

    def load_received(self, job: int, transfer: Any, req: str, gen: int, keys: Any) -> None:
        src, dst = specs(transfer)
        rows = layout(dst, src, tuple(keys), self.per)
        if rows is not None:
            self.loads[job] = (req, gen, rows)

    def done(self, job: int) -> list[ev.Event]:
        """The verdicts on a job this rank just reported (none for an unaudited one)."""
        if job in self.requested:
            return self._stored(job)
        if job in self.loads:
            return self._loaded(job)
        return []

    def _stored(self, job: int) -> list[ev.Event]:
        out: list[ev.Event] = []
        by_key: dict[str, list[tuple[Row, str]]] = {}
        for row, digest in self.requested.pop(job):
            by_key.setdefault(row[0], []).append((row, digest))
        host = self.tier.host_digest
        for key, rows in by_key.items():
            wrong = [(d, host(r[2], r[3])) for r, d in rows if host(r[2], r[3]) != d]
            self.expected[key] = (job, {r[3]: d for r, d in rows})
            expected, actual = wrong[0] if wrong else (None, None)
            out.append(
                build.key_verified(key=key, ok=not wrong, expected=expected, actual=actual, job=job)
            )
        return out

    def _loaded(self, job: int) -> list[ev.Event]:
        req, gen, rows = self.loads.pop(job)
        digest = self.tier.device_digest
        verdicts: dict[str, tuple[bool, int]] = {}
        for key, block, _, sub in rows:
            known = self.expected.get(key)
            if known is None or sub not in known[1]:
                continue  # stored before this journal began, or by another rank's copy
            ok = digest(block) == known[1][sub]
            before = verdicts.get(key, (True, known[0]))[0]
            verdicts[key] = (before and ok, known[0])
        return [
            build.load_verified(req=req, gen=gen, key=key, ok=ok, job=writer)
            for key, (ok, writer) in verdicts.items()
        ]
