"""Opening a journal read-only, even one a killed writer left mid-way.

:class:`journal.Journal` opened with ``readonly=True`` never changes the
user's files. SQLite sometimes cannot honour that in place: see
:func:`connect_readonly`.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile


def connect_readonly(path: str) -> tuple[sqlite3.Connection, str | None]:
    """A read-only connection to the journal at ``path``, and the private
    folder it reads from when it cannot read the file in place.

    A writer killed while SQLite changed the file's journal mode (closing a
    segment, or opening the next, see :mod:`journal.segments`) leaves a hot
    rollback journal (``-journal``) beside it, or a header saying WAL with
    the log already folded in and removed. SQLite cannot read either
    read-only: it would first roll back, or make a new log. The file is
    then copied, with what lies beside it, into a private temporary folder
    and read there, so the user's files are never changed; the folder is
    removed when the journal is closed.
    """
    uri = f"file:{path}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn, None
    except sqlite3.OperationalError as exc:
        if "readonly" not in str(exc):
            raise
        conn.close()
    private = tempfile.mkdtemp(prefix="kvstate-journal-")
    copy = os.path.join(private, os.path.basename(path))
    for suffix in ("", "-journal", "-wal"):
        if os.path.exists(path + suffix):
            shutil.copyfile(path + suffix, copy + suffix)
    conn = sqlite3.connect(copy, isolation_level=None, check_same_thread=False)
    return conn, private


def forget_copy(private: str) -> None:
    """Remove the private folder :func:`connect_readonly` read from."""
    shutil.rmtree(private, ignore_errors=True)
