"""A generic, append-only, hash-chained event journal on SQLite.

This package knows nothing about KV caches: a record is a kind, a payload and
an envelope (``seq``, ``step``, ``rank``, ``ts``). The domain lives in
:mod:`kvstate`, which builds on this layer and never the other way round.
"""

from .database import Journal, is_journal_file
from .errors import JournalError, RecordError, TamperedError
from .jsonl import dump_record, parse_line, read_jsonl, read_jsonl_lines, write_jsonl
from .output import OutputExists, atomic_output, journal_output, refuse_existing
from .process_writer import ProcessWriter
from .record import Record
from .thread_writer import JournalWriter

__all__ = [
    "Journal",
    "JournalError",
    "JournalWriter",
    "OutputExists",
    "ProcessWriter",
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
