"""``kvstate watch`` left on beside the engines: it never keeps a journal from
becoming one file, survives retention, forgets what is gone, and logs.

A writer leaves WAL mode as it closes only while no other connection has
its file open; the watcher holds none between two polls, and the writer
folds its log in first, so even a reader that holds the file then cannot
leave a ``.db`` that misses records when copied alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from journal import Journal
from journal import database as jdb
from journal.rotation import Rotation
from journal.segments import Rotating
from kvstate.violations import Code
from replay.verdict import replay
from replay.watch import Watcher
from tests.builder import legacy_run

ROOT = Path(__file__).resolve().parent.parent
KVSTATE = [sys.executable, "-m", "replay"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return legacy_run(tmp_path_factory.mktemp("watched"))


def _codes(violations: list) -> dict[str, int]:  # type: ignore[type-arg]
    out: dict[str, int] = {}
    for v in violations:
        out[v.code.value] = out.get(v.code.value, 0) + 1
    return out


def _legacy_run(folder: Path) -> Path:
    """`kvstate run` of the legacy policy (seed 3: 203 violations) into ``folder``."""
    journal = folder / "legacy.db"
    subprocess.run(
        [*KVSTATE, "run", "--journal", str(journal), "--policy", "legacy", "--seed", "3",
         "--requests", "40"],
        env=ENV, stdout=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    return journal


def _alone(path: Path, tmp_path: Path) -> Path:
    """``path`` copied alone, as people attach a journal to a ticket."""
    copy = tmp_path / "ticket" / path.name
    copy.parent.mkdir(exist_ok=True)
    shutil.copyfile(path, copy)
    return copy


def test_a_journal_written_while_watch_follows_it_ends_as_one_file(tmp_path: Path) -> None:
    """`kvstate watch` polls the folder as fast as it can while the simulator
    writes a legacy run into it; the finished journal is one file, and its
    ``.db`` copied alone replays byte for byte as the original."""
    folder = tmp_path / "journals"
    folder.mkdir()
    watch = subprocess.Popen(
        [*KVSTATE, "watch", str(folder), "--interval", "0"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        journal = _legacy_run(folder)
        assert watch.poll() is None  # it was following all along
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["legacy.db"]
    assert jdb.wal_state(journal) == (False, None)
    whole, alone = replay([str(journal)]), replay([str(_alone(journal, tmp_path))])
    assert whole.events == alone.events > 0 and not whole.unfinished
    assert [(v.code, v.seq) for v in whole.violations] == [
        (v.code, v.seq) for v in alone.violations
    ]
    assert not [w for w in whole.warnings if w.code is Code.WAL_LEFT]


def test_a_reader_holding_the_file_as_its_writer_closes_loses_the_copy_nothing(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader (not kvstate's watcher) keeps its connection open across the
    writer's close: the file stays in WAL mode, but its log was folded in
    first, so the ``.db`` alone holds every record; replay says the file was
    left in WAL mode."""
    monkeypatch.setattr(jdb, "LEAVE_WAL_FOR", 0.05)
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    path = tmp_path / "held.db"
    writer = Journal(path)
    writer.append_rows(rows[:10])
    holder = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    holder.execute("SELECT count(*) FROM sqlite_master").fetchone()
    writer.append_rows(rows[10:])
    writer.close()
    holder.close()
    assert jdb.wal_state(path)[0]  # a reader had it: still WAL mode
    result = replay([str(path)])
    (left,) = [w for w in result.warnings if w.code is Code.WAL_LEFT]
    assert "the journal ended" in left.message
    alone = replay([str(_alone(path, tmp_path))])
    assert alone.events == result.events == len(rows) and not alone.unfinished
    # and reading the copy made nothing beside it
    assert sorted(p.name for p in (tmp_path / "ticket").iterdir()) == ["held.db"]


def test_a_live_journal_copied_without_its_log_is_unfinished_and_not_named_in_wal(
    plain: Path, tmp_path: Path
) -> None:
    """A live journal's ``.db`` copied without its ``-wal`` holds what SQLite
    folded into it so far: read as unfinished (a killed writer's file looks
    the same, every record in it: no WAL_LEFT for a journal that did not end)."""
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    path = tmp_path / "live.db"
    writer = Journal(path)
    try:
        writer.append_rows(rows[:500])
        # SQLite folds its log into the file now and then (every 1,000 pages):
        # the copy holds what it folded, the rest is in the -wal left behind
        writer._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        writer.append_rows(rows[500:-1])  # engine_idle not written yet
        result = replay([str(_alone(path, tmp_path))])
    finally:
        writer.close()
    assert result.unfinished and result.events == 500
    assert not [w for w in result.warnings if w.code is Code.WAL_LEFT]


def test_watch_follows_a_journal_that_retention_overtakes(plain: Path, tmp_path: Path) -> None:
    """Small segments and a tight budget, the watcher reading only every few
    commits: retention removes segments before it reaches them, over and
    over. It goes on from the oldest segment's checkpoint each time, is never
    unreadable, counts how often, and ends with the findings of the whole run."""
    from kvstate.checkpoint import parts
    from kvstate.ledger import Ledger
    from kvstate.spill import SpillArchive
    from replay.sources import entries

    folder = tmp_path / "live"
    folder.mkdir()
    watcher = Watcher(folder)
    rotation = Rotation(max_bytes=16_384, keep_bytes=2 * 16_384)
    ledger, found = Ledger(archive=SpillArchive()), []  # type: ignore[var-annotated]
    rotating = Rotating(Journal(folder / "engine.db"), rotation, synchronous="NORMAL",
                        checkpoint=lambda: parts(ledger, found))  # fmt: skip
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    records = list(entries([str(plain)]))
    rotations, step = 0, 20
    for n, start in enumerate(range(0, len(rows), step)):
        rotating.journal.append_rows(rows[start : start + step])
        for entry in records[start : start + step]:  # the writer's fold, as it commits
            found += ledger.apply(entry.seq, entry.step, entry.event)
        index = rotating.index
        rotating.committed()
        rotations += rotating.index - index
        if n % 7 == 0:  # the watcher falls behind by several segments at a time
            watcher.poll()
            (f,) = watcher.figures()
            assert f.error is None, f.error
    rotating.journal.close()
    while watcher.poll():
        pass
    (f,) = watcher.figures()
    assert rotations >= 20 and rotating.removed
    assert f.error is None and f.overtaken > 0
    assert f.folded == f.written == len(rows) and f.closed == "engine_idle"
    assert dict(f.violations) == _codes(replay([str(plain)]).violations)


def test_a_commit_between_the_head_and_the_rows_read_is_counted_as_written(
    plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer commits its last records, the closing one among them, after
    the watcher read how far the journal goes and before it read the rows: the
    watcher folds them, and the journal is not left looking behind its own
    fold (it is let go of once ended, and would say so forever)."""
    from replay import _follow

    folder = tmp_path / "journals"
    folder.mkdir()
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    writer = Journal(folder / "engine.db")
    writer.append_rows(rows[:-5])
    read_rows = _follow.rows

    def writer_commits_first(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if writer.head()[0] < len(rows):
            writer.append_rows(rows[-5:])
        return read_rows(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_follow, "rows", writer_commits_first)
    watcher = Watcher(folder)
    watcher.poll()
    writer.close()
    (f,) = watcher.figures()
    assert f.closed == "engine_idle"
    assert f.folded == f.written == len(rows) and f.lag_records() == 0


def test_watch_forgets_a_journal_deleted_and_lets_go_of_its_file(
    plain: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "journals"
    folder.mkdir()
    journal = folder / "legacy.db"
    shutil.copyfile(plain, journal)
    watcher = Watcher(folder)
    while watcher.poll():
        pass
    (f,) = watcher.figures()
    assert f.closed == "engine_idle" and f.bytes == journal.stat().st_size
    # no descriptor of it is held between polls: removing it frees its disk
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert fds and str(journal) not in fds
    journal.unlink()
    with caplog.at_level(logging.WARNING, logger="kvstate.watch"):
        watcher.poll()
    assert watcher.figures() == []
    assert [r.getMessage() for r in caplog.records] == [
        f"{journal}: gone (deleted or moved away); no longer followed"
    ]


def _lines(stderr: str, marker: str) -> list[str]:
    return [line for line in stderr.splitlines() if marker in line]


def test_off_a_terminal_each_new_finding_and_each_skipped_file_is_one_log_line(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "journals"
    folder.mkdir()
    other = folder / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    (folder / "garbage.db").write_bytes(b"not a database at all")
    (folder / "empty.db").write_bytes(b"")
    log_file = tmp_path / "watch.log"
    with open(log_file, "w") as log:
        watch = subprocess.Popen(
            [*KVSTATE, "watch", str(folder), "--interval", "0.1"],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=log,
        )
    try:
        journal = _legacy_run(folder)
        expected = replay([str(journal)]).violations
        # until the watcher read the journal's closing record (progress it
        # logs), after which it has nothing more to say of it
        while not _lines(log_file.read_text(), f"{journal}: ended with engine_idle"):
            assert watch.poll() is None, log_file.read_text()[-2000:]
            time.sleep(0.1)
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.communicate()
    stderr = log_file.read_text()
    skipped = _lines(stderr, ": skipped: ")
    assert len(skipped) == 3, skipped
    assert sorted(line.split(": skipped: ")[0] for line in skipped) == [
        f"WARNING kvstate.watch: {folder / name}" for name in ("empty.db", "garbage.db", "other.db")
    ]
    findings = _lines(stderr, "explain it with: kvstate replay")
    assert len(findings) == len(expected) > 0
    first = expected[0]
    assert findings[0].startswith(
        f"WARNING kvstate.watch: {journal}: {first.code.value} at seq {first.seq}: "
    )
    assert not _lines(stderr, "kvstate: kvstate")  # one prefix


def test_watch_beside_a_writer_process_rotating_as_fast_as_it_can(tmp_path: Path) -> None:
    """The writer process rotates at a few KiB of records and keeps two
    segments, while a watcher thread polls as `kvstate watch` does: retention
    removes segments under it again and again, on its own schedule. The
    journal is never called unreadable, and the watcher ends with every
    record and finding the writer's own audit counted."""
    import threading

    from benchmarks.bench_hot_path import BLOCK, WORLD, lifecycle
    from journal import segments
    from kvstate import Recorder, SpillArchive

    folder = tmp_path / "journals"
    folder.mkdir()
    watcher = Watcher(folder)
    errors: list[str] = []
    done = threading.Event()

    def follow() -> None:
        while not done.is_set():
            watcher.poll()
            errors.extend(f.error for f in watcher.figures() if f.error)

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        rec = Recorder.open(
            folder / "engine.db",
            block_size=BLOCK,
            world_size=WORLD,
            rotate_bytes=4_096,
            retain_bytes=8_192,
        )
        lifecycle(rec, 1_500, archive=SpillArchive)
        rec.close()
    finally:
        done.set()
        thread.join()
    while watcher.poll():
        pass
    (f,) = watcher.figures()
    rotations = max(i for i, _ in segments.present(str(folder / "engine.db")))
    assert rotations >= 20 and f.segments_removed >= rotations - 2
    assert errors == [] and f.error is None
    assert f.closed == "engine_idle" and f.folded == f.written == rec.recorded
    assert dict(f.violations) == _codes(rec.violations)
