"""Build journal-v1 records by hand, the way a foreign writer would.

Records are plain dicts (the JSON Lines form), so tests exercise the codec,
the fold and the CLI exactly as an unseen journal would.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
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


def legacy_run(folder: Path, policy: str = "legacy") -> Path:
    """The simulator's run of seed 3, 40 requests (``legacy``: 203 violations),
    written to ``folder/plain/POLICY.db``."""
    from replay.cli import main

    plain = folder / "plain" / f"{policy}.db"
    plain.parent.mkdir(parents=True)
    argv = ["run", "--journal", str(plain), "--policy", policy, "--seed", "3", "--requests", "40"]
    main(argv)
    return plain


def on_disk(folder: Path) -> int:
    """The bytes the files in ``folder`` take (one removed meanwhile: none)."""
    total = 0
    for p in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_size
    return total


def record_again(
    plain: Path, out: Path, sizes: list[int] | None = None, **settings: object
) -> str | None:
    """``plain``'s records recorded again at ``out`` through ``Recorder.open``
    with ``settings``, a commit per engine step (as the simulator commits);
    ``sizes`` gets the journal's bytes on disk after each commit. With a
    ``metrics`` address, returns what ``/metrics`` said before the close."""
    from kvstate import Recorder
    from replay.sources import entries

    records = iter(entries([str(plain)]))
    header = next(records).event
    rec = Recorder.open(
        out,
        block_size=header.block_size,
        world_size=header.world_size,
        policy=header.policy,
        engine=header.engine,
        run=header.run,
        **settings,  # type: ignore[arg-type]
    )
    step = 0
    for entry in records:
        if entry.step != step:
            rec.commit()
            step = entry.step
            if sizes is not None:
                sizes.append(on_disk(out.parent))
        rec.record(entry.event, entry.step)
    scraped = None
    if settings.get("metrics"):
        rec.commit(settle=True)
        with urllib.request.urlopen(f"http://{settings['metrics']}/metrics", timeout=60) as r:
            scraped = r.read().decode()
    rec.close(raise_found=False)
    return scraped
