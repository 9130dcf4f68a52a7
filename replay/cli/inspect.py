"""``kvstate inspect``: the terminal UI (``--once``: print the overview and exit)."""

from __future__ import annotations

import argparse
import os
import sys

from journal import JournalError, RecordError, segments

from ..report import report_console
from ._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    Subparsers,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "inspect",
        help="a terminal UI to travel through a journal (--once: print and exit)",
        description="Requests, jobs, blocks, violations and events as of any seq. Keys: "
        "left/right a record, PgUp/PgDn a step, g go to seq, n/p next/previous violation, "
        "/ filter, Enter a row's timeline, ? help, q quit. The journal is opened read-only.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="journal database or .jsonl file; several are one run, merged as replay merges them",
    )
    p.add_argument("--follow", action="store_true", help="tail a journal being written")
    p.add_argument("--once", action="store_true", help="print the overview and violations")
    p.add_argument(
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="with --once, at most N violations (0: every one); default 20",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The terminal UI, or with --once the overview and violations as text."""
    for path in args.paths:
        if not os.path.exists(path) and not segments.is_removed_head(path):
            return unusable(RecordError("no such file", path=path), as_json=False)
    if args.follow and len(args.paths) > 1:
        print("kvstate: error: --follow takes one journal", file=sys.stderr)
        return EXIT_UNUSABLE
    target = args.paths[0] if len(args.paths) == 1 else list(args.paths)
    try:
        if args.once:
            from ..tui._once import print_once

            return print_once(report_console(), list(args.paths), args.limit or None)
        from ..tui.inspector import Inspector

        app = Inspector(target, follow=args.follow)
    except ImportError as exc:
        print(f"kvstate: error: the inspector needs the 'tui' extra ({exc})", file=sys.stderr)
        return EXIT_UNUSABLE
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    app.run()
    return EXIT_CLEAN
