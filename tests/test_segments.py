"""A journal rotated into segments reads as one journal; a broken run of segments is named.

The chain continues from one segment to the next (each later segment's
first commit links to the previous segment's last), so the records read
across segments are the records written, verified; a missing, reordered or
foreign segment, or one whose predecessor grew after it began, is a
``SegmentError`` naming the file.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import msgpack
import pytest

from journal import Journal, TamperedError
from journal import rotation as rotation_module
from journal import segments as seg
from journal.errors import SegmentError
from journal.rotation import Rotation


def _rows(start: int, n: int, tag: str = "x") -> list[tuple]:
    pack = msgpack.packb
    return [(s, "k", s, None, s, pack({"n": s, "tag": tag * 40})) for s in range(start, start + n)]


def _write(first: Path, commits: int, *, max_bytes: int = 16_384, tag: str = "x") -> list[tuple]:
    """``commits`` commits of 10 rows, rotated at ``max_bytes``; returns every row written."""
    rotation = Rotation(max_bytes=max_bytes)
    journal = Journal(first)
    index, written = 1, []
    for c in range(commits):
        rows = _rows(c * 10 + 1, 10, tag)
        journal.append_rows(rows)
        written += rows
        if rotation.due(journal):
            journal = rotation.rotate(journal, str(first), index, synchronous="NORMAL")
            index += 1
    journal.close()
    return written


def _read(first: Path) -> list[tuple]:
    out = []
    for journal in seg.segments(first):
        with journal:
            out += list(journal.stored_rows())
    return out


def test_a_rotated_journal_reads_as_the_journal_written(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    written = _write(first, 60)
    files = sorted(p.name for p in tmp_path.glob("engine*.db"))
    assert len(files) > 3 and files[0] == "engine.000002.db" and "engine.db" in files
    assert _read(first) == written  # every record, in order, each segment's chain verified


def test_a_missing_segment_is_named(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    _write(first, 60)
    (tmp_path / "engine.000002.db").unlink()  # the test's own file
    with pytest.raises(SegmentError, match=r"engine\.000002\.db: segment 2 is missing"):
        _read(first)


def test_a_segment_out_of_order_is_named(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    _write(first, 60)
    (tmp_path / "engine.000002.db").unlink()
    (tmp_path / "engine.000003.db").rename(tmp_path / "engine.000002.db")
    with pytest.raises(SegmentError, match="says it is segment 3, not 2: out of order"):
        _read(first)


def test_a_segment_of_another_journal_is_named(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "a" / "engine.db", tmp_path / "b" / "engine.db"
    ours.parent.mkdir()
    theirs.parent.mkdir()
    _write(ours, 60)
    _write(theirs, 60, tag="y")
    shutil.copy(theirs.parent / "engine.000002.db", ours.parent / "engine.000002.db")
    with pytest.raises(SegmentError, match="belongs to another journal"):
        _read(ours)


def test_a_segment_whose_predecessor_grew_after_it_began_is_named(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    written = _write(first, 60)
    with Journal(first) as journal:  # a commit slipped into segment 1 after rotation
        journal.append_rows(_rows(len(written) + 1000, 1))
    with pytest.raises(SegmentError, match=r"engine\.000002\.db: does not follow engine\.db"):
        _read(first)


def test_a_tampered_record_in_a_later_segment_names_its_seq(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    _write(first, 60)
    later = tmp_path / "engine.000002.db"
    with Journal(later, readonly=True) as journal:
        seq = next(iter(journal.stored_rows()))[0] + 3
    conn = sqlite3.connect(later)
    conn.execute("DROP TRIGGER records_refuse_update")
    conn.execute("UPDATE records SET step = 999 WHERE seq = ?", (seq,))
    conn.commit()
    conn.close()
    with pytest.raises(TamperedError) as info:
        _read(first)
    assert info.value.seq is not None and info.value.seq <= seq
    assert "engine.000002.db" in str(info.value)


def test_a_later_segment_is_not_a_journal_to_start_from(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    _write(first, 60)
    with pytest.raises(SegmentError, match="give its first segment"):
        _read(tmp_path / "engine.000002.db")


def test_rotation_never_overwrites_a_segment(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    (tmp_path / "engine.000002.db").write_bytes(b"the user's file")
    journal = Journal(first)
    journal.append_rows(_rows(1, 10))
    with pytest.raises(SegmentError, match="exists already; not overwritten"):
        Rotation(max_bytes=1).rotate(journal, str(first), 1, synchronous="NORMAL")
    assert (tmp_path / "engine.000002.db").read_bytes() == b"the user's file"


def test_rotation_by_age(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(rotation_module.time, "monotonic", lambda: now[0])
    rotation = Rotation(max_seconds=60)
    journal = Journal(tmp_path / "engine.db")
    journal.append_rows(_rows(1, 10))
    assert not rotation.due(journal)
    now[0] += 61
    assert rotation.due(journal)
    journal = rotation.rotate(journal, str(tmp_path / "engine.db"), 1, synchronous="NORMAL")
    assert not rotation.due(journal)  # the new segment's age starts now
    journal.close()
    with pytest.raises(ValueError, match="positive"):
        Rotation(max_bytes=0)


# -- a recorder's journal, rotated, read by every command ----------------------------


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The simulator's legacy run, and the same records recorded again through a
    recorder whose writer process rotates every few kilobytes."""
    from tests.builder import legacy_run, record_again

    folder = tmp_path_factory.mktemp("twins")
    plain = legacy_run(folder)
    rotated = folder / "rotated" / "legacy.db"
    rotated.parent.mkdir()
    # a segment's schema alone is some 30 KB with its log
    record_again(plain, rotated, rotate_bytes=131_072)
    return plain, rotated


def test_a_rotated_run_replays_to_the_verdicts_of_its_unrotated_twin(
    twins: tuple[Path, Path],
) -> None:
    from replay.verdict import replay

    plain, rotated = twins
    assert len(list(rotated.parent.glob("legacy.0000*.db"))) >= 3  # it rotated
    a, b = replay([str(plain)]), replay([str(rotated)])
    assert a.violations and [(v.code, v.seq, v.message) for v in a.violations] == [
        (v.code, v.seq, v.message) for v in b.violations
    ]
    assert a.events == b.events


@pytest.mark.parametrize(
    "command",
    [
        ["replay", "{first}"],
        ["replay", "{folder}"],
        ["timeline", "{first}", "--req", "req-6"],
        ["export", "{first}", "{out}", "--format", "jsonl"],
        ["inspect", "{first}", "--once"],
        ["watch", "{folder}", "--once"],
    ],
    ids=lambda c: c[0],
)
def test_every_reader_takes_the_first_segment_or_the_folder_as_the_journal(
    twins: tuple[Path, Path], command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from replay.cli import main

    plain, rotated = twins
    outs = []
    for first in (plain, rotated):
        out = tmp_path / f"{first.parent.name}.jsonl"
        argv = [a.format(first=first, folder=first.parent, out=out) for a in command]
        status = main(argv)
        text = capsys.readouterr().out
        if command[0] == "export":
            text = "\n".join(
                line.split('"ts"')[0] for line in out.read_text().splitlines()
            )  # the recorder stamped its own ts
        outs.append((status, text.replace(str(first.parent), "DIR")))
    assert outs[0][0] == outs[1][0] == (0 if command[0] == "export" else 1)  # violations
    if command[0] in ("timeline", "export"):
        assert outs[0][1] == outs[1][1]
    if command[0] == "watch":  # one journal, read across its segments
        assert outs[1][1].count("1 journal(s)") == 1 and "203 violation(s)" in outs[1][1]


def test_the_vllm_observer_reads_rotation_and_retention_from_the_extra_config() -> None:
    from types import SimpleNamespace

    from kvstate.vllm._journals import rotation_of

    def config(**extra: object) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))

    assert rotation_of(None) == (None, None, None, None)
    assert rotation_of(config()) == (None, None, None, None)
    got = rotation_of(config(kvstate_rotate_bytes=1 << 30, kvstate_rotate_seconds=3600))
    assert got == (1 << 30, 3600.0, None, None)
    got = rotation_of(config(kvstate_rotate_bytes=1 << 30, kvstate_retain_bytes=1 << 34,
                             kvstate_retain_seconds=7 * 86400))  # fmt: skip
    assert got == (1 << 30, None, 1 << 34, 7 * 86400.0)
    with pytest.raises(ValueError, match="kvstate_retain_seconds"):
        rotation_of(config(kvstate_retain_seconds=-1))
    for bad in (0, -5, "1GB", True):
        with pytest.raises(ValueError, match="kvstate_rotate_bytes"):
            rotation_of(config(kvstate_rotate_bytes=bad))


def test_watch_follows_a_journal_across_its_segments_as_they_are_written(
    twins: tuple[Path, Path], tmp_path: Path
) -> None:
    from replay.verdict import replay
    from replay.watch import Watcher

    plain, _ = twins
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    watcher = Watcher(tmp_path)
    rotation = Rotation(max_bytes=65_536)
    first = tmp_path / "engine.db"
    journal, index, written = Journal(first), 1, 0
    for start in range(0, len(rows), 50):
        journal.append_rows(rows[start : start + 50])
        written = min(start + 50, len(rows))
        if rotation.due(journal):
            journal = rotation.rotate(journal, str(first), index, synchronous="NORMAL")
            index += 1
        while watcher.poll():
            pass
        (f,) = watcher.figures()  # one journal, however many segments
        assert f.error is None and f.folded == written and f.segments == index
    journal.close()
    (f,) = watcher.figures()
    watcher.close()
    assert index > 3
    expected: dict[str, int] = {}
    for v in replay([str(plain)]).violations:
        expected[v.code.value] = expected.get(v.code.value, 0) + 1
    assert dict(f.violations) == expected
