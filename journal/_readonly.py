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
    if _wal_without_log(path):
        # A file whose header says WAL, with no log beside it: a journal its
        # writer closed while a reader held it (journal.database._leave_wal
        # folded the log in first), or a ``.db`` copied alone. Opened plainly,
        # SQLite would make a new ``-wal`` and ``-shm`` beside the user's file;
        # with no log there is nothing but the file to read, so it is read as
        # it is. A writer that opens it meanwhile makes its log first: the
        # next open reads the log too.
        uri += "&immutable=1"
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


def says_wal(path: str) -> bool:
    """Whether the database file's header says WAL mode (its read and write
    versions, bytes 18 and 19), read without opening the database."""
    try:
        with open(path, "rb") as f:
            f.seek(18)
            return f.read(2) == b"\x02\x02"
    except OSError:
        return False


def _wal_without_log(path: str) -> bool:
    return says_wal(path) and not os.path.exists(path + "-wal")


def forget_copy(private: str) -> None:
    """Remove the private folder :func:`connect_readonly` read from."""
    shutil.rmtree(private, ignore_errors=True)
