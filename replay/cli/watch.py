"""``kvstate watch DIR``: follow the journals processes are writing, fold them, serve /metrics."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from journal import JournalError, RecordError

if TYPE_CHECKING:
    from kvstate.figures import Figures

    from ..watch import Watcher

from ._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Subparsers,
    terminations_interrupt,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "watch",
        help="follow every journal under a folder as processes write them; "
        "--metrics serves their figures to Prometheus",
        description="Follow every journal database under DIR (new ones as they appear), "
        "fold what each commits, print a status line per journal on a terminal, and with "
        "--metrics serve /metrics (docs/ops.md). Runs until interrupted; --once reads "
        "what is there and exits 0 clean, 1 violations, 2 unreadable.",
    )
    p.add_argument("folder", metavar="DIR", help="the folder the journals are written to")
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve /metrics at this address")
    p.add_argument(
        "--interval", type=float, default=0.5, help="seconds between two reads of the folder"
    )
    p.add_argument(
        "--disk-budget",
        type=int,
        metavar="BYTES",
        help="the bytes the journals may hold (published for the disk alert)",
    )
    p.add_argument("--once", action="store_true", help="read what is there, report, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..watch import Watcher

    try:
        watcher = Watcher(args.folder)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    stop = None
    try:
        if args.metrics:
            from kvstate.extras import require_metrics_extra

            require_metrics_extra("--metrics")
            from kvstate.prometheus import FiguresCollector, serve

            try:
                collector = FiguresCollector(
                    watcher.figures, budget=args.disk_budget, skipped=lambda: len(watcher.skipped)
                )
                stop = serve(args.metrics, collector)
            except (ValueError, OSError) as exc:
                print(f"kvstate: error: --metrics {args.metrics}: {exc}", file=sys.stderr)
                return EXIT_UNUSABLE
            print(f"kvstate watch: serving http://{args.metrics}/metrics", flush=True)
        if args.once:
            while watcher.poll():
                pass
            watcher.poll()  # a file not a journal is called skipped the second poll it is found
            return _report(watcher)
        with terminations_interrupt():
            _follow(watcher, args.interval)
        return EXIT_CLEAN  # pragma: no cover - _follow returns only by an interrupt
    except KeyboardInterrupt:
        return _report(watcher)
    except (RecordError, JournalError) as exc:
        return unusable(exc, as_json=False)
    finally:
        if stop is not None:
            stop()
        watcher.close()


def _follow(watcher: Watcher, interval: float) -> None:
    """Poll until interrupted; on a terminal, the status lines redrawn in place."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console()
    if not console.is_terminal:
        while True:
            if not watcher.poll():
                time.sleep(interval)
    with Live(console=console, auto_refresh=False) as live:
        while True:
            progressed = watcher.poll()
            lines = run_lines(watcher.figures()) or ["(no journal yet)"]
            live.update(Text("\n".join(lines)), refresh=True)
            if not progressed:
                time.sleep(interval)


def run_lines(figures: list[Figures]) -> list[str]:
    """One status line per run: its journals' records and findings summed, the
    jobs in flight as its scheduler (or its one journal) counts them."""
    runs: dict[str, list[Figures]] = {}
    for f in figures:
        runs.setdefault(f.run or f.journal, []).append(f)
    lines = []
    for run, parts in sorted(runs.items()):
        audited = [f for f in parts if f.audited]
        found = sum(sum(f.violations.values()) for f in parts)
        firsts = [
            f"{os.path.basename(f.journal)} seq {f.first_violation_seq}"
            for f in parts
            if f.first_violation_seq is not None
        ]
        state = next((f.error for f in parts if f.error), None) or (
            "closed" if all(f.closed for f in parts) else "open"
        )
        first = f" (first: {', '.join(firsts)})" if firsts else ""
        lines.append(
            f"{run}  {len(parts)} journal(s)  {state}  {sum(f.folded for f in parts)} records  "
            f"{found} violation(s){first}  "
            f"{sum(f.jobs_in_flight for f in audited)} job(s) in flight  "
            f"lag {max(f.lag_records() for f in parts)}"
        )
    return lines


def _report(watcher: Watcher) -> int:
    figures = watcher.figures()
    for line in run_lines(figures):
        print(line)
    for f in figures:
        print(f"  {f.journal}: {f.status()}")
    for name, why in sorted(watcher.skipped.items()):
        # not a journal (another SQLite file, an empty or garbage .db): said and
        # counted, and no reason to call the journals beside it unreadable
        print(f"{name}: skipped: {why}")
    if any(f.error for f in figures):
        return EXIT_UNUSABLE
    return EXIT_VIOLATIONS if any(f.violations for f in figures) else EXIT_CLEAN
