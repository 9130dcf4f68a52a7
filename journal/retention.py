"""Retention: a rotated journal keeps at most so many bytes, or hours.

A journal that rotates (:mod:`journal.segments`) can also keep a budget
(:class:`~journal.rotation.Rotation`'s ``keep_bytes`` and ``keep_seconds``).
Then every new segment begins with a *checkpoint*: the application's state
after the last commit of the segment before it, handed over in parts by the
writer and stored in the segment's ``checkpoint`` table. The checkpoint is
chained like a commit: its link covers its parts and the previous segment's
last link, and the new segment's first commit links to it, so a changed
checkpoint breaks the chain where the segment's records begin.

After each rotation, whole segments are removed, oldest first, while the
journal is over its budget, and only where the segment after the one
removed begins with a checkpoint: what the removed records folded into is
never lost. The current segment is never removed. The byte budget counts
the current segment at its full size (its checkpoint and the rotation size
of records), so the journal on disk stays within ``keep_bytes`` between
rotations too; the age budget
removes a segment once its last write is older than ``keep_seconds``.

A checkpoint grows with the history it carries, and may outgrow the
rotation size asked: then the rotation size in force grows to the
checkpoint's bytes (:attr:`~journal.rotation.Rotation.rotate_bytes`), so a
segment never holds fewer bytes of records than of checkpoint (rotated
sooner, the writer would spend its time writing checkpoints). Where even
then the budget cannot hold the current segment at its full size, no
removal can make up for it: that is said on stderr (:func:`say_sizes`) and
kept as :attr:`~journal.rotation.Rotation.short_bytes`, which the writer's
figures publish, rather than the budget being overrun in silence.

A reader given the journal's first segment, or its folder, then starts at
the oldest remaining segment (:func:`journal.segments.open_first`) and the
application goes on from its checkpoint. The order of the steps is what a
kill at any moment cannot break: the new segment is made whole under a
hidden name, its checkpoint in the same transaction, renamed into place and
the folder synced, and only then is the oldest file removed; a kill between
two removals leaves a shorter run of segments that still begins with a
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ._schema import checkpoint_parts, segment_row
from .segment_files import file_bytes, later_indexes, segment_path, sync_folder

if TYPE_CHECKING:
    from .rotation import Rotation

T = TypeVar("T")


def remove_old(first: str, current: int, rotation: Rotation) -> list[str]:
    """Remove the oldest segments of the journal whose first segment is named
    ``first`` while it is over ``rotation``'s budget; ``current`` is the
    index of the segment written now. Returns the files removed."""
    indexes = ([1] if os.path.exists(first) else []) + later_indexes(first)
    sizes = {i: file_bytes(segment_path(first, i)) for i in indexes}
    # the current segment counts at the size it may reach before the next
    # rotation: its checkpoint, and the rotation size in force of records
    # after it (grown to the checkpoint's where that is larger)
    room = sizes.get(current, 0) + (rotation.rotate_bytes or 0)
    total = sum(size for i, size in sizes.items() if i != current) + room
    if rotation.keep_bytes is not None:
        # what no removal can make up for: the budget cannot hold the segment
        # being written (said, and published by the writer's figures)
        rotation.short_bytes = max(0, room - rotation.keep_bytes)
    say_sizes(segment_path(first, current), rotation, room)
    ident = _journal_id(segment_path(first, current))
    removed: list[str] = []
    for index in indexes:
        if index >= current:
            break
        path = segment_path(first, index)
        try:
            over = rotation.keep_bytes is not None and total > rotation.keep_bytes
            old = (
                rotation.keep_seconds is not None
                and time.time() - os.path.getmtime(path) > rotation.keep_seconds
            )
            if not (over or old):
                break
            after = segment_path(first, index + 1)
            if not _begins_with_checkpoint(after, ident):
                break  # what this segment folded into is nowhere else: kept
            if index > 1 and _journal_id(path) != ident:
                break  # not this journal's (never removed: it is not ours)
            for name in (path, path + "-wal", path + "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        except OSError as exc:
            # The journal goes on: a segment that cannot be removed now (its
            # folder's permissions, a file held elsewhere) is over the budget
            # until a later rotation can; never a reason to stop recording.
            print(f"journal retention: {path} not removed: {exc}", file=sys.stderr)
            break
        removed.append(path)
        total -= sizes[index]
    if removed:
        with contextlib.suppress(OSError):
            sync_folder(os.path.dirname(first))
    return removed


def say_sizes(path: str, rotation: Rotation, room: int) -> None:
    """Say on stderr that the rotation size in force grew past the one asked
    (to the checkpoint's bytes: once, and again each time it has doubled
    since), and that the byte budget cannot hold the segment being written,
    ``path``, at its full size, ``room`` (once, and again each time what it
    lacks has grown by a quarter since it was said); and that it holds
    again. The writer's figures publish both at every rotation."""
    said = rotation.said
    grown = rotation.rotate_bytes or 0
    if grown > (rotation.max_bytes or 0) and grown >= 2 * said["rotate"]:  # 0: never said
        said["rotate"] = grown
        print(
            f"journal retention: {path}: its checkpoint is {rotation.checkpoint_bytes} "
            f"bytes, more than the rotation size of {rotation.max_bytes}: the journal "
            f"rotates at {grown} bytes of records (never fewer than of checkpoint)",
            file=sys.stderr,
        )
    short = rotation.short_bytes
    keep = rotation.keep_bytes or 0
    if short and (not said["short"] or short >= said["short"] * 5 // 4):
        said["short"] = short
        print(
            f"journal retention: {path}: the budget of {keep} bytes cannot "
            f"hold the segment being written at its full size, {room} bytes (its "
            f"checkpoint, then {grown} bytes of records): the journal goes up to {short} "
            f"bytes over its budget; give it at least {room} bytes, more to keep older "
            "segments",
            file=sys.stderr,
        )
    elif not short and said["short"]:
        said["short"] = 0
        print(f"journal retention: {path}: the budget holds again", file=sys.stderr)


def _read(path: str, what: Callable[[sqlite3.Connection], T]) -> T | None:
    """``what`` of the segment at ``path``, read on a connection of its own
    (None: the file cannot be read)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        return what(conn)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _journal_id(path: str) -> str | None:
    row = _read(path, segment_row)
    return None if row is None else row[1]


def _begins_with_checkpoint(path: str, ident: str | None) -> bool:
    if not os.path.exists(path) or _journal_id(path) != ident:
        return False
    return bool(_read(path, lambda conn: checkpoint_parts(conn) is not None))
