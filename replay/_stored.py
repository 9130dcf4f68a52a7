"""What every way of reading a stored journal shares (see :mod:`replay.sources`).

A journal named on the command line must exist (or be a rotated journal
whose head retention removed); a database's rows decode through
:mod:`kvstate.codec`; a journal whose head was removed begins with the
checkpoint of its oldest segment left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from journal import Journal, RecordError, segments
from kvstate.checkpoint import resumed_at
from kvstate.codec import Entry, Located, from_stored


def existing(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, once it is known to name a journal (or a removed head)."""
    name = os.fspath(path)
    if not os.path.exists(name) and not segments.is_removed_head(name):
        raise RecordError("no such file", path=name)
    if os.path.isdir(name):
        raise RecordError("is a directory, not a journal", path=name)
    return name


def rows(journal: Journal, name: str, after: int, upto: int | None) -> Iterator[Located]:
    """The records of one journal database with ``after < seq <= upto``,
    chain-verified and decoded, each located in ``name``."""
    for seq, kind, step, rank, ts, payload in journal.stored_rows(after=after, upto=upto):
        yield Located(from_stored(seq, kind, step, rank, ts, payload, name), name, seq, None)


def resumed(journal: Journal) -> Located | None:
    """The checkpoint the first remaining segment of a journal begins with,
    when the segments before it were removed."""
    found = resumed_at(journal)
    if found is None:
        return None
    return Located(Entry(found.seq, 0, None, found), journal.path, found.seq, None)  # type: ignore[arg-type]
