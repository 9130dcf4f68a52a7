"""The files of a segmented journal (:mod:`journal.segments`): their names
and what the file system says of them, for the segments' reader, the
rotation that makes them and the retention that removes them alike."""

from __future__ import annotations

import contextlib
import os
import re

from .database import Journal

#: the index of a later segment in its file name: ``NAME.000002.db``
_LATER = re.compile(r"^(?P<stem>.+)\.(?P<index>\d{6})(?P<suffix>\.[^.]+)?$")


def segment_path(first: str | os.PathLike[str], index: int) -> str:
    """The file of segment ``index`` (1: the first segment itself)."""
    path = os.fspath(first)
    if index == 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{index:06d}{suffix}"


def file_bytes(path: str) -> int:
    """A journal file's size on disk, its write-ahead log and shared index included."""
    total = 0
    for name in (path, path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(name)
    return total


def sync_folder(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def id_of_open(journal: Journal) -> str | None:
    """The id of the journal whose segment ``journal`` is (None: a first
    segment with no commit yet, which has no later segment either)."""
    row = journal.segment()
    if row is not None:
        return row[1]
    link = journal.first_link()
    return None if link is None else link.hex()


def present(first: str) -> list[tuple[int, str]]:
    """The segments of the journal whose first segment is named ``first``
    that are on disk now, oldest first: (index, file)."""
    head = [(1, first)] if os.path.exists(first) else []
    return head + [(i, segment_path(first, i)) for i in later_indexes(first)]


def later_segments(first: str) -> list[str]:
    """The later segments of the journal whose first segment is named ``first``."""
    return [segment_path(first, i) for i in later_indexes(first)]


def later_indexes(first: str) -> list[int]:
    folder = os.path.dirname(first) or "."
    stem, suffix = os.path.splitext(os.path.basename(first))
    found = []
    for name in os.listdir(folder):
        match = _LATER.match(name)
        if match and match["stem"] == stem and (match["suffix"] or "") == suffix:
            found.append(int(match["index"]))
    return sorted(found)


def first_of(path: str | os.PathLike[str]) -> str | None:
    """The first segment of the journal ``path`` is a later segment of, by
    name (None: ``path`` is not named as a later segment)."""
    name = os.fspath(path)
    match = _LATER.match(os.path.basename(name))
    if match is None or int(match["index"]) <= 1:
        return None
    return os.path.join(os.path.dirname(name), match["stem"] + (match["suffix"] or ""))
