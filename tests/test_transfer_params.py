"""A request's ``kv_transfer_params`` in the generic adapter's journal.

A prefill/decode pair relates two engines' journals of one request by these:
the decode's request arrives naming where its KV is, and the prefill's
connector returns, with its delayed free, what the decode will read. The
generic observer writes each once (``transfer_params``), never a test's
mock, and the fold accepts them without a finding.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kvstate import Recorder
from kvstate.vllm.generic._observer import ConnectorObserver
from replay.sources import Located
from replay.verdict import fold_located


def _observer() -> tuple[Recorder, ConnectorObserver]:
    rec = Recorder.in_memory(block_size=16, world_size=1)
    return rec, ConnectorObserver(rec, block_size=16, world_size=1)


def _records(rec: Recorder) -> list[Any]:
    return [e.event for e in rec.entries or [] if e.event.kind != "journal_opened"]


def _fold(rec: Recorder) -> list[str]:
    entries = rec.entries or []
    _ledger, _n, violations, _warnings = fold_located(Located(e, "j", e.seq, None) for e in entries)
    return [v.code.value for v in violations]


def test_a_decode_request_names_where_its_kv_is_once() -> None:
    rec, observer = _observer()
    remote = {"do_remote_prefill": True, "remote_block_ids": [4, 5], "remote_engine_id": "p0"}
    request = SimpleNamespace(request_id="r", kv_transfer_params=remote)
    observer.matched(request, 0, (32, True))
    observer.matched(request, 0, (32, True))  # asked again: neither record is repeated
    kinds = [e.kind for e in _records(rec)]
    assert kinds == ["transfer_params", "kv_matched"]
    params = _records(rec)[0]
    assert (params.req, params.at, params.gen) == ("r", "arrived", None)
    assert json.loads(params.params) == remote
    assert list(json.loads(params.params)) == sorted(remote)  # keys sorted: one text per mapping
    assert _fold(rec) == []


def test_a_prefill_finish_names_what_the_decode_will_read_with_its_generation() -> None:
    rec, observer = _observer()
    request = SimpleNamespace(request_id="r", kv_transfer_params=None, status="FINISHED_LENGTH")
    observer.matched(request, 0, (0, False))
    observer.admit("r", 32)
    observer.replaced("r", [1, 2], [])
    handed = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 7}
    observer.finished_by(request, (True, handed))
    observer.output(
        SimpleNamespace(finished_recving=(), finished_sending={"r"}, invalid_block_ids=None)
    )
    records = _records(rec)
    kinds = [e.kind for e in records]
    assert "transfer_params" in kinds
    params = records[kinds.index("transfer_params")]
    assert (params.req, params.at, params.gen) == ("r", "finished", 0)
    assert json.loads(params.params) == handed
    finish = records[kinds.index("request_finished")]
    assert finish.hold
    assert kinds[-1] == "held_blocks_released"
    assert _fold(rec) == []


def test_no_params_and_a_mock_s_params_write_nothing() -> None:
    rec, observer = _observer()
    for i, params in enumerate([None, {}, object(), SimpleNamespace(do_remote_prefill=True)]):
        request = SimpleNamespace(request_id=f"r{i}", kv_transfer_params=params)
        observer.matched(request, 0, (0, False))
        observer.admit(f"r{i}", 16)
        observer.finished_by(request, (False, params))
    assert "transfer_params" not in [e.kind for e in _records(rec)]


def test_a_mapping_whose_keys_cannot_be_sorted_is_still_written() -> None:
    rec, observer = _observer()
    request = SimpleNamespace(request_id="r", kv_transfer_params={1: "a", "b": 2})
    observer.matched(request, 0, (0, False))
    (params,) = [e for e in _records(rec) if e.kind == "transfer_params"]
    assert "'b': 2" in json.loads(params.params)
