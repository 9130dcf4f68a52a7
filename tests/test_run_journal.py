"""``kvstate run``'s journal: its folder, rotation and retention, and one deleted under it.

* The journal's folder is made (docs/ops.md's first example writes
  ``journals/NAME.db`` in an empty folder); nothing else is.
* ``--rotate-bytes`` / ``--rotate-seconds`` / ``--retain-bytes`` /
  ``--retain-seconds`` are ``Recorder.open``'s: the legacy run (203
  violations) kept within 400 KB loses its head, and its summary and verdict
  go on from the checkpoint to the findings of the run kept whole. A
  setting refused is exit 2, one line, before any file or folder is made.
* ``kvstate timeline`` of a request whose records retention removed says
  so, and never offers the request's own name as a near match.
* A journal deleted (or moved) while the run writes it ends the run with
  exit 2 and a line naming the file, not "no such journal".
* ``--force`` never replaces one file of a rotated journal, nor writes a
  rotated journal over an existing one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from journal import segments
from replay.cli import main

ROOT = Path(__file__).resolve().parent.parent
LEGACY = ["--policy", "legacy", "--seed", "3", "--requests", "40"]
KEPT = ["--rotate-bytes", "131072", "--retain-bytes", "400000"]


def _replay_rows(out: str) -> list[str]:
    """The summary table's findings, one line each (``replay: CODE N``)."""
    return [" ".join(line.split()) for line in out.splitlines() if "replay:" in line]


@pytest.fixture(scope="module")
def retained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, str]:
    """The legacy run written whole, and again rotated and retained; each
    with what ``kvstate run`` printed."""
    folder = tmp_path_factory.mktemp("run")
    outs = []
    for name, extra in (("plain", []), ("kept", KEPT)):
        path = folder / name / "legacy.db"
        done = subprocess.run(
            [sys.executable, "-m", "replay", "run", "--journal", str(path), *LEGACY, *extra],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1, done.stderr  # violations
        outs.append(done.stdout)
    return folder / "plain" / "legacy.db", folder / "kept" / "legacy.db", outs[0], outs[1]


def test_the_first_example_of_ops_md_runs_in_an_empty_folder(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "ops.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S) if "kvstate run" in b)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in block.strip().splitlines():
        done = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode in (0, 1), (command, done.stderr)  # clean or violations
        assert "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in (tmp_path / "journals").iterdir()) == ["fixed.db", "legacy.db"]


def test_a_retained_run_goes_on_from_its_checkpoint_to_the_whole_runs_findings(
    retained: tuple[Path, Path, str, str],
) -> None:
    _, kept, whole, cut = retained
    assert not kept.exists() and len(segments.later_segments(str(kept))) >= 2  # head removed
    assert _replay_rows(cut) == _replay_rows(whole) and len(_replay_rows(whole)) == 5
    assert "203 violation(s)" in " ".join(cut.split()) and "FROM_CHECKPOINT" in cut
    assert "FROM_CHECKPOINT" not in whole


@pytest.mark.parametrize(
    "options",
    [
        ["--retain-bytes", "400000"],
        ["--retain-seconds", "60"],
        ["--rotate-bytes", "131072", "--retain-bytes", "131072"],
        ["--engines", "2", "--bulk", *KEPT],
        ["--rotate-bytes", "0"],
        ["--retain-seconds", "-1", "--rotate-seconds", "60"],
    ],
    ids=["no-rotation", "age-no-rotation", "budget-under-two", "bulk", "zero", "negative"],
)
def test_a_refused_setting_is_one_line_and_exit_2_before_any_file(
    options: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "journals" / "run.db"
    try:
        status = main(["run", "--journal", str(journal), "--requests", "2", *options])
    except SystemExit as exc:  # argparse's refusal of a value
        status = int(str(exc.code))
    err = capsys.readouterr().err
    assert status == 2 and "kvstate: error:" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # not even the folder


def test_a_rotated_journal_never_replaces_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "run.db"
    assert main(["run", "--journal", str(journal), "--requests", "2"]) == 0
    before = journal.read_bytes()
    capsys.readouterr()
    argv = ["run", "--journal", str(journal), "--requests", "2", "--force", *KEPT]
    assert main(argv) == 2
    assert "never written over another" in capsys.readouterr().err
    assert journal.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["run.db"]


def test_force_never_replaces_the_first_segment_of_a_rotated_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its later segments would then follow neither journal: the old one
    lost its head, and the new one is unreadable past its own file."""
    journal = tmp_path / "run.db"
    argv = ["run", "--journal", str(journal), *LEGACY, "--rotate-bytes", "65536"]
    assert main(argv) == 1
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(files) > 2
    capsys.readouterr()
    assert main(["run", "--journal", str(journal), "--requests", "2", "--force"]) == 2
    assert "has later segments (it rotated)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files


def test_timeline_of_a_request_whose_records_retention_removed_says_so(
    retained: tuple[Path, Path, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from replay.sources import entries
    from replay.verdict import replay

    plain, kept, _, _ = retained
    resumed = replay([str(kept)]).from_checkpoint
    assert resumed is not None
    last: dict[str, int] = {}
    for entry in entries([str(plain)]):
        req = getattr(entry.event, "req", None)
        if isinstance(req, str):
            last[req] = entry.seq
    gone = sorted(req for req, seq in last.items() if seq <= resumed.seq)
    assert gone  # requests whose every record was removed
    for req in gone[:3]:
        assert main(["timeline", str(kept), "--req", req]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"the records naming request {req} were removed by retention" in err, err
        assert f"begins after seq {resumed.seq}, from its checkpoint" in err
        assert not re.search(rf"near matches:.*\b{re.escape(req)}\b", err), err
    assert main(["timeline", str(kept), "--req", "req-999"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"records 1..{resumed.seq} were removed by retention" in err
    assert "near matches:" in err and "req-999" not in err.split("near matches:")[1]


@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_journal_deleted_or_moved_under_the_run_is_named_with_exit_2(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvstate.harness.sim.runtime import Simulation
    from replay.verdict import replay

    journal, moved = tmp_path / "run.db", tmp_path / "elsewhere.db"
    step = Simulation.engine_step

    def engine_step(sim: Simulation) -> None:
        if sim.engine.step == 20 and journal.exists():  # as `rm run.db` from a shell
            journal.unlink() if how == "deleted" else journal.rename(moved)
        step(sim)

    monkeypatch.setattr(Simulation, "engine_step", engine_step)
    assert main(["run", "--journal", str(journal), "--requests", "40"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{journal}: the journal was deleted or moved while the run wrote it" in err
    assert not journal.exists()
    if how == "moved":  # the run wrote on into it: whole where it went
        verdict = replay([str(moved)])
        assert verdict.events > 100 and not verdict.unfinished
