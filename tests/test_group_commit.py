"""kvstate.vllm's group commits: the engine's thread records, kvstate's thread hands over.

The observer's hooks run on vLLM's engine thread every step; encoding a
group and writing it to the writer process's pipe is done by one thread of
kvstate's (``kvstate-commit``), which wakes on its own every ``INTERVAL``,
so that neither the hand-over nor waking that thread is on the engine's
clock. These tests use a real recorder and its writer process; they wait
on the committer's rounds (progress), never on time.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from journal import JournalError
from kvstate import events as ev
from kvstate.recorder import Recorder
from kvstate.vllm import _commit

#: a guard against a hang only: every wait below ends on progress
HANG = 120.0


def _recorder(tmp_path: Path) -> Recorder:
    return Recorder.open(tmp_path / "engine.db", block_size=16, world_size=1, audit="off")


def _rows(path: Path) -> int:
    with sqlite3.connect(path) as db:
        count: int = db.execute("SELECT count(*) FROM records").fetchone()[0]
    return count


def _seen(recorder: Recorder) -> tuple[threading.Event, list[str]]:
    """Wrap ``recorder.commit``: which threads called it, and an event at each call."""
    called = threading.Event()
    threads: list[str] = []
    commit = recorder.commit

    def watched(**kwargs: Any) -> None:
        threads.append(threading.current_thread().name)
        try:
            commit(**kwargs)
        finally:
            called.set()

    recorder.commit = watched  # type: ignore[method-assign]
    return called, threads


def _settled() -> None:
    """Wait until the committer has handed over everything recorded so far."""
    assert _commit.COMMITTER.settle(HANG)


def test_a_group_is_handed_over_by_kvstates_thread(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    called, threads = _seen(recorder)
    for i in range(5):
        recorder.record(ev.RequestAdmitted(req=f"r{i}", gen=0, prompt_tokens=16), 1)
    group.step_ended()
    assert called.wait(HANG)  # the committer's next round, with no call of the engine's
    assert threads == ["kvstate-commit"]  # not the caller's (the engine's) thread
    assert recorder.writer is not None
    recorder.writer.flush()  # every frame handed over is now written
    assert _rows(tmp_path / "engine.db") == 6  # the header and the five
    group.step_ended()  # nothing new: nothing handed over
    _settled()  # had it been, the hand-over would be done by now
    recorder.close()
    assert threads == ["kvstate-commit"]


def test_a_step_with_nothing_recorded_hands_nothing_over(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    called, threads = _seen(recorder)
    for _ in range(3):
        group.step_ended()
    _settled()  # any hand-over is done (and counted) before the journal closes
    recorder.close()
    assert not called.is_set() and threads == []


def test_a_burst_is_handed_over_at_once_not_at_the_next_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's thread wakes the committer only for MAX_RECORDS waiting:
    with ticks an hour apart, the burst is still handed over."""
    monkeypatch.setattr(_commit, "MAX_RECORDS", 4)
    monkeypatch.setattr(_commit, "INTERVAL", 3600.0)
    try:
        recorder = _recorder(tmp_path)
        group = _commit.GroupCommit(recorder)
        _settled()  # the committer now waits an INTERVAL, or a wake
        called, threads = _seen(recorder)
        for i in range(3):
            recorder.record(ev.RequestAdmitted(req=f"r{i}", gen=0, prompt_tokens=16), 1)
        group.step_ended()  # 3 waiting: left for the tick
        recorder.record(ev.RequestAdmitted(req="r3", gen=0, prompt_tokens=16), 1)
        group.step_ended()  # 4: now
        assert called.wait(HANG)
        assert threads == ["kvstate-commit"]
        recorder.close()
    finally:
        monkeypatch.undo()
        _commit.COMMITTER.wake()  # back to ticks of INTERVAL for the tests after this one


def test_a_failed_hand_over_is_raised_at_the_next_step_on_the_callers_thread(
    tmp_path: Path,
) -> None:
    """The observation that calls ``step_ended`` then ends that journal
    (``ObservedProcess.observe``); the error is never lost on the other thread."""
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)

    def failing(**_kwargs: Any) -> None:
        raise JournalError("engine.db: the journal writer process is gone")

    recorder.commit = failing  # type: ignore[method-assign]
    recorder.record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16), 1)
    _settled()
    with pytest.raises(JournalError, match="writer process is gone"):
        group.step_ended()
    group.step_ended()  # raised once
    del recorder.commit
    recorder.close()
    assert _rows(tmp_path / "engine.db") == 2  # close flushed what the hand-over could not


def test_a_journal_closed_before_its_group_is_handed_over_loses_nothing(tmp_path: Path) -> None:
    """finish() may close a journal between the committer's rounds: close
    flushed it, and a late hand-over does nothing (no error at the next step)."""
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    recorder.record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16), 1)
    recorder.close()
    group.send()  # as the committer thread would, after close
    assert group.failed is None
    assert _rows(tmp_path / "engine.db") == 2


def test_a_forked_child_hands_over_none_of_its_parents_journals(tmp_path: Path) -> None:
    """The records buffered at the fork are the parent's, for the parent's
    writer process: the child's committer must never send them (twice)."""
    recorder = _recorder(tmp_path)
    _commit.GroupCommit(recorder)
    called, threads = _seen(recorder)
    _settled()  # the committer now waits for its next tick
    recorder.record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16), 1)
    pid = os.fork()
    if pid == 0:
        inherited = len(_commit.COMMITTER._groups)
        os._exit(3 if inherited or called.is_set() else 0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _settled()
    recorder.close()
    assert _rows(tmp_path / "engine.db") == 2  # the header and the record, once
    assert threads == ["kvstate-commit"]
