"""sqlite-utils plugin: registers ``journal_json`` so the per-kind views work
from ``sqlite-utils query`` and ``sqlite-utils rows``."""

from __future__ import annotations

import sqlite3

from sqlite_utils import hookimpl

from ._schema import register_functions


@hookimpl
def prepare_connection(conn: sqlite3.Connection) -> None:
    register_functions(conn)
