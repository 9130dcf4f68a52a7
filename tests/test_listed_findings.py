"""A live audit lists its first findings and counts the rest: weeks of them grow no process.

An engine that breaks an invariant every step, observed for weeks, would
otherwise grow its own process (``recorder.violations``, the findings no
ledger takes) and its writer process with every finding. The journal holds
every record, and replay lists every finding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstate import audit
from kvstate import events as ev
from kvstate.audit import Auditor
from kvstate.codec import Entry
from kvstate.recorder import Recorder
from kvstate.violations import Code, Violation
from replay.verdict import replay


def _unknown_completions(n: int) -> list[ev.Event]:
    """``n`` completions of jobs never enqueued: one CAUSALITY finding each."""
    return [ev.CompletionsReceived(job=100 + i, count=1) for i in range(n)]


def test_an_inline_audit_lists_the_first_findings_and_counts_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(audit, "LISTED_FINDINGS", 5)
    rec = Recorder.in_memory(block_size=16, world_size=1, audit="inline")
    rec.auditor.attach_scheduler()
    found = [v for event in _unknown_completions(12) for v in rec.emit(event, 1)]
    assert len(found) == 12  # each call still returns its own findings
    assert [v.job for v in rec.violations] == [100, 101, 102, 103, 104]
    assert rec.auditor.omitted == 7


def test_findings_no_ledger_takes_are_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``record`` (the vLLM observer's way: no ledger ever takes them) keeps
    the oldest untaken findings, as many as are listed."""
    monkeypatch.setattr(audit, "LISTED_FINDINGS", 5)
    rec = Recorder.in_memory(block_size=16, world_size=1, audit="inline")
    rec.auditor.attach_scheduler()
    for event in _unknown_completions(12):
        rec.record(event, 1)
    assert [v.job for v in rec.auditor.untaken] == [100, 101, 102, 103, 104]
    assert [v.job for v in rec.auditor.take_new()] == [100, 101, 102, 103, 104]
    rec.record(ev.CompletionsReceived(job=7, count=1), 1)
    assert [v.job for v in rec.auditor.take_new()] == [7]  # room again once taken


def test_a_writer_processs_auditor_lists_nothing_and_still_reports_each_batch() -> None:
    remote = Auditor.remote("scheduler", None)
    first: list[Violation] = []
    remote.on_first = first.append
    header = ev.JournalOpened(version=1, block_size=16, world_size=1)
    events = [header, *_unknown_completions(3)]
    found = remote.fold_batch([Entry(seq, 1, 0, e) for seq, e in enumerate(events, start=1)])
    assert [v.code for v in found] == [Code.CAUSALITY] * 3
    assert remote.violations == [] and remote.untaken == [] and remote.omitted == 0
    assert [v.job for v in first] == [100]  # the first finding is still told (logged once)


def test_a_journaled_recorder_lists_the_first_and_replay_lists_every_finding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default recorder: a writer process that audits each batch and
    reports its findings back, listed here up to the bound."""
    monkeypatch.setattr(audit, "LISTED_FINDINGS", 5)
    path = tmp_path / "engine.db"
    rec = Recorder.open(path, block_size=16, world_size=1)
    rec.auditor.attach_scheduler()
    for event in _unknown_completions(12):
        rec.record(event, 1)
    rec.commit(settle=True)
    assert [v.job for v in rec.violations] == [100, 101, 102, 103, 104]
    assert rec.auditor.omitted == 7
    rec.close()
    result = replay([str(path)])
    assert [v.job for v in result.violations] == list(range(100, 112))
