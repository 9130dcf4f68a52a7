"""Several journals of one run (one per process) merged into one file.

The merged order is replay's: by ``ts`` where every file has it, else the
files one after another. Each record keeps its kind and fields; ``seq`` is
its position in the merged order, so ``kvstate replay merged.db`` reports the
same findings at the same seqs as ``kvstate replay a.db b.db``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from journal import Journal, atomic_output, write_jsonl
from kvstate.codec import Entry, to_record, to_row
from kvstate.recorder import journal_views

from .sources import entries

_BATCH = 4096


def write(source: Iterable[Entry], tmp: str | os.PathLike[str], *, jsonl: bool) -> int:
    """Write ``source`` to the (temporary) path ``tmp``; returns the record count."""
    if jsonl:
        return write_jsonl((to_record(e) for e in source), tmp)
    n = 0
    with Journal(tmp) as journal:
        journal.create_views(journal_views())
        batch: list[Entry] = []
        for entry in source:
            # One commit per engine step, as the engine committed them: a
            # removed tail of whole steps then reads as an unfinished run,
            # and any change inside a step breaks that step's link.
            if batch and (entry.step != batch[-1].step or len(batch) == _BATCH):
                n += journal.append_rows(map(to_row, batch))
                batch = []
            batch.append(entry)
        n += journal.append_rows(map(to_row, batch))
    return n


def merge(
    paths: Sequence[str], destination: str, *, force: bool = False, mixed_runs: bool = False
) -> int:
    """Merge ``paths`` into ``destination`` (a temporary file renamed into place).

    ``mixed_runs`` merges journals of different runs on purpose (their ids
    then share one namespace; see :func:`replay.sources.open_stream`).
    """
    jsonl = destination.endswith((".jsonl", ".ndjson", ".json"))
    with atomic_output(destination, force=force) as tmp:
        return write(entries(list(paths), mixed_runs=mixed_runs), tmp, jsonl=jsonl)
