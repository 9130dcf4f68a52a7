"""A prefill/decode pair's two journals, related by the proxy's transfer id (replay.pairs).

Each engine journals its own request ids and its own pool's blocks; only the
``transfer_id`` in each request's ``kv_transfer_params`` is shared. The
records here are the ones kvstate's generic adapter writes for vLLM's
MooncakeConnector (``tests/test_vllm_pd.py`` runs the real pair), on one
clock as two engines of one host share CLOCK_MONOTONIC.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstate import Recorder
from kvstate import events as ev
from kvstate import transfer_events as tx
from kvstate.violations import Code
from replay.cli import main as cli_main
from replay.pairs import relate
from replay.verdict import replay


def _journal(path: Path, clock: Callable[[], int], events: list[ev.Event]) -> str:
    rec = Recorder.open(
        path, block_size=32, world_size=1, process=False, background=False, clock=clock
    )
    for step, event in enumerate(events):
        rec.record(event, step)
    rec.close(raise_found=False)
    return str(path)


def _arrived(req: str, **params: object) -> tx.TransferParams:
    return tx.TransferParams(req=req, at="arrived", params=json.dumps(params, sort_keys=True))


def _prefill(transfer: str, *, released: bool = True) -> list[ev.Event]:
    events: list[ev.Event] = [
        _arrived("p-1", do_remote_decode=True, transfer_id=transfer),
        ev.RequestAdmitted(req="p-1", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="p-1", gen=0, blocks=(1, 2), mode="replace"),
        ev.RequestFinished(req="p-1", gen=0, hold=True),
    ]
    if released:
        events += [
            tx.TransferFinished(req="p-1", gen=0, direction="send"),
            ev.HeldBlocksReleased(req="p-1", gen=0),
        ]
    return events


def _decode(transfer: str) -> list[ev.Event]:
    return [
        _arrived("d-1", do_remote_prefill=True, transfer_id=transfer, remote_engine_id="p"),
        ev.RequestAdmitted(req="d-1", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="d-1", gen=0, blocks=(7, 8), mode="replace"),
        tx.RemoteLoadStarted(req="d-1", gen=0, blocks=(7, 8), tokens=63),
        tx.TransferFinished(req="d-1", gen=0, direction="recv"),
    ]


def test_a_decode_load_is_related_to_the_prefill_hold_it_read(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    # the decode asks first; the prefill's send and free follow (push: it wrote, then freed)
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    pair = relate([prefill], [decode])
    assert pair.related == ["x-1"] and pair.unrelated == [] and pair.freed_before_read == []
    assert pair.blocks == 2
    assert (pair.prefill["x-1"].req, pair.decode["x-1"].req) == ("p-1", "d-1")


def test_a_prefill_that_freed_before_the_decode_asked_is_named(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    # vLLM #45357, #52234: the prefill's hold ended before the decode's load began
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    assert relate([prefill], [decode]).freed_before_read == ["x-1"]


def test_a_load_with_no_prefill_hold_is_unrelated(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    decode = _journal(tmp_path / "d.db", clock, _decode("x-2"))
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    pair = relate([prefill], [decode])
    assert pair.related == [] and pair.unrelated == ["x-2"]


def test_a_hold_still_held_is_never_freed_before_the_read(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1", released=False))
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    pair = relate([prefill], [decode])
    assert pair.related == ["x-1"] and pair.freed_before_read == []


def test_a_prefill_that_did_not_hold_while_the_decode_read_is_named(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    events = _prefill("x-1", released=False)
    events[-1] = ev.RequestFinished(req="p-1", gen=0, hold=False)  # freed at once
    prefill = _journal(tmp_path / "p.db", clock, events)
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    pair = relate([prefill], [decode])
    assert pair.related == ["x-1"] and pair.not_held == ["x-1"]
    assert pair.freed_before_read == []  # a free, but not of held blocks


def test_a_load_reported_failed_after_a_free_without_hold_is_not_a_read(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    events = _prefill("x-1", released=False)
    events[-1] = ev.RequestFinished(req="p-1", gen=0, hold=False, aborted=True)
    prefill = _journal(tmp_path / "p.db", clock, events)
    failed = _decode("x-1")
    failed[-1] = tx.TransferFinished(req="d-1", gen=0, direction="recv", failed=True)
    decode = _journal(tmp_path / "d.db", clock, failed)
    assert relate([prefill], [decode]).not_held == []


def test_a_transfer_id_met_again_keeps_its_first_request(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    second = [
        _arrived("p-2", do_remote_decode=True, transfer_id="x-1"),
        ev.RequestAdmitted(req="p-2", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="p-2", gen=0, blocks=(3,), mode="replace"),
        ev.RequestFinished(req="p-2", gen=0, hold=False),
    ]
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1") + second)
    pair = relate([prefill], [decode])
    assert pair.prefill["x-1"].req == "p-1" and pair.prefill["x-1"].held
    assert pair.not_held == [] and pair.freed_before_read == []


def test_a_reused_delayed_free_is_named_with_the_transfer_it_broke(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    # vLLM #52234: the prefill hands p-1's held blocks to p-2 (another
    # transfer's request) before the decode read them
    events = [
        *_prefill("x-1", released=False),
        _arrived("p-2", do_remote_decode=True, transfer_id="x-2"),
        ev.RequestAdmitted(req="p-2", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="p-2", gen=0, blocks=(2, 3), mode="replace"),
    ]
    prefill = _journal(tmp_path / "p.db", clock, events)
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    found = replay([prefill]).violations
    assert [v.code for v in found] == [Code.DELAYED_FREE_REUSED]
    assert found[0].req == "p-2"  # the request handed the block...
    assert relate([prefill], [decode]).transfer_of("prefill", found[0]) == "x-1"  # ...broke x-1


def test_a_load_handed_on_is_flagged_once_and_its_receive_is_expected(tmp_path: Path) -> None:
    clock = itertools.count(1000).__next__
    # vLLM #56104, #41269: d-1 is aborted while its write is still landing, and
    # d-2 gets its blocks; the receive is reported later, as the write ends
    events = [
        *_decode("x-1")[:-1],
        ev.RequestFinished(req="d-1", gen=0, hold=True, aborted=True),
        ev.RequestAdmitted(req="d-2", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="d-2", gen=0, blocks=(7, 8), mode="replace"),
        tx.TransferFinished(req="d-1", gen=0, direction="recv"),
        ev.HeldBlocksReleased(req="d-1", gen=0),
    ]
    decode = _journal(tmp_path / "d.db", clock, events)
    found = replay([decode]).violations
    assert sorted(v.code.value for v in found) == [
        "DELAYED_FREE_REUSED",
        "DELAYED_FREE_REUSED",
        "LOAD_TARGET_RELEASED",
    ]  # one per block reused, one for the load: no UNEXPECTED_TRANSFER at its receive
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    pair = relate([prefill], [decode])
    assert {pair.transfer_of("decode", v) for v in found} == {"x-1"}


def _pd_check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    status = cli_main(["pd-check", *argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out) if out.strip() else {}


def test_pd_check_reads_the_two_journals_as_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = itertools.count(1000).__next__
    decode = _journal(
        tmp_path / "d.db",
        clock,
        [*_decode("x-1"), ev.RequestFinished(req="d-1", gen=0), ev.EngineIdle()],
    )
    prefill = _journal(tmp_path / "p.db", clock, [*_prefill("x-1"), ev.EngineIdle()])
    status, out = _pd_check(capsys, prefill, decode, "--require-idle")
    assert status == 0, out
    assert out["related"] == ["x-1"] and out["blocks_moved"] == 2
    assert all(not found for found in out["pair"].values())


def test_pd_check_fails_a_pair_whose_prefill_freed_before_the_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = itertools.count(1000).__next__
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    status, out = _pd_check(capsys, prefill, decode)
    assert status == 1
    assert out["pair"]["read after the free"] == ["x-1"]
    assert out["prefill"]["violations"] == out["decode"]["violations"] == []


def test_pd_check_names_the_transfer_of_an_engines_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = itertools.count(1000).__next__
    events = [
        *_prefill("x-1", released=False),
        ev.RequestAdmitted(req="p-2", gen=0, prompt_tokens=64),
        ev.BlocksAssigned(req="p-2", gen=0, blocks=(2,), mode="replace"),
    ]
    prefill = _journal(tmp_path / "p.db", clock, events)
    decode = _journal(tmp_path / "d.db", clock, _decode("x-1"))
    status, out = _pd_check(capsys, prefill, decode)
    assert status == 1
    (found,) = out["prefill"]["violations"]
    assert (found["code"], found["transfer"]) == ("DELAYED_FREE_REUSED", "x-1")


def test_pd_check_names_an_unusable_journal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = itertools.count(1000).__next__
    prefill = _journal(tmp_path / "p.db", clock, _prefill("x-1"))
    status = cli_main(["pd-check", prefill, str(tmp_path / "missing.db")])
    assert status == 2
    assert "missing.db" in capsys.readouterr().err
