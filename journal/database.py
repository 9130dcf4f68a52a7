"""The append-only SQLite journal.

Writes are group commits: :meth:`Journal.append` takes a whole batch (an
engine step's records) and writes it in one transaction, because SQLite does
tens of thousands of inserts per second but only a few hundred transactions.
The database runs in WAL mode. What a returned :meth:`Journal.append`
promises depends on ``synchronous``:

* ``NORMAL`` (the default): the batch is in the write-ahead log, handed to
  the operating system. It survives the process being killed (SIGKILL, a
  crash) at any moment. A power loss or kernel crash may drop the last
  batches, never corrupt the ones before.
* ``FULL``: the log is also fsynced before the commit returns, so the batch
  survives a power loss too, at the price of one disk flush per batch.

Reads stream in ``seq`` order straight from a cursor, so memory does not grow
with the journal, and every record's digest is checked against the chain as
it goes by.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgpack

from . import _chain, _schema, _values
from .errors import JournalError, RecordError, TamperedError
from .record import Record

_INSERT = (
    f"INSERT INTO {_schema.TABLE} (seq, kind, step, rank, ts, payload, digest) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_SELECT = f"SELECT seq, kind, step, rank, ts, payload, digest FROM {_schema.TABLE}"
_FOLLOW_CHUNK = 4096
#: rows fetched, chain-checked and decoded together when reading
_READ_CHUNK = 1024
#: one decoded row: seq, kind, step, rank, ts and the payload's fields
Row = tuple[int, str, "int | None", "int | None", "int | None", Mapping[str, Any]]
#: ``synchronous`` levels a journal can be opened with (see the module docstring)
SYNCHRONOUS = ("NORMAL", "FULL")
#: the seq "before every record": seqs are non-negative
BEFORE_FIRST = -1


def is_journal_file(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is an SQLite database (by its 16-byte header)."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


class Journal:
    """An append-only, hash-chained journal of :class:`Record` in one SQLite file.

    Open with ``Journal(path)`` to create or append, ``Journal(path,
    readonly=True)`` to read a journal that must already exist. One
    connection: use a journal from one thread at a time (the
    :class:`~journal.writer.JournalWriter` owns it from its thread).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        readonly: bool = False,
        synchronous: str = "NORMAL",
    ) -> None:
        self.path = os.fspath(path)
        self.readonly = readonly
        if synchronous not in SYNCHRONOUS:
            raise JournalError(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        self.synchronous = synchronous
        try:
            if readonly:
                if not os.path.exists(self.path):
                    raise JournalError(f"{self.path}: no such journal")
                if os.path.isdir(self.path):
                    raise JournalError(f"{self.path}: is a directory, not a journal")
                uri = f"file:{self.path}?mode=ro"
                self._conn = sqlite3.connect(
                    uri, uri=True, isolation_level=None, check_same_thread=False
                )
            else:
                self._conn = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False
                )
            self._conn.execute("PRAGMA busy_timeout = 5000")
            _schema.register_functions(self._conn)
            if not readonly:
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute(f"PRAGMA synchronous = {synchronous}")
                _schema.create(self._conn)
            _schema.check(self._conn, self.path)
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"{self.path}: cannot open journal: {exc}") from exc
        self._pack = msgpack.Packer(use_bin_type=True).pack

    # -- writing -----------------------------------------------------------------

    def head(self) -> tuple[int, bytes]:
        """The last record's ``seq`` and digest; ``(BEFORE_FIRST, GENESIS)`` when empty."""
        try:
            row = self._conn.execute(
                f"SELECT seq, digest FROM {_schema.TABLE} ORDER BY seq DESC LIMIT 1"
            ).fetchone()
        except sqlite3.Error as exc:
            raise JournalError(f"{self.path}: cannot read the journal: {exc}") from exc
        return (BEFORE_FIRST, _chain.GENESIS) if row is None else (row[0], row[1])

    def append(self, records: Iterable[Record]) -> int:
        """Append a batch in one transaction; returns how many were written.

        ``seq`` must increase strictly, continuing after the last stored one.
        The whole batch is written or none of it is.
        """
        return self.append_rows((r.seq, r.kind, r.step, r.rank, r.ts, r.payload) for r in records)

    def append_rows(self, rows: Iterable[Row]) -> int:
        """:meth:`append` for rows ``(seq, kind, step, rank, ts, payload)``.

        The writer thread's path: no :class:`Record` is built per record, and
        packing, chaining and the insert happen in one loop. It shares the
        engine's interpreter lock, so every step saved here is the engine's.
        """
        if self.readonly:
            raise JournalError(f"{self.path}: journal is open read-only")
        conn = self._conn
        pack = self._pack
        envelope = _chain.pack_envelope
        blake2b, size = hashlib.blake2b, _chain.DIGEST_SIZE
        written = 0

        def chained(last_seq: int, digest: bytes) -> Iterator[tuple[Any, ...]]:
            # Rows are made as SQLite takes them, not collected first: a
            # batch of thousands of rows alive at once was promoted through
            # the collector's generations and set off full collections of
            # the engine's heap (append cost per row doubled at 8k rows).
            nonlocal written
            for seq, kind, step, rank, ts, payload in rows:
                if seq <= last_seq:
                    why = "is negative" if seq < 0 else f"does not follow seq {last_seq}"
                    raise RecordError(f"seq {seq} {why}", path=self.path, seq=seq)
                packed = pack(payload if type(payload) is dict else dict(payload))
                # _chain.link, inlined: this loop runs once per record written
                h = blake2b(digest, digest_size=size)
                h.update(envelope((seq, kind, step, rank, ts)))
                h.update(packed)
                digest = h.digest()
                yield (seq, kind, step, rank, ts, packed, digest)
                written += 1
                last_seq = seq

        try:
            # IMMEDIATE takes the write lock up front, so a concurrent writer
            # waits on busy_timeout instead of failing at the first insert.
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(_INSERT, chained(*self.head()))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return written

    def create_views(self, kinds: Mapping[str, Sequence[str]]) -> None:
        """Create one SQL view per record kind (see :func:`journal._schema.create_views`)."""
        _schema.create_views(self._conn, kinds)

    # -- reading -----------------------------------------------------------------

    def __len__(self) -> int:
        try:
            return self._conn.execute(f"SELECT count(*) FROM {_schema.TABLE}").fetchone()[0]
        except sqlite3.Error as exc:
            raise JournalError(f"{self.path}: cannot read the journal: {exc}") from exc

    def records(
        self, *, after: int = BEFORE_FIRST, upto: int | None = None, verify: bool = True
    ) -> Iterator[Record]:
        """Stream the records with ``after < seq <= upto`` in seq order.

        With ``verify`` each digest is recomputed and a break in the chain
        raises :class:`TamperedError` naming the first bad seq. A row SQLite
        cannot read (a damaged page, text that is not UTF-8) raises
        :class:`RecordError` naming the last good seq.
        """
        for seq, kind, step, rank, ts, fields in self.rows(after=after, upto=upto, verify=verify):
            yield Record(seq, kind, fields, step, rank, ts)

    def rows(
        self, *, after: int = BEFORE_FIRST, upto: int | None = None, verify: bool = True
    ) -> Iterator[Row]:
        """:meth:`records` as plain tuples ``(seq, kind, step, rank, ts, payload)``.

        The reading path of replay: rows are fetched, chain-checked and
        decoded a chunk at a time, and no object is built per record beyond
        the tuple and its payload dict. The checks are those of
        :meth:`records`, which is this plus a :class:`Record` per row.
        """
        last = after
        try:
            previous = self._digest_before(after) if verify else _chain.GENESIS
            if upto is None:
                cursor = self._conn.execute(f"{_SELECT} WHERE seq > ? ORDER BY seq", (after,))
            else:
                cursor = self._conn.execute(
                    f"{_SELECT} WHERE seq > ? AND seq <= ? ORDER BY seq", (after, upto)
                )
            while True:
                chunk = cursor.fetchmany(_READ_CHUNK)
                if not chunk:
                    return
                broken: RecordError | None = None
                if verify:
                    previous, good, broken = self._verify(chunk, previous)
                    chunk = chunk[:good]
                yield from self._decode_chunk(chunk)
                if broken is not None:
                    raise broken  # after the good records before it
                last = chunk[-1][0]
        except sqlite3.Error as exc:
            where = "the first record" if last == BEFORE_FIRST else f"the record after seq {last}"
            raise RecordError(f"cannot read {where}: {exc}", path=self.path) from exc

    def follow(
        self,
        *,
        after: int = BEFORE_FIRST,
        poll_interval: float = 0.1,
        stop: Callable[[], bool] | threading.Event | None = None,
    ) -> Iterator[Record]:
        """Yield records as another process appends them, until ``stop``.

        Reads in short chunks and never holds a read transaction between
        polls, so the writer (in WAL mode) is never blocked.
        """
        should_stop = stop.is_set if isinstance(stop, threading.Event) else stop
        previous = self._digest_before(after)
        last = after
        while True:
            try:
                rows = self._conn.execute(
                    f"{_SELECT} WHERE seq > ? ORDER BY seq LIMIT {_FOLLOW_CHUNK}", (last,)
                ).fetchall()
            except sqlite3.Error as exc:
                raise RecordError(
                    f"cannot read the record after seq {last}: {exc}", path=self.path
                ) from exc
            for row in rows:
                record, previous = self._decode(row, previous, True)
                last = record.seq
                yield record
            if len(rows) == _FOLLOW_CHUNK:
                continue
            if should_stop is not None and should_stop():
                return
            time.sleep(poll_interval)

    def _digest_before(self, after: int) -> bytes:
        if after < 0:
            return _chain.GENESIS
        row = self._conn.execute(
            f"SELECT digest FROM {_schema.TABLE} WHERE seq <= ? ORDER BY seq DESC LIMIT 1",
            (after,),
        ).fetchone()
        return _chain.GENESIS if row is None else row[0]

    def _verify(
        self, chunk: list[tuple[Any, ...]], previous: bytes
    ) -> tuple[bytes, int, RecordError | None]:
        """Check a chunk of rows against the chain.

        Returns the last good digest, how many rows are good, and the error
        for the first bad one (None when all are good), so the caller still
        hands out every record before a break. One tight loop per chunk
        (this is most of what reading costs): each digest is recomputed
        from the one before, exactly as :func:`journal._chain.link` does on
        append.
        """
        blake2b, pack, size = hashlib.blake2b, _chain.pack_envelope, _chain.DIGEST_SIZE
        for good, (seq, kind, step, rank, ts, payload, digest) in enumerate(chunk):
            if type(payload) is not bytes or type(digest) is not bytes or type(kind) is not str:
                why = "row does not have the journal's column types"
                return previous, good, RecordError(why, path=self.path, seq=seq)
            h = blake2b(previous, digest_size=size)
            h.update(pack((seq, kind, step, rank, ts)))
            h.update(payload)
            if h.digest() != digest:
                why = (
                    "digest does not match the hash chain: the record or one before it was changed"
                )
                return previous, good, TamperedError(why, path=self.path, seq=seq)
            previous = digest
        return previous, len(chunk), None

    def _decode_chunk(self, chunk: list[tuple[Any, ...]]) -> Iterator[Row]:
        unpack = msgpack.unpackb
        usable = _values.payload_problem
        for seq, kind, step, rank, ts, payload, _digest in chunk:
            if type(payload) is not bytes or type(kind) is not str:
                raise RecordError(
                    "row does not have the journal's column types", path=self.path, seq=seq
                )
            try:
                fields = unpack(payload, raw=False)
            except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
                    msgpack.StackError) as exc:  # fmt: skip
                raise RecordError(
                    f"payload is not msgpack: {exc}", path=self.path, seq=seq
                ) from exc
            if type(fields) is not dict:
                raise RecordError("payload is not a map", path=self.path, seq=seq)
            found = usable(fields)
            if found:
                raise RecordError(
                    f"unusable value in the payload: {found}", path=self.path, seq=seq
                )
            yield seq, kind, step, rank, ts, fields

    def _decode(self, row: tuple[Any, ...], previous: bytes, verify: bool) -> tuple[Record, bytes]:
        """One row (the follow path, which reads a few at a time)."""
        digest = row[6]
        if verify:
            digest, _good, broken = self._verify([row], previous)
            if broken is not None:
                raise broken
        for seq, kind, step, rank, ts, fields in self._decode_chunk([row]):
            return Record(seq, kind, fields, step, rank, ts), digest
        raise RecordError("row vanished while decoding", path=self.path, seq=row[0])

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent).

        A journal written here leaves WAL mode as it closes: the log is
        checkpointed into the file and removed, so the finished journal is one
        self-contained file, and readers opening it read-only do not leave
        ``-wal``/``-shm`` files beside it. If another process still has it
        open (a ``--follow`` reader), it stays in WAL mode; nothing is lost.
        """
        if not self.readonly:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("PRAGMA journal_mode = DELETE")
        self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
