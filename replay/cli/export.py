"""``kvstate export``: a Perfetto trace or JSON Lines."""

from __future__ import annotations

import argparse
import os
import sys

from journal import JournalError, atomic_output, write_jsonl
from kvstate.codec import to_record

from .. import export
from ..sources import entries
from ._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    Subparsers,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "export",
        help="export a journal as a Perfetto trace or as JSON Lines",
        description="perfetto: Chrome trace-event JSON (a track per rank and one for the "
        "scheduler, job/DMA/put spans, markers for preemptions and violations). "
        "jsonl: the records as JSON Lines (merged and renumbered when several paths). "
        "parquet: the run's facts for SQL (keys written, verified and loaded, violations, "
        "request outcomes; docs/fleet.md); given a folder of several runs, OUT is a folder "
        "with one file per run.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--format", choices=("perfetto", "jsonl", "parquet"), required=True)
    p.add_argument("out", metavar="OUT", help="output file (refuses to overwrite)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.format == "parquet":
        return _parquet(args)
    try:
        with atomic_output(args.out, force=args.force) as tmp:
            if args.format == "perfetto":
                with open(tmp, "w", encoding="utf-8") as f:
                    n, _verdict = export.write_perfetto(args.paths, f)
            else:
                n = write_jsonl((to_record(e) for e in entries(args.paths)), tmp)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    unit = "trace events" if args.format == "perfetto" else "records"
    hint = "; open it at ui.perfetto.dev" if args.format == "perfetto" else ""
    print(f"wrote {n} {unit} to {args.out}{hint}")
    return EXIT_CLEAN


def _parquet(args: argparse.Namespace) -> int:
    """One run's facts to OUT; a fleet's, one file per run, into the folder OUT."""
    from .. import fleet, runs
    from ..facts import write_facts

    try:
        grouped = runs.group(args.paths)
        if len(grouped) == 1 and not any(os.path.isdir(p) for p in args.paths):
            ((run_name, paths),) = grouped.items()
            verdicts = [write_facts(run_name, paths, args.out, force=args.force)]
        else:
            verdicts = fleet.check_runs(grouped, args.out)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    for v in verdicts:
        if v.error:
            print(f"kvstate: error: {v.run}: {v.error}", file=sys.stderr)
    done = [v for v in verdicts if v.facts and not v.error]
    print(f"wrote the facts of {len(done)} run(s) to {args.out}")
    return EXIT_UNUSABLE if len(done) < len(verdicts) else EXIT_CLEAN
