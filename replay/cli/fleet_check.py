"""``kvstate fleet-check``: every run of a fleet replayed in parallel, and the
keys one run poisoned that another run loaded."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from journal import JournalError

if TYPE_CHECKING:
    from .. import fleet
    from ..facts import RunVerdict

from rich import box
from rich.table import Table

from ..report import emit, report_console
from ..safe import literal
from ._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Subparsers,
    add_worker_options,
    ray_address,
    to_json,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "fleet-check",
        help="replay every run under a folder in parallel and join their facts with DuckDB",
        description="Group the journals under PATH by the run their headers name, replay each "
        "run on its own worker (a local process pool, or Ray tasks with --ray), write each "
        "run's facts to Parquet, and report each run's verdict and every key that one run "
        "poisoned and another run loaded. Exit 0 when every run is clean and nothing crossed, "
        "1 otherwise, 2 when a run's journals are unusable.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="folders or journal files")
    p.add_argument(
        "--facts",
        metavar="DIR",
        help="where each run's facts go, one Parquet file per run (default: a folder of "
        "$XDG_CACHE_HOME/kvstate/facts, or ~/.cache/kvstate/facts, for the first PATH that "
        "is a folder, else the first journal's; never inside the folder checked); an "
        "unchanged run's facts are reused",
    )
    add_worker_options(p)
    p.add_argument(
        "--limit", type=int, default=20, metavar="N", help="print at most N cross-run loads"
    )
    p.add_argument(
        "--sql",
        metavar="QUERY",
        help="instead of the report, run QUERY in DuckDB over the view facts (every "
        "checked run's facts) and print its result",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def _facts_dir(args: argparse.Namespace) -> str:
    """``--facts``, else a cache folder of the user's own, one per checked folder.

    Never inside the folder being checked: that is the user's evidence (a
    repository's ``examples/``, an incident's journals), not a place for ours.
    """
    if args.facts:
        return str(args.facts)
    folder = next((p for p in args.paths if os.path.isdir(p)), None)
    if folder is None:
        folder = os.path.dirname(os.path.abspath(args.paths[0]))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    where = os.path.abspath(folder)
    tag = hashlib.sha256(where.encode()).hexdigest()[:12]
    return os.path.join(cache, "kvstate", "facts", f"{os.path.basename(where) or 'root'}-{tag}")


def run(args: argparse.Namespace) -> int:
    from .. import fleet, runs

    try:
        grouped = runs.group(args.paths)
        verdicts = fleet.check_runs(
            grouped, _facts_dir(args), workers=args.workers, ray_address=ray_address(args)
        )
        facts = [v.facts for v in verdicts if v.facts]
        if args.sql:
            return _query(facts, args.sql, as_json=args.json)
        # a fleet's wrong loads can be millions: counted in DuckDB, and the
        # first --limit of them fetched (or, for --json, streamed)
        crossed = fleet.cross_run_summary(facts, 0 if args.json else args.limit)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    status = max((v.exit_status for v in verdicts), default=EXIT_CLEAN)
    if crossed.total and status == EXIT_CLEAN:
        status = EXIT_VIOLATIONS
    if args.json:
        _print_json(verdicts, fleet.iter_cross_run(facts))
        return status
    _print(verdicts, crossed)
    return status


def _print_json(verdicts: list[RunVerdict], crossed: Iterator[dict[str, Any]]) -> None:
    """One JSON object, ``cross_run`` written a row at a time: the same bytes
    as ``to_json`` of the whole object, without holding every row."""
    head = to_json(
        {
            "runs": [
                {
                    "run": v.run,
                    "paths": list(v.paths),
                    "events": v.events,
                    "verdict": v.verdict,
                    "exit_status": v.exit_status,
                    "codes": v.codes,
                    "unfinished": v.unfinished,
                    "facts": v.facts,
                    "error": v.error,
                }
                for v in verdicts
            ],
            "cross_run": [],
        }
    )
    out = sys.stdout
    out.write(head[: -len("[]}")] + "[")
    for n, row in enumerate(crossed):
        out.write((", " if n else "") + to_json(row))
    out.write("]}\n")


def _print(verdicts: list[RunVerdict], crossed: fleet.CrossRun) -> None:
    print(f"{len(verdicts)} runs")
    for v in verdicts:
        if v.error:
            print(f"  {v.run}: unusable: {v.error}")
            continue
        codes = ", ".join(f"{code} {n}" for code, n in sorted(v.codes.items())) or "-"
        # which files the run is: a run's name alone does not say
        files = ", ".join(v.paths)
        line = f"  {v.run}: {v.verdict} ({v.events} records in {files}) {codes}"
        if v.unfinished:
            line += " [UNFINISHED: end-of-run checks not run]"
        print(line)
        wrong = v.codes.get("WRONG_KV_LOADED", 0)
        sources = crossed.sources.get(v.run, {})
        if sources:
            names = ", ".join(sorted(sources))
            print(
                f"    {sum(sources.values())} of its {wrong} WRONG_KV_LOADED loaded keys poisoned "
                f"in another run ({names}): the poison came from outside"
            )
    if not crossed.total:
        print("no run loaded wrong KV from a key another run poisoned")
        return
    print(f"{crossed.total} wrong loads of keys poisoned in another run:")
    for row in crossed.first:
        read = (
            f", poisoned read {row['poisoned_read_file']}:{row['poisoned_read_seq']}"
            if row["poisoned_read_seq"] is not None
            else ""
        )
        print(
            f"  {row['loaded_run']} {row['loaded_file']}:{row['loaded_seq']} "
            f"req {row['loaded_req']} gen {row['loaded_gen']} loaded {row['key']}; "
            f"written by job {row['written_job']} of req {row['written_req']} in "
            f"{row['written_run']} (enqueued {row['written_file']}:{row['written_seq']}{read})"
        )
    if crossed.total > len(crossed.first):
        print(f"  ... {crossed.total - len(crossed.first)} more (--limit, or --json for all)")


def _query(facts: list[str], sql: str, *, as_json: bool) -> int:
    """A user's question in DuckDB SQL over the runs' facts."""
    import duckdb

    from .. import fleet

    con = fleet.connect(facts)
    try:
        cursor = con.execute(sql)
        names = [d[0] for d in cursor.description or ()]
        rows = cursor.fetchall()
    except duckdb.Error as exc:
        print(f"kvstate: error: --sql: {exc}".splitlines()[0], file=sys.stderr)
        return EXIT_UNUSABLE
    finally:
        con.close()
    if as_json:
        print(to_json([dict(zip(names, row, strict=True)) for row in rows]))
        return EXIT_CLEAN
    table = Table(*names, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for row in rows:
        table.add_row(*(literal("" if v is None else str(v)) for v in row))
    emit(report_console(), table)
    return EXIT_CLEAN
