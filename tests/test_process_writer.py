"""The journal writer process: same journal as the thread, and it survives the engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from journal import Journal, JournalError
from kvstate import events as ev
from kvstate.codec import Entry, from_stored
from kvstate.harness.vllm_engine.watchdog import Stall
from kvstate.process_writer import ProcessWriter
from kvstate.recorder import Recorder
from kvstate.writer_codec import ORPHANED, BatchCodec, encode_batch
from replay.verdict import replay


def _events(n: int) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(n):
        out.append(ev.JobReceived(job=i, rank=i % 2))
        out.append(ev.DmaDone(job=i, rank=i % 2, digest=f"d{i}", blocks=(i, i + 1)))
        out.append(ev.RequestFinished(req=f"r{i}", gen=i, hold=bool(i % 3)))
    return out


def _stored(path: Path) -> list[Entry]:
    with Journal(path, readonly=True) as journal:
        return [from_stored(*row, str(path)) for row in journal.stored_rows()]


def test_the_writer_process_writes_what_the_thread_writes(tmp_path: Path) -> None:
    events = _events(50)
    clock = iter(range(10**6)).__next__
    paths = []
    for process in (False, True):
        path = tmp_path / f"{process}.db"
        with Recorder.open(
            path, block_size=16, world_size=2, process=process, clock=clock, run="one"
        ) as rec:
            for i, event in enumerate(events):
                rec.record(event, i // 7)
                if i % 7 == 6:
                    rec.commit(wait=i % 2 == 0)
        paths.append(path)
    thread, process = (_stored(p) for p in paths)
    assert [(e.seq, e.step, e.event) for e in thread] == [(e.seq, e.step, e.event) for e in process]
    assert len(process) == len(events) + 1


def test_a_killed_engine_loses_nothing_it_handed_over(tmp_path: Path) -> None:
    path = tmp_path / "engine.db"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from kvstate import events as ev
        from kvstate.recorder import Recorder
        rec = Recorder.open({str(path)!r}, block_size=16, world_size=1, process=True)
        for i in range(300):
            rec.record(ev.JobReceived(job=i, rank=0), i // 10)
            if i % 10 == 9:
                rec.commit(wait=False)  # handed over, not waited for
        rec.record(ev.JobReceived(job=999, rank=0), 99)  # never handed over
        print(rec.writer.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr
    writer = int(run.stdout.split()[0])
    _wait_until_gone(writer)
    stored = _stored(path)
    received = [e.event.job for e in stored if isinstance(e.event, ev.JobReceived)]
    assert received == list(range(300))
    last = stored[-1].event
    assert isinstance(last, ev.EngineCrashed) and last.error == ORPHANED
    result = replay([str(path)])
    assert result.violations[-1].code == "CRASH"  # (the jobs were never enqueued: CAUSALITY)


def _writer(tmp_path: Path) -> tuple[Path, ProcessWriter]:
    """A new journal and a writer process for it (not started yet)."""
    path = tmp_path / "j.db"
    Journal(path).close()
    return path, ProcessWriter(path)


def test_a_write_error_in_the_writer_process_reaches_the_engine(tmp_path: Path) -> None:
    path, writer = _writer(tmp_path)
    writer.append(Entry(1, 0, None, ev.EngineIdle()))
    writer.commit()
    writer.append(Entry(1, 0, None, ev.EngineIdle()))  # seq 1 again
    with pytest.raises(JournalError, match="does not follow seq 1"):
        writer.commit()
    with pytest.raises(JournalError):
        writer.close()
    assert writer._process.poll() is not None
    assert [e.seq for e in _stored(path)] == [1]


def test_start_readies_the_writer_process_and_sends_nothing_built(tmp_path: Path) -> None:
    # Started with the journal (kvstate.vllm opens its journals while vLLM
    # builds the engine), the process's start-up is over before the first
    # commit; what was appended meanwhile goes with that commit, not before.
    path, writer = _writer(tmp_path)
    writer.append(Entry(1, 0, None, ev.EngineIdle()))
    assert writer.pid is None
    writer.start()
    pid = writer.pid
    assert pid is not None and writer._process.poll() is None  # running, and it answered
    assert _stored(path) == []  # the record being built was not sent
    writer.start()  # a second start is nothing
    assert writer.pid == pid
    writer.commit()
    assert [e.seq for e in _stored(path)] == [1]
    writer.close()
    with pytest.raises(JournalError):
        writer.start()


def test_a_record_the_decoder_refuses_is_written_as_record_refused(tmp_path: Path) -> None:
    # Building an event does not validate it; the writer writes, at its seq,
    # what it refused and why, so every reader can go past it.
    codec = BatchCodec()
    blob = encode_batch([Entry(4, 0, None, ev.JobStarted(job=-5, rank=3))])
    [(seq, kind, _step, rank, _ts, payload)] = codec.rows(blob)
    assert (seq, kind, rank) == (4, "record_refused", None)
    event = from_stored(seq, kind, 0, rank, None, payload, "j.db").event
    assert isinstance(event, ev.RecordRefused) and event.refused == "job_started"
    assert "'job' must be a non-negative integer, not -5" in event.error


def _wait_until_gone(pid: int) -> None:
    # A safety bound for a broken writer, not a judgement of speed: the
    # writer exits as soon as it has read its pipe to the end.
    for _ in range(6000):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"writer process {pid} outlived its engine")


def _recorded(path: Path, events: list[ev.Event]) -> Recorder:
    rec = Recorder.open(path, block_size=16, world_size=2, run="one")
    for i, event in enumerate(events):
        rec.record(event, i)
    return rec


def test_ctrl_c_in_the_encoder_leaves_the_batch_for_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal handler raises at whatever call the engine is in; Ctrl-C
    landing as the batch is encoded must not lose it (it did: the batch had
    left the buffer first, and the journal got a gap in its seqs)."""
    path = tmp_path / "engine.db"
    events = _events(20)
    rec = _recorded(path, events[:30])
    writer = rec.writer
    assert isinstance(writer, ProcessWriter)
    import kvstate.process_writer as pw

    real = pw.encode_batch

    def interrupted(batch: list[Entry]) -> bytes:
        real(batch)
        monkeypatch.setattr(pw, "encode_batch", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(pw, "encode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rec.commit()
    for i, event in enumerate(events[30:], start=30):
        rec.record(event, i)
    rec.close()
    stored = _stored(path)
    assert [e.seq for e in stored] == list(range(1, len(events) + 2))
    assert [e.event for e in stored[1:]] == events


def test_ctrl_c_between_two_reads_of_an_answer_keeps_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer can arrive in pieces; Ctrl-C after the first piece was read
    must leave it for the next wait. Reading the rest as a new header (as
    the engine did) lost the protocol: every later answer was misread."""
    import kvstate.process_writer as pw

    path = tmp_path / "engine.db"
    events = _events(20)
    rec = _recorded(path, events[:30])
    rec.commit()  # the writer process is started
    writer = rec.writer
    assert isinstance(writer, ProcessWriter)
    real_read = os.read
    reads = 0

    def in_pieces(fd: int, n: int) -> bytes:
        nonlocal reads
        if fd != writer._in:
            return real_read(fd, n)
        reads += 1
        if reads == 2:  # Ctrl-C while waiting for the rest of an answer
            raise KeyboardInterrupt
        return real_read(fd, min(n, 5))

    monkeypatch.setattr(pw.os, "read", in_pieces)
    for i, event in enumerate(events[30:40], start=30):
        rec.record(event, i)
    with pytest.raises(KeyboardInterrupt):
        rec.commit()
    assert reads == 2 and len(writer._inbox) == 5  # the piece read is kept, not dropped
    for i, event in enumerate(events[40:], start=40):
        rec.record(event, i)
        rec.commit()
    rec.close()
    assert [e.event for e in _stored(path)[1:]] == events


def test_two_threads_waiting_for_their_commits_read_the_answers_in_turn(tmp_path: Path) -> None:
    """The engine's thread waits for its step while a sending thread flushes
    before it raises: two readers of one answer pipe must not split an answer."""
    import threading

    path = tmp_path / "engine.db"
    rec = Recorder.open(path, block_size=16, world_size=2, run="one")
    events = _events(200)
    failures: list[BaseException] = []

    def commit_each(mine: list[ev.Event]) -> None:
        try:
            for event in mine:
                rec.record(event, 0)
                rec.commit()
        except BaseException as exc:
            failures.append(exc)

    threads = [
        threading.Thread(target=commit_each, args=(events[i::2],), daemon=True) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    writer = rec.writer
    assert isinstance(writer, ProcessWriter)
    # Split answers leave a thread waiting for one that never comes: fail on
    # no progress (the tickets answered), not on a deadline.
    progress = lambda: (writer._written, writer._submitted)  # noqa: E731
    stall = Stall(30, progress(), time.monotonic())
    while any(thread.is_alive() for thread in threads):
        if stall.stalled(progress(), time.monotonic()):
            pytest.fail(f"a waiting thread stopped moving at {progress()}")
        time.sleep(0.05)
    rec.close()
    assert failures == []
    assert sorted(map(repr, (e.event for e in _stored(path)[1:]))) == sorted(map(repr, events))
