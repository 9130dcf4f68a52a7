"""An archive on disk, so memory does not grow with history.

:class:`SpillArchive` keeps parked jobs and requests and the key log (see
:mod:`kvstate.archive`) in a private temporary SQLite database: SQLite
creates it in the temporary directory, holds a few megabytes of it in
memory, and deletes it when the connection closes (or the process ends).
Nothing is written beside the user's journals.

Replay, ``export`` and ``inspect --once`` park into one, so a journal of any
length replays in the same memory. A connector can hand one to its
:class:`~kvstate.scheduler.SchedulerLedger` and each
:class:`~kvstate.worker.WorkerLedger` (``archive=SpillArchive()``), where
they park the generations of ended requests, so an engine that runs for
weeks holds what is live, not every request it has served.

Writes are buffered and inserted in batches; a read first flushes what is
pending, so every answer is as if each write had gone straight in. Reads are
rare by design: a parked entity is read back only when a record or a call
names it, a key only when an audit record does.

An incident tool must survive the incident, a full disk included: when the
temporary database cannot be written, what has not been written stays in
memory and everything after it goes there too (the archive becomes the
in-memory one it extends); only if what was already written cannot be read
back does the fold stop, with :class:`kvstate.errors.TemporaryStorageError`
(the command line's exit status 3: the environment, not the input), never
with a wrong answer.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvstate.archive import Archive, Key

from .tempdb import BATCH as _BATCH
from .tempdb import insert as _insert
from .tempdb import open_temp as _open
from .tempdb import read as _read
from .tempdb import stream as _stream


class SpillArchive(Archive):
    """:class:`kvstate.archive.Archive` in a temporary SQLite database."""

    def __init__(self) -> None:
        super().__init__()
        self._db = _open(
            "CREATE TABLE entities (kind TEXT, name, blob BLOB, PRIMARY KEY (kind, name));"
            "CREATE TABLE key_writes (key TEXT, seq INTEGER, job INTEGER);"
            "CREATE INDEX key_writes_by_key ON key_writes (key);"
        )
        #: the temporary database failed: new state stays in memory (the base class)
        self.in_memory = self._db is None
        self._puts: dict[Key, bytes] = {}
        self._writes: list[tuple[str, int, int]] = []
        #: taken back, but the database could not delete them
        self._dead: set[Key] = set()

    # -- entities --------------------------------------------------------------------

    def put(self, key: Key, blob: bytes) -> None:
        if self.in_memory:
            super().put(key, blob)
            return
        self._puts[key] = blob
        self._count += 1
        if len(self._puts) >= _BATCH:
            self._flush_puts()

    def take(self, key: Key) -> bytes | None:
        blob = self._puts.pop(key, None)
        if blob is None:
            blob = super().take(key)  # counts itself
            if blob is not None:
                return blob
        else:
            self._count -= 1
            return blob
        if key in self._dead:
            return None
        kind, name = key
        found = "SELECT blob FROM entities WHERE kind = ? AND name = ?"
        rows = _read(self._db, found, (kind, name))
        if not rows:
            return None
        if not _insert(self._db, "DELETE FROM entities WHERE kind = ? AND name = ?", [key]):
            self._dead.add(key)  # taken, though the full disk still holds it
        self._count -= 1
        return bytes(rows[0][0])

    def keys(self) -> Iterator[Key]:
        self._flush_puts()
        stored = [
            (kind, name)
            for kind, name in _read(self._db, "SELECT kind, name FROM entities")
            if (kind, name) not in self._dead
        ]
        return iter([*stored, *super().keys()])

    def __len__(self) -> int:
        return self._count

    def items(self, newest: int | None = None) -> Iterator[list[tuple[Key, bytes]]]:
        self._flush_puts()
        # what went to memory (after the disk failed) is the newest of all
        kept = 0
        for batch in super().items(newest):
            kept += len(batch)
            yield batch
        if newest is not None and kept >= newest:
            return
        limit = -1 if newest is None else newest - kept
        query = "SELECT kind, name, blob FROM entities ORDER BY rowid DESC LIMIT ?"
        dead = self._dead
        for rows in _stream(self._db, query, (limit,)):
            yield [((k, n), b) for k, n, b in rows if (k, n) not in dead]

    def _flush_puts(self) -> None:
        if not self._puts:
            return
        rows = [(kind, name, blob) for (kind, name), blob in self._puts.items()]
        if _insert(self._db, "INSERT INTO entities VALUES (?, ?, ?)", rows):
            self._puts.clear()
            return
        # Counted already: moved to memory as they are.
        self.in_memory = True
        self._top.own.update(self._puts)
        self._puts.clear()

    # -- the key log -----------------------------------------------------------------

    def key_written(self, key: str, seq: int, job: int) -> None:
        if self.in_memory:
            super().key_written(key, seq, job)
            return
        self._writes.append((key, seq, job))
        if len(self._writes) >= _BATCH:
            self._flush_writes()

    def key_writers(self, key: str, before: int) -> tuple[tuple[int, ...], int | None]:
        self._flush_writes()
        rows = _read(
            self._db,
            "SELECT seq, job FROM key_writes WHERE key = ? AND seq < ? ORDER BY rowid",
            (key, before),
        )
        # Writes that went to memory came after every write on disk.
        later, first_later = super().key_writers(key, before)
        if not rows:
            return later, first_later
        return (*(seq for seq, _ in rows), *later), rows[0][1]

    def key_writes(self, newest: int | None = None) -> Iterator[list[tuple[str, int, int]]]:
        self._flush_writes()
        # Writes on disk came first, then those kept in memory.
        query = (
            "SELECT key, seq, job FROM (SELECT rowid AS r, key, seq, job FROM key_writes "
            "ORDER BY rowid DESC LIMIT ?) ORDER BY r"
        )
        yield from _stream(self._db, query, (-1 if newest is None else newest,))
        yield from super().key_writes()

    def key_log(self, upto: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
        self._flush_writes()
        keys = {k for (k,) in _read(self._db, "SELECT DISTINCT key FROM key_writes")}
        keys.update(self._log.writers)
        found = {key: self.key_writers(key, upto + 1) for key in keys}
        return {key: w for key, w in found.items() if w[0]}

    def _flush_writes(self) -> None:
        if not self._writes:
            return
        rows, self._writes = self._writes, []
        if not _insert(self._db, "INSERT INTO key_writes VALUES (?, ?, ?)", rows):
            self.in_memory = True
            for key, seq, job in rows:
                super().key_written(key, seq, job)

    # -- copies ----------------------------------------------------------------------

    def copy(self) -> Archive:
        """An in-memory copy of everything (for ``whole()`` views, which hold it all anyway)."""
        self._flush_puts()
        self._flush_writes()
        new = super().copy()  # what is in memory, shared; counted with the rest
        log, new._log = new._log, type(new._log)()
        for kind, name, blob in _read(self._db, "SELECT kind, name, blob FROM entities"):
            if (kind, name) not in self._dead:
                new._top.own[(kind, name)] = bytes(blob)
        # Writes on disk came first, then those kept in memory.
        for key, seq, job in _read(self._db, "SELECT key, seq, job FROM key_writes ORDER BY rowid"):
            new.key_written(key, seq, job)
        for key, seqs in log.writers.items():
            for seq in seqs:
                new.key_written(key, seq, log.first_job[key])
        return new

    def close(self) -> None:
        """Close the database; SQLite deletes its file."""
        if self._db is not None:
            self._db.close()
