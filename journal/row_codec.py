"""The one interface between a writer process and the application it writes for.

A :class:`journal.ProcessWriter` hands the writer process one opaque blob
per commit; the writer process (:mod:`journal._writer_program`) builds the
application's :class:`RowCodec` from a name and a settings string, and that
codec is the only application code it calls: rows go down through
:meth:`RowCodec.rows`, and what the application's work after a commit found
goes back through :meth:`RowCodec.report`, bytes the engine's
``on_report`` receives with the next answer. The journal knows neither what
the rows mean nor what a report says.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

#: a row as :meth:`journal.Journal.append_rows` takes it: seq, kind, step,
#: rank, ts, payload bytes
Row = tuple[int, str, int, int | None, int | None, bytes]


class RowCodec(Protocol):
    """What a writer process calls, in this order for each commit:
    :meth:`rows`, the write, :meth:`report` (with the answer, when the
    engine waits) and :meth:`committed` (after the answer, unless the engine
    settles: then before it)."""

    def rows(self, blob: bytes) -> list[Row]:
        """The rows of one handed-over batch, in seq order."""
        ...

    def committed(self) -> None:
        """The batch of the last :meth:`rows` is durable: the application's
        work after a commit (kvstate's: the audit, figures, checkpoints)."""
        ...

    def report(self) -> bytes:
        """What that work found since the last report (empty: nothing)."""
        ...

    def orphaned(self, last_seq: int) -> list[Row]:
        """The rows that close a journal whose engine died."""
        ...

    def checkpoint(self) -> Iterator[bytes]:
        """What a new segment begins with where the journal keeps a retention budget."""
        ...

    def rotated(self, index: int, path: str, removed: list[str]) -> None:
        """The writer began segment ``index`` at ``path``; retention removed ``removed``."""
        ...

    def sized(self, rotate_bytes: int | None, checkpoint_bytes: int, short_bytes: int) -> None:
        """Where the journal rotates now (see :mod:`journal.retention`)."""
        ...
