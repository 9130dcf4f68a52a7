"""Retention in the journal layer: budgets of bytes and age, kept by removing
whole segments, each only after a checkpoint, and readers that go on.

The checkpoint here is opaque bytes (the journal knows nothing of what it
holds); ``tests/test_retention.py`` checks kvstate's, and replay from it.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import msgpack
import pytest

from journal import Journal
from journal import segments as seg
from journal.rotation import Rotation
from journal.segments import Rotating, SegmentError


def test_a_segment_left_without_its_head_and_without_a_checkpoint_is_named(
    tmp_path: Path,
) -> None:
    first = tmp_path / "engine.db"
    rotation = Rotation(max_bytes=16_384)
    journal = Journal(first)
    for c in range(40):
        pack = msgpack.packb
        journal.append_rows([(c * 10 + i, "k", c, None, c, pack({"n": i})) for i in range(1, 11)])
        if rotation.due(journal):
            journal = rotation.rotate(journal, str(first), seg.segment_path(str(first), 1) and
                                      _index(journal), synchronous="NORMAL")  # fmt: skip
    journal.close()
    first.unlink()  # the test's own file: a head removed without retention
    with pytest.raises(SegmentError, match="begins with no checkpoint"):
        list(seg.segments(first))


def _index(journal: Journal) -> int:
    row = journal.segment()
    return 1 if row is None else row[0]


def _rotating(first: Path, rotation: Rotation) -> Rotating:
    def checkpoint() -> list[bytes]:
        return [b"state-after-%d" % rotating.journal.head()[0], b"more"]

    rotating = Rotating(Journal(first), rotation, synchronous="NORMAL", checkpoint=checkpoint)
    return rotating


def _commits(rotating: Rotating, start: int, end: int) -> None:
    """Commits ``start``..``end - 1`` of ten 200-byte records each, each followed
    by the writer's rotation check (and its retention)."""
    pack = msgpack.packb
    for c in range(start, end):
        rotating.journal.append_rows([(c * 10 + i, "k", c, None, c, pack({"n": "x" * 200}))
                                      for i in range(1, 11)])  # fmt: skip
        rotating.committed()


def _seqs(first: Path) -> list[int]:
    """The seqs of what is left, read as one chain."""
    seqs = []
    for journal in seg.segments(first):
        with journal:
            seqs += [row[0] for row in journal.stored_rows()]
    return seqs


def test_retention_by_age_removes_segments_older_than_the_budget(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    rotating = _rotating(first, Rotation(max_bytes=16_384, keep_seconds=3600))
    _commits(rotating, 0, 21)
    for path in [str(first), *seg.later_segments(str(first))]:  # made two hours old
        if path != rotating.journal.path:
            os.utime(path, (0, os.path.getmtime(path) - 7200))
    _commits(rotating, 21, 30)
    rotating.journal.close()
    assert rotating.removed and not first.exists()
    left = seg.later_segments(str(first))
    assert len(left) >= 2 and all(p not in rotating.removed for p in left)
    # what is left reads as one chain from its checkpoint
    seqs = []
    for n, journal in enumerate(seg.segments(first)):
        with journal:
            assert n > 0 or journal.checkpoint() is not None
            seqs += [row[0] for row in journal.stored_rows()]
    assert seqs == list(range(seqs[0], 301)) and seqs[0] > 1


def test_a_file_left_with_a_hot_rollback_journal_is_read_without_changing_it(
    tmp_path: Path,
) -> None:
    """A writer killed while SQLite changed a segment's journal mode leaves a
    hot ``-journal``: SQLite cannot read that read-only. The reader reads a
    private copy, and the user's files stay as they were."""
    path = tmp_path / "h.db"
    with Journal(path) as journal:
        journal.append_rows([(1, "k", None, None, None, {"a": 1})])
    pid = os.fork()
    if pid == 0:  # a transaction half done, then killed
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DROP TRIGGER records_refuse_delete")
        conn.execute("DELETE FROM records")
        conn.execute("PRAGMA cache_size = 1")
        for i in range(2000):  # pages spill into the file before any commit
            conn.execute(f"CREATE TABLE IF NOT EXISTS t{i % 50} (x)")
        os._exit(0)
    os.waitpid(pid, 0)
    hot = path.with_name("h.db-journal")
    before = (path.read_bytes(), hot.read_bytes())
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        sqlite3.connect(f"file:{path}?mode=ro", uri=True).execute("SELECT * FROM records")
    with Journal(path, readonly=True) as journal:
        assert [r.payload for r in journal.records()] == [{"a": 1}]
    assert (path.read_bytes(), hot.read_bytes()) == before


def test_a_segment_that_cannot_be_removed_does_not_stop_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Retention is housekeeping: an unlink refused is said on stderr, the
    segment stays over the budget until a later rotation, and every commit
    goes on being written."""
    first = tmp_path / "engine.db"
    rotating = _rotating(first, Rotation(max_bytes=16_384, keep_bytes=40_000))
    real_unlink = os.unlink

    def refuse(name: str | os.PathLike[str]) -> None:
        if str(name).endswith(".db") and "engine" in str(name):
            raise PermissionError(13, "Permission denied", str(name))
        real_unlink(name)

    monkeypatch.setattr(os, "unlink", refuse)
    _commits(rotating, 0, 30)
    rotating.journal.close()
    assert not rotating.removed and first.exists()
    assert "not removed: [Errno 13] Permission denied" in capsys.readouterr().err
    assert _seqs(first) == list(range(1, 301))


def test_a_reader_that_retention_overtakes_is_told_to_read_again(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    rotating = _rotating(first, Rotation(max_bytes=16_384, keep_bytes=10_000_000))
    _commits(rotating, 0, 40)
    rotating.journal.close()
    reading = seg.segments(first)
    with next(reading) as journal:
        list(journal.stored_rows())
        for gone in (first, Path(seg.segment_path(str(first), 2))):  # as retention would
            gone.unlink()
    with pytest.raises(SegmentError, match="removed by retention while the journal was read"):
        next(reading)
