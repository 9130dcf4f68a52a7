"""``kvstate pd-check PREFILL DECODE``: a prefill/decode pair's two journals read as one run.

Each engine's journal is replayed on its own (block ids are each engine's own
pool's, so one fold of both would mix two pools), and the two are related by
the proxy's transfer id (:mod:`replay.pairs`). A violation in one engine is
shown with the transfer it touched and the other engine's request of it:
a prefill's reused delayed free with the decode request that read it, a
decode's load handed on with the prefill request that wrote it.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table
from rich.text import Text

from journal import JournalError
from kvstate.violations import Violation

from ..pairs import Pair, Side, relate
from ..report import emit, report_console
from ..safe import literal
from ..verdict import ReplayResult, replay
from ._common import EXIT_CLEAN, EXIT_VIOLATIONS, Subparsers, to_json, unusable

ROLES = ("prefill", "decode")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "pd-check",
        help="replay a prefill/decode pair's two journals and relate them by transfer id",
        description="Replay the prefill engine's journal and the decode engine's, each on "
        "its own, relate every decode load to the prefill request it read by the proxy's "
        "transfer_id, and report each engine's violations with the other engine's request "
        "of the same transfer, and the pair's own findings: a load from no request of the "
        "prefill, a held free ended before the decode's load began, a load reported done "
        "from blocks the prefill did not hold. Exit 0 when both engines are clean and the "
        "pair is, 1 otherwise, 2 when a journal is unusable.",
    )
    p.add_argument("prefill", metavar="PREFILL", help="the prefill engine's journal")
    p.add_argument("decode", metavar="DECODE", help="the decode engine's journal")
    p.add_argument(
        "--require-idle",
        action="store_true",
        help="a journal that ends before its engine did is a failure, as in kvstate replay",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    paths = {"prefill": args.prefill, "decode": args.decode}
    try:
        results = {role: replay([paths[role]], require_idle=args.require_idle) for role in ROLES}
        pair = relate([args.prefill], [args.decode])
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=args.json)
    found = pair_findings(pair)
    failed = any(r.exit_status != EXIT_CLEAN for r in results.values()) or any(found.values())
    status = EXIT_VIOLATIONS if failed else EXIT_CLEAN
    if args.json:
        print(to_json(_as_dict(paths, results, pair, found, status)))
        return status
    console = report_console()
    emit(console, _table(results, pair, found))
    for role in ROLES:
        for v in results[role].violations:
            emit(console, literal(_line(role, paths[role], v, pair)))
    for what, transfers in found.items():
        for t in transfers:
            emit(console, literal(f"pair: transfer {t}: {WHAT[what]} ({_sides(pair, t)})"))
    emit(console, Text("verdict: " + ("violations" if failed else "clean"), style="bold"))
    return status


#: each of the pair's own findings: its row in the table, what it means
WHAT = {
    "unrelated": "the decode loaded it from no request of the prefill journal",
    "read after the free": "the prefill freed its held blocks before the decode's load began",
    "read though not held": "the decode's load was reported done from blocks the prefill "
    "did not hold",
}


def pair_findings(pair: Pair) -> dict[str, list[str]]:
    """The pair's own findings (none is one engine's alone), transfer ids each."""
    return {
        "unrelated": pair.unrelated,
        "read after the free": pair.freed_before_read,
        "read though not held": pair.not_held,
    }


def _line(role: str, path: str, v: Violation, pair: Pair) -> str:
    line = f"{role} {path} seq {v.seq}: {v.code.value}: {v.message}"
    t = pair.transfer_of(role, v)
    return line if t is None else f"{line} [transfer {t}: {_sides(pair, t)}]"


def _sides(pair: Pair, t: str) -> str:
    def name(side: Side | None) -> str:
        return side.req if side is not None else "none"

    return f"prefill request {name(pair.prefill.get(t))}, decode request {name(pair.decode.get(t))}"


def _table(results: dict[str, ReplayResult], pair: Pair, found: dict[str, list[str]]) -> Table:
    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for role in ROLES:
        table.add_column(f"{role} engine", justify="right")
    table.add_row("records", *(str(results[r].events) for r in ROLES))
    table.add_row("violations", *(str(len(results[r].violations)) for r in ROLES))
    table.add_row("transfers related", "", str(len(pair.related)))
    for what, transfers in found.items():
        table.add_row(f"  {what}", "", str(len(transfers)))
    return table


def _as_dict(
    paths: dict[str, str],
    results: dict[str, ReplayResult],
    pair: Pair,
    found: dict[str, list[str]],
    status: int,
) -> dict[str, Any]:
    engines = {}
    for role in ROLES:
        engines[role] = {
            "path": paths[role],
            "exit_status": results[role].exit_status,
            "violations": [
                {**v.to_dict(), "transfer": pair.transfer_of(role, v)}
                for v in results[role].violations
            ],
        }
    return {
        **engines,
        "related": pair.related,
        "pair": found,
        "blocks_moved": pair.blocks,
        "exit_status": status,
    }
