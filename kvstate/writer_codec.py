"""A recorded batch as one blob: what the engine hands the journal writer process.

At each commit the engine encodes its batch of entries with
:func:`encode_batch`, one msgspec call: each entry is an array ``[seq, step,
ts, event]`` with the event as its stored payload map, and the kinds come in
a list beside them. The writer process builds a :class:`BatchCodec`, which
cuts each event's bytes out of the blob without re-encoding them (they are
exactly the stored payload, see :func:`kvstate.codec.payload_bytes`) and
reads the rank from the event's typed decode.

A record whose payload the typed decoder refuses (a value the contract
refuses: a negative block id, a string where an id goes) is not written as
it was handed over, which would leave every reader unable to go past it: a
``record_refused`` naming the kind and the field takes its seq, and the
audit reports it (``RECORD_REFUSED``) like any finding.

With an audit configuration (see :meth:`kvstate.audit.Auditor.remote_config`)
the codec also folds every committed batch, parking settled state in a
:class:`~kvstate.spill.SpillArchive`, and its :meth:`BatchCodec.report`
carries the findings back to the engine with the writer's next answer.
With a metrics address (:class:`CodecSettings`), it keeps the journal's
:class:`~kvstate.figures.Figures` as it commits and folds, and serves them
on ``/metrics`` from this process: the engine's thread pays nothing more.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import msgspec

from journal import segments
from journal.segments import file_bytes

from . import build
from .audit import Auditor, Fold
from .codec import Entry, payload_bytes, refusal, refused, to_row
from .events import SIDE_WORKER, JournalOpened
from .violations import Code, Violation

if TYPE_CHECKING:
    from .checkpointer import Checkpoints
    from .figures import Figures
    from .live_counts import LiveCounts

_encode = msgspec.msgpack.Encoder().encode
#: a row as :meth:`journal.Journal.append_rows` takes it from the writer
#: process: seq, kind, step, rank, ts, the payload's bytes
Row = tuple[int, str, int, Optional[int], Optional[int], bytes]  # noqa: UP045
_Blob = tuple[list[str], list[tuple[int, int, Optional[int], msgspec.Raw]]]  # noqa: UP045

#: the ``error`` of the record a writer appends when its engine died
ORPHANED = "the engine process ended without closing its journal (killed, or died in C)"


def encode_batch(batch: list[Entry]) -> bytes:
    """The blob of one commit (runs on the engine's thread, once per commit).

    An event holding a value msgspec cannot encode (an object a connector
    read off the engine: a mock, a tensor) would fail the whole batch, and
    every commit after it; that batch is encoded again entry by entry, with
    a ``record_refused`` in place of each entry that cannot be.
    """
    try:
        return _encode(([entry[3].kind for entry in batch], batch))
    except (TypeError, ValueError, OverflowError):
        pass
    kept = []
    for entry in batch:
        try:
            _encode(entry)
        except (TypeError, ValueError, OverflowError) as exc:
            seq, step, ts, event = entry
            entry = refused(seq, step, ts, event.kind, refusal(event) or f"{event.kind}: {exc}")
        kept.append(entry)
    return _encode(([entry[3].kind for entry in kept], kept))


class CodecSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the writer process's :class:`BatchCodec` is built with: one typed
    value, handed to the process on its command line as JSON."""

    #: what it folds (see :meth:`kvstate.audit.Auditor.remote_config`): a
    #: scheduler alone, or a scheduler and its ranks; None: nothing
    fold: Fold | None = None
    #: ``HOST:PORT`` where it serves the journal's figures on ``/metrics``
    metrics: str | None = None
    #: a live counts file it shares with the engine (:mod:`kvstate.live_counts`)
    counts: str | None = None
    #: the journal's path (the figures' label)
    journal: str = ""
    #: whether it keeps the fold for retention's checkpoints
    checkpoints: bool = False
    #: the retention byte budget (for the figures)
    budget: int | None = None

    def with_fold(self, fold: Fold | None) -> CodecSettings:
        """These settings folding ``fold`` (as the engine decides once its ledgers attach)."""
        return msgspec.structs.replace(self, fold=fold)

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str) -> CodecSettings:
        return msgspec.json.decode(text, type=cls) if text else cls()


def encode_report(found: list[Violation]) -> bytes:
    """Findings as the writer process sends them back."""
    return _encode([v.to_dict() for v in found]) if found else b""


def decode_report(report: bytes) -> list[Violation]:
    """The findings of :func:`encode_report`."""
    out = []
    for item in msgspec.msgpack.decode(report):
        item["code"] = Code(item["code"])
        item["chain"] = tuple(item["chain"])
        out.append(Violation(**item))
    return out


class BatchCodec:
    """Rows from blobs, in the journal writer process
    (:mod:`kvstate._writer_program`), which calls it, in this order for each
    commit: :meth:`rows`, the write, :meth:`report` (with the answer, when
    the engine waits) and :meth:`committed` (after the answer, unless the
    engine settles: then before it).
    """

    def __init__(self, given: CodecSettings | None = None) -> None:
        from .codec import _DECODERS  # the one decoder of each kind

        given = given or CodecSettings()
        audit, metrics, counts = given.fold, given.metrics, given.counts
        journal, checkpoints, budget = given.journal, given.checkpoints, given.budget
        self._decoders = _DECODERS
        self._decode_blob = msgspec.msgpack.Decoder(_Blob).decode
        self._last_step = 0
        self._auditor: Auditor | None = None
        if audit:
            from .spill import SpillArchive

            self._auditor = Auditor.remote(audit, SpillArchive())
        #: what checkpoints are made of (retention: kvstate.checkpoint): the
        #: audit's fold where it folds as replay does, else one of their own
        self._checkpoints: Checkpoints | None = None
        if checkpoints:
            from .checkpointer import Checkpoints

            same = self._auditor is not None and audit == "scheduler+workers"
            self._checkpoints = Checkpoints(self._auditor.state() if same else None)  # type: ignore[union-attr]
        #: the decoded entries of the batch being committed (for the audit)
        self._entries: list[Entry] = []
        self._found: list[Violation] = []
        #: the journal's figures, with a metrics address or a live counts file
        self.figures: Figures | None = None
        self._kinds: list[str] = []
        self._counts: LiveCounts | None = None
        if counts is not None:
            from .figures import Figures
            from .live_counts import LiveCounts

            self._counts = LiveCounts(counts, owner=False)
            self.figures = Figures(journal=journal or "", audited=self._auditor is not None)
        #: the segment written now, and what the closed ones hold on disk
        self._current = journal or ""
        self._closed_bytes = 0
        if metrics is not None and journal is not None:
            self._serve(metrics, journal, budget)

    def _serve(self, address: str, journal: str, budget: int | None) -> None:
        """Keep the figures and serve them; a server that cannot start is said
        on stderr and the journal is written all the same."""
        import attrs

        from .figures import Figures

        if self.figures is None:
            self.figures = Figures(journal=journal, audited=self._auditor is not None)
        figures = self.figures
        try:
            from .prometheus import FiguresCollector, serve

            serve(
                address,
                FiguresCollector(
                    lambda: [attrs.evolve(figures, violations=figures.violations.copy())],
                    budget=budget,
                ),
            )
        except (ImportError, ValueError, OSError) as exc:
            print(f"kvstate: {journal}: /metrics at {address} not served: {exc}", file=sys.stderr)

    def rows(self, blob: bytes) -> list[Row]:
        kinds, entries = self._decode_blob(blob)
        rows = []
        audited = self._entries = []
        for kind, (seq, step, ts, raw) in zip(kinds, entries, strict=True):
            payload = bytes(raw)
            event = self._event(kind, payload)
            if event is None:
                # refused: its explanation in its place, the same seq
                entry = refused(seq, step, ts, kind, self._why(kind, payload))
                row = to_row(entry)
                event = entry.event
            else:
                rank = event.rank if event.side == SIDE_WORKER else None
                row = (seq, kind, step, rank, ts, payload)
            if self._auditor is not None or self._checkpoints is not None:
                audited.append(Entry(seq, step, ts, event))
            if self.figures is not None:
                self._kinds.append(kind)
                if seq == 1 and isinstance(event, JournalOpened):
                    self.figures.header(event)
                    self.figures.audited = self._auditor is not None
            rows.append(row)
        if rows:
            self._last_step = rows[-1][2]
        return rows

    def committed(self) -> None:
        """The batch is in the journal: fold it."""
        auditor = self._auditor
        found = [] if auditor is None else auditor.fold_batch(self._entries)
        self._found += found
        checkpoints = self._checkpoints
        if checkpoints is not None:
            checkpoints.committed(self._entries, found)
        self._entries = []
        figures = self.figures
        if figures is not None:
            figures.written += len(self._kinds)
            if self._kinds:
                figures.last_write = time.time()  # kvstate_journal_silent_seconds
            figures.fold(self._kinds, found, None if auditor is None else auditor.ledger)
            self._kinds = []
            figures.caught_up_at = time.monotonic()
            figures.bytes = self._closed_bytes + file_bytes(self._current)
            if self._counts is not None:
                self._counts.store(figures.folded, figures.first_violation_seq, figures.violations)

    def rotated(self, index: int, path: str, removed: list[str]) -> None:
        """The writer began segment ``index`` at ``path``; retention removed ``removed``."""
        figures = self.figures
        self._current = path
        if figures is None:
            return
        first = segments.head_name(path)
        present = [p for p in (first, *segments.later_segments(first)) if os.path.exists(p)]
        self._closed_bytes = sum(file_bytes(p) for p in present if p != path)
        # as the disk holds it now: the closed segment folded its log in,
        # retention removed what it removed
        figures.bytes = self._closed_bytes + file_bytes(path)
        figures.segments = len(present)
        figures.segments_removed += len(removed)

    def sized(self, rotate_bytes: int | None, checkpoint_bytes: int, short_bytes: int) -> None:
        """Where the journal rotates now: the rotation size in force, the
        current segment's checkpoint bytes, and what the byte budget lacks to
        hold that segment (:mod:`journal.retention`), for the figures."""
        figures = self.figures
        if figures is not None:
            figures.rotate_bytes = rotate_bytes
            figures.checkpoint_bytes = checkpoint_bytes
            figures.budget_short_bytes = short_bytes

    def checkpoint(self) -> Iterator[bytes]:
        """The fold as it stands after the last commit, in parts (see
        :mod:`kvstate.checkpoint`): what a new segment begins with when the
        journal keeps a retention budget (:mod:`journal.retention`)."""
        if self._checkpoints is None:
            raise RuntimeError("this codec was not built to write checkpoints")
        return self._checkpoints.parts()

    def report(self) -> bytes:
        """What the audit found since the last report."""
        found, self._found = self._found, []
        return encode_report(found)

    def _event(self, kind: str, payload: bytes) -> Any:
        try:
            return self._decoders[kind](payload)
        except (KeyError, msgspec.DecodeError, RecursionError):
            return None

    @staticmethod
    def _why(kind: str, payload: bytes) -> str:
        """What the contract refuses in a payload the typed decoder did not
        take, in a reader's words (the reader's own general path)."""
        from journal import RecordError

        from .codec import from_row

        try:
            fields = msgspec.msgpack.decode(payload)
            if type(fields) is not dict:
                return f"{kind}: the payload is not a map"
            rank = fields.pop("rank", None)
            from_row(0, kind, 0, rank if type(rank) is int else None, None, fields)
        except RecordError as exc:
            return exc.message
        except (msgspec.DecodeError, RecursionError) as exc:
            return f"{kind}: {exc}"
        return f"{kind}: refused by its typed decoder"

    def orphaned(self, last_seq: int) -> list[Row]:
        """The record that closes a journal whose engine died: ``engine_crashed``."""
        event = build.engine_crashed(error=ORPHANED)
        return [
            (last_seq + 1, event.kind, self._last_step, None, time.monotonic_ns(),
             payload_bytes(event))
        ]  # fmt: skip
