"""Retention: a rotated journal keeps a budget, and replay goes on from a checkpoint.

The legacy simulator run (203 violations) is recorded again through a
writer process that rotates into small segments and keeps at most a few of
them: its head is removed, the oldest segment left begins with a checkpoint
of the fold, and every reader takes what is left as the journal. Replay
restores the checkpoint and reaches the very violations of the unrotated
twin (those of the removed records carried by the checkpoint), and says
that it went on from a checkpoint (``FROM_CHECKPOINT``), never a plain
verdict over records it did not see.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import sqlite3
import zlib
from pathlib import Path

import pytest

from journal import Journal, JournalError, RecordError
from journal import segments as seg
from journal.rotation import Rotation
from journal.segments import Rotating
from tests.builder import legacy_run, on_disk, record_again

ROTATE, RETAIN = 131_072, 400_000


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int]]:
    folder = tmp_path_factory.mktemp("retained")
    plain = legacy_run(folder)
    kept = folder / "kept" / "legacy.db"
    kept.parent.mkdir()
    sizes: list[int] = []
    record_again(plain, kept, sizes, rotate_bytes=ROTATE, retain_bytes=RETAIN)
    return plain, kept, sizes


def _findings(result: object) -> list[tuple[object, int, str]]:
    return [(v.code, v.seq, v.message) for v in result.violations]  # type: ignore[attr-defined]


def test_the_head_is_removed_and_what_is_left_begins_with_a_checkpoint(
    twins: tuple[Path, Path, list[int]],
) -> None:
    _, kept, _ = twins
    assert not kept.exists()  # the first segment went
    left = seg.later_segments(str(kept))
    assert len(left) >= 2
    for path in left:
        with Journal(path, readonly=True) as journal:
            assert journal.checkpoint() is not None


def test_disk_stays_within_the_budget(twins: tuple[Path, Path, list[int]]) -> None:
    _, kept, sizes = twins
    # the budget counts the segment being written at its full size; a commit
    # may cross the rotation size before the rotation that follows it
    assert max(sizes) <= RETAIN + 32_768
    assert on_disk(kept.parent) <= RETAIN


def test_replay_from_the_checkpoint_reaches_the_verdicts_of_the_unrotated_twin(
    twins: tuple[Path, Path, list[int]],
) -> None:
    from kvstate.violations import Code
    from replay.verdict import replay

    plain, kept, _ = twins
    a, b = replay([str(plain)]), replay([str(kept)])
    assert a.violations and _findings(a) == _findings(b)
    notes = [w for w in b.warnings if w.code is Code.FROM_CHECKPOINT]
    assert len(notes) == 1 and b.from_checkpoint is notes[0]
    assert [w for w in b.warnings if w is not notes[0]] == a.warnings
    assert b.events == a.events - notes[0].seq  # the records it read: those left
    assert b.exit_status == a.exit_status == 1


def test_its_verdict_and_json_say_it_went_on_from_a_checkpoint(
    twins: tuple[Path, Path, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    from replay.cli import main

    _, kept, _ = twins
    assert main(["replay", "--json", str(kept)]) == 1
    out = json.loads(capsys.readouterr().out)
    seq = out["from_checkpoint"]["after_seq"]
    assert seq > 0 and "removed by retention" in out["from_checkpoint"]["message"]
    assert any(w["code"] == "FROM_CHECKPOINT" for w in out["warnings"])
    assert main(["replay", str(kept)]) == 1
    assert f"FROM_CHECKPOINT: records 1..{seq} were removed" in capsys.readouterr().out


def test_a_clean_run_with_its_head_removed_is_never_plain_clean(tmp_path: Path) -> None:
    from replay.verdict import replay

    plain = legacy_run(tmp_path, "kvstate")
    kept = tmp_path / "kept" / "kvstate.db"
    kept.parent.mkdir()
    record_again(plain, kept, rotate_bytes=ROTATE, retain_bytes=RETAIN)
    a, b = replay([str(plain)]), replay([str(kept)])
    assert not kept.exists() and not a.violations and not b.violations
    assert a.from_checkpoint is None and b.from_checkpoint is not None
    assert b.to_dict()["from_checkpoint"]["after_seq"] == b.from_checkpoint.seq


@pytest.mark.parametrize(
    "command",
    [
        ["replay", "{first}"],
        ["replay", "{folder}"],
        ["replay", "{oldest}"],
        ["timeline", "{first}", "--req", "req-39"],
        ["export", "{first}", "{out}", "--format", "perfetto"],
        ["inspect", "{first}", "--once"],
        ["watch", "{folder}", "--once"],
        ["fleet-check", "{folder}", "--workers", "1"],
    ],
    ids=lambda c: f"{c[0]}-{c[1].strip('{}')}",
)
def test_every_reader_takes_what_is_left_as_the_journal(
    twins: tuple[Path, Path, list[int]],
    command: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from replay.cli import main

    _, kept, _ = twins
    oldest = seg.later_segments(str(kept))[0]
    out = tmp_path / "out.json"
    argv = [a.format(first=kept, folder=kept.parent, oldest=oldest, out=out) for a in command]
    if command[0] == "fleet-check":
        argv[1:1] = ["--facts", str(tmp_path / "facts")]
    status = main(argv)
    text = capsys.readouterr().out
    assert status == (0 if command[0] == "export" else 1), text
    if command[0] == "timeline":
        assert "req-39" in text
    if command[0] == "export":
        other = json.loads(out.read_text())["otherData"]
        assert other["verdict"] == "violations" and "after_seq" in other["from_checkpoint"]
    if command[0] == "inspect":
        assert "FROM_CHECKPOINT" in text
    if command[0] == "watch":
        assert "1 journal(s)" in text and "203 violation(s)" in text


def test_what_cannot_stand_alone_is_refused_by_name(
    twins: tuple[Path, Path, list[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Converting what is left would write a journal without its checkpoint;
    merging it with another would mix a fold of one journal into another's."""
    from replay.cli import main

    plain, kept, _ = twins
    assert main(["export", str(kept), str(tmp_path / "o.jsonl"), "--format", "jsonl"]) == 2
    assert "removed by retention" in capsys.readouterr().err
    assert main(["replay", str(kept), str(plain)]) == 2
    assert "not merged with others" in capsys.readouterr().err


def test_replay_at_a_seq_before_the_checkpoint_is_refused(
    twins: tuple[Path, Path, list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    from replay.cli import main

    _, kept, _ = twins
    assert main(["replay", str(kept), "--at", "5"]) == 2
    assert "were removed by retention" in capsys.readouterr().err


def test_time_travel_after_the_checkpoint_sees_the_twins_ledger(
    twins: tuple[Path, Path, list[int]],
) -> None:
    from kvstate._ledger_state import folded_state
    from replay.timetravel import TimeTravel

    plain, kept, _ = twins
    a, b = TimeTravel(str(plain)), TimeTravel(str(kept))
    try:
        assert b.first_seq > 0
        for seq in (b.first_seq, b.first_seq + 7, b.last_seq):
            left, right = a.ledger_at(seq).whole(), b.ledger_at(seq).whole()
            assert folded_state(left)[:-1] == folded_state(right)[:-1]
        b.index()
        a.index()
        assert [(v.code, v.seq) for v in a.violations] == [(v.code, v.seq) for v in b.violations]
    finally:
        a.stop()
        b.stop()


def test_the_writer_process_publishes_segments_removals_and_the_budget(tmp_path: Path) -> None:
    plain = legacy_run(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "kept" / "legacy.db"
    out.parent.mkdir()
    text = record_again(plain, out, rotate_bytes=ROTATE, retain_bytes=RETAIN, metrics=address)
    assert text is not None

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + "{") or
                    x.startswith(name + " "))  # fmt: skip
        return float(line.rsplit(" ", 1)[1])

    assert value("kvstate_disk_budget_bytes") == RETAIN
    assert value("kvstate_journal_segments_removed_total") >= 3
    assert 2 <= value("kvstate_journal_segments") <= RETAIN // 40_000
    assert 0 < value("kvstate_journal_bytes") <= RETAIN
    assert value("kvstate_records_total") == value("kvstate_journal_records")


def test_watch_counts_the_segments_retention_removed(twins: tuple[Path, Path, list[int]]) -> None:
    """``kvstate watch`` publishes kvstate_journal_segments_removed_total from
    the files, as the writer process counts its removals, and the bytes of
    the segments still on disk."""
    from replay.watch import Watcher

    _, kept, _ = twins
    left = seg.later_segments(str(kept))
    first_left = min(int(Path(p).name.split(".")[-2]) for p in left)
    watcher = Watcher(kept.parent)
    try:
        while watcher.poll():
            pass
        (figures,) = watcher.figures()
    finally:
        watcher.close()
    assert figures.segments_removed == first_left - 1 >= 1
    assert figures.segments == first_left + len(left) - 1
    assert figures.bytes == sum(os.path.getsize(p) for p in left)


# -- the checkpoint is input: chained, and read with care ---------------------------------


def test_a_changed_checkpoint_breaks_the_chain_where_its_segment_begins(
    twins: tuple[Path, Path, list[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from replay.cli import main

    _, kept, _ = twins
    copy = tmp_path / "kept"
    shutil.copytree(kept.parent, copy)
    oldest = seg.later_segments(str(copy / kept.name))[0]
    conn = sqlite3.connect(oldest)
    conn.execute("DROP TRIGGER checkpoint_refuse_update")  # the test's own copy
    part = conn.execute("SELECT data FROM checkpoint WHERE part = 0").fetchone()[0]
    state = pickle.loads(zlib.decompress(part))
    state[2]["records"] += 1  # one record more than was folded
    changed = zlib.compress(pickle.dumps(state, pickle.HIGHEST_PROTOCOL))
    conn.execute("UPDATE checkpoint SET data = ? WHERE part = 0", (changed,))
    conn.commit()
    conn.close()
    assert main(["replay", str(copy)]) == 2
    err = capsys.readouterr().err
    assert os.path.basename(oldest) in err and "hash chain" in err


def test_a_checkpoint_that_names_a_callable_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    from kvstate import _pickles
    from kvstate.checkpoint import Resumed, restore
    from kvstate.events import JournalOpened
    from kvstate.ledger import Ledger

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    blob = zlib.compress(pickle.dumps(("ledger", 1, {"x": Evil()}, {}, None, [], {})))
    header = JournalOpened(version=1, block_size=4, world_size=1)
    resumed = Resumed(7, "seg.db", 2, header, lambda: iter([blob]))
    with pytest.raises(RecordError, match=r"seg\.db \(seq 7\).*may not name"):
        restore(Ledger(), resumed)
    with pytest.raises(pickle.UnpicklingError):
        _pickles.loads(pickle.dumps(Evil()))  # what the parking unpacks goes the same way
    assert not marker.exists()


def test_retention_is_refused_where_it_cannot_hold(tmp_path: Path) -> None:
    from kvstate import Recorder

    with pytest.raises(ValueError, match="twice the rotation size"):
        Rotation(max_bytes=100_000, keep_bytes=150_000)
    with pytest.raises(ValueError, match="rotation size or age"):
        Rotation(keep_bytes=1_000_000)
    with pytest.raises(JournalError, match="has none to write"):
        Rotating(Journal(tmp_path / "a.db"), Rotation(max_bytes=10, keep_bytes=20),
                 synchronous="NORMAL")  # fmt: skip
    with pytest.raises(ValueError, match="process=True"):
        Recorder.open(tmp_path / "b.db", block_size=4, world_size=1, process=False,
                      rotate_bytes=ROTATE, retain_bytes=RETAIN)  # fmt: skip


def test_a_new_journal_is_not_begun_beside_the_segments_of_an_old_one(
    twins: tuple[Path, Path, list[int]],
) -> None:
    from kvstate import Recorder

    _, kept, _ = twins
    before = sorted(os.listdir(kept.parent))
    with pytest.raises(FileExistsError, match="later segments of a journal of this name"):
        Recorder.open(kept, block_size=4, world_size=1)
    assert sorted(os.listdir(kept.parent)) == before


# -- a kill at any point of rotation or retention ----------------------------------------


def test_sigkills_of_the_writer_during_rotation_and_retention_lose_nothing(
    tmp_path: Path,
) -> None:
    """The writer process itself is killed, every few rotations in: what is
    left opens from its oldest segment's checkpoint, every later segment has
    its checkpoint, the chain holds across them, every durable commit is
    there, and replay finds nothing but the unfinished end."""
    from tests import crashsim

    heads = half_made = 0
    for seed in range(24):
        # (a kill right after a rotation may leave no record after the checkpoint)
        committed, _found, removed, half = crashsim.kill_writer_once(str(tmp_path), seed)
        assert committed > 0
        heads += removed
        half_made += half
    assert heads >= 12  # most kills came after retention had removed the head
    assert half_made >= 1  # and some in the middle of making the next segment


def test_a_checkpoint_carries_the_newest_history_and_says_what_it_forgot(
    twins: tuple[Path, Path, list[int]],
) -> None:
    """Live state whole, settled history bounded: the newest parked entities
    only, and the verdict names how many older ones it no longer judges."""
    from kvstate.checkpoint import Resumed, parts, restore, summary_of
    from kvstate.ledger import Ledger
    from kvstate.spill import SpillArchive
    from replay.sources import entries

    plain, _, _ = twins
    ledger = Ledger(archive=SpillArchive(), park_after=64, sweep_every=32)
    for entry in entries([str(plain)]):
        ledger.apply(entry.seq, entry.step, entry.event)
    parked = len(ledger.archive)
    assert parked > 10
    blobs = list(parts(ledger, [], newest_parked=10, newest_key_writes=5))
    header, forgotten, omitted = summary_of("x.db", 9, blobs[0])
    assert forgotten == parked - 10 and header == ledger.header and omitted == 0
    resumed = Resumed(9, "x.db", 2, header, lambda: iter(blobs), forgotten)
    again = Ledger(archive=SpillArchive())
    restore(again, resumed)
    assert len(again.archive) == 10 and sum(map(len, again.archive.key_writes())) == 5
    assert again.requests == ledger.requests and again.jobs == ledger.jobs  # live: whole
    assert f"{forgotten} older settled jobs and requests are not judged again" in (
        resumed.describe()
    )


def test_what_is_left_may_be_a_checkpoint_with_no_record_after_it(
    twins: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    """A writer killed right after it began a segment leaves the checkpoint
    and nothing else: replay restores it (read again, the segment closed by
    then) and gives the findings it carries, from the checkpoint."""
    from kvstate.checkpoint import parts
    from kvstate.ledger import Ledger
    from kvstate.spill import SpillArchive
    from replay.sources import entries
    from replay.verdict import replay

    plain, _, _ = twins
    upto = 1200
    first = tmp_path / "engine.db"
    ledger, found = Ledger(archive=SpillArchive()), []
    with Journal(plain, readonly=True) as source, Journal(first) as journal:
        journal.append_rows(list(source.stored_rows(upto=upto)))
    for entry in entries([str(plain)]):
        if entry.seq > upto:
            break
        found += ledger.apply(entry.seq, entry.step, entry.event)
    journal = Journal(first)
    Rotation(max_bytes=1).rotate(
        journal, str(first), 1, synchronous="NORMAL", checkpoint=parts(ledger, found)
    ).close()
    first.unlink()  # as retention would have
    result = replay([str(first)])
    expected = [(v.code, v.seq, v.message) for v in found if not v.is_warning]
    assert expected and _findings(result) == expected
    assert result.events == 0 and result.from_checkpoint is not None
    assert result.from_checkpoint.seq == upto


def test_watch_follows_a_journal_while_retention_removes_its_head(
    twins: tuple[Path, Path, list[int]], tmp_path: Path
) -> None:
    """The watcher holds the first segment open when retention removes it,
    and goes on into the next by the journal's id, read from what it holds;
    a watcher begun after the removal starts from the checkpoint. Both count
    the twin's findings."""
    from kvstate.checkpoint import parts
    from kvstate.ledger import Ledger
    from kvstate.spill import SpillArchive
    from replay.sources import entries
    from replay.verdict import replay
    from replay.watch import Watcher

    plain, _, _ = twins
    folder = tmp_path / "live"
    folder.mkdir()
    watcher = Watcher(folder)
    rotation = Rotation(max_bytes=65_536, keep_bytes=3 * 65_536)
    ledger, found = Ledger(archive=SpillArchive()), []
    first = folder / "engine.db"
    rotating = Rotating(Journal(first), rotation, synchronous="NORMAL",
                        checkpoint=lambda: parts(ledger, found))  # fmt: skip
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    records = list(entries([str(plain)]))
    late = None
    for start in range(0, len(rows), 50):
        rotating.journal.append_rows(rows[start : start + 50])
        for entry in records[start : start + 50]:  # the writer's fold, as it commits
            found += ledger.apply(entry.seq, entry.step, entry.event)
        rotating.committed()
        while watcher.poll():
            pass
        if late is None and rotating.removed:
            late = Watcher(folder)  # begun once the head is gone
    rotating.journal.close()
    while watcher.poll() or (late is not None and late.poll()):
        pass
    assert late is not None and not first.exists()
    expected: dict[str, int] = {}
    for v in replay([str(plain)]).violations:
        expected[v.code.value] = expected.get(v.code.value, 0) + 1
    for w in (watcher, late):
        (f,) = w.figures()
        w.close()
        assert f.error is None and f.folded == f.written == len(rows) and not f.lag_records()
        assert dict(f.violations) == expected


def test_every_segment_reads_with_sql_as_the_first_does(
    twins: tuple[Path, Path, list[int]],
) -> None:
    """The per-kind views go with each new segment: what is left after
    retention answers the same queries (sqlite-utils, docs/journal.md)."""
    _, kept, _ = twins
    oldest = seg.later_segments(str(kept))[0]
    conn = sqlite3.connect(f"file:{oldest}?mode=ro", uri=True)
    from journal._schema import register_functions

    register_functions(conn)
    rows = conn.execute("SELECT seq, job, req FROM job_enqueued ORDER BY seq LIMIT 3").fetchall()
    conn.close()
    assert rows and all(isinstance(job, int) and req.startswith("req-") for _, job, req in rows)


def test_a_checkpoint_lists_the_first_findings_and_counts_the_rest(
    twins: tuple[Path, Path, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal whose records are mostly findings (a rank's, folded alone)
    must not grow its writer or its checkpoints without end: the first
    findings are listed, the rest counted, and the verdict says so."""
    from kvstate import checkpoint
    from kvstate.checkpoint import Resumed, restore, summary_of
    from kvstate.checkpointer import Checkpoints
    from kvstate.ledger import Ledger
    from replay.sources import entries

    monkeypatch.setattr(checkpoint, "MAX_FINDINGS", 50)
    plain, _, _ = twins
    kept = Checkpoints()
    kept.committed(list(entries([str(plain)])), [])
    assert len(kept.found) == 50 and kept.omitted > 100
    blobs = list(kept.parts())
    header, _, omitted = summary_of("x.db", 1707, blobs[0])
    assert omitted == kept.omitted
    resumed = Resumed(1707, "x.db", 9, header, lambda: iter(blobs), 0, omitted)
    assert len(restore(Ledger(), resumed)) == 50
    assert f"the first 50 findings of those records, and {omitted:,} more" in resumed.describe()
