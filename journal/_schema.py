"""The journal's SQLite schema, created with sqlite-utils.

One STRICT table of records keyed by ``seq`` (an alias of the rowid, so
appends land in key order), triggers that refuse UPDATE and DELETE so the
journal is append-only by construction, and a one-row table naming the schema
version so a future layout can be told apart.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence

import msgpack

from .errors import JournalError

#: 2: one chain link per commit, on its last row (1: a link on every row)
SCHEMA_VERSION = 2
#: the versions this reader reads (version 1 is the same chain, a commit per record)
READABLE_VERSIONS = (1, 2)
TABLE = "records"
_COLUMNS = frozenset({"seq", "kind", "step", "rank", "ts", "payload", "digest"})
_KIND_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")

_TRIGGERS = f"""
CREATE TRIGGER IF NOT EXISTS {TABLE}_refuse_update BEFORE UPDATE ON {TABLE}
BEGIN SELECT RAISE(ABORT, 'the journal is append-only: UPDATE refused'); END;
CREATE TRIGGER IF NOT EXISTS {TABLE}_refuse_delete BEFORE DELETE ON {TABLE}
BEGIN SELECT RAISE(ABORT, 'the journal is append-only: DELETE refused'); END;
"""


def journal_json(payload: bytes | None) -> str | None:
    """SQL function: a msgpack payload as JSON text, for views and ad-hoc queries."""
    if payload is None:
        return None
    import json

    return json.dumps(msgpack.unpackb(payload, raw=False), ensure_ascii=False)


def register_functions(conn: sqlite3.Connection) -> None:
    """Register the SQL functions the views use on one connection."""
    conn.create_function("journal_json", 1, journal_json, deterministic=True)


def create(conn: sqlite3.Connection) -> None:
    """Create the schema in an empty database (idempotent)."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if TABLE in tables and "schema_version" in tables:
        # A journal that exists (a writer process opens the one its engine
        # created): its tables are not made again, so sqlite-utils, and the
        # numpy it imports where installed (0.2 s of CPU at the writer's
        # start), are not loaded.
        conn.executescript(_TRIGGERS)
        return
    import sqlite_utils  # only writers need it; it pulls in numpy when installed

    db = sqlite_utils.Database(conn)
    if TABLE not in db.table_names():
        db.table(TABLE).create(
            {
                "seq": int,
                "kind": str,
                "step": int,
                "rank": int,
                "ts": int,
                "payload": bytes,
                "digest": bytes,
            },
            pk="seq",
            not_null={"kind", "payload"},
            strict=True,
        )
    if "schema_version" not in db.table_names():
        db.table("schema_version").create({"version": int}, strict=True)
        db.table("schema_version").insert({"version": SCHEMA_VERSION})
    conn.executescript(_TRIGGERS)


#: the one-row table of a journal's segment after the first (see :mod:`journal.segments`)
SEGMENT = "segment"


def create_segment(
    conn: sqlite3.Connection,
    *,
    index: int,
    journal_id: str,
    previous_seq: int,
    previous_link: bytes,
    previous_name: str | None,
) -> None:
    """Mark an empty journal as segment ``index`` of journal ``journal_id``,
    continuing the chain after ``previous_seq`` and ``previous_link``."""
    conn.execute(
        f"CREATE TABLE {SEGMENT} (segment_index INTEGER NOT NULL, journal_id TEXT NOT NULL, "
        "previous_seq INTEGER NOT NULL, previous_link BLOB NOT NULL, previous_name TEXT) STRICT"
    )
    conn.execute(
        f"INSERT INTO {SEGMENT} VALUES (?, ?, ?, ?, ?)",
        (index, journal_id, previous_seq, previous_link, previous_name),
    )


def segment_row(conn: sqlite3.Connection) -> tuple[int, str, int, bytes, str | None] | None:
    """The segment row, or None for a journal that is not a segment."""
    try:
        row = conn.execute(
            f"SELECT segment_index, journal_id, previous_seq, previous_link, previous_name "
            f"FROM {SEGMENT}"
        ).fetchone()
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):  # a whole journal, or a first segment
            return None
        raise
    if row is None:
        return None
    return int(row[0]), str(row[1]), int(row[2]), bytes(row[3]), row[4]


#: the table of a later segment that begins with a checkpoint of the
#: application's state (see :mod:`journal.retention`): its parts, in order
CHECKPOINT = "checkpoint"

_CHECKPOINT_TRIGGERS = f"""
CREATE TRIGGER {CHECKPOINT}_refuse_update BEFORE UPDATE ON {CHECKPOINT}
BEGIN SELECT RAISE(ABORT, 'a checkpoint is append-only: UPDATE refused'); END;
CREATE TRIGGER {CHECKPOINT}_refuse_delete BEFORE DELETE ON {CHECKPOINT}
BEGIN SELECT RAISE(ABORT, 'a checkpoint is append-only: DELETE refused'); END;
"""


def create_checkpoint(conn: sqlite3.Connection, parts: Iterable[bytes]) -> Iterator[bytes]:
    """Store ``parts`` as this segment's checkpoint (the table made first);
    the returned iterator inserts each part as it hands it on, so the caller
    chains them without holding them all, and must exhaust it."""
    conn.execute(f"CREATE TABLE {CHECKPOINT} (part INTEGER PRIMARY KEY, data BLOB NOT NULL) STRICT")
    for statement in _CHECKPOINT_TRIGGERS.strip().split("END;"):
        if statement.strip():
            conn.execute(statement + "END;")
    return _inserted(conn, parts)


def _inserted(conn: sqlite3.Connection, parts: Iterable[bytes]) -> Iterator[bytes]:
    for index, part in enumerate(parts):
        conn.execute(f"INSERT INTO {CHECKPOINT} VALUES (?, ?)", (index, part))
        yield part


def checkpoint_parts(conn: sqlite3.Connection) -> Iterator[bytes] | None:
    """The parts of this segment's checkpoint in order, or None without one."""
    try:
        cursor = conn.execute(f"SELECT data FROM {CHECKPOINT} ORDER BY part")
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            return None
        raise
    return (row[0] for row in cursor)


def check(conn: sqlite3.Connection, path: str) -> None:
    """Refuse a database that is not a journal of a version we can read."""
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        raise JournalError(f"{path}: not a journal database ({exc})") from exc
    if TABLE not in names or "schema_version" not in names:
        raise JournalError(f"{path}: not a kvstate journal (no '{TABLE}' table)")
    try:
        columns = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
        row = conn.execute("SELECT version FROM schema_version").fetchone()
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        raise JournalError(f"{path}: not a readable journal database ({exc})") from exc
    if not columns >= _COLUMNS:
        missing = ", ".join(sorted(_COLUMNS - columns))
        raise JournalError(f"{path}: not a kvstate journal ('{TABLE}' lacks {missing})")
    if row is None or row[0] not in READABLE_VERSIONS:
        found = None if row is None else row[0]
        raise JournalError(f"{path}: unknown journal schema version {found!r}")


def view_definitions(conn: sqlite3.Connection) -> list[str]:
    """The SQL of every view of the journal (what a later segment repeats)."""
    rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'view' ORDER BY name")
    return [row[0] for row in rows]


def define_views(conn: sqlite3.Connection, definitions: Sequence[str], path: str) -> None:
    """Make the views :func:`view_definitions` read from another segment."""
    for sql in definitions:
        if not sql.upper().startswith("CREATE VIEW "):
            raise JournalError(f"{path}: not a view definition: {sql[:60]!r}")
        conn.execute(sql)


def create_views(conn: sqlite3.Connection, kinds: Mapping[str, Sequence[str]]) -> None:
    """One view per kind, named after it, with the payload fields as columns.

    Reading the views needs the ``journal_json`` SQL function: registered on
    every connection the journal opens, and by the sqlite-utils plugin this
    package installs, so ``sqlite-utils query`` can read them too.
    """
    import sqlite_utils

    db = sqlite_utils.Database(conn)
    for kind, fields in kinds.items():
        if not _KIND_NAME.match(kind) or kind in (TABLE, "schema_version"):
            raise JournalError(f"cannot create a view for kind {kind!r}")
        columns = "".join(f", json_extract(j, '$.{field}') AS \"{field}\"" for field in fields)
        sql = (
            f"SELECT seq, step, rank, ts{columns} FROM "
            f"(SELECT seq, step, rank, ts, journal_json(payload) AS j "
            f"FROM {TABLE} WHERE kind = '{kind}')"
        )
        db.create_view(kind, sql, replace=True)
