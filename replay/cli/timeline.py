"""``kvstate timeline``: one request (all generations) or one job, as lanes."""

from __future__ import annotations

import argparse

from journal import JournalError

from .. import timeline
from ..report import emit, lanes_table, report_console
from ..safe import literal
from ._common import (
    EXIT_CLEAN,
    EXIT_VIOLATIONS,
    Subparsers,
    to_json,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "timeline",
        help="every record of one request (all generations) or one job, as lanes",
        description="Show the records of one request or one job across the scheduler and "
        "every rank, with the violations raised at them. Exit 1 if any is marked.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--req", help="request id")
    which.add_argument("--job", type=int, help="store job id")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        line = timeline.build(args.paths, req=args.req, job=args.job)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    if args.json:
        print(to_json(line.to_dict()))
    else:
        console = report_console()
        title = f"Timeline of {line.title}: {len(line.entries)} records"
        emit(console, lanes_table(line.entries, line.violations, title, not console.is_terminal))
        for seq, found in sorted(line.violations.items()):
            for v in found:
                emit(console, literal(f"seq {seq} {v.code.value}: {v.message}"))
    return EXIT_VIOLATIONS if line.violations else EXIT_CLEAN
