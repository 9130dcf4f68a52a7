"""kvstate.vllm's group commits: the engine's thread decides, kvstate's thread hands over.

The observer's hooks run on vLLM's engine thread every step; encoding a
group and writing it to the writer process's pipe is done by one thread of
kvstate's (``kvstate-commit``), so that it is not on the engine's clock.
These tests use a real recorder and its writer process.
"""

from __future__ import annotations

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


def _drained() -> None:
    """Wait until the committer has sent everything handed to it before (one queue, in order)."""
    done = threading.Event()

    class Last:
        def send(self) -> None:
            done.set()

    _commit.COMMITTER.hand_over(Last())  # type: ignore[arg-type]
    assert done.wait(HANG)


def test_a_due_group_is_handed_over_by_kvstates_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_commit, "INTERVAL", 0.0)  # every step with records is due
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    called, threads = _seen(recorder)
    for i in range(5):
        recorder.record(ev.RequestAdmitted(req=f"r{i}", gen=0, prompt_tokens=16), 1)
    group.step_ended()
    assert called.wait(HANG)
    assert threads == ["kvstate-commit"]  # not the caller's (the engine's) thread
    assert recorder.writer is not None
    recorder.writer.flush()  # every frame handed over is now written
    assert _rows(tmp_path / "engine.db") == 6  # the header and the five
    group.step_ended()  # nothing new: nothing handed over
    _drained()  # had it been, the hand-over would be done by now
    recorder.close()
    assert threads == ["kvstate-commit"]


def test_a_step_with_nothing_recorded_hands_nothing_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_commit, "INTERVAL", 0.0)
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    called, threads = _seen(recorder)
    for _ in range(3):
        group.step_ended()
    _drained()  # any hand-over is done (and counted) before the journal closes
    recorder.close()
    assert not called.is_set() and threads == []


def test_a_failed_hand_over_is_raised_at_the_next_step_on_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The observation that calls ``step_ended`` then ends that journal
    (``ObservedProcess.observe``); the error is never lost on the other thread."""
    monkeypatch.setattr(_commit, "INTERVAL", 0.0)
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)

    def failing(**_kwargs: Any) -> None:
        raise JournalError("engine.db: the journal writer process is gone")

    recorder.commit = failing  # type: ignore[method-assign]
    recorder.record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16), 1)
    group.step_ended()
    _drained()
    with pytest.raises(JournalError, match="writer process is gone"):
        group.step_ended()
    group.step_ended()  # raised once
    del recorder.commit
    recorder.close()
    assert _rows(tmp_path / "engine.db") == 2  # close flushed what the hand-over could not


def test_a_journal_closed_before_its_group_is_handed_over_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """finish() may close a journal while its group waits on the queue: close
    flushed it, and the late hand-over does nothing (no error at the next step)."""
    monkeypatch.setattr(_commit, "INTERVAL", 0.0)
    recorder = _recorder(tmp_path)
    group = _commit.GroupCommit(recorder)
    recorder.record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16), 1)
    recorder.close()
    group.send()  # as the committer thread would, after close
    assert group.failed is None
    assert _rows(tmp_path / "engine.db") == 2
