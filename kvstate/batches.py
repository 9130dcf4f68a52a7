"""A recorded batch as one blob: what the engine hands the journal writer process.

At each commit the engine encodes its batch of entries with
:func:`encode_batch`, one msgspec call: each entry is an array ``[seq, step,
ts, event]`` with the event as its stored payload map, and the kinds come in
a list beside them. The writer process builds a :class:`BatchCodec`, which
cuts each event's bytes out of the blob without re-encoding them (they are
exactly the stored payload, see :func:`kvstate.codec.payload_bytes`) and
reads the rank from the event's typed decode.

A record whose payload the typed decoder refuses is still written as it was
handed over: the journal never drops what the engine recorded, and every
reader then names that record's seq.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import msgspec

from .codec import Entry, payload_bytes
from .events import SIDE_WORKER, EngineCrashed

_encode = msgspec.msgpack.Encoder().encode
_Blob = tuple[list[str], list[tuple[int, int, Optional[int], msgspec.Raw]]]  # noqa: UP045

#: the ``error`` of the record a writer appends when its engine died
ORPHANED = "the engine process ended without closing its journal (killed, or died in C)"


def encode_batch(batch: list[Entry]) -> bytes:
    """The blob of one commit (runs on the engine's thread, once per commit)."""
    return _encode(([entry[3].kind for entry in batch], batch))


class BatchCodec:
    """Rows from blobs, in the journal writer process (see :mod:`journal.process_writer`)."""

    def __init__(self) -> None:
        from .codec import _DECODERS  # the one decoder of each kind

        self._decoders = _DECODERS
        self._decode_blob = msgspec.msgpack.Decoder(_Blob).decode
        self._last_step = 0

    def rows(self, blob: bytes) -> list[tuple[int, str, int, int | None, int | None, bytes]]:
        kinds, entries = self._decode_blob(blob)
        rows = []
        for kind, (seq, step, ts, raw) in zip(kinds, entries, strict=True):
            payload = bytes(raw)
            rows.append((seq, kind, step, self._rank(kind, payload), ts, payload))
        if rows:
            self._last_step = rows[-1][2]
        return rows

    def _rank(self, kind: str, payload: bytes) -> int | None:
        try:
            event: Any = self._decoders[kind](payload)
        except (KeyError, msgspec.DecodeError):
            # Kept as handed over; replay names this record's seq. Its rank
            # is whatever the payload says, if it says one.
            try:
                fields = msgspec.msgpack.decode(payload)
            except msgspec.DecodeError:
                return None
            rank = fields.get("rank") if type(fields) is dict else None
            return rank if type(rank) is int else None
        return event.rank if event.side == SIDE_WORKER else None

    def orphaned(self, last_seq: int) -> list[tuple[int, str, int, None, int, bytes]]:
        """The record that closes a journal whose engine died: ``engine_crashed``."""
        event = EngineCrashed(error=ORPHANED)
        return [
            (last_seq + 1, event.kind, self._last_step, None, time.monotonic_ns(),
             payload_bytes(event))
        ]  # fmt: skip
