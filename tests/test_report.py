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
    timeline = out[out.index("Timeline") : out.index("Violations, one row")]
    assert "scheduler" in timeline and "rank 0" in timeline
    assert "<- POISONED_READ" in timeline
    assert "job 0 of r1/0 enqueued" in timeline


def test_violations_are_grouped_by_root_cause_and_all_lists_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = zoo_journal(tmp_path, "poisoned-read")
    grouped = report(capsys, path)
    assert "from 2 root cause(s)" in grouped
    rows = [line for line in grouped.splitlines() if "| POISONED_READ |" in line]
    assert len(rows) == 1 and "|     2 |" in rows[0]
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
