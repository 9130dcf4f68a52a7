"""Where the fold runs is one value (kvstate.placement), fixed when the journal
opens, and no other module of the library decides or repeats it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstate import Recorder, SchedulerLedger, WorkerLedger
from kvstate.placement import Site
from kvstate.writer_codec import CodecSettings

ROOT = Path(__file__).resolve().parent.parent

OPENED = [
    ({}, Site.WRITER_PROCESS),
    ({"process": False}, Site.WRITER_THREAD),
    ({"process": False, "background": False}, Site.COMMITTING_THREAD),
    ({"audit": "inline"}, Site.CALLER),
    ({"audit": "off"}, Site.NOWHERE),
]


@pytest.mark.parametrize(("settings", "site"), OPENED, ids=[s.name for _, s in OPENED])
def test_the_site_is_fixed_when_the_journal_opens(
    tmp_path: Path, settings: dict[str, object], site: Site
) -> None:
    rec = Recorder.open(tmp_path / "j.db", block_size=16, world_size=1, **settings)  # type: ignore[arg-type]
    try:
        assert rec.placement.site is site  # before any ledger attaches or any commit
        SchedulerLedger(rec)
        WorkerLedger(0, rec)
        rec.commit()
        assert rec.placement.site is site
    finally:
        rec.close()


def test_a_writer_process_folds_a_scheduler_and_the_committing_thread_ranks_alone(
    tmp_path: Path,
) -> None:
    """Ranks recording without their scheduler are judged against the specs
    they registered, which are not in the journal: their batches stay with
    the committing thread. Either way the findings are the audit's."""
    whole = Recorder.open(tmp_path / "whole.db", block_size=16, world_size=1)
    SchedulerLedger(whole)
    WorkerLedger(0, whole)
    ranks = Recorder.open(tmp_path / "ranks.db", block_size=16, world_size=1)
    WorkerLedger(0, ranks)
    for rec in (whole, ranks):
        rec.commit()
        rec.close()
    assert whole.placement.writer_process_folds
    assert not ranks.placement.writer_process_folds


def test_the_writer_process_is_configured_by_one_typed_value() -> None:
    settings = CodecSettings(fold="scheduler+workers", journal="j.db", checkpoints=True)
    assert CodecSettings.decode(settings.encode()) == settings
    assert CodecSettings.decode("") == CodecSettings()
    with pytest.raises(Exception, match="fold"):
        CodecSettings.decode('{"fold": "everything"}')


def _library_modules() -> list[Path]:
    return sorted(p for pkg in ("journal", "kvstate", "replay") for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_but_the_placement_branches_on_where_the_fold_runs() -> None:
    """Only kvstate/placement.py names a Site, and none of the flags that used
    to repeat the decision (folded_remotely, hand_to_writer, writer_folds,
    writer_checks) is left anywhere."""
    gone = {"folded_remotely", "hand_to_writer", "writer_folds", "writer_checks", "codec_arg"}
    naming_site, repeating = [], []
    for path in _library_modules():
        tree = ast.parse(path.read_text(), str(path))
        names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        rel = str(path.relative_to(ROOT))
        if "Site" in names and rel != "kvstate/placement.py":
            naming_site.append(rel)
        # journal/ carries the writer process's settings as an opaque string
        if names & gone and not rel.startswith("journal/"):
            repeating.append((rel, sorted(names & gone)))
    assert naming_site == []
    assert repeating == []


def test_a_writer_of_the_callers_own_folds_on_the_committing_thread(tmp_path: Path) -> None:
    """``Recorder(header, writer)`` as docs/api.md documents it: the writer
    folds nothing itself, so each batch is folded once committed, on the
    committing thread, and values are checked at the call."""
    from journal import Journal
    from kvstate import events as ev
    from kvstate.codec import to_row
    from kvstate.thread_writer import JournalWriter

    writer = JournalWriter(Journal(tmp_path / "own.db"), to_row, background=False)
    rec = Recorder(ev.JournalOpened(version=1, block_size=16, world_size=1), writer, audit="commit")
    assert rec.placement.site is Site.COMMITTING_THREAD and rec.placement.check is not None
    rec.auditor.attach_scheduler()
    rec.record(ev.RequestFinished(req="never-admitted", gen=0), 1)
    assert rec.violations == []
    rec.commit()
    assert [v.seq for v in rec.violations] == [2]
    rec.close()
