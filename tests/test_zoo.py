"""The bug zoo: every seeded bug, under the legacy policy and the fixed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstate.codec import to_dict
from kvstate.folder import fold_all
from kvstate.harness.zoo import CASES, run_case
from replay.cli import main


def fold(case_name: str, policy: str):  # type: ignore[no-untyped-def]
    recorder = run_case(CASES[case_name], policy)
    entries = recorder.entries or []
    found = [v for v in fold_all(entries) if not v.is_warning]
    return entries, found


@pytest.mark.parametrize("name", sorted(CASES))
def test_legacy_journal_is_flagged_with_the_right_code_at_the_right_record(name: str) -> None:
    case = CASES[name]
    entries, found = fold(name, "legacy")
    assert found, f"{name}: the legacy journal replayed clean"
    first = found[0]
    assert first.code.value == case.expected
    assert entries[first.seq - 1].event.kind == case.at_kind


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixed_twin_replays_clean(name: str) -> None:
    entries, found = fold(name, "kvstate")
    assert found == []
    assert entries[-1].event.kind == "engine_idle"


def test_poisoned_read_also_poisons_the_store() -> None:
    entries, found = fold("poisoned-read", "legacy")
    poisoned = [v for v in found if v.code.value == "POISONED_KEY"]
    assert {v.key for v in poisoned} == {"m@r1:0", "m@r1:1"}
    audits = [e.event for e in entries if e.event.kind == "key_verified"]
    assert all(a.ok for a in audits if a.key.startswith("m@r0"))


def test_the_aba_drops_the_new_generations_save() -> None:
    entries, _ = fold("req-id-aba", "legacy")
    skipped = [e.event for e in entries if e.event.kind == "job_skipped"]
    assert [(s.job, s.reason) for s in skipped] == [(1, "stale")]


def test_cases_are_deterministic() -> None:
    for name in CASES:
        a = [to_dict(e) for e in run_case(CASES[name], "legacy").entries or []]
        b = [to_dict(e) for e in run_case(CASES[name], "legacy").entries or []]
        assert a == b


def test_zoo_command_writes_journals_that_replay_as_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["zoo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in CASES:
        assert name in out
        legacy, fixed = tmp_path / f"{name}.legacy.jsonl", tmp_path / f"{name}.kvstate.jsonl"
        assert main(["replay", "--json", str(fixed)]) == 0
        capsys.readouterr()
        assert main(["replay", "--json", str(legacy)]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["violations"][0]["code"] == CASES[name].expected


def test_zoo_without_out_never_stops_on_an_earlier_run_and_shows_whole_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["zoo"]) == 0
    first = capsys.readouterr().out
    assert main(["zoo", "poisoned-read"]) == 0  # the first run's journals stay, untouched
    second = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo", "zoo-2"]
    assert "zoo-2/poisoned-read.legacy.jsonl" in " ".join(second.split())
    assert len(list((tmp_path / "zoo").iterdir())) == 2 * len(CASES)
    for name in CASES:  # at 80 columns, every name whole (it is what one types next)
        assert name in first, first


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_docs_table_says_what_the_legacy_journal_gives(name: str) -> None:
    """docs/bug-zoo.md's row of each case names its code, seq and record kind."""
    entries, found = fold(name, "legacy")
    first = found[0]
    kind = entries[first.seq - 1].event.kind
    docs = (Path(__file__).resolve().parent.parent / "docs" / "bug-zoo.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith(f"| `{name}` |"))
    assert f"`{first.code.value}` at seq {first.seq} (`{kind}`)" in row
