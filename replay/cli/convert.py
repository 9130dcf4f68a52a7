"""``kvstate convert``: JSON Lines <-> journal database, and merging journals."""

from __future__ import annotations

import argparse

from journal import JournalError

from ..merge import merge
from ._common import (
    EXIT_CLEAN,
    Subparsers,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "convert",
        help="convert between JSON Lines and a journal database, or merge journals",
        description="Copy every record from SOURCE to DESTINATION. A destination ending in "
        ".jsonl is written as JSON Lines, anything else as a journal database. Several "
        "sources (one run's per-process journals) are merged in replay's order.",
    )
    p.add_argument("source", nargs="+")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
    p.add_argument(
        "--mixed-runs",
        action="store_true",
        help="merge journals of different runs on purpose (every other reader refuses: "
        "their job ids and requests then share one namespace)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """JSON Lines <-> journal database, record for record; several sources merged."""
    try:
        n = merge(args.source, args.destination, force=args.force, mixed_runs=args.mixed_runs)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    print(f"wrote {n} records to {args.destination}")
    return EXIT_CLEAN
