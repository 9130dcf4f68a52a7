"""``kvstate replay DIR`` (or ``--by-run``): each run replayed on its own worker.

The journals are grouped by the run their headers name; each run's replay is
exactly ``kvstate replay`` of that run's files, its report rendered by the
worker and printed here in run order. The exit status is the worst run's.
"""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any

from rich.console import Console

from journal import JournalError

from ..report import needed_records, print_report, report_console
from ..sources import collect
from ..verdict import replay
from ._common import EXIT_UNUSABLE, ray_address, to_json, unusable


def replay_run(
    run: str,
    paths: list[str],
    require_idle: bool,
    show_all: bool,
    limit: int,
    as_json: bool,
    screen: tuple[int, bool],
) -> tuple[int, str]:
    """One worker's task: one run's replay, as its exit status and its report."""
    try:
        result = replay(paths, require_idle=require_idle)
    except (JournalError, OSError) as exc:
        error = {"run": run, "paths": paths, "verdict": "unusable", "error": str(exc)}
        return EXIT_UNUSABLE, to_json(error) if as_json else f"kvstate: error: {exc}"
    if as_json:
        return result.exit_status, to_json({"run": run, "paths": paths, **result.to_dict()})
    try:
        records = collect(paths, needed_records(result))
    except (JournalError, OSError):
        records = {}
    # Rendered here, printed by the parent: as wide as its screen, in colour
    # when that is a terminal.
    width, terminal = screen
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=terminal)
    console.print(f"run {run}: {len(paths)} file(s)", markup=False, highlight=False)
    print_report(result, records, show_all=show_all, limit=limit, console=console)
    return result.exit_status, out.getvalue()


def run_by_run(args: argparse.Namespace) -> int:
    from .. import fleet, runs

    if args.at is not None or args.minimize:
        print(
            "kvstate: error: --at and --minimize take one run's journals, not a folder of runs",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    try:
        grouped = runs.group(args.paths)
        screen = report_console()
        calls: list[tuple[Any, ...]] = [
            (
                run,
                paths,
                args.require_idle,
                args.all,
                args.limit,
                args.json,
                (screen.width, screen.is_terminal),
            )
            for run, paths in grouped.items()
        ]
        done = fleet.map_runs(
            replay_run, calls, workers=args.workers, ray_address=ray_address(args)
        )
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    if args.json:
        print("[" + ",\n".join(text for _, text in done) + "]")
    else:
        for _, text in done:
            print(text, end="" if text.endswith("\n") else "\n")
    return max(status for status, _ in done)
