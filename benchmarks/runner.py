"""The performance table of issue 12, measured in one run, each row against its target.

Every row is a ratio measured in this run: a cost against its budget, or a
rate against a ceiling measured on the same machine a moment before (a raw
SQLite ``executemany`` of the same rows, a scan of the same table). Numbers
from different runs are not compared; these 2-core machines are noisy.

Rows not measured here yet are listed with ``"measured": null``; the
engine-step ratio in a real vLLM engine is ``benchmarks/bench_vllm_step.py``.
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from benchmarks.bench_hot_path import BLOCK, WORLD, lifecycle
from journal import Journal, atomic_output
from kvstate import Recorder
from kvstate.codec import to_record
from kvstate.events import JournalOpened
from replay import replay


@attrs.frozen
class Row:
    """One line of the table: what, how much, against what, and whether it meets it."""

    name: str
    measured: float | None
    unit: str
    target: str
    ratio: float | None
    met: bool | None
    note: str = ""


@attrs.frozen
class Sizes:
    jobs: int  # lifecycles for the caller-side rows (about 21 records each)
    replay_jobs: tuple[int, ...]  # journals replayed for rate and memory

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        return cls(200, (200, 1000)) if quick else cls(20_000, (10_000, 50_000))


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def caller_rows(jobs: int) -> list[Row]:
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD))
    memory_s, events = _timed(lambda: lifecycle(rec, jobs))
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder.open(os.path.join(tmp, "j.db"), block_size=BLOCK, world_size=WORLD)
        journal_s, _ = _timed(lambda: lifecycle(rec, jobs))
        rec.close()
    per_memory = memory_s / events * 1e9
    per_journal = journal_s / events * 1e9
    return [
        Row(
            "caller cost per recorded event, in memory",
            per_memory,
            "ns",
            "<= 1000 ns",
            per_memory / 1000,
            per_memory <= 1000,
        ),
        Row(
            "caller cost per recorded event, journal on",
            per_journal,
            "ns",
            "<= 2000 ns",
            per_journal / 2000,
            per_journal <= 2000,
        ),
        Row(
            "journal on / in memory, same run",
            per_journal / per_memory,
            "x",
            "<= 1.2",
            per_journal / per_memory / 1.2,
            per_journal / per_memory <= 1.2,
        ),
    ]


def writer_row(jobs: int) -> Row:
    """Encoding, chaining and inserting our records vs a raw executemany of the same rows."""
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD), keep=True)
    lifecycle(rec, jobs)
    entries = rec.entries or []
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(os.path.join(tmp, "w.db"))
        ours_s, _ = _timed(
            lambda: [
                journal.append([to_record(e) for e in entries[i : i + 4096]])
                for i in range(0, len(entries), 4096)
            ]
        )
        rows = list(
            journal._conn.execute(  # the very rows our writer produced
                "SELECT seq, kind, step, rank, ts, payload, digest FROM records ORDER BY seq"
            )
        )
        journal.close()
        raw = sqlite3.connect(os.path.join(tmp, "raw.db"), isolation_level=None)
        raw.execute(
            "CREATE TABLE t (seq INTEGER PRIMARY KEY, kind TEXT, step INT, rank INT, "
            "ts INT, payload BLOB, digest BLOB)"
        )

        def insert() -> None:
            for i in range(0, len(rows), 4096):
                raw.execute("BEGIN")
                raw.executemany("INSERT INTO t VALUES (?,?,?,?,?,?,?)", rows[i : i + 4096])
                raw.execute("COMMIT")

        raw_s, _ = _timed(insert)
        raw.close()
    ratio = raw_s / ours_s  # our throughput as a fraction of the raw one
    return Row(
        "writer append vs raw sqlite3 executemany",
        len(entries) / ours_s,
        "records/s",
        ">= 0.8 x raw",
        ratio / 0.8,
        ratio >= 0.8,
        f"raw {len(rows) / raw_s:,.0f} records/s",
    )


def _scan_rate(path: str) -> float:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    t, n = _timed(
        lambda: sum(1 for _ in conn.execute("SELECT seq, kind, step, rank, payload FROM records"))
    )
    conn.close()
    return n / t


def _peak_rss_mb(path: str) -> float:
    """Peak resident memory of ``kvstate replay PATH`` in its own process."""
    code = (
        "import resource, sys\n"
        "from replay import replay\n"
        "replay([sys.argv[1]])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip()) / 1024  # ru_maxrss is in KiB on Linux


def replay_rows(sizes: tuple[int, ...]) -> tuple[list[Row], list[dict[str, float]]]:
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for jobs in sizes:
            path = os.path.join(tmp, f"r{jobs}.db")
            rec = Recorder.open(path, block_size=BLOCK, world_size=WORLD)
            records = lifecycle(rec, jobs)
            rec.close()
            seconds, result = _timed(lambda p=path: replay([p]))
            points.append(
                {
                    "records": records,
                    "seconds": seconds,
                    "rate": records / seconds,
                    "scan_rate": _scan_rate(path),
                    "peak_mb": _peak_rss_mb(path),
                    "violations": len(result.violations),
                }
            )
    last = points[-1]
    flat = max(p["peak_mb"] for p in points) / min(p["peak_mb"] for p in points)
    rows = [
        Row(
            f"replay rate, {last['records']:,} records",
            last["rate"],
            "records/s",
            ">= 500,000 records/s",
            last["rate"] / 500_000,
            last["rate"] >= 500_000,
            f"SQLite scan ceiling {last['scan_rate']:,.0f} records/s "
            f"({last['rate'] / last['scan_rate']:.2f} of it)",
        ),
        Row(
            f"replay peak memory, {last['records']:,} records",
            last["peak_mb"],
            "MB",
            "<= 300 MB",
            last["peak_mb"] / 300,
            last["peak_mb"] <= 300,
            f"{flat:.2f}x from {points[0]['records']:,} records (flat is 1.0)",
        ),
    ]
    return rows, points


NOT_YET = [
    Row(
        "export --format perfetto / inspect --once at 5M records",
        None,
        "MB",
        "<= 500 MB",
        None,
        None,
        "not measured by the runner yet",
    ),
    Row(
        "kvstate inspect per key at 1M records",
        None,
        "ms",
        "<= 200 ms",
        None,
        None,
        "not measured by the runner yet",
    ),
    Row(
        "engine step, ledger on / off (real vLLM)",
        None,
        "x",
        "<= 1.02",
        None,
        None,
        "benchmarks/bench_vllm_step.py (docs/vllm.md)",
    ),
    Row(
        "kvstate demo throughput, ledger on / off",
        None,
        "x",
        ">= 0.95",
        None,
        None,
        "not measured by the runner yet",
    ),
]


def run(quick: bool) -> dict[str, Any]:
    sizes = Sizes.of(quick)
    rows = caller_rows(sizes.jobs)
    rows.append(writer_row(sizes.jobs))
    replayed, points = replay_rows(sizes.replay_jobs)
    rows += replayed + NOT_YET
    return {
        "quick": quick,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "rows": [attrs.asdict(r) for r in rows],
        "replay_points": points,
        "self_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| what | measured | target | ratio to target | met | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        measured = "not measured" if r["measured"] is None else f"{r['measured']:,.2f} {r['unit']}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(
            f"| {r['name']} | {measured} | {r['target']} | {ratio} | {met} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path, *, force: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (
        ("bench.json", json.dumps(report, indent=1) + "\n"),
        ("bench.md", markdown(report)),
    ):
        path = out / name
        with atomic_output(str(path), force=force) as tmp:
            Path(tmp).write_text(text)
        written.append(path)
    return written
