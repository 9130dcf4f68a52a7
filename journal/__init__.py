"""A generic, append-only, hash-chained event journal on SQLite.

This package knows nothing about KV caches: a record is a kind, a payload and
an envelope (``seq``, ``step``, ``rank``, ``ts``). The domain lives in
:mod:`kvstate`, which builds on this layer and never the other way round.
It stores: :class:`Journal` appends a batch of rows as one transaction and
chains them, :mod:`journal.segments` rotates and keeps a byte budget, and
the readers read. How records are batched, and in which thread or process
they are encoded and folded, is kvstate's (its writers call
:meth:`Journal.append_rows` once per batch).
"""

from .database import Journal, is_journal_file
from .errors import JournalError, RecordError, TamperedError
from .jsonl import dump_record, parse_line, read_jsonl, read_jsonl_lines, write_jsonl
from .output import OutputExists, atomic_output, journal_output, refuse_existing
from .record import Record

__all__ = [
    "Journal",
    "JournalError",
    "OutputExists",
    "Record",
    "RecordError",
    "TamperedError",
    "atomic_output",
    "dump_record",
    "is_journal_file",
    "journal_output",
    "parse_line",
    "read_jsonl",
    "read_jsonl_lines",
    "refuse_existing",
    "write_jsonl",
]
