"""kvstate export: a Perfetto trace with a valid trace-event structure, and JSON Lines."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from journal import write_jsonl
from kvstate.codec import to_record
from kvstate.harness.zoo import CASES, run_case
from replay.cli import main
from replay.sources import read_path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def validate(trace: dict) -> list[dict]:
    """Check the Chrome trace-event rules Perfetto relies on; return the events."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    open_async: dict[tuple[str, str], int] = defaultdict(int)
    for e in events:
        assert e["ph"] in {"M", "X", "i", "b", "e"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["name"], str) and e["name"]
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "process_sort_index", "thread_name"}
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in {"t", "p", "g"}
        if e["ph"] in {"b", "e"}:
            key = (e["cat"], e["id"])
            open_async[key] += 1 if e["ph"] == "b" else -1
            assert open_async[key] >= 0, f"{key} ends before it begins"
    assert all(n == 0 for n in open_async.values()), "unbalanced async spans"
    return events


def export(tmp_path: Path, capsys: pytest.CaptureFixture[str], *paths: str) -> dict:
    out = tmp_path / "trace.json"
    assert main(["export", *paths, "--format", "perfetto", str(out)]) == 0
    assert "ui.perfetto.dev" in capsys.readouterr().out
    return json.loads(out.read_text())


def test_clean_two_rank_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = validate(export(tmp_path, capsys, str(EXAMPLES / "clean.jsonl")))
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"scheduler", "rank 0", "rank 1"}
    jobs = [e for e in events if e["ph"] == "b" and e["cat"] == "job"]
    assert sorted((e["name"], e["pid"]) for e in jobs) == [
        ("job 0", 2), ("job 0", 3), ("job 1", 2), ("job 1", 3)
    ]  # fmt: skip
    slices = sorted(e["name"] for e in events if e["ph"] == "X")
    assert slices == ["DMA job 1", "DMA job 1", "put job 1", "put job 1"]
    markers = {e["name"] for e in events if e["ph"] == "i"}
    assert {"preempted r1/0", "resumed r1/1", "finished r1/1"} <= markers
    assert not any(e.get("cat") == "violation" for e in events)


def test_violations_are_markers_on_their_lane(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "poison.jsonl"
    write_jsonl(
        (to_record(e) for e in run_case(CASES["poisoned-read"], "legacy").entries or []), path
    )
    events = validate(export(tmp_path, capsys, str(path)))
    marks = [e for e in events if e.get("cat") == "violation"]
    assert [m["name"] for m in marks][:2] == ["VIOLATION POISONED_READ"] * 2
    assert marks[0]["pid"] == 2  # rank 0's process: the DMA record raised it
    assert marks[0]["args"]["chain"] and "epoch" in marks[0]["args"]["message"]


def test_unfinished_spans_are_closed_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = validate(export(tmp_path, capsys, str(EXAMPLES / "stale_generation.jsonl")))
    assert any(e["ph"] == "e" and e["name"] == "job 1" for e in events)


def test_jsonl_export_keeps_every_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    src = EXAMPLES / "clean.jsonl"
    assert main(["export", str(src), "--format", "jsonl", str(out)]) == 0
    assert [i.entry for i in read_path(out)] == [i.entry for i in read_path(src)]
    assert main(["export", str(src), "--format", "jsonl", str(out)]) == 2  # no overwrite
