"""A private temporary SQLite database: what kvstate spills to, so memory does not grow.

SQLite creates it in the temporary directory, holds a few megabytes of it in
memory, and deletes it when the connection closes (or the process ends).
Nothing is written beside the user's journals. A database that cannot be
written leaves its caller to keep the rest in memory (``insert`` answers
False); one whose rows cannot be read back raises
:class:`~kvstate.errors.TemporaryStorageError`, never a wrong answer.
:class:`kvstate.spill.SpillArchive` and the inspector's violation spool use it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from typing import Any

from .errors import TemporaryStorageError

#: buffered writes per batch
BATCH = 4096


def open_temp(schema: str) -> sqlite3.Connection | None:
    """A private temporary database ("" in SQLite: on disk, deleted on close)."""
    try:
        db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        # MEMORY, not OFF: a batch the full disk refuses must roll back cleanly.
        db.executescript("PRAGMA journal_mode = MEMORY; PRAGMA synchronous = OFF;" + schema)
    except sqlite3.Error:
        return None
    return db


def insert(db: sqlite3.Connection | None, sql: str, rows: list[Any]) -> bool:
    """Insert a batch; False when the temporary database cannot take it."""
    if db is None:
        return False
    try:
        db.execute("BEGIN")
        db.executemany(sql, rows)
        db.execute("COMMIT")
    except sqlite3.Error:
        try:
            if db.in_transaction:
                db.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        return False
    return True


def stream(
    db: sqlite3.Connection | None, sql: str, args: tuple[Any, ...] = ()
) -> Iterator[list[Any]]:
    """:func:`read` in batches of rows (what would not fit in memory at once)."""
    if db is None:
        return
    try:
        cursor = db.execute(sql, args)
        while rows := cursor.fetchmany(BATCH):
            yield rows
    except sqlite3.Error as exc:
        raise _unreadable(exc) from exc


def _unreadable(exc: sqlite3.Error) -> TemporaryStorageError:
    # The environment failed, not the journal: never an answer without
    # what was parked, and never blamed on the input.
    return TemporaryStorageError(
        f"kvstate's temporary storage in {_where()} cannot be read back "
        f"({exc}): free space there or set TMPDIR to a roomier place; the journal is "
        "not at fault"
    )


def _where() -> str:
    """Where SQLite puts a temporary database on Unix (its own search order)."""
    for name in ("SQLITE_TMPDIR", "TMPDIR"):
        if os.environ.get(name):
            return f"{os.environ[name]} (${name})"
    return "/var/tmp, /usr/tmp or /tmp"


def read(db: sqlite3.Connection | None, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
    if db is None:
        return []
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.Error as exc:
        raise _unreadable(exc) from exc
