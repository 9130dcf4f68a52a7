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
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgpack

from . import _chain, _schema, _values
from ._readonly import connect_readonly, forget_copy, says_wal
from .errors import JournalError, RecordError
from .record import Record

#: what reading a damaged file raises: SQLite's errors, and a TEXT value
#: (a kind, a table name in the schema) whose bytes are not UTF-8
_UNREADABLE = (sqlite3.Error, UnicodeDecodeError)

_INSERT = (
    f"INSERT INTO {_schema.TABLE} (seq, kind, step, rank, ts, payload, digest) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_UNLINKED = (
    f"INSERT INTO {_schema.TABLE} (seq, kind, step, rank, ts, payload) VALUES (?, ?, ?, ?, ?, ?)"
)
_SELECT = f"SELECT seq, kind, step, rank, ts, payload, digest FROM {_schema.TABLE}"
_FOLLOW_CHUNK = 4096
#: rows fetched, chain-checked and decoded together when reading
_READ_CHUNK = 1024
#: one decoded row: seq, kind, step, rank, ts and the payload's fields
Row = tuple[int, str, "int | None", "int | None", "int | None", Mapping[str, Any]]
#: a row to append: its payload a mapping, or bytes the application encoded
NewRow = tuple[int, str, "int | None", "int | None", "int | None", "Mapping[str, Any] | bytes"]
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
    connection: use a journal from one thread at a time (a writer that
    writes from a thread of its own owns it from that thread).
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
        #: a private copy read where the file cannot be read in place (journal._readonly)
        self._private: str | None = None
        try:
            if readonly:
                if not os.path.exists(self.path):
                    raise JournalError(f"{self.path}: no such journal")
                if os.path.isdir(self.path):
                    raise JournalError(f"{self.path}: is a directory, not a journal")
                self._conn, self._private = connect_readonly(self.path)
            else:
                if not os.path.lexists(self.path):
                    _create_whole(self.path)
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
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot open journal: {exc}") from exc
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._base = self._chain_base()

    def _chain_base(self) -> tuple[int, bytes]:
        """Where this file's chain starts: before the first record of a whole
        journal, or after the previous segment's last commit (a later segment
        of a rotated journal, see :mod:`journal.segments`)."""
        try:
            row = _schema.segment_row(self._conn)
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the segment table: {exc}") from exc
        if row is None:
            return BEFORE_FIRST, _chain.GENESIS
        # A checkpoint written with this segment is chained like a commit
        # between the previous segment's last one and this one's first.
        try:
            parts = _schema.checkpoint_parts(self._conn)
            if parts is None:
                return row[2], row[3]
            return row[2], _chain.checkpoint_link(row[3], parts)
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the checkpoint: {exc}") from exc

    def continue_after(
        self,
        *,
        index: int,
        journal_id: str,
        previous_seq: int,
        previous_link: bytes,
        previous_name: str | None,
        checkpoint: Iterable[bytes] | None = None,
    ) -> None:
        """Make this new, empty journal segment ``index`` of a rotated journal:
        its first commit follows ``previous_seq`` and links to ``previous_link``.

        ``checkpoint``: the application's state after ``previous_seq``, in
        parts, stored with the segment and chained between the two (see
        :mod:`journal.retention`): what lets the segments before this one be
        removed. One transaction: the segment is made whole or not at all.
        """
        if self.readonly or len(self):
            raise JournalError(f"{self.path}: only a new, empty journal can continue another")
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            _schema.create_segment(
                conn,
                index=index,
                journal_id=journal_id,
                previous_seq=previous_seq,
                previous_link=previous_link,
                previous_name=previous_name,
            )
            if checkpoint is not None:
                for _part in _schema.create_checkpoint(conn, checkpoint):
                    pass
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._base = self._chain_base()

    def checkpoint(self) -> Iterator[bytes] | None:
        """The parts of the checkpoint this segment begins with (already
        verified against the chain when the journal was opened: its link is
        the one this segment's first commit follows); None without one."""
        try:
            return _schema.checkpoint_parts(self._conn)
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the checkpoint: {exc}") from exc

    def first_link(self) -> bytes | None:
        """The link of the first commit in this file (None: no commit yet)."""
        try:
            row = self._conn.execute(
                f"SELECT digest FROM {_schema.TABLE} WHERE digest IS NOT NULL ORDER BY seq LIMIT 1"
            ).fetchone()
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the journal: {exc}") from exc
        return None if row is None else bytes(row[0])

    def segment(self) -> tuple[int, str, int, bytes, str | None] | None:
        """(index, journal id, previous seq, previous link, previous file) of a
        later segment; None for a whole journal or a first segment."""
        try:
            return _schema.segment_row(self._conn)
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the segment table: {exc}") from exc

    # -- writing -----------------------------------------------------------------

    def head(self) -> tuple[int, bytes]:
        """The last record's ``seq`` and digest; ``(BEFORE_FIRST, GENESIS)`` when empty."""
        try:
            row = self._conn.execute(
                f"SELECT seq, digest FROM {_schema.TABLE} ORDER BY seq DESC LIMIT 1"
            ).fetchone()
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the journal: {exc}") from exc
        return self._base if row is None else (row[0], row[1])

    def append(self, records: Iterable[Record]) -> int:
        """Append a batch in one transaction; returns how many were written.

        ``seq`` must increase strictly, continuing after the last stored one.
        The whole batch is written or none of it is.
        """
        return self.append_rows((r.seq, r.kind, r.step, r.rank, r.ts, r.payload) for r in records)

    def append_rows(self, rows: Iterable[NewRow]) -> int:
        """:meth:`append` for rows ``(seq, kind, step, rank, ts, payload)``.

        A payload is a mapping (packed here with msgpack) or bytes the
        application already encoded. The batch is one commit: its rows are
        inserted in one transaction and chained with one link, stored on the
        last row (see :mod:`journal._chain`).
        """
        if self.readonly:
            raise JournalError(f"{self.path}: journal is open read-only")
        conn = self._conn
        pack = self._pack
        try:
            # IMMEDIATE takes the write lock up front, so a concurrent writer
            # waits on busy_timeout instead of failing at the first insert,
            # and the head read below is the one this commit follows.
            conn.execute("BEGIN IMMEDIATE")
            last_seq, previous = self.head()
            batch: list[tuple[Any, ...]] = []
            for seq, kind, step, rank, ts, payload in rows:
                if seq <= last_seq:
                    why = "is negative" if seq < 0 else f"does not follow seq {last_seq}"
                    raise RecordError(f"seq {seq} {why}", path=self.path, seq=seq)
                if not isinstance(payload, bytes):
                    payload = pack(payload if type(payload) is dict else dict(payload))
                batch.append((seq, kind, step, rank, ts, payload))
                last_seq = seq
            written = len(batch)
            if batch:
                digest = _chain.link(previous, batch)
                last = batch.pop()
                conn.executemany(_INSERT_UNLINKED, batch)
                conn.execute(_INSERT, (*last, digest))
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and "disk is full" in str(exc):
                # the batch is not written (rolled back whole); say where the room ran out
                folder = os.path.dirname(os.path.abspath(self.path))
                raise JournalError(
                    f"{self.path}: the disk holding {folder} is full: this commit "
                    f"(after seq {self.head()[0]}) was not written"
                ) from exc
            raise
        return written

    def create_views(self, kinds: Mapping[str, Sequence[str]]) -> None:
        """Create one SQL view per record kind (see :func:`journal._schema.create_views`)."""
        try:
            _schema.create_views(self._conn, kinds)
        except sqlite3.Error as exc:
            # Two processes opening one new journal race here ("view ... already exists").
            raise JournalError(
                f"{self.path}: cannot create the journal's views ({exc}); "
                "is another process opening this journal?"
            ) from exc

    def view_definitions(self) -> list[str]:
        """The SQL that made this journal's views (a later segment gets the same)."""
        try:
            return _schema.view_definitions(self._conn)
        except _UNREADABLE as exc:
            raise JournalError(f"{self.path}: cannot read the journal's views: {exc}") from exc

    def define_views(self, definitions: Sequence[str]) -> None:
        """Make views from :meth:`view_definitions` of another segment of this journal."""
        if self.readonly:
            raise JournalError(f"{self.path}: journal is open read-only")
        _schema.define_views(self._conn, definitions, self.path)

    # -- reading -----------------------------------------------------------------

    def __len__(self) -> int:
        try:
            return self._conn.execute(f"SELECT count(*) FROM {_schema.TABLE}").fetchone()[0]
        except _UNREADABLE as exc:
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

        Rows are fetched, chain-checked and decoded a chunk at a time, and no
        object is built per record beyond the tuple and its payload dict.
        The checks are those of :meth:`records`, which is this plus a
        :class:`Record` per row.
        """
        for chunk in self._chunks(after, upto, verify):
            yield from self._decode_chunk(chunk)

    def stored_rows(
        self, *, after: int = BEFORE_FIRST, upto: int | None = None, verify: bool = True
    ) -> Iterator[tuple[int, str, int | None, int | None, int | None, bytes]]:
        """:meth:`rows` with each payload as the bytes stored, not decoded.

        For an application that decodes payloads with a schema of its own
        (replay's typed decoders): the chain and the column types are checked
        as for :meth:`rows`; what the payload holds is the caller's to check.
        """
        for chunk in self._chunks(after, upto, verify):
            for seq, kind, step, rank, ts, payload, _digest in chunk:
                yield seq, kind, step, rank, ts, payload

    def _chunks(
        self, after: int, upto: int | None, verify: bool
    ) -> Iterator[list[tuple[Any, ...]]]:
        """Rows with ``after < seq <= upto`` in seq order, a chunk at a time.

        With ``verify``, reading starts at the link before ``after`` and a row
        is handed out only once the link of its commit checks out, so a
        chunk holds whole verified commits; a break raises after the good
        commits before it.
        """
        last = after
        try:
            start, previous = self._link_at_or_before(after) if verify else (after, None)
            check = _chain.Verifier(self.path, previous) if previous is not None else None
            cursor = self._conn.execute(f"{_SELECT} WHERE seq > ? ORDER BY seq", (start,))
            while True:
                rows = cursor.fetchmany(_READ_CHUNK)
                if not rows:
                    if check is not None:
                        check.end()
                    return
                good, broken = check.feed(rows) if check is not None else self._typed(rows)
                chunk = [r for r in good if r[0] > after and (upto is None or r[0] <= upto)]
                if chunk:
                    yield chunk
                    last = chunk[-1][0]
                if broken is not None:
                    raise broken  # after the good records before it
                if upto is not None and good and good[-1][0] >= upto:
                    return
        except _UNREADABLE as exc:
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
        polls, so the writer (in WAL mode) is never blocked. Commits are
        atomic, so each poll sees whole commits and verifies their links.
        """
        should_stop = stop.is_set if isinstance(stop, threading.Event) else stop
        last, previous = self._link_at_or_before(after)
        check = _chain.Verifier(self.path, previous)
        while True:
            try:
                rows = self._conn.execute(
                    f"{_SELECT} WHERE seq > ? ORDER BY seq LIMIT {_FOLLOW_CHUNK}", (last,)
                ).fetchall()
            except _UNREADABLE as exc:
                raise RecordError(
                    f"cannot read the record after seq {last}: {exc}", path=self.path
                ) from exc
            good, broken = check.feed(rows)
            for seq, kind, step, rank, ts, fields in self._decode_chunk(good):
                if seq > after:
                    yield Record(seq, kind, fields, step, rank, ts)
            if broken is not None:
                raise broken
            if rows:
                last = rows[-1][0]
            if len(rows) == _FOLLOW_CHUNK:
                continue
            if should_stop is not None and should_stop():
                return
            time.sleep(poll_interval)

    def _link_at_or_before(self, after: int) -> tuple[int, bytes]:
        """The seq and link of the last commit that ends at or before ``after``
        (the chain's base, before this file's first commit)."""
        if after <= self._base[0]:
            return self._base
        row = self._conn.execute(
            f"SELECT seq, digest FROM {_schema.TABLE} WHERE seq <= ? AND digest IS NOT NULL "
            "ORDER BY seq DESC LIMIT 1",
            (after,),
        ).fetchone()
        if row is None:
            return self._base
        if type(row[1]) is not bytes:
            raise RecordError("row does not have the journal's column types", path=self.path,
                              seq=row[0])  # fmt: skip
        return row[0], row[1]

    def _typed(
        self, rows: list[tuple[Any, ...]]
    ) -> tuple[list[tuple[Any, ...]], RecordError | None]:
        """The rows that lead with the journal's column types, and the error for
        the first that does not (the unverified path's only check)."""
        for good, (seq, kind, _step, _rank, _ts, payload, _digest) in enumerate(rows):
            if type(payload) is not bytes or type(kind) is not str:
                why = "row does not have the journal's column types"
                return rows[:good], RecordError(why, path=self.path, seq=seq)
        return rows, None

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

    # -- lifecycle ---------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (idempotent).

        A journal written here leaves WAL mode as it closes: the log is
        checkpointed into the file and removed, so the finished journal is one
        self-contained file, and readers opening it read-only do not leave
        ``-wal``/``-shm`` files beside it. See :func:`_leave_wal` for a
        reader that has it open at that moment.
        """
        if not self.readonly:
            _leave_wal(self._conn)
        self._conn.close()
        if self._private is not None:
            forget_copy(self._private)
            self._private = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_whole(path: str) -> None:
    """Make a new journal file at ``path`` with its schema, whole, or not at all.

    Made under a hidden name and linked into place once its tables exist,
    as each later segment is (journal.segments): a reader listing the
    folder (``kvstate watch``) never meets the file between its writer
    creating it and making its tables, which a loaded machine stretches
    (an import lies between), and so never takes a journal being made for
    some other database. A file another writer linked into place meanwhile
    is theirs: this one is dropped, and the journal opened is that one.
    """
    folder, name = os.path.split(path)
    hidden = os.path.join(folder, f".{name}.tmp")
    for leftover in (hidden, hidden + "-journal"):
        if os.path.exists(leftover):  # ours, from a creation killed half-way
            os.unlink(leftover)
    conn = sqlite3.connect(hidden, isolation_level=None)
    try:
        _schema.create(conn)
    finally:
        conn.close()
    try:
        os.link(hidden, path)  # never over a file made meanwhile
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        if not os.path.lexists(path):
            os.rename(hidden, path)
    if os.path.exists(hidden):
        os.unlink(hidden)


#: how long :func:`_leave_wal` tries to leave WAL mode while readers have the
#: file open, and how long it sleeps between two tries (seconds)
LEAVE_WAL_FOR, LEAVE_WAL_EVERY = 2.0, 0.005


def _leave_wal(conn: sqlite3.Connection) -> None:
    """Fold the log into the file and take it out of WAL mode, as a writer closes.

    The race: a reader (``kvstate watch`` following the folder, a replay)
    that has the file open when its writer closes. Leaving WAL mode needs
    the file to itself, and SQLite refuses at once, without its busy
    handler, while any other connection is open; left in WAL mode, the
    finished journal is two files, and the ``.db`` copied alone for a
    ticket misses every record still in the ``-wal``. So the log is first
    checkpointed into the file and truncated (which readers that are not in
    a read transaction do not block): from then on the ``.db`` alone holds
    every record, whatever happens next. Then the change of mode is tried
    until the readers let go (a poll of ``kvstate watch`` holds the file
    for one read), for at most :data:`LEAVE_WAL_FOR` seconds; a reader that
    holds it longer leaves the header saying WAL with an empty log beside
    it, which every reader of this package reads as one file
    (:func:`journal._readonly.connect_readonly`) and replay names
    (:func:`wal_state`).
    """
    with contextlib.suppress(sqlite3.Error):
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    deadline = time.monotonic() + LEAVE_WAL_FOR
    while True:
        try:
            conn.execute("PRAGMA journal_mode = DELETE").fetchall()
            return
        except sqlite3.Error:
            if time.monotonic() >= deadline:
                return
            time.sleep(LEAVE_WAL_EVERY)


def wal_state(path: str | os.PathLike[str]) -> tuple[bool, int | None]:
    """Whether the database file at ``path`` says it is in WAL mode, and the
    size of the ``-wal`` log beside it (None: there is none). Read without
    opening the database, so nothing is made beside it."""
    name = os.fspath(path)
    try:
        log: int | None = os.path.getsize(name + "-wal")
    except OSError:
        log = None
    return says_wal(name), log
