"""No command destroys a file: every output is a temporary file renamed into
place, an existing output is refused unless --force, and a failure leaves
the old file byte for byte (issue: `export` twice deleted its own output,
`convert` onto an existing journal deleted the journal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from journal import OutputExists, atomic_output, journal_output
from replay import replay
from replay.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
POISONED = str(EXAMPLES / "poisoned_read.jsonl")
CLEAN = str(EXAMPLES / "clean.jsonl")


def victim(path: Path, content: bytes = b"precious bytes\x00\xff") -> bytes:
    path.write_bytes(content)
    return content


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize(
    "argv",
    [
        ["export", POISONED, "--format", "perfetto", "{out}"],
        ["export", POISONED, "--format", "jsonl", "{out}"],
        ["convert", CLEAN, "{out}"],
        ["replay", POISONED, "--minimize", "{out}"],
        ["run", "--requests", "4", "--journal", "{out}"],
    ],
    ids=["export-perfetto", "export-jsonl", "convert", "minimize", "run"],
)
def test_an_existing_output_is_refused_and_kept(tmp_path: Path, argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out.file"
    before = victim(out)
    status = main([a.format(out=out) for a in argv])
    assert status == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["export", POISONED, "--format", "jsonl", "{out}", "--force"],
        ["convert", CLEAN, "{out}", "--force"],
        ["replay", POISONED, "--minimize", "{out}", "--force"],
    ],
    ids=["export", "convert", "minimize"],
)
def test_force_replaces_with_a_complete_file(tmp_path: Path, argv: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    before = victim(out)
    assert main([a.format(out=out) for a in argv]) in (0, 1)
    after = out.read_bytes()
    assert after != before and after.endswith(b"\n")
    assert leftovers(tmp_path) == []


def test_running_export_twice_keeps_the_first_output(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["export", POISONED, "--format", "perfetto", str(out)]) == 0
    first = out.read_bytes()
    assert main(["export", POISONED, "--format", "perfetto", str(out)]) == 2
    assert out.read_bytes() == first


def test_a_failing_forced_write_leaves_the_old_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"kind":"journal_opened","version":1,"block_size":4,"world_size":1,"step":0}\n{oops\n'
    )
    for argv in (
        ["convert", str(bad), str(tmp_path / "j.db"), "--force"],
        ["export", str(bad), "--format", "jsonl", str(tmp_path / "j.db"), "--force"],
    ):
        out = tmp_path / "j.db"
        before = victim(out)
        assert main(argv) == 2
        assert out.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_convert_onto_an_existing_journal_keeps_it(tmp_path: Path) -> None:
    journal = tmp_path / "victim.db"
    assert main(["convert", POISONED, str(journal)]) == 0
    before = journal.read_bytes()
    assert main(["convert", CLEAN, str(journal)]) == 2
    assert journal.read_bytes() == before


def test_zoo_refuses_existing_journals(tmp_path: Path) -> None:
    folder = tmp_path / "zoo"
    folder.mkdir()
    mine = folder / "poisoned-read.legacy.jsonl"
    before = victim(mine)
    assert main(["zoo", "poisoned-read", "--out", str(folder)]) == 2
    assert mine.read_bytes() == before
    assert main(["zoo", "poisoned-read", "--out", str(folder), "--force"]) == 0
    assert mine.read_bytes() != before


def test_demo_refuses_existing_journals(tmp_path: Path) -> None:
    (tmp_path / "legacy.db").write_bytes(b"mine")
    status = main(["demo", "--out", str(tmp_path), "--store", "memory", "--requests", "8"])
    assert status == 2
    assert (tmp_path / "legacy.db").read_bytes() == b"mine"
    assert not (tmp_path / "kvstate.db").exists()


def test_atomic_output_removes_only_its_own_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "o.txt"
    neighbour = tmp_path / ".o.txt.unrelated.tmp"
    neighbour.write_text("not ours")
    with pytest.raises(RuntimeError), atomic_output(out) as tmp:
        Path(tmp).write_text("half")
        raise RuntimeError("writer failed")
    assert not out.exists()
    assert neighbour.read_text() == "not ours"
    assert leftovers(tmp_path) == [neighbour.name]


def test_atomic_output_does_not_replace_a_file_that_appears_meanwhile(tmp_path: Path) -> None:
    out = tmp_path / "o.txt"
    with pytest.raises(OutputExists), atomic_output(out) as tmp:
        Path(tmp).write_text("new")
        out.write_text("someone else's")
    assert out.read_text() == "someone else's"


def test_an_interrupted_run_publishes_its_journal(tmp_path: Path) -> None:
    out = tmp_path / "run.db"
    with pytest.raises(KeyboardInterrupt), atomic_output(out, keep_on_interrupt=True) as tmp:
        Path(tmp).write_text("records so far")
        raise KeyboardInterrupt
    assert out.read_text() == "records so far"
    assert os.listdir(tmp_path) == ["run.db"]


def test_a_new_journal_is_written_under_its_own_name(tmp_path: Path) -> None:
    out = tmp_path / "run.db"
    with pytest.raises(RuntimeError), journal_output(out) as where:
        assert where == str(out)  # nothing to protect: the run writes in place
        Path(where).write_text("records so far")
        raise RuntimeError("the run failed")
    assert out.read_text() == "records so far"  # the evidence stays


def test_a_forced_replacement_goes_beside_and_then_over_the_old_journal(tmp_path: Path) -> None:
    out = tmp_path / "run.db"
    out.write_text("old run")
    with journal_output(out, force=True) as where:
        assert where == f"{out}.new" and out.read_text() == "old run"
        Path(where).write_text("new run")
    assert out.read_text() == "new run" and os.listdir(tmp_path) == ["run.db"]
    (tmp_path / "run.db.new").write_text("left by a killed run")
    refused = journal_output(out, force=True)
    with pytest.raises(OutputExists, match=r"run\.db\.new: already exists"), refused:
        pass
    assert (tmp_path / "run.db.new").read_text() == "left by a killed run"


def _kill_mid_run(argv: list[str], journal: Path, cwd: Path) -> None:
    """Start ``kvstate run``, SIGKILL it once ``journal`` holds records."""
    import contextlib
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "replay", *argv], cwd=cwd, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        while proc.poll() is None:  # progress, not a clock: until records are committed
            n = 0
            with contextlib.suppress(sqlite3.Error):
                conn = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
                try:  # closed at once: an open reader keeps the -wal behind
                    n = conn.execute("SELECT count(*) FROM records").fetchone()[0]
                finally:
                    conn.close()
            if n > 50:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                _writer_gone(journal)
                return
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raise AssertionError("the run finished before it could be killed: make it longer")


def _writer_gone(journal: Path) -> None:
    """Wait for the journal's writer process, which outlives the killed run
    to write what it was handed and end the journal (a grandchild: found
    by its command line)."""
    import time

    def writing() -> bool:
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"_writer_program" in cmdline and str(journal).encode() in cmdline and state != "Z":
                return True
        return False

    while writing():
        time.sleep(0.05)


def _killed(result: object) -> bool:
    """How replay reads a killed run: its writer process wrote what it was
    handed and ended the journal with engine_crashed (CRASH, the only finding)."""
    from kvstate.violations import Code

    found = result.violations  # type: ignore[attr-defined]
    return [v.code for v in found] == [Code.CRASH] and "without closing its journal" in str(
        found[0].message
    )


def test_a_sigkilled_run_leaves_its_journal_where_the_user_looks(tmp_path: Path) -> None:
    journal = tmp_path / "run.db"
    argv = ["run", "--journal", str(journal), "--requests", "4000"]
    _kill_mid_run(argv, journal, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [
        "run.db"
    ]
    result = replay([str(journal)])
    assert _killed(result) and result.events > 50


def test_a_sigkilled_forced_run_keeps_the_old_journal_and_the_new_beside_it(tmp_path: Path) -> None:
    journal = tmp_path / "run.db"
    assert main(["run", "--journal", str(journal), "--requests", "8"]) == 0
    before = journal.read_bytes()
    argv = ["run", "--journal", str(journal), "--requests", "4000", "--force"]
    _kill_mid_run(argv, Path(f"{journal}.new"), tmp_path)
    assert journal.read_bytes() == before  # the old run, untouched
    assert _killed(replay([f"{journal}.new"]))  # the killed one, findable by its documented name
