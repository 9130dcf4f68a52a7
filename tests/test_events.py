"""Event kinds: validation where records are decoded, and the record codecs."""

from __future__ import annotations

import pytest

from journal import Record, RecordError
from kvstate import events as ev
from kvstate.codec import Entry, event_payload, from_record, from_stored, payload_bytes, to_record

SPEC_KINDS = {
    "journal_opened",
    "request_admitted",
    "request_resumed",
    "blocks_assigned",
    "request_preempted",
    "request_finished",
    "held_blocks_released",
    "job_enqueued",
    "completions_received",
    "pins_released",
    "engine_crashed",
    "engine_idle",
    "job_received",
    "preemption_seen",
    "job_started",
    "job_skipped",
    "dma_started",
    "dma_done",
    "put_done",
    "put_failed",
    "offset_saved",
    "request_marked_skipped",
    "retry_tokens_set",
    "retry_tokens_cleared",
    "kv_block_stored",
    "request_retired",
    "job_reported",
    "key_verified",
    "load_verified",
}

EXAMPLES: dict[str, dict[str, object]] = {
    "journal_opened": {"version": 1, "block_size": 16, "world_size": 2, "policy": "kvstate"},
    "request_admitted": {"req": "r", "gen": 0, "prompt_tokens": 40, "hashes": ["a", "b"]},
    "request_resumed": {"req": "r", "gen": 1},
    "blocks_assigned": {"req": "r", "gen": 0, "blocks": [1, 2], "mode": "append", "cached": [1]},
    "request_preempted": {"req": "r", "gen": 0},
    "request_finished": {"req": "r", "gen": 0, "hold": True, "aborted": False},
    "held_blocks_released": {"req": "r", "gen": 0},
    "job_enqueued": {
        "job": 3,
        "req": "r",
        "gen": 0,
        "token_start": 0,
        "token_end": 32,
        "reads": [1, 2],
        "pins": [2, 1],
        "keys": ["k1", "k2"],
        "parent": "k0",
        "world_size": 2,
    },
    "completions_received": {"job": 3, "count": 2},
    "pins_released": {"job": 3, "blocks": [1, 2]},
    "engine_crashed": {"error": "boom"},
    "engine_idle": {},
    "job_received": {"job": 3},
    "preemption_seen": {"req": "r", "gen": 0},
    "job_started": {"job": 3},
    "job_skipped": {"job": 3, "reason": "pressure"},
    "dma_started": {"job": 3},
    "dma_done": {"job": 3, "digest": "ab12"},
    "put_done": {"job": 3, "stored": 1, "existed": 1},
    "put_failed": {"job": 3, "error": "-200 no space"},
    "offset_saved": {"job": 3, "req": "r", "offset": 32},
    "request_marked_skipped": {"job": 3, "req": "r"},
    "retry_tokens_set": {"job": 3, "req": "r", "start": 16, "count": 16},
    "retry_tokens_cleared": {"job": 3, "req": "r"},
    "kv_block_stored": {"job": 3, "key": "k2", "parent": "k1"},
    "request_retired": {"req": "r", "gen": 0},
    "job_reported": {"job": 3},
    "key_verified": {"key": "k1", "ok": False, "expected": "aa", "actual": "bb"},
    "load_verified": {"req": "r", "gen": 0, "key": "k1", "ok": True},
}
#: kinds this project adds to the contract (docs/events.md, "Additions")
ADDED_KINDS = {"key_missing", "key_loaded", "record_refused"}
EXAMPLES["key_missing"] = {"key": "k1", "reason": "evicted"}
EXAMPLES["key_loaded"] = {"req": "r1", "gen": 0, "key": "k1", "digest": "9f2c"}
EXAMPLES["record_refused"] = {"refused": "blocks_assigned", "error": "'blocks' must be ..."}
#: additions for connectors that load as well as store (kvstate.tier_events)
ADDED_KINDS |= {"load_enqueued", "flush_requested", "flush_done", "tier_stored", "tier_evicted"}
ADDED_KINDS |= {"tier_promoted"}
EXAMPLES["load_enqueued"] = {
    "job": 4,
    "req": "r",
    "gen": 1,
    "writes": [5, 6],
    "keys": ["k1", "k2"],
    "world_size": 2,
}
EXAMPLES["flush_requested"] = {"jobs": [3]}
EXAMPLES["flush_done"] = {"jobs": [3]}
EXAMPLES["tier_stored"] = {"job": 3, "keys": ["k1", "k2"]}
EXAMPLES["tier_evicted"] = {"keys": ["k1"]}
EXAMPLES["tier_promoted"] = {"keys": ["k1"]}
#: the observer's own end of a journal it cannot go on with (kvstate.vllm)
ADDED_KINDS |= {"observer_stood_down"}
EXAMPLES["observer_stood_down"] = {"reason": "the scheduler output is a SimpleNamespace"}
#: the lifecycle at vLLM's connector boundary (kvstate.transfer_events)
ADDED_KINDS |= {"kv_matched", "remote_load_started", "transfer_finished", "blocks_invalid"}
ADDED_KINDS |= {"cache_reset", "transfer_params"}
EXAMPLES["kv_matched"] = {"req": "r", "computed": 16, "matched": 32, "load_async": True}
EXAMPLES["remote_load_started"] = {"req": "r", "gen": 0, "blocks": [5, 6], "tokens": 32}
EXAMPLES["transfer_finished"] = {"req": "r", "gen": 0, "direction": "recv"}
EXAMPLES["blocks_invalid"] = {"blocks": [6]}
EXAMPLES["cache_reset"] = {"accepted": True, "jobs": [3]}
EXAMPLES["transfer_params"] = {"req": "r", "at": "finished", "params": '{"a": 1}', "gen": 0}


def record(kind: str, payload: dict[str, object], *, seq: int = 7, step: int = 2) -> Record:
    rank = 1 if ev.EVENT_TYPES[kind].side == ev.SIDE_WORKER else None
    return Record(seq, kind, dict(payload), step, rank, 12345)


def test_every_spec_kind_has_a_class() -> None:
    assert set(ev.EVENT_TYPES) == SPEC_KINDS | ADDED_KINDS == set(EXAMPLES)


@pytest.mark.parametrize("kind", sorted(SPEC_KINDS | ADDED_KINDS))
def test_round_trip_through_the_record_form(kind: str) -> None:
    entry = from_record(record(kind, EXAMPLES[kind]))
    assert entry.event.kind == kind
    assert entry == from_record(to_record(entry))
    again = to_record(entry)
    assert (again.seq, again.step, again.ts) == (7, 2, 12345)
    for name, value in EXAMPLES[kind].items():
        # optional fields at their default may be left out
        assert again.payload.get(name, entry.event.optional_fields.get(name)) == value


def test_events_are_immutable() -> None:
    event = ev.JobStarted(job=1, rank=0)
    with pytest.raises(AttributeError):
        event.job = 2  # type: ignore[misc]


def test_lists_become_tuples_when_decoded() -> None:
    entry = from_record(Record(1, "pins_released", {"job": 1, "blocks": [3, 2]}, 0))
    assert entry.event.blocks == (3, 2)
    stored = from_stored(1, "pins_released", 0, None, None, payload_bytes(entry.event))
    assert stored.event.blocks == (3, 2)
    assert stored == entry


def test_building_an_event_does_not_validate_but_every_decoder_does() -> None:
    # The connector pays for the struct only; the writer's auditor and every
    # reader decode the stored bytes, and that is where a bad value is caught.
    event = ev.JobStarted(job=-1, rank=0)
    with pytest.raises(RecordError, match="'job' must be a non-negative integer") as info:
        from_stored(9, "job_started", 0, 0, None, payload_bytes(event), "j.db")
    assert str(info.value).startswith("j.db") and info.value.seq == 9


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("job_started", {"job": -1}, "non-negative"),
        ("job_started", {"job": True}, "non-negative"),
        ("job_started", {"job": 1.0}, "non-negative"),
        ("request_admitted", {"req": 5}, "string"),
        ("blocks_assigned", {"mode": "prepend"}, "append, replace"),
        ("blocks_assigned", {"blocks": [1, "2"]}, "non-negative"),
        ("blocks_assigned", {"blocks": 3}, "list"),
        ("job_skipped", {"reason": "bored"}, "stale, pressure, empty, error"),
        ("job_enqueued", {"token_end": 0, "token_start": 4}, "before"),
        ("job_enqueued", {"keys": ["a", 1]}, "strings"),
        ("job_enqueued", {"world_size": 0}, "positive"),
        ("request_finished", {"hold": "yes"}, "true or false"),
        ("journal_opened", {"version": 2}, "unknown journal version 2"),
        ("key_verified", {"ok": 1}, "true or false"),
    ],
)
def test_invalid_fields_are_one_error_type_with_location(
    kind: str, change: dict[str, object], message: str
) -> None:
    payload = {**EXAMPLES[kind], **change}
    with pytest.raises(RecordError) as info:
        from_record(record(kind, payload), path="j.jsonl", line=9)
    assert message in str(info.value)
    assert str(info.value).startswith("j.jsonl:9")


def test_unknown_kind_missing_field_missing_step_and_rank() -> None:
    with pytest.raises(RecordError, match="unknown kind 'job_exploded'"):
        from_record(Record(4, "job_exploded", {}, 0))
    with pytest.raises(RecordError, match="lacks 'job'") as info:
        from_record(Record(4, "job_started", {}, 0, 0))
    assert info.value.seq == 4
    with pytest.raises(RecordError, match="no 'step'"):
        from_record(Record(4, "engine_idle", {}, None))
    with pytest.raises(RecordError, match="needs 'rank'"):
        from_record(Record(4, "job_started", {"job": 1}, 0, None))


def test_unknown_extra_fields_are_kept_and_ignored() -> None:
    entry = from_record(Record(1, "job_started", {"job": 1, "thread": "send-0"}, 0, 0))
    assert entry.event.extra == {"thread": "send-0"}
    assert to_record(entry).payload == {"job": 1, "thread": "send-0"}


def test_payload_excludes_rank_which_lives_in_the_envelope() -> None:
    entry = Entry(1, 0, None, ev.JobReported(job=4, rank=3))
    assert event_payload(entry.event) == {"job": 4}
    assert to_record(entry).rank == 3
