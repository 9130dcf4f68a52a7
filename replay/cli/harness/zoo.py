"""``kvstate zoo``: every seeded upstream bug under the legacy and the fixed policy."""

from __future__ import annotations

import argparse
import os
import sys

from rich import box
from rich.table import Table
from rich.text import Text

from journal import JournalError, atomic_output, refuse_existing, write_jsonl
from kvstate.codec import to_record

from ...report import emit, report_console
from ...verdict import replay
from .._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Subparsers,
    unusable,
)


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "zoo",
        help="replay every seeded upstream bug under the legacy and the fixed policy",
        description="Run the bug zoo (docs/bug-zoo.md): write a legacy journal and its fixed "
        "twin per case and replay both. Exit 0 when every legacy journal is flagged with "
        "its case's code and every fixed twin is clean.",
    )
    p.add_argument("cases", nargs="*", metavar="CASE", help="case names (default: all)")
    p.add_argument(
        "--out",
        help="folder for the journals (default: ./zoo, or ./zoo-2, ./zoo-3, ... the first "
        "that does not exist yet, so a second run never stops on the first one's journals)",
    )
    p.add_argument("--force", action="store_true", help="replace journals already in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the bug zoo: each seeded bug under the legacy and the fixed policy."""
    from kvstate.harness.zoo import CASES, run_case

    names = args.cases or sorted(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"kvstate: error: unknown case(s) {', '.join(unknown)}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.out is None:
        args.out = _fresh("zoo")
    paths = [
        os.path.join(args.out, f"{name}.{policy}.jsonl")
        for name in names
        for policy in ("legacy", "kvstate")
    ]
    try:
        for path in paths:
            refuse_existing(path, force=args.force)
    except JournalError as exc:
        return unusable(exc, as_json=False)
    os.makedirs(args.out, exist_ok=True)
    table = Table(box=box.SIMPLE_HEAD)
    # the case's name is what a user types next: never cut, the others wrap
    table.add_column("case", no_wrap=True, min_width=max(map(len, names)))
    table.add_column("upstream")
    # nor is a code: it is the next thing to look up
    table.add_column("legacy policy", min_width=max(len(CASES[n].expected) for n in names))
    table.add_column("kvstate policy")
    all_as_expected = True
    for name in names:
        case = CASES[name]
        verdicts = []
        for policy in ("legacy", "kvstate"):
            path = os.path.join(args.out, f"{name}.{policy}.jsonl")
            entries = run_case(case, policy).entries or []
            with atomic_output(path, force=args.force) as tmp:
                write_jsonl((to_record(e) for e in entries), tmp)
            result = replay([path])
            first = result.violations[0] if result.violations else None
            verdicts.append(f"{first.code.value} at seq {first.seq}" if first else "clean")
            if policy == "legacy":
                all_as_expected &= first is not None and first.code.value == case.expected
            else:
                all_as_expected &= first is None
        table.add_row(
            Text(name),
            Text(case.upstream),
            Text(verdicts[0], style="red"),
            Text(verdicts[1], style="green"),
        )
    console = report_console()
    emit(console, table)
    emit(
        console,
        Text(
            f"journals: {args.out}/CASE.legacy.jsonl and {args.out}/CASE.kvstate.jsonl; "
            f"explain one with: kvstate replay {args.out}/{names[0]}.legacy.jsonl"
        ),
    )
    return EXIT_CLEAN if all_as_expected else EXIT_VIOLATIONS


def _fresh(base: str) -> str:
    """``base``, or ``base-2``, ``base-3``, ...: the first name nothing has yet."""
    name, n = base, 1
    while os.path.lexists(name):
        n += 1
        name = f"{base}-{n}"
    return name
