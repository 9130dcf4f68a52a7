"""``python -m benchmarks --quick`` keeps working: every row, a ratio, files written safely."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
    )


def test_quick_run_measures_every_row_against_its_target(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    measured = [r for r in rows.values() if r["measured"] is not None]
    assert len(measured) >= 6
    for r in measured:
        assert r["measured"] > 0, r
        if r["target"] != "-":  # the fleet row reports a rate with no target
            assert r["ratio"] > 0 and isinstance(r["met"], bool), r
    # The replay rows come from journals actually written and replayed clean.
    assert all(p["violations"] == 0 and p["records"] > 0 for p in report["replay_points"])
    table = (tmp_path / "bench.md").read_text()
    assert all(name in table for name in rows)
    assert "| engine-process CPU per recorded transition, journal on |" in done.stdout
    # Memory is the measured process's own (not the runner's): tiny journals, small peaks.
    assert all(0 < p["peak_mb"] < 200 for p in report["replay_points"])
    # The plots: replay time and memory against length, step cost against batch size.
    for name in ("replay.png", "step.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mixes = [(s["running"], s["mix"]) for s in report["step_overhead"]]
    assert mixes == [(n, m) for n in (64, 256) for m in ("worst", "decode", "prefill")]
    assert all(s["us_per_request"] > 0 for s in report["step_overhead"])
    # What the live ledgers keep per finished job: some bytes, far below a
    # whole job's state (a few KB) since the ledgers park what settled.
    assert 0 < report["live_bytes_per_job"] < 20_000
    assert "bytes per finished job" in table
    assert isinstance(report["live_bytes_per_job_spilled"], float) and "SpillArchive" in table
    # The fleet: 1 and 2 workers over the same runs, the join finding the poison.
    small, big = report["fleets"]
    assert big["requests"] == 60 and big["stores"] == 2 and big["make_seconds"] > 0
    assert small["runs"] < big["runs"] and small["points"][0]["worker_peak_mb"] > 0
    assert [p["workers"] for p in big["points"]] == [1, 2]
    assert big["points"][0]["records"] == big["points"][1]["records"] > 0
    assert big["join"]["rows"] > 0 and "| fleet runs |" in table and "straight line" in table
    # The compressed day: the budget held, rotations made, the scrape timed.
    on, off = report["day"]["on"][0], report["day"]["off"][0]
    assert on["rotations"] >= 10 and on["disk_peak_bytes"] <= on["budget_bytes"]
    assert off["disk_peak_bytes"] > on["budget_bytes"]  # what retention kept off the disk
    assert on["scrape_ms"] > 0 and on["scrape_bytes"] > 1000


def test_results_are_never_overwritten_without_force(tmp_path: Path) -> None:
    (tmp_path / "bench.json").write_text("mine\n")
    done = _run(tmp_path)
    assert done.returncode == 2 and "already exists" in done.stderr
    assert (tmp_path / "bench.json").read_text() == "mine\n"
    assert "| engine-process CPU" not in done.stdout  # refused before measuring anything


def test_the_demo_bound_times_ledger_calls_and_puts_the_classes_back() -> None:
    from benchmarks.bench_demo import measure
    from kvstate import SchedulerLedger, WorkerLedger

    before = (SchedulerLedger.begin_step, WorkerLedger.register)
    got = measure(12, "memory")
    assert (SchedulerLedger.begin_step, WorkerLedger.register) == before
    assert got["clean"] and got["finished"] == 12 and got["store"] == "memory"
    assert got["ledger_calls"] > 100 and 0 < got["ledger_s"] < got["wall_s"]
    assert got["ratio_bound"] == 1 - got["share"] and 0 < got["share"] < 1
    assert "SchedulerLedger.begin_step" in got["slowest_calls"]


def test_the_fleet_row_shrinks_its_runs_to_a_disk_that_cannot_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet row asks for 1,000 runs of 3,000 requests; on a disk that
    cannot hold them twice over it makes shorter runs (and says so in the row)."""
    from benchmarks import bench_fleet

    per_request = bench_fleet.RECORDS_PER_REQUEST * bench_fleet.BYTES_PER_RECORD
    for free in (10**12, 10**9, 10**6, 1):
        usage = types.SimpleNamespace(free=free)
        monkeypatch.setattr(bench_fleet.shutil, "disk_usage", lambda _folder, u=usage: u)
        got = bench_fleet.fitting(3000, 1000, str(tmp_path))
        if 2 * 1000 * 3000 * per_request <= free:
            assert got == 3000
        else:
            assert 1 <= got < 3000
            assert got == 1 or 2 * 1000 * got * per_request <= free


def _updated(tmp_path: Path, which: str, earlier: dict[str, Any]) -> dict[str, Any]:
    """``python -m benchmarks --quick --update WHICH`` on a copy of ``earlier``; the new table."""
    (tmp_path / "bench.json").write_text(json.dumps(earlier))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--update", which, "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads((tmp_path / "bench.json").read_text())
    return report


def test_update_measures_the_days_rows_into_an_earlier_table(tmp_path: Path) -> None:
    """``--update day``: the compressed day's rows measured now and put into a
    table an earlier run wrote; its other rows stay as they were."""
    earlier = json.loads((ROOT / "docs" / "perf" / "bench.json").read_text())
    earlier["rows"] = [r for r in earlier["rows"] if not r["name"].startswith("a day,")]
    report = _updated(tmp_path, "day", earlier)
    days = [r for r in report["rows"] if r["name"].startswith("a day,")]
    assert len(days) == 5 and all(r["measured"] > 0 for r in days)
    assert report["rows"][: len(earlier["rows"])] == earlier["rows"]
    assert "disk at its peak / its retention budget" in (tmp_path / "bench.md").read_text()


def test_update_vllm_puts_every_engine_row_where_the_old_row_was(tmp_path: Path) -> None:
    """``--update vllm``: the rows of kvstate's CPU on vLLM's engine thread
    (Mooncake, the OffloadingConnector, the generic adapter's two) replace, in place, the one row
    of a table from before the rows were named by connector; every other row
    stays as it was. ``--quick`` measures neither (each row then says why),
    so this needs no vLLM."""
    from benchmarks.runner import VLLM_ROW

    earlier = json.loads((ROOT / "docs" / "perf" / "bench.json").read_text())
    engine = [r for r in earlier["rows"] if r["name"].startswith(VLLM_ROW)]
    assert engine, "the table has the vLLM engine rows"
    at = earlier["rows"].index(engine[0])
    old = {**engine[0], "name": VLLM_ROW}  # one row, as tables before had it
    others = [r for r in earlier["rows"] if r not in engine]
    earlier["rows"] = [*others[:at], old, *others[at:]]
    report = _updated(tmp_path, "vllm", earlier)
    fresh = [r for r in report["rows"] if r["name"].startswith(VLLM_ROW)]
    assert [r["name"].removeprefix(VLLM_ROW) for r in fresh] == [
        ", MooncakeStoreConnector",
        ", OffloadingConnector",
        ", ExampleConnector (generic adapter)",
        ", MooncakeConnector P/D decode engine (generic adapter)",
    ]
    assert all(r["measured"] is None and "--quick" in r["note"] for r in fresh)
    assert [r for r in report["rows"] if r not in fresh] == others
    assert report["rows"][at : at + 4] == fresh
