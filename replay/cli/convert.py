"""``kvstate convert``: JSON Lines <-> journal database, record for record."""

from __future__ import annotations

import argparse

from journal import Journal, JournalError, atomic_output, write_jsonl
from kvstate.codec import to_record
from kvstate.recorder import journal_views

from ..sources import entries
from ._common import (
    EXIT_CLEAN,
    Subparsers,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "convert",
        help="convert between JSON Lines and a journal database",
        description="Copy every record from SOURCE to DESTINATION. A destination ending in "
        ".jsonl is written as JSON Lines, anything else as a journal database.",
    )
    p.add_argument("source")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """JSON Lines <-> journal database, record for record."""
    src, dst = args.source, args.destination
    try:
        with atomic_output(dst, force=args.force) as tmp:
            source = entries([src])
            if dst.endswith((".jsonl", ".ndjson", ".json")):
                n = write_jsonl((to_record(e) for e in source), tmp)
            else:
                with Journal(tmp) as journal:
                    journal.create_views(journal_views())
                    batch = []
                    n = 0
                    for entry in source:
                        batch.append(to_record(entry))
                        if len(batch) == 4096:
                            n += journal.append(batch)
                            batch = []
                    n += journal.append(batch)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    print(f"wrote {n} records to {dst}")
    return EXIT_CLEAN
