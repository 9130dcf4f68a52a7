"""Build journal-v1 records by hand, the way a foreign writer would.

Records are plain dicts (the JSON Lines form), so tests exercise the codec,
the fold and the CLI exactly as an unseen journal would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from journal import Record
from kvstate.codec import Entry, from_record
from kvstate.ledger import Ledger
from kvstate.violations import Violation


class JournalBuilder:
    def __init__(
        self, *, world_size: int = 1, block_size: int = 4, protocol: str | None = None
    ) -> None:
        self.world_size = world_size
        self.block_size = block_size
        self.records: list[dict[str, Any]] = []
        self.step = 0
        header = {"protocol": protocol} if protocol is not None else {}
        self.add(
            "journal_opened", version=1, block_size=block_size, world_size=world_size, **header
        )

    def add(self, kind: str, **fields: Any) -> int:
        seq = len(self.records) + 1
        record = {"seq": seq, "kind": kind, "step": fields.pop("step", self.step), **fields}
        self.records.append(record)
        return seq

    # -- scenario helpers --------------------------------------------------------

    def admit(
        self, req: str, gen: int = 0, blocks: list[int] | None = None, tokens: int = 8
    ) -> int:
        seq = self.add("request_admitted", req=req, gen=gen, prompt_tokens=tokens)
        if blocks:
            self.add("blocks_assigned", req=req, gen=gen, blocks=blocks, mode="append")
        return seq

    def enqueue(
        self,
        job: int,
        req: str,
        gen: int,
        *,
        reads: list[int],
        pins: list[int] | None = None,
        token_end: int | None = None,
        keys: list[str] | None = None,
        parent: str | None = None,
    ) -> int:
        if keys is None:
            keys = [f"k{req}{i}" for i in range(len(reads))]
        return self.add(
            "job_enqueued",
            job=job,
            req=req,
            gen=gen,
            token_start=0,
            token_end=len(reads) * self.block_size if token_end is None else token_end,
            reads=reads,
            pins=reads if pins is None else pins,
            keys=keys,
            parent=parent,
            world_size=self.world_size,
        )

    def run(self, job: int, rank: int = 0, *, report: bool = True) -> None:
        """A successful transfer on one rank, from receipt to report."""
        self.add("job_received", job=job, rank=rank)
        self.add("job_started", job=job, rank=rank)
        self.add("dma_started", job=job, rank=rank)
        self.add("dma_done", job=job, rank=rank)
        self.add("put_done", job=job, rank=rank, stored=1, existed=0)
        if report:
            self.add("job_reported", job=job, rank=rank)

    def complete(self, job: int, pins: list[int]) -> None:
        """All ranks' completions, then the tail-first release."""
        self.add("completions_received", job=job, count=self.world_size)
        self.add("pins_released", job=job, blocks=list(reversed(pins)))

    # -- outputs -------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """The records decoded, as a reader would hand them to the fold."""
        out = []
        for raw in self.records:
            fields = dict(raw)
            seq, kind, step = fields.pop("seq"), fields.pop("kind"), fields.pop("step")
            rank = fields.pop("rank", None)
            out.append(from_record(Record(seq, kind, fields, step, rank)))
        return out

    def fold(self) -> tuple[list[Violation], list[Violation]]:
        """(violations, warnings) of the journal."""
        ledger = Ledger()
        found: list[Violation] = []
        for entry in self.entries():
            found.extend(ledger.apply(entry.seq, entry.step, entry.event))
        return [v for v in found if not v.is_warning], [v for v in found if v.is_warning]

    def codes(self) -> list[str]:
        return [v.code.value for v in self.fold()[0]]

    def only(self, code: str) -> Violation:
        """The single violation with ``code`` (fails if there are none or several)."""
        matches = [v for v in self.fold()[0] if v.code.value == code]
        if len(matches) != 1:  # not `assert`: this module is not rewritten by pytest
            raise AssertionError(f"expected one {code}, got {self.codes()}")
        return matches[0]

    def write(self, path: Path) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        return path
