"""`kvstate replay` and `kvstate convert` as a user runs them: exit statuses,
the JSON object of docs/events.md, "The command line", --at, merged journals, and clear errors
for unusable input."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from replay.cli import main
from replay.sources import read_path
from tests.builder import JournalBuilder

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_clean_example_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "replay", str(EXAMPLES / "clean.jsonl"))
    assert status == 0 and "clean" in out


def test_json_report_shape(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "replay", "--json", str(EXAMPLES / "poisoned_read.jsonl"))
    report = json.loads(out)
    assert status == 1
    assert report["verdict"] == "violations" and report["events"] == 17
    assert report["warnings"] == []
    first = report["violations"][0]
    assert {"code", "seq", "message", "chain"} <= first.keys()
    assert (first["code"], first["seq"], first["job"], first["block"]) == (
        "POISONED_READ",
        10,
        0,
        5,
    )
    assert first["chain"] == [4, 6, 8]
    assert [v["code"] for v in report["violations"]] == [
        "POISONED_READ",
        "POISONED_READ",
        "POISONED_KEY",
    ]


def test_human_report_lists_code_seq_entities_and_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "replay", str(EXAMPLES / "stale_generation.jsonl"))
    assert status == 1
    for text in ("STALE_GENERATION", "PREMATURE_RETIRE", "stale job 0", "chain: 4 → 5 → 10"):
        assert text in out


def test_at_prints_the_ledger_as_it_stood(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "clean.jsonl")
    status, out, _ = run(capsys, "replay", "--json", "--at", "7", path)
    report = json.loads(out)
    assert status == 0 and report["at"] == 7 and report["events"] == 7
    ledger = report["ledger"]
    assert ledger["requests"]["r1"]["0"]["state"] == "preempted"
    assert ledger["blocks"]["0"]["refs"] == 1  # held by job 0's pin only
    status, out, _ = run(capsys, "replay", "--json", "--at", "36", path)
    ledger = json.loads(out)["ledger"]
    assert ledger["jobs"]["1"]["released"] is True
    assert ledger["ranks"]["0"]["requests"]["r1"]["saved_offset"] == 8
    status, out, _ = run(capsys, "replay", "--at", "7", path)
    assert "ledger after seq 7" in out and "preempted" in out


def test_at_counts_only_violations_up_to_seq(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(EXAMPLES / "poisoned_read.jsonl")
    assert run(capsys, "replay", "--at", "9", "--json", path)[0] == 0
    assert run(capsys, "replay", "--at", "10", "--json", path)[0] == 1


@pytest.mark.parametrize(
    ("lines", "where", "message"),
    [
        (
            ['{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0}', "{"],
            ":2",
            "not valid JSON",
        ),
        (
            [
                '{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0}',
                '{"kind":"job_teleported","step":0}',
            ],
            ":2",
            "unknown kind",
        ),
        (
            ['{"kind":"journal_opened","version":2,"block_size":4,"world_size":1,"step":0}'],
            ":1",
            "unknown journal version 2",
        ),
        (['{"kind":"engine_idle","step":0}'], ":1", "first record must be journal_opened"),
        (
            [
                '{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0,"seq":3}',
                '{"kind":"engine_idle","step":0,"seq":3}',
            ],
            ":2",
            "does not increase",
        ),
        (
            [
                '{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0}',
                '{"kind":"job_started","step":0,"job":1}',
            ],
            ":2",
            "needs 'rank'",
        ),
        ([], "", "journal is empty"),
    ],
)
def test_unusable_input_exits_2_naming_file_and_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], where: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    status, out, err = run(capsys, "replay", str(path))
    assert status == 2
    assert f"{path}{where}" in err and message in err
    assert "Traceback" not in err and out == ""
    status, out, err = run(capsys, "replay", "--json", str(path))
    assert status == 2 and json.loads(out)["verdict"] == "unusable"


def test_unreadable_and_tampered_databases_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "replay", str(tmp_path / "missing.db"))[0] == 2
    assert run(capsys, "replay", str(tmp_path))[0] == 2
    db = tmp_path / "run.db"
    assert run(capsys, "convert", str(EXAMPLES / "clean.jsonl"), str(db))[0] == 0
    conn = sqlite3.connect(db)
    conn.execute("DROP TRIGGER records_refuse_update")
    conn.execute("UPDATE records SET step = 7 WHERE seq = 12")
    conn.commit()
    conn.close()
    status, _, err = run(capsys, "replay", str(db))
    assert status == 2 and "hash chain" in err
    # the error names the commit that holds seq 12, by its first seq and its range
    first, last = map(int, re.search(r"commit of seqs (\d+)\.\.(\d+)", err).groups())  # type: ignore[union-attr]
    assert first <= 12 <= last and f"{db} (seq {first})" in err


def test_convert_round_trip_and_database_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = EXAMPLES / "stale_generation.jsonl"
    db, back = tmp_path / "j.db", tmp_path / "back.jsonl"
    assert run(capsys, "convert", str(src), str(db))[0] == 0
    assert run(capsys, "convert", str(db), str(back))[0] == 0
    # the same records; optional fields at their default (parent: null) are omitted
    assert [e.entry for e in read_path(back)] == [e.entry for e in read_path(src)]
    assert run(capsys, "convert", str(back), str(tmp_path / "again.db"))[0] == 0
    assert run(capsys, "convert", str(tmp_path / "again.db"), str(tmp_path / "again.jsonl"))[0] == 0
    assert (tmp_path / "again.jsonl").read_text() == back.read_text()
    a = json.loads(run(capsys, "replay", "--json", str(src))[1])
    b = json.loads(run(capsys, "replay", "--json", str(db))[1])
    assert a == b
    assert run(capsys, "convert", str(src), str(db))[0] == 2  # refuses to overwrite


def split_by_process(records: list[dict], tmp_path: Path) -> list[str]:
    """One file per process (scheduler, each rank), each with its own header and seqs."""
    header = records[0]
    groups: dict[str, list[dict]] = {}
    for ts, record in enumerate(records[1:], 1):
        name = "sched" if "rank" not in record else f"rank{record['rank']}"
        groups.setdefault(name, []).append({**record, "ts": 1000 + ts})
    paths = []
    for name, items in sorted(groups.items()):
        path = tmp_path / f"{name}.jsonl"
        lines = [{**header, "seq": 1, "ts": 0}] + [{**r, "seq": i} for i, r in enumerate(items, 2)]
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
        paths.append(str(path))
    return paths


def test_several_journals_merge_by_ts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = [json.loads(line) for line in (EXAMPLES / "clean.jsonl").read_text().splitlines()]
    paths = split_by_process(records, tmp_path)
    status, out, _ = run(capsys, "replay", "--json", *paths)
    report = json.loads(out)
    assert status == 0 and report["merged"] == paths
    assert report["events"] == len(records) + len(paths) - 1  # one header per file

    poisoned = [
        json.loads(line) for line in (EXAMPLES / "poisoned_read.jsonl").read_text().splitlines()
    ]
    (tmp_path / "p").mkdir()
    paths = split_by_process(poisoned, tmp_path / "p")
    report = json.loads(run(capsys, "replay", "--json", *paths)[1])
    first = report["violations"][0]
    assert first["code"] == "POISONED_READ" and first["file"].endswith("rank0.jsonl")
    assert first["file_seq"] == 4  # header, job_received, job_started, then dma_started


def test_merge_without_ts_concatenates_in_the_order_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sched = JournalBuilder()
    sched.admit("a", blocks=[1])
    sched.enqueue(0, "a", 0, reads=[1])
    rank = JournalBuilder()
    rank.run(0)
    a, b = sched.write(tmp_path / "a.jsonl"), rank.write(tmp_path / "b.jsonl")
    assert run(capsys, "replay", str(a), str(b))[0] == 0
    status, out, _ = run(capsys, "replay", "--json", str(b), str(a))
    assert status == 1 and json.loads(out)["violations"][0]["code"] == "CAUSALITY"


def test_merged_headers_must_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = JournalBuilder(world_size=1).write(tmp_path / "a.jsonl")
    b = JournalBuilder(world_size=2).write(tmp_path / "b.jsonl")
    status, _, err = run(capsys, "replay", str(a), str(b))
    assert status == 2 and "world_size=2" in err


def test_strings_from_the_journal_are_not_markup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    j = JournalBuilder()
    j.admit("[red]x[/red]", blocks=[1])
    j.add("engine_crashed", error="[bold]boom[/bold]")
    status, out, _ = run(capsys, "replay", str(j.write(tmp_path / "m.jsonl")))
    assert status == 1 and "[bold]boom[/bold]" in out
    status, out, _ = run(capsys, "replay", "--at", "3", str(tmp_path / "m.jsonl"))
    assert "[red]x[/red]" in out


def test_installed_command_reports_without_traceback(tmp_path: Path) -> None:
    exe = shutil.which("kvstate") or str(Path(sys.executable).parent / "kvstate")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0}\n{"kind":"x","step":0}\n'
    )
    proc = subprocess.run([exe, "replay", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"{bad}:2" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([exe, "replay", str(EXAMPLES / "clean.jsonl")], capture_output=True)
    assert proc.returncode == 0


def test_version_names_the_installed_release(capsys) -> None:  # type: ignore[no-untyped-def]
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvstate {version('kvstate')}"


def test_at_past_the_end_says_so(capsys) -> None:  # type: ignore[no-untyped-def]
    clean = str(Path(__file__).resolve().parent.parent / "examples" / "clean.jsonl")
    last = sum(1 for line in Path(clean).read_text().splitlines() if line.strip())
    assert main(["replay", "--at", "9999", clean]) == 0
    err = capsys.readouterr().err
    assert f"--at 9999 is past the last record (seq {last})" in err
    assert main(["replay", "--at", "3", clean]) == 0
    assert "past the last record" not in capsys.readouterr().err


def test_replay_reads_a_journal_once_for_its_verdict_and_its_story(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fold keeps the first violation's records as it reads them; the
    report no longer reads the journal a second time for them."""
    from replay import sources
    from replay.cli import replay as replay_command

    opened: list[str] = []
    read_path = sources.read_path

    def counted(path, **kw):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return read_path(path, **kw)

    monkeypatch.setattr(sources, "read_path", counted)
    monkeypatch.setattr(replay_command, "collect", lambda *a: pytest.fail("read again"))
    example = Path(__file__).resolve().parent.parent / "examples" / "poisoned_read.jsonl"
    assert main(["replay", str(example)]) == 1
    out = capsys.readouterr().out
    assert opened == [str(example)]
    assert "POISONED_READ" in out


def test_a_database_is_opened_once_for_its_progress_total_and_its_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The progress bar's total came from a connection of its own, before the
    fold opened the journal again; now the fold's reader says it."""
    from journal import segments
    from replay import sources
    from replay.verdict import replay

    db = tmp_path / "j.db"
    assert run(capsys, "convert", str(EXAMPLES / "poisoned_read.jsonl"), str(db))[0] == 0
    opened: list[str] = []
    journal_class = segments.Journal

    def counted(path, **kw):  # type: ignore[no-untyped-def]
        opened.append(str(path))
        return journal_class(path, **kw)

    # the reader opens a journal's segments, the first of them once
    monkeypatch.setattr(segments, "Journal", counted)
    sized, done = sources.Sized(), []
    result = replay([str(db)], progress=done.append, sized=sized)
    assert opened == [str(db)]
    assert (
        sized.total
        == result.events
        == len((EXAMPLES / "poisoned_read.jsonl").read_text().splitlines())
    )
    assert result.exit_status == 1 and done


def test_a_journal_too_long_to_keep_reads_its_story_again(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from replay import verdict as engine

    example = Path(__file__).resolve().parent.parent / "examples" / "poisoned_read.jsonl"
    assert main(["replay", str(example)]) == 1
    kept = capsys.readouterr().out
    monkeypatch.setattr(engine, "STORY_WINDOW", 2)  # nothing kept past two records
    assert engine.replay([str(example)]).story is None
    assert main(["replay", str(example)]) == 1
    assert capsys.readouterr().out == kept  # the same report, its records read again


def test_at_zero_is_the_ledger_before_the_first_record_not_an_empty_journal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--at 0 said "journal is empty": the fold checked for a header a second
    time, after the reader (replay.sources.checked) had already."""
    example = Path(__file__).resolve().parent.parent / "examples" / "clean.jsonl"
    assert main(["replay", "--json", "--at", "0", str(example)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["events"] == 0 and report["ledger"]["records"] == 0
