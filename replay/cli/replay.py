"""``kvstate replay``: fold journals, report every violation, ``--at``, ``--minimize``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from journal import JournalError, atomic_output, refuse_existing, write_jsonl
from kvstate.codec import to_record

from ..minimize import minimize as shrink
from ..progress import records_progress
from ..report import needed_records, print_report, report_console
from ..sources import Sized, collect, open_stream
from ..verdict import replay
from ._common import (
    EXIT_CLEAN,
    EXIT_VIOLATIONS,
    Subparsers,
    add_worker_options,
    to_json,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "replay",
        help="fold a journal and report every violation (exit 0 clean, 1 violations, 2 bad input)",
        description="Replay journal databases or JSON Lines files. Several paths are one run "
        "from several processes, merged by ts (else in the order given).",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="journal database or .jsonl file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--at", type=int, metavar="SEQ", help="print the ledger as it stood after SEQ")
    p.add_argument(
        "--all", action="store_true", help="list every violation, not one row per root cause"
    )
    p.add_argument(
        "--minimize",
        metavar="OUT.jsonl",
        help="write the smallest journal whose first violation has the same code",
    )
    p.add_argument(
        "--require-idle",
        action="store_true",
        help="exit 1 when the journal ends before engine_idle or engine_crashed (UNFINISHED)",
    )
    p.add_argument("--force", action="store_true", help="let --minimize replace its output")
    p.add_argument(
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="at most N rows of root causes (or of violations with --all); default 20",
    )
    runs = p.add_argument_group(
        "many runs",
        "a folder, or --by-run with files of several runs: the journals are grouped by the "
        "run their headers name and each run is replayed on its own worker, exactly as "
        "kvstate replay of that run alone; the exit status is the worst run's",
    )
    runs.add_argument(
        "--by-run", action="store_true", help="group PATHs by run instead of merging them"
    )
    add_worker_options(runs)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.by_run or any(os.path.isdir(p) for p in args.paths):
        from ._by_run import run_by_run

        return run_by_run(args)
    if args.minimize:
        return _write_minimized(args)
    try:
        sized = Sized()
        with records_progress(sized, "replaying") as progress:
            result = replay(
                args.paths,
                at=args.at,
                require_idle=args.require_idle,
                progress=progress,
                sized=sized,
            )
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    last = result.folded.last_seq  # (the whole ledger would copy every parked entity)
    if args.at is not None and last is not None and args.at > last:
        print(
            f"kvstate: warning: --at {args.at} is past the last record (seq {last}); "
            f"this is the ledger after seq {last}",
            file=sys.stderr,
        )
    if args.json:
        print(to_json(result.to_dict()))
    else:
        records = result.story  # kept while folding: the journal is read once
        if records is None:  # too long to keep: read the few records again
            try:
                records = collect(args.paths, needed_records(result))
            except (JournalError, OSError):
                records = {}  # the verdict stands; the story just has fewer details
        print_report(result, records, show_all=args.all, limit=args.limit)
    return result.exit_status


def _write_minimized(args: argparse.Namespace) -> int:
    """--minimize: the smallest journal failing like this one, written to OUT.jsonl."""
    try:
        refuse_existing(args.minimize, force=args.force)
        loaded = []
        sized = Sized()
        with records_progress(sized, "reading") as progress:
            stream, _origin = open_stream(args.paths, sized=sized)
            for entry in (item.entry for item in stream):
                loaded.append(entry)
                if progress is not None and len(loaded) % 16384 == 0:
                    progress(len(loaded))
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    console = report_console(stderr=True)
    with (
        console.status("minimizing (slice, then delta debugging)", spinner="dots")
        if (console.is_terminal)
        else contextlib.nullcontext()
    ):
        found = shrink(loaded)
    if found is None:
        print("journal is clean: nothing to minimize")
        return EXIT_CLEAN
    try:
        with atomic_output(args.minimize, force=args.force) as tmp:
            write_jsonl((to_record(e) for e in found.entries), tmp)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    target = found.target
    summary = {
        "code": target.code.value,
        "seq": target.seq,
        "records": found.original,
        "sliced": found.sliced,
        "minimized": len(found.entries),
        "tests": found.tests,
        "out": args.minimize,
    }
    if args.json:
        print(to_json(summary))
    else:
        print(
            f"{target.code.value} at seq {target.seq}: {found.original} records -> "
            f"{found.sliced} in the slice -> {len(found.entries)} after delta debugging "
            f"({found.tests} replays). Wrote {args.minimize}; replay it with: "
            f"kvstate replay {args.minimize}"
        )
    return EXIT_VIOLATIONS
