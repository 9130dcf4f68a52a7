"""The simulator's audit after a run: every stored key read back from the store.

Each key names the block hash and rank whose KV it must hold
(:func:`.content.full_block_kv`), so what the store returns is compared
with what that key should hold: ``key_verified`` (``ok`` false is a
poisoned key). A key the store no longer has (evicted, or a failed read)
is journaled as ``key_missing``, never compared: an empty buffer is not
somebody else's KV. If the store stops answering as a whole, the audit
stops there and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from kvstate import build
from kvstate.recorder import Recorder

from . import store as st
from .content import full_block_kv, short


@attrs.frozen
class ReadBack:
    """What the read-back found: keys whose KV was wrong, keys the store lacked."""

    poisoned: int
    missing: int


def read_back(
    recorder: Recorder, reader: st.Store, writers: Mapping[str, int], size: int, step: int
) -> ReadBack:
    """Read each key of ``writers`` (key -> the job that wrote it) through
    ``reader``, journaling a verdict for each on ``recorder`` at ``step``."""
    poisoned = missing = 0
    for key in sorted(writers):
        rank = int(key.split("@tp_rank:")[1].split("@")[0])
        block_hash = bytes.fromhex(key.rsplit("@", 1)[1])
        buffer = bytearray(size)
        try:
            code = reader.batch_get_into([key], [memoryview(buffer)])[0]
        except st.StoreError as exc:
            code = exc.code
        if code < 0:
            missing += 1
            recorder.record(build.key_missing(key=key, reason=st.describe_missing(code)), step)
            if code == st.RPC_FAIL:
                break  # every further read would wait for the dead master
            continue
        expected = full_block_kv(block_hash, rank, size)
        ok = bytes(buffer) == expected
        poisoned += not ok
        event = build.key_verified(
            key=key, ok=ok, expected=short(expected), actual=short(bytes(buffer)), job=writers[key]
        )
        recorder.record(event, step)
    return ReadBack(poisoned=poisoned, missing=missing)
