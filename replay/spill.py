"""An archive on disk, so replay's memory does not grow with the journal.

:class:`SpillArchive` keeps parked jobs and requests and the key log (see
:mod:`kvstate.archive`) in a private temporary SQLite database: SQLite
creates it in the temporary directory, holds a few megabytes of it in
memory, and deletes it when the connection closes. Nothing is written
beside the user's journals.

Writes are buffered and inserted in batches; a read first flushes what is
pending, so every answer is as if each write had gone straight in. Reads are
rare by design: a parked entity is read back only when a late record names
it, a key only when an audit record does.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

from kvstate.archive import Archive, Key

#: buffered writes per batch
_BATCH = 4096


class SpillArchive(Archive):
    """:class:`kvstate.archive.Archive` in a temporary SQLite database."""

    def __init__(self) -> None:
        super().__init__()
        # "" is SQLite's private temporary database: on disk, deleted on close.
        self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self._db.executescript(
            """
            PRAGMA journal_mode = OFF;
            PRAGMA synchronous = OFF;
            CREATE TABLE entities (kind TEXT, name, blob BLOB, PRIMARY KEY (kind, name));
            CREATE TABLE key_writes (key TEXT, seq INTEGER, job INTEGER);
            CREATE INDEX key_writes_by_key ON key_writes (key);
            """
        )
        self._puts: dict[Key, bytes] = {}
        self._writes: list[tuple[str, int, int]] = []
        self._count = 0

    # -- entities --------------------------------------------------------------------

    def put(self, key: Key, blob: bytes) -> None:
        self._puts[key] = blob
        self._count += 1
        if len(self._puts) >= _BATCH:
            self._flush_puts()

    def take(self, key: Key) -> bytes | None:
        blob = self._puts.pop(key, None)
        if blob is not None:
            self._count -= 1
            return blob
        kind, name = key
        row = self._db.execute(
            "SELECT blob FROM entities WHERE kind = ? AND name = ?", (kind, name)
        ).fetchone()
        if row is None:
            return None
        self._db.execute("DELETE FROM entities WHERE kind = ? AND name = ?", (kind, name))
        self._count -= 1
        return bytes(row[0])

    def keys(self) -> Iterator[Key]:
        self._flush_puts()
        return iter([(kind, name) for kind, name in self._db.execute(
            "SELECT kind, name FROM entities"
        )])  # fmt: skip

    def __len__(self) -> int:
        return self._count

    def _flush_puts(self) -> None:
        if not self._puts:
            return
        rows = [(kind, name, blob) for (kind, name), blob in self._puts.items()]
        self._puts.clear()
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO entities VALUES (?, ?, ?)", rows)
        self._db.execute("COMMIT")

    # -- the key log -----------------------------------------------------------------

    def key_written(self, key: str, seq: int, job: int) -> None:
        self._writes.append((key, seq, job))
        if len(self._writes) >= _BATCH:
            self._flush_writes()

    def key_writers(self, key: str, before: int) -> tuple[tuple[int, ...], int | None]:
        self._flush_writes()
        rows = self._db.execute(
            "SELECT seq, job FROM key_writes WHERE key = ? AND seq < ? ORDER BY rowid",
            (key, before),
        ).fetchall()
        return tuple(seq for seq, _ in rows), (rows[0][1] if rows else None)

    def key_log(self, upto: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
        self._flush_writes()
        keys = [k for (k,) in self._db.execute("SELECT DISTINCT key FROM key_writes")]
        found = {key: self.key_writers(key, upto + 1) for key in keys}
        return {key: w for key, w in found.items() if w[0]}

    def _flush_writes(self) -> None:
        if not self._writes:
            return
        rows, self._writes = self._writes, []
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO key_writes VALUES (?, ?, ?)", rows)
        self._db.execute("COMMIT")

    # -- copies ----------------------------------------------------------------------

    def copy(self) -> Archive:
        """An in-memory copy of everything (for ``whole()`` views, which hold it all anyway)."""
        new = Archive()
        for key in self.keys():
            blob = self._db.execute(
                "SELECT blob FROM entities WHERE kind = ? AND name = ?", key
            ).fetchone()[0]
            new.put(key, bytes(blob))
        self._flush_writes()
        writes = self._db.execute("SELECT key, seq, job FROM key_writes ORDER BY rowid")
        for key, seq, job in writes:
            new.key_written(key, seq, job)
        return new

    def close(self) -> None:
        """Close the database; SQLite deletes its file."""
        self._db.close()


class ViolationSpool:
    """Findings kept on disk in the order found, for reports that print them all.

    Holds ``(seq, code, message)`` rows in a private temporary SQLite database
    (deleted when closed), so printing every violation of a journal full of
    them costs no memory per violation.
    """

    def __init__(self) -> None:
        self._db = sqlite3.connect("", isolation_level=None, check_same_thread=False)
        self._db.executescript(
            "PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;"
            "CREATE TABLE found (seq INTEGER, code TEXT, message TEXT);"
        )
        self._pending: list[tuple[int, str, str]] = []
        self._count = 0

    def add(self, seq: int, code: str, message: str) -> None:
        self._pending.append((seq, code, message))
        self._count += 1
        if len(self._pending) >= _BATCH:
            self._flush()

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[int, str, str]]:
        """Every row in the order added, read in pages."""
        self._flush()
        last = 0
        while True:
            page = self._db.execute(
                "SELECT rowid, seq, code, message FROM found WHERE rowid > ? ORDER BY rowid "
                "LIMIT 4096",
                (last,),
            ).fetchall()
            if not page:
                return
            for _rowid, seq, code, message in page:
                yield seq, code, message
            last = page[-1][0]

    def _flush(self) -> None:
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        self._db.execute("BEGIN")
        self._db.executemany("INSERT INTO found VALUES (?, ?, ?)", rows)
        self._db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
