"""The generic journal: append-only storage, the hash chain, group commit,
streaming and following readers, JSON Lines."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from journal import (
    Journal,
    JournalError,
    Record,
    RecordError,
    TamperedError,
    read_jsonl,
    write_jsonl,
)
from kvstate.thread_writer import JournalWriter


def recs(start: int, n: int) -> list[Record]:
    return [
        Record(s, "tick", {"n": s, "blocks": [s, s + 1]}, s // 10, s % 2 or None, 1000 + s)
        for s in range(start, start + n)
    ]


def test_append_and_read_back(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.append(recs(1, 5))
        j.append(recs(6, 5))
        assert len(j) == 10
        assert list(j.records()) == recs(1, 10)
        assert [r.seq for r in j.records(after=7)] == [8, 9, 10]


def test_update_and_delete_are_refused(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.append(recs(1, 2))
    conn = sqlite3.connect(tmp_path / "j.db")
    for sql in ("UPDATE records SET kind = 'x'", "DELETE FROM records"):
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(sql)
    conn.close()


def test_table_is_strict(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db"):
        pass
    conn = sqlite3.connect(tmp_path / "j.db")
    with pytest.raises(sqlite3.IntegrityError):
        conn.execute(
            "INSERT INTO records (seq, kind, step, payload, digest) VALUES (1, 'k', 'x', x'', x'')"
        )
    conn.close()


def test_tampering_is_detected_at_the_commit_of_the_changed_record(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.append(recs(1, 5))
        j.append(recs(6, 5))  # one commit, one link: seqs 6..10
        j.append(recs(11, 2))
    conn = sqlite3.connect(path)
    links = [r[0] for r in conn.execute("SELECT seq FROM records WHERE digest IS NOT NULL")]
    assert links == [5, 10, 12]
    conn.execute("DROP TRIGGER records_refuse_update")
    conn.execute("UPDATE records SET step = 99 WHERE seq = 7")
    conn.commit()
    conn.close()
    with Journal(path, readonly=True) as j:
        it = j.records()
        assert [next(it).seq for _ in range(5)] == [1, 2, 3, 4, 5]
        with pytest.raises(TamperedError, match=r"commit of seqs 6\.\.10") as info:
            next(it)
        # a reader starting inside the changed commit still checks all of it
        with pytest.raises(TamperedError):
            list(j.records(after=8))
        assert [r.seq for r in j.records(after=10)] == [11, 12]
    assert info.value.seq == 6 and str(path) in str(info.value)


def test_a_commit_whose_link_was_removed_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.append(recs(1, 3))
        j.append(recs(4, 3))
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER records_refuse_update")
    conn.execute("UPDATE records SET digest = NULL WHERE seq = 6")
    conn.commit()
    conn.close()
    with Journal(path, readonly=True) as j:
        with pytest.raises(TamperedError, match=r"seqs 4\.\.6 are not covered"):
            list(j.records())
        assert [r.seq for r in j.records(upto=3)] == [1, 2, 3]


def test_a_journal_linked_on_every_record_still_reads(tmp_path: Path) -> None:
    # Journals of schema version 1 carry a link on every row: the same chain
    # with one record per commit.
    path = tmp_path / "j.db"
    with Journal(path) as j:
        for seq in range(1, 6):
            j.append(recs(seq, 1))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = 1")
    conn.commit()
    conn.close()
    with Journal(path, readonly=True) as j:
        assert [r.seq for r in j.records()] == [1, 2, 3, 4, 5]
        assert [r.seq for r in j.records(after=2, upto=4)] == [3, 4]


def test_a_batch_is_all_or_nothing_and_seq_must_increase(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db") as j:
        j.append(recs(1, 3))
        bad = [*recs(4, 2), Record(5, "tick", {}, 0)]
        with pytest.raises(RecordError, match="does not follow"):
            j.append(bad)
        assert len(j) == 3
        j.append(recs(4, 1))
        assert len(j) == 4


def test_not_a_journal_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="no such journal"):
        Journal(tmp_path / "absent.db", readonly=True)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.close()
    with pytest.raises(JournalError, match="not a kvstate journal"):
        Journal(other, readonly=True)
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(JournalError):
        Journal(garbage, readonly=True)


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with Journal(path):
        pass
    conn = sqlite3.connect(path)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match="schema version 99"):
        Journal(path, readonly=True)


def test_readonly_journal_refuses_appends(tmp_path: Path) -> None:
    with Journal(tmp_path / "j.db"):
        pass
    with Journal(tmp_path / "j.db", readonly=True) as j, pytest.raises(JournalError):
        j.append(recs(1, 1))


def test_writer_commits_one_transaction_per_batch(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.db")
    statements: list[str] = []
    journal._conn.set_trace_callback(statements.append)
    with JournalWriter(journal, lambda r: r, background=True) as writer:
        for batch in range(3):
            for r in recs(1 + batch * 100, 100):
                writer.append(r)
            writer.commit()
        writer.flush()
        commits = [s for s in statements if s.strip().upper() == "COMMIT"]
        assert len(commits) == 3
    with Journal(tmp_path / "j.db", readonly=True) as j:
        assert len(j) == 300


def test_writer_failure_is_raised_and_nothing_is_lost(tmp_path: Path) -> None:
    writer = JournalWriter(Journal(tmp_path / "j.db"), lambda r: r, background=True)
    writer.append(recs(1, 1)[0])
    writer.append(recs(1, 1)[0])  # duplicate seq: the batch fails
    with pytest.raises(JournalError, match="writer failed"):
        writer.commit()  # a commit waits for its batch, so it reports the failure itself
    with pytest.raises(JournalError, match="writer failed"):
        writer.flush()
    assert [len(b) for b in writer.unwritten] == [2]
    with pytest.raises(JournalError):
        writer.close()


_APPENDER = """
import sys, time
from journal import Journal, Record
with Journal(sys.argv[1]) as j:
    for start in range(1, 50, 10):
        j.append([Record(s, "tick", {"n": s}, 0) for s in range(start, start + 10)])
        time.sleep(0.05)
"""


def test_follow_sees_records_another_process_appends(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    Journal(path).close()
    stop = threading.Event()
    seen: list[int] = []

    def read() -> None:
        with Journal(path, readonly=True) as reader:
            for record in reader.follow(poll_interval=0.01, stop=stop):
                seen.append(record.seq)

    thread = threading.Thread(target=read)
    thread.start()
    writer = subprocess.run([sys.executable, "-c", _APPENDER, str(path)], capture_output=True)
    assert writer.returncode == 0, writer.stderr
    deadline = time.monotonic() + 5
    while len(seen) < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(timeout=5)
    assert seen == list(range(1, 51))


def test_jsonl_round_trip_preserves_every_record(tmp_path: Path) -> None:
    original = recs(1, 20)
    write_jsonl(original, tmp_path / "a.jsonl")
    assert list(read_jsonl(tmp_path / "a.jsonl")) == original
    with Journal(tmp_path / "a.db") as j:
        j.append(read_jsonl(tmp_path / "a.jsonl"))
        write_jsonl(j.records(), tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ('{"kind":"a"}\n{oops\n', 2, "not valid JSON"),
        ('{"kind":"a"}\n[1,2]\n', 2, "JSON object"),
        ('{"seq":1}\n', 1, "no 'kind'"),
        ('{"kind":"a","seq":"1"}\n', 1, "'seq' must be an integer"),
        ('{"kind":"a","step":1.5}\n', 1, "'step' must be an integer"),
        ('{"kind":"a","seq":5}\n{"kind":"a","seq":5}\n', 2, "does not increase"),
    ],
)
def test_jsonl_errors_name_file_and_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(RecordError) as info:
        list(read_jsonl(path))
    assert info.value.line == line and message in str(info.value)
    assert str(info.value).startswith(f"{path}:{line}")


def test_jsonl_seq_defaults_to_line_number_and_blank_lines_count(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"kind":"a"}\n\n{"kind":"b"}\n')
    assert [r.seq for r in read_jsonl(path)] == [1, 3]


def test_invalid_utf8_is_a_located_error(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"kind":"a"}\n{"kind":"\xff"}\n')
    with pytest.raises(RecordError, match="UTF-8") as info:
        list(read_jsonl(path))
    assert info.value.line == 2


def test_views_are_readable_with_sqlite_utils(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    with Journal(path) as j:
        j.append(recs(1, 3))
        j.create_views({"tick": ("n", "blocks")})
        rows = j._conn.execute("SELECT seq, n, blocks FROM tick").fetchall()
        assert rows[0] == (1, 1, "[1,2]")
    out = subprocess.run(
        [sys.executable, "-m", "sqlite_utils", "query", str(path), "select n, blocks from tick"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout)[2] == {"n": 3, "blocks": "[3,4]"}


def _peak_while_reading(path: Path) -> int:
    with Journal(path, readonly=True) as j:
        tracemalloc.start()
        count = sum(1 for _ in j.records())
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert count > 0
    return peak


def test_reading_memory_does_not_grow_with_the_journal(tmp_path: Path) -> None:
    for name, n in (("small.db", 2_000), ("large.db", 40_000)):
        with Journal(tmp_path / name) as j:
            for start in range(1, n + 1, 1000):
                j.append(recs(start, 1000))
    small = _peak_while_reading(tmp_path / "small.db")
    large = _peak_while_reading(tmp_path / "large.db")
    # 20x the records; a reader that buffered them would peak ~20x higher
    assert large < 2 * small + 64 * 1024


def test_a_view_that_cannot_be_made_is_a_journal_error_naming_the_file(tmp_path: Path) -> None:
    """What a second process racing Recorder.open onto the same new journal
    meets (an object named like a view already there) is a JournalError
    naming the file, never a raw sqlite3 error."""
    from kvstate.recorder import Recorder

    path = tmp_path / "raced.db"
    Journal(path).close()
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE job_enqueued (x)")  # where a view belongs
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match=r"raced\.db: cannot create the journal's views"):
        Recorder.open(path, block_size=4, world_size=1)
