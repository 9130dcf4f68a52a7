"""The hash chain that makes a journal tamper-evident: one link per commit.

:func:`link` makes a commit's link, :func:`checkpoint_link` a segment's
checkpoint's (journal.retention), and :class:`Verifier` checks rows read
back against them.

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
from typing import Any

import msgpack

from .errors import RecordError, TamperedError

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


class Verifier:
    """Checks rows against the chain, one commit at a time.

    Rows are held until the row carrying their commit's link arrives; then
    the link is recomputed (:func:`journal._chain.link`) and, if it matches,
    the commit's rows are handed out. Schema-1 journals link every row, so
    each of their rows is a commit of one.
    """

    def __init__(self, path: str, previous: bytes) -> None:
        self.path = path
        self.previous = previous
        self.pending: list[tuple[Any, ...]] = []

    def feed(self, rows: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], RecordError | None]:
        """The rows of every commit completed and verified by ``rows``, and the
        error for the first commit that fails (None when none does)."""
        good: list[tuple[Any, ...]] = []
        pending = self.pending
        for row in rows:
            seq, kind, _step, _rank, _ts, payload, digest = row
            if (
                type(payload) is not bytes
                or type(kind) is not str
                or (digest is not None and type(digest) is not bytes)
            ):
                why = "row does not have the journal's column types"
                return good, RecordError(why, path=self.path, seq=seq)
            pending.append(row)
            if digest is None:
                continue
            if link(self.previous, (r[:6] for r in pending)) != digest:
                first = pending[0][0]
                span = f"seq {seq}" if first == seq else f"seqs {first}..{seq}"
                why = (
                    f"the link of the commit of {span} does not match the hash chain: "
                    "a record of it or one before it was changed"
                )
                return good, TamperedError(why, path=self.path, seq=first)
            self.previous = digest
            good.extend(pending)
            pending.clear()
        return good, None

    def end(self) -> None:
        """At the end of the rows: records after the last link were never chained."""
        if self.pending:
            first, last = self.pending[0][0], self.pending[-1][0]
            why = f"records of seqs {first}..{last} are not covered by a link of the hash chain"
            raise TamperedError(why, path=self.path, seq=first)
