"""The human report explains the first violation, draws its chain as lanes,
and groups violations of one root cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from journal import write_jsonl
from kvstate.codec import to_record
from kvstate.harness.zoo import CASES, run_case
from kvstate.violations import Code, Violation
from replay.cli import main
from replay.explain import group


def zoo_journal(tmp_path: Path, name: str, policy: str = "legacy") -> str:
    path = tmp_path / f"{name}.{policy}.jsonl"
    write_jsonl((to_record(e) for e in run_case(CASES[name], policy).entries or []), path)
    return str(path)


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    main(["replay", *argv])
    return capsys.readouterr().out


def test_first_violation_is_told_as_a_story_with_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = report(capsys, zoo_journal(tmp_path, "poisoned-read"))
    assert "First violation: POISONED_READ at seq 12" in out
    for phrase in (
        "Job 0 of request r1 (generation 0) read block 2 on rank 0",
        "at seq 8 (preempted r1/0) it lost its last holder",
        "at seq 10 (r2/0 appends blocks [2, 3]) it was handed to another request",
        "The job pinned []",
    ):
        assert phrase in " ".join(out.split()), phrase
    timeline = out[out.index("Timeline") : out.index("Root causes")]
    assert "scheduler" in timeline and "rank 0" in timeline
    assert "<- POISONED_READ" in timeline
    assert "job 0 of r1/0 enqueued" in timeline


def test_violations_are_grouped_by_root_cause_and_all_lists_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = zoo_journal(tmp_path, "poisoned-read")
    grouped = report(capsys, path)
    # one poisoned job: its two poisoned reads and the two keys they poisoned
    assert "from 1 root cause(s)" in grouped
    causes = grouped[grouped.index("Root causes") :]
    assert causes.count("poisoned job 0 of r1/0") == 1
    assert "POISONED_READ ×2" in causes and "POISONED_KEY ×2" in causes
    every = report(capsys, "--all", path)
    rows = [line for line in every.splitlines() if "POISONED_READ" in line and "| 0 " in line]
    assert len(rows) == 2


def test_piped_report_is_plain_ascii(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = report(capsys, zoo_journal(tmp_path, "req-id-aba"))
    table_part = out[out.index("Timeline") :]
    assert all(ord(ch) < 128 for ch in table_part.replace("→", "").replace("×", ""))
    assert "\x1b[" not in out  # no colour codes when not a terminal


def test_stale_generation_story_names_what_made_it_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = " ".join(report(capsys, zoo_journal(tmp_path, "req-id-aba")).split())
    assert "job 0 of r1/0 changed request state for r1" in out
    assert "the rank already knew that generation was over" in out


def test_clean_journal_has_no_story(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = report(capsys, zoo_journal(tmp_path, "poisoned-read", "kvstate"))
    assert "verdict: clean" in out and "First violation" not in out


def test_grouping_key_is_code_and_chain() -> None:
    a = Violation(Code.POISONED_READ, 9, "m", (1, 4, 6), job=0, block=2)
    b = Violation(Code.POISONED_READ, 9, "m", (1, 4, 6), job=0, block=3)
    c = Violation(Code.POISONED_READ, 11, "m", (2, 5, 7), job=1, block=2)
    d = Violation(Code.CRASH, 12, "m")
    groups = group([a, b, c, d])
    assert [len(g.members) for g in groups] == [2, 1, 1]


def test_the_report_leads_with_a_summary_by_code_in_the_documented_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = report(capsys, zoo_journal(tmp_path, "poisoned-read"))
    summary = out[out.index("Summary by code") : out.index("First violation")]
    codes = [c for c in ("POISONED_READ", "POISONED_KEY") if c in summary]
    assert codes == ["POISONED_READ", "POISONED_KEY"]  # the order of docs/events.md's table
    assert summary.index("POISONED_READ") < summary.index("POISONED_KEY")


def test_limit_caps_the_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = zoo_journal(tmp_path, "poisoned-read")
    out = report(capsys, "--all", "--limit", "1", path)
    assert "the first 1 of 4; --limit N for more" in out


def test_the_report_honours_columns_and_has_no_trailing_spaces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = zoo_journal(tmp_path, "req-id-aba")
    widths = {}
    for width in ("72", "130", None):
        if width is None:
            monkeypatch.delenv("COLUMNS")  # piped with nothing said: 80, as a terminal
        else:
            monkeypatch.setenv("COLUMNS", width)
        out = report(capsys, path)
        lines = out.splitlines()
        widths[width] = max(len(line) for line in lines)
        assert all(line == line.rstrip() for line in lines)
    assert widths["72"] <= 72 and widths["130"] <= 130 and widths[None] <= 80
    assert widths["130"] > 80  # the report does use the width it is given


def test_merged_reports_name_each_records_file_and_own_seq(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    text = Path(zoo_journal(tmp_path, "poisoned-read")).read_text()
    records = [json.loads(line) for line in text.splitlines()]
    sched = [r for r in records if "rank" not in r]
    ranks = [r for r in records if "rank" in r]
    for i, r in enumerate(sched, 1):
        r["seq"] = i
    header = dict(sched[0])
    for i, r in enumerate([header, *ranks], 1):
        r["seq"] = i
    a, b = tmp_path / "sched.jsonl", tmp_path / "rank0.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in sched))
    b.write_text("".join(json.dumps(r) + "\n" for r in [header, *ranks]))
    out = report(capsys, str(a), str(b))
    timeline = out[out.index("Timeline") : out.index("Root causes")]
    assert "sched.jsonl:" in timeline and "rank0.jsonl:" in timeline
