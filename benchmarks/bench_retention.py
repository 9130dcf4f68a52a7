"""A day of an engine's journal, time compressed: rotation and retention, on against off.

Issue 31's engine writes 2,000 records a second, some 14 GB a day at 82
bytes a record. Rotated at 1 GiB and kept within 4 GiB, a day is 14
rotations and, from the fifth on, a removal each. This run writes the same
day in fewer records: the segment and the budget shrink by the same factor,
so it makes the day's rotations and removals (and more), each with its
checkpoint, in minutes. The engine is the whole-lifecycle driver of
``bench_hot_path`` (a scheduler and two ranks through the ledgers), its
journal written and audited by the writer process, and read for figures on
``/metrics`` as Prometheus would.

Measured in one run, each configuration in a fresh interpreter: the disk
the journal's folder holds against its budget, sampled at every sixteenth
of the run once the writer is done with the commit before (a rotation
included: the folder as it stands between rotations), with what the
writer's ``/metrics`` says then (the rotation size in force, the
checkpoint's bytes, what the budget lacks), and whether every sample was
within the budget; the writer process's and the engine's memory over the
run (flat: the last quarter's against the first's); the engine's CPU per
record with rotation and retention on against off; the latency of a scrape.

Run: ``python benchmarks/bench_retention.py [--jobs N] [--segment BYTES]
[--budget BYTES] [--retain-only]``: ``--segment`` rotates at that size
instead of the day's, compressed (the budget stays four segments or the
day's, compressed, whichever is more, unless ``--budget`` gives it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
import time
import urllib.request
from typing import Any

from benchmarks.bench_hot_path import BLOCK, WORLD, lifecycle
from kvstate import Recorder, SpillArchive

#: issue 31's record rate, and the bytes a record takes in a journal
RATE = 2_000
#: a day's configuration: segments of 1 GiB, at most 4 GiB kept
DAY_SEGMENT, DAY_BUDGET = 1 << 30, 4 << 30
#: records a bench_hot_path lifecycle writes (a job on two ranks, its request)
RECORDS_PER_JOB = 24
SAMPLES = 16


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _folder_bytes(folder: str) -> int:
    total = 0
    for name in os.listdir(folder):
        with contextlib.suppress(FileNotFoundError):  # removed by retention meanwhile
            total += os.path.getsize(os.path.join(folder, name))
    return total


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: the writer's figures each sample records, by the name of their metric
_WRITER_FIGURES = {
    "rotate_bytes": "kvstate_journal_rotate_bytes",
    "checkpoint_bytes": "kvstate_journal_checkpoint_bytes",
    "budget_short_bytes": "kvstate_journal_budget_short_bytes",
    "journal_bytes": "kvstate_journal_bytes",
}


def _metric(text: str, name: str) -> float | None:
    """The value of the one series of ``name`` in a scrape (None: absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def measure(
    jobs: int, retain: bool, *, segment: int | None = None, budget: int | None = None
) -> dict[str, Any]:
    """One configuration: ``jobs`` lifecycles, with rotation and retention or
    without; ``segment`` and ``budget`` in place of the day's, compressed."""
    records = jobs * RECORDS_PER_JOB
    compression = RATE * 86_400 / records
    if segment is None:
        segment = max(131_072, int(DAY_SEGMENT / compression))
    if budget is None:
        budget = max(4 * segment, int(DAY_BUDGET / compression))
    address = f"127.0.0.1:{_port()}"
    settings: dict[str, Any] = {"rotate_bytes": segment, "retain_bytes": budget} if retain else {}
    samples: list[dict[str, Any]] = []
    outside = 0.0  # the engine's CPU spent sampling, not engine work
    with tempfile.TemporaryDirectory() as folder:
        rec = Recorder.open(
            os.path.join(folder, "engine.db"),
            block_size=BLOCK,
            world_size=WORLD,
            metrics=address,
            **settings,
        )

        # the wall time of each durable commit: a rotation's pause shows here
        waits: list[float] = []
        writer = rec.writer
        commit = writer.commit  # type: ignore[union-attr]

        def timed_commit(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            commit(*args, **kwargs)
            waits.append(time.perf_counter() - start)

        writer.commit = timed_commit  # type: ignore[union-attr, method-assign]

        def sample() -> None:
            nonlocal outside
            t0 = time.process_time()
            rec.commit(settle=True)
            # The writer rotates after it answers; an empty frame is answered
            # once it is done with the one before, the rotation included
            rec.commit(settle=True)
            disk = _folder_bytes(folder)
            pid = rec.writer.pid  # type: ignore[union-attr]
            wall = time.perf_counter()
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=60) as r:
                text = r.read()
            scrape_ms = (time.perf_counter() - wall) * 1e3
            said = text.decode()
            samples.append(
                {
                    "disk": disk,
                    "writer_mb": _rss_mb(pid) if pid else 0.0,
                    "engine_mb": _rss_mb(os.getpid()),
                    "scrape_ms": scrape_ms,
                    "scrape_bytes": len(text),
                    **{key: _metric(said, name) for key, name in _WRITER_FIGURES.items()},
                }
            )
            outside += time.process_time() - t0

        t0 = time.process_time()
        lifecycle(rec, jobs, between=sample, archive=SpillArchive, every=max(1, jobs // SAMPLES))
        rec.close()
        engine_s = time.process_time() - t0 - outside
        written = rec.recorded
        last = max((int(n.split(".")[1]) for n in os.listdir(folder) if n.count(".") == 2),
                   default=1)  # fmt: skip
    quarter = max(1, len(samples) // 4)

    def flat(key: str) -> float:
        first = max(s[key] for s in samples[1 : 1 + quarter])  # after the warm-up sample
        last = max(s[key] for s in samples[-quarter:])
        return last / first

    return {
        "retain": retain,
        "records": written,
        "compression": compression,
        "segment_bytes": segment,
        "budget_bytes": budget,
        "rotations": last - 1,
        "engine_ns_per_record": engine_s * 1e9 / written,
        "disk_peak_bytes": max(s["disk"] for s in samples),
        # each sample: the folder's bytes against the budget, and what the
        # writer's /metrics said then (None: not published, retention off)
        "samples": [
            {"disk": s["disk"], **{key: s[key] for key in _WRITER_FIGURES}} for s in samples
        ],
        "within_budget": all(s["disk"] <= budget for s in samples) if retain else None,
        "writer_mb": [s["writer_mb"] for s in samples],
        "engine_mb": [s["engine_mb"] for s in samples],
        "writer_growth": flat("writer_mb"),
        "engine_growth": flat("engine_mb"),
        "scrape_ms": sorted(s["scrape_ms"] for s in samples)[len(samples) // 2],
        "scrape_bytes": samples[-1]["scrape_bytes"],
        "commit_ms_p50": sorted(waits)[len(waits) // 2] * 1e3,
        # the first commit starts the writer process: not a pause of the run
        "commit_ms_max": max(waits[1:]) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--segment", type=int, help="rotate at BYTES (default: the day's)")
    parser.add_argument("--budget", type=int, help="retain BYTES (default: see the docstring)")
    parser.add_argument("--retain-only", action="store_true", help="skip the run without rotation")
    args = parser.parse_args()
    for retain in (True,) if args.retain_only else (False, True):
        print(json.dumps(measure(args.jobs, retain, segment=args.segment, budget=args.budget)))


if __name__ == "__main__":
    main()
