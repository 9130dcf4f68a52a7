"""The hash chain that makes a journal tamper-evident.

Each record stores a digest that covers its own content and the digest of the
record before it, so changing, inserting or dropping any record breaks every
digest after it. A plain chain proves linear history only; that is what a
local debugging journal needs.
"""

from __future__ import annotations

import hashlib

import msgpack

DIGEST_SIZE = 16
GENESIS = bytes(DIGEST_SIZE)

#: the envelope ``(seq, kind, step, rank, ts)`` as hashed into each digest
pack_envelope = msgpack.Packer(use_bin_type=True).pack


def link(
    previous: bytes,
    seq: int,
    kind: str,
    step: int | None,
    rank: int | None,
    ts: int | None,
    payload: bytes,
) -> bytes:
    """The digest of one record given the digest of the record before it."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_SIZE)
    h.update(pack_envelope((seq, kind, step, rank, ts)))
    h.update(payload)
    return h.digest()
