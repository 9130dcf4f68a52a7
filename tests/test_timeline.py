"""kvstate timeline: one request across generations and ranks, or one job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from journal import write_jsonl
from kvstate.codec import to_record
from kvstate.harness.zoo import CASES, run_case
from replay.cli import main


@pytest.fixture
def aba(tmp_path: Path) -> str:
    path = tmp_path / "aba.jsonl"
    write_jsonl((to_record(e) for e in run_case(CASES["req-id-aba"], "legacy").entries or []), path)
    return str(path)


def test_request_timeline_spans_generations_and_marks_violations(
    aba: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["timeline", aba, "--req", "r1", "--json"]) == 1
    line = json.loads(capsys.readouterr().out)
    texts = [r["text"] for r in line["records"]]
    assert texts[0] == "admitted r1/0" and "resumed r1/1" in texts
    assert {r["lane"] for r in line["records"]} == {"scheduler", "rank 0"}
    marked = [code for r in line["records"] for code in r["violations"]]
    assert sorted(marked) == ["PREMATURE_RETIRE", "STALE_GENERATION"]
    assert all(r["record"]["seq"] == r["seq"] for r in line["records"])


def test_job_timeline_includes_its_incarnation(
    aba: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["timeline", aba, "--job", "1", "--json"]) == 1
    kinds = [r["record"]["kind"] for r in json.loads(capsys.readouterr().out)["records"]]
    assert kinds[0] == "job_enqueued"
    assert "job_skipped" in kinds and "request_finished" in kinds
    assert "request_admitted" not in kinds  # r1/0's records are another incarnation


def test_human_timeline_has_lanes(aba: str, capsys: pytest.CaptureFixture[str]) -> None:
    main(["timeline", aba, "--req", "r1"])
    out = capsys.readouterr().out
    assert "Timeline of request r1" in out and "| scheduler" in out and "| rank 0" in out
    assert "saved offset 8 for r1  <- STALE_GENERATION" in out


def test_clean_job_timeline_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ok.jsonl"
    write_jsonl(
        (to_record(e) for e in run_case(CASES["req-id-aba"], "kvstate").entries or []), path
    )
    assert main(["timeline", str(path), "--job", "1"]) == 0
    capsys.readouterr()


def test_an_unknown_id_exits_2_with_near_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.jsonl"
    write_jsonl(
        (to_record(e) for e in run_case(CASES["req-id-aba"], "kvstate").entries or []), path
    )
    assert main(["timeline", str(path), "--req", "r11"]) == 2
    err = capsys.readouterr().err
    assert "no record names request r11; near matches: r1" in err and len(err.splitlines()) == 1
    assert main(["timeline", str(path), "--job", "40"]) == 2
    assert "no record names job 40; near matches: 0, 1" in capsys.readouterr().err
