"""A value the contract refuses never makes a journal unreadable.

With a writer process (the default) the writer decodes every record anyway:
a record it refuses is written as a ``record_refused`` at the same seq, the
audit reports ``RECORD_REFUSED`` like any finding, and replay still gives a
verdict for everything the journal holds. With any other writer the call
itself is refused (``RefusedValueError`` naming the field) and nothing is
recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from journal import Journal
from kvstate import Recorder, SchedulerLedger
from kvstate.errors import LedgerUsageError, RefusedValueError
from kvstate.events import RequestAdmitted
from kvstate.violations import RecordRefusedError
from replay.cli import main

BAD_BLOCKS: dict[str, list[Any]] = {"negative": [-1], "a string": ["x"], "2^64": [2**64]}


def _run(rec: Recorder, blocks: list[Any], strict: bool = False) -> SchedulerLedger:
    s = SchedulerLedger(rec, strict=strict)
    s.begin_step()
    s.admit("r", 4)
    s.assign_blocks("r", blocks, resumed=False)
    s.request_finished("r")
    s.idle()
    return s


def _replay(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    status = main(["replay", "--json", str(path)])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("bad", sorted(BAD_BLOCKS))
def test_the_writer_process_writes_a_record_refused_in_its_place(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.db"
    rec = Recorder.open(path, block_size=4, world_size=1)
    _run(rec, BAD_BLOCKS[bad])
    rec.close()
    assert [v.code.value for v in rec.violations] == ["RECORD_REFUSED"]  # found live
    with Journal(path, readonly=True) as journal:
        kinds = [r.kind for r in journal.records()]
    assert kinds[2] == "record_refused" and kinds[-1] == "engine_idle"  # seq 3
    status, report = _replay(path, capsys)
    assert status == 1 and report["verdict"] == "violations"  # a verdict, not exit 2
    (refused,) = report["violations"]
    assert refused["code"] == "RECORD_REFUSED" and refused["seq"] == 3
    assert "'blocks' must be a list of non-negative integers" in refused["message"]


def test_a_strict_ledger_raises_the_refusal_at_its_next_call(tmp_path: Path) -> None:
    rec = Recorder.open(tmp_path / "run.db", block_size=4, world_size=1)
    s = SchedulerLedger(rec)
    s.begin_step()
    s.admit("r", 4)
    s.assign_blocks("r", [-1], resumed=False)
    s.begin_step()  # its batch is durable; the writer audits it while the engine goes on
    with pytest.raises(RecordRefusedError, match="blocks_assigned"):
        s.begin_step()  # the next answer brings the finding back
    rec.close(raise_found=False)


@pytest.mark.parametrize("process", [False, True], ids=["writer thread", "writer process"])
def test_an_object_no_codec_can_write_is_refused_not_a_traceback(
    tmp_path: Path, process: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a connector test's MagicMock did: TypeError out of the encoder at finish()."""
    path = tmp_path / "run.db"
    rec = Recorder.open(path, block_size=4, world_size=1, process=process)
    event = RequestAdmitted(req="r", gen=0, prompt_tokens=mock.MagicMock())
    if process:
        rec.record(event, 1)  # handed over: refused by the writer
        rec.close()
        status, report = _replay(path, capsys)
        assert status == 1 and report["violations"][0]["code"] == "RECORD_REFUSED"
        message = report["violations"][0]["message"]
        assert "'prompt_tokens' must be a non-negative integer, not <MagicMock" in message
    else:
        with pytest.raises(RefusedValueError, match="request_admitted"):
            rec.record(event, 1)
        rec.close()
        assert _replay(path, capsys)[0] == 0  # the header alone, nothing lost


@pytest.mark.parametrize("bad", sorted(BAD_BLOCKS))
@pytest.mark.parametrize("placement", ["writer thread", "committing thread", "in memory"])
def test_elsewhere_the_call_is_refused_and_nothing_recorded(
    placement: str, bad: str, tmp_path: Path
) -> None:
    if placement == "in memory":
        rec = Recorder.in_memory(block_size=4, world_size=1)
    else:
        rec = Recorder.open(
            tmp_path / "run.db", block_size=4, world_size=1, process=False,
            background=placement == "writer thread",
        )  # fmt: skip
    s = SchedulerLedger(rec)
    s.begin_step()
    s.admit("r", 4)
    with pytest.raises(RefusedValueError, match="'blocks' must be a list of non-negative") as e:
        s.assign_blocks("r", BAD_BLOCKS[bad], resumed=False)
    assert isinstance(e.value, LedgerUsageError)
    assert rec.recorded == 2  # header, admit; nothing for the refused call, no seq taken
    assert s.table("r") == []
    s.assign_blocks("r", [1], resumed=False)  # the ledger goes on
    s.request_finished("r")
    s.idle()
    rec.close()
    assert rec.violations == []


def test_a_header_the_contract_refuses_is_refused_at_open(tmp_path: Path) -> None:
    with pytest.raises(RefusedValueError, match="block_size"):
        Recorder.open(tmp_path / "run.db", block_size=mock.MagicMock(), world_size=1)  # type: ignore[arg-type]
    with pytest.raises(RefusedValueError, match="world_size"):
        Recorder.in_memory(block_size=4, world_size=0)
