"""``kvstate demo``: the main job, legacy vs kvstate against a real Mooncake store."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from rich.text import Text

from journal import JournalError, journal_output, refuse_existing

from ...report import emit, report_console
from ...safe import printable
from .._common import (
    EXIT_CLEAN,
    EXIT_UNUSABLE,
    EXIT_VIOLATIONS,
    Subparsers,
    interrupted_status,
    terminations_interrupt,
    unusable,
)
from ._summary import summary_table


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: legacy vs kvstate on one workload against a real Mooncake store",
        description="Run the same seeded, preemption-heavy workload under the legacy connector "
        "and under kvstate's ledgers, against a local Mooncake master this command starts and "
        "stops (the in-memory store where Mooncake cannot run), then print both side by side. "
        "Exit 0 when the legacy run poisons keys and the kvstate run is clean.",
    )
    p.add_argument("--out", default="demo", help="folder for the two journals (demo/)")
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--block-bytes", type=int, default=32768, help="bytes per block per rank")
    p.add_argument(
        "--segment-mb",
        type=int,
        help="Mooncake segment per rank, in MiB (at least 16; default: large enough that "
        "nothing is evicted). A small one makes the store evict: the audit then records "
        "key_missing, never POISONED_KEY",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--store",
        choices=("auto", "mooncake", "memory"),
        default="auto",
        help="auto: Mooncake when it can run, else the in-memory store",
    )
    p.add_argument("--master-url", help="use this master's metadata URL instead of starting one")
    p.add_argument("--master-rpc", help="and its RPC address, HOST:PORT")
    p.add_argument("--force", action="store_true", help="replace journals already in --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The same workload under the legacy connector and under kvstate, side by side."""
    from rich.progress import BarColumn, Progress, TextColumn

    from kvstate.harness.live.mooncake_demo import journal_path, mooncake_problem, run_policy
    from kvstate.harness.sim.config import SimConfig

    console = report_console()
    master = None
    if args.master_url or args.master_rpc:
        from kvstate.harness.live.master import MasterError, existing_master

        if not (args.master_url and args.master_rpc):
            print("kvstate: error: give both --master-url and --master-rpc", file=sys.stderr)
            return EXIT_UNUSABLE
        try:
            master = existing_master(args.master_url, args.master_rpc)
        except MasterError as exc:
            print(f"kvstate: error: {exc}", file=sys.stderr)
            return EXIT_UNUSABLE
    problem = None if args.store != "memory" else "the in-memory store was asked for"
    if args.store != "memory":
        problem = mooncake_problem()
        if problem and args.store == "mooncake":
            print(f"kvstate: error: Mooncake cannot run: {problem}", file=sys.stderr)
            return EXIT_UNUSABLE
    use_mooncake = problem is None
    backend = "the in-memory store"
    if use_mooncake:
        backend = (
            f"the Mooncake master at {args.master_rpc}" if master else "a local Mooncake master"
        )
    if not use_mooncake and args.store != "memory":
        emit(console,
            Text(f"notice: Mooncake cannot run here ({problem}); using the in-memory store.",
                 style="yellow")
        )  # fmt: skip
    paths = {policy: journal_path(args.out, policy) for policy in ("legacy", "kvstate")}
    try:
        for path in paths.values():
            refuse_existing(path, force=args.force)
        os.makedirs(args.out, exist_ok=True)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    emit(
        console,
        Text(
            f"kvstate demo: {args.requests} requests, {args.world_size} ranks, seed {args.seed}, "
            f"against {backend}: the connector before vLLM #52372, then kvstate's ledgers.",
            style="bold",
        ),
    )
    runs = []
    try:
        with terminations_interrupt():
            for policy in ("legacy", "kvstate"):
                config = SimConfig(
                    requests=args.requests,
                    world_size=args.world_size,
                    block_bytes=args.block_bytes,
                    seed=args.seed,
                    policy=policy,
                )
                with (
                    Progress(
                        TextColumn(f"{policy:>8} policy"),
                        BarColumn(),
                        TextColumn(
                            "{task.completed}/{task.total} requests · step {task.fields[step]}"
                        ),
                        console=console,
                        disable=not console.is_terminal,
                    ) as bar,
                    journal_output(paths[policy], force=args.force) as tmp,
                ):
                    task = bar.add_task(policy, total=config.requests, step=0)
                    run = run_policy(
                        config,
                        tmp,
                        use_mooncake=use_mooncake,
                        master=master,
                        progress=functools.partial(_advance, bar, task),
                        segment_bytes=args.segment_mb << 20 if args.segment_mb else None,
                    )
                run.summary.journal = paths[policy]
                runs.append(run)
                if run.summary.error is not None:
                    break  # the store or the engine failed: no second run on a broken setup
    except KeyboardInterrupt as exc:
        print(
            f"kvstate: interrupted; the records so far are in {args.out}/ "
            "(replay reports them UNFINISHED); the Mooncake master was stopped",
            file=sys.stderr,
        )
        return interrupted_status(exc)
    except Exception as exc:  # a master that would not start, a client setup that failed
        print(f"kvstate: error: {printable(exc)}", file=sys.stderr)
        return EXIT_UNUSABLE
    emit(console, summary_table([r.summary for r in runs]))
    failed = [r.summary for r in runs if r.summary.error is not None]
    if failed:
        print(
            f"kvstate: error: the {failed[0].policy} run crashed: {printable(failed[0].error)}; "
            f"its journal {failed[0].journal} ends with engine_crashed",
            file=sys.stderr,
        )
        return EXIT_VIOLATIONS
    if use_mooncake:
        emit(console, Text(f"Mooncake's own log: {os.path.join(args.out, 'mooncake.log')}"))
    legacy, fixed = runs[0].summary, runs[1].summary
    emit(console, Text("Inspect the journals:", style="bold"))
    for line in (
        f"kvstate replay {paths['legacy']}            # the first violation, explained",
        f"kvstate replay {paths['kvstate']}           # clean",
        f"kvstate timeline {paths['legacy']} --req {legacy.first_violation_req or 'req-0'}"
        "   # the first violation's request",
        f"kvstate replay {paths['legacy']} --minimize {args.out}/repro.jsonl",
        f"kvstate export {paths['legacy']} --format perfetto {args.out}/legacy.trace.json",
    ):
        emit(console, Text("  " + line))
    as_expected = legacy.poisoned_keys > 0 and fixed.poisoned_keys == 0 and not fixed.violations
    return EXIT_CLEAN if as_expected else EXIT_VIOLATIONS


def _advance(bar: Any, task: Any, summary: Any) -> None:
    """Move a run's progress bar to the summary's finished requests and step."""
    bar.update(task, completed=summary.finished, step=summary.steps)
