"""The hash chain that makes a journal tamper-evident: one link per commit.

A commit (one :meth:`journal.Journal.append`, typically one engine step) is
written with one digest, stored on its last row, that covers every row of
the commit and the link before it. Changing, inserting or dropping any
record therefore breaks the link of its commit and every link after it, and
a reader names the commit's seq range. Hashing once per commit rather than
once per record is what keeps the chain off an engine's clock.

Journals written with a link on every row (schema version 1) are the same
chain with one record per commit, so one definition reads both. A plain
chain proves linear history only; that is what a local debugging journal
needs. A tail of whole commits removed leaves a shorter valid chain: readers
report such a journal as unfinished, not as tampered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgpack

DIGEST_SIZE = 16
GENESIS = bytes(DIGEST_SIZE)

#: one stored row as the chain covers it: seq, kind, step, rank, ts, payload bytes
ChainedRow = tuple[int, str, "int | None", "int | None", "int | None", bytes]

#: the envelope ``(seq, kind, step, rank, ts)`` as hashed into each link
pack_envelope = msgpack.Packer(use_bin_type=True).pack


def link(previous: bytes, rows: Iterable[ChainedRow]) -> bytes:
    """The link of one commit: its rows, in seq order, after the link before it."""
    h = hashlib.blake2b(previous, digest_size=DIGEST_SIZE)
    update, envelope = h.update, pack_envelope
    for seq, kind, step, rank, ts, payload in rows:
        update(envelope((seq, kind, step, rank, ts)))
        update(payload)
    return h.digest()


def checkpoint_link(previous: bytes, parts: Iterable[bytes]) -> bytes:
    """The link of a checkpoint (see :mod:`journal.retention`): its parts, in
    order, after the link before it, as one commit whose rows are the parts
    (each under its index and the kind ``checkpoint``)."""
    return link(previous, ((i, "checkpoint", None, None, None, p) for i, p in enumerate(parts)))
