"""Journals grouped into runs, by the run identity in their headers.

A fleet's folder holds the journals of many runs, several files each (the
scheduler's and one per rank). Each file's ``journal_opened`` names its run;
a file without one (another writer's) is a run by itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from journal import RecordError, is_journal_file, segments
from kvstate import events as ev
from kvstate.checkpoint import Resumed

from .sources import read_path

#: what a folder's journals are called (databases are also recognised by content)
_JSONL = (".jsonl", ".ndjson")


def journal_files(paths: Sequence[str]) -> list[str]:
    """``paths`` with each folder replaced by the journals under it, sorted."""
    found: list[str] = []
    for path in paths:
        if not os.path.isdir(path):
            found.append(path)
            continue
        for file in sorted(Path(path).rglob("*")):
            name = str(file)
            # hidden files are half-written outputs (".NAME.tmp"), never journals
            hidden = any(part.startswith(".") for part in file.relative_to(path).parts)
            if hidden or not file.is_file():
                continue
            # a later segment is read through its journal's first segment
            if not segments.is_start(name):
                continue
            if name.endswith(_JSONL) or is_journal_file(name):
                found.append(name)
    if not found:
        raise RecordError("no journal files found", path=", ".join(paths))
    return found


def run_of(path: str) -> str:
    """The run a journal belongs to: its header's ``run``, else the file itself."""
    for item in read_path(path):
        header = item.entry.event
        if isinstance(header, Resumed):  # the head was removed: the checkpoint holds it
            header = header.header
        if isinstance(header, ev.JournalOpened) and header.run is not None:
            return str(header.run)
        break
    return f"file:{path}"


def group(paths: Sequence[str]) -> dict[str, list[str]]:
    """Run -> its journal files, runs and files in name order."""
    runs: dict[str, list[str]] = {}
    for path in journal_files(paths):
        runs.setdefault(run_of(path), []).append(path)
    return dict(sorted(runs.items()))
