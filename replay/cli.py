"""The ``kvstate`` command line.

Exit statuses follow spec section 7: 0 clean, 1 at least one violation,
2 unusable input (the message names the file and line or seq). No command
prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from journal import (
    Journal,
    JournalError,
    RecordError,
    atomic_output,
    refuse_existing,
    write_jsonl,
)
from kvstate.codec import to_record
from kvstate.recorder import journal_views
from kvstate.sim.runtime import SimConfig

from . import export, timeline
from .engine import replay
from .minimize import minimize
from .report import (
    lanes_table,
    needed_records,
    print_report,
    report_console,
    summary_line,
)
from .safe import literal, printable
from .sources import collect, entries

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_UNUSABLE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 too; keep its usage line
        self.print_usage(sys.stderr)
        self.exit(EXIT_UNUSABLE, f"kvstate: error: {message}\n")


def _unusable(exc: Exception, *, as_json: bool) -> int:
    message = str(exc)
    print(f"kvstate: error: {message}", file=sys.stderr)
    if as_json:
        out: dict[str, object] = {"verdict": "unusable", "error": message}
        if isinstance(exc, RecordError):
            out.update(
                {k: v for k, v in (("file", exc.path), ("line", exc.line), ("seq", exc.seq)) if v}
            )
        print(_json(out))
    return EXIT_UNUSABLE


def _json(obj: object) -> str:
    """Standard JSON for stdout: no NaN, and ASCII only, so no control character
    from a journal string can reach a terminal raw."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into an exception so cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def _terminations_interrupt() -> Iterator[None]:
    """While a long command runs, SIGTERM and SIGHUP unwind it like Ctrl-C: the
    journal is flushed, temporary files are published or removed, and the
    Mooncake master is stopped."""

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        saved[sig] = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _interrupted_status(exc: KeyboardInterrupt) -> int:
    return 128 + (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)


def cmd_minimize(args: argparse.Namespace) -> int:
    try:
        refuse_existing(args.minimize, force=args.force)
        loaded = list(entries(args.paths))
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=args.json)
    found = minimize(loaded)
    if found is None:
        print("journal is clean: nothing to minimize")
        return EXIT_CLEAN
    try:
        with atomic_output(args.minimize, force=args.force) as tmp:
            write_jsonl((to_record(e) for e in found.entries), tmp)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=args.json)
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
        print(_json(summary))
    else:
        print(
            f"{target.code.value} at seq {target.seq}: {found.original} records -> "
            f"{found.sliced} in the slice -> {len(found.entries)} after delta debugging "
            f"({found.tests} replays). Wrote {args.minimize}; replay it with: "
            f"kvstate replay {args.minimize}"
        )
    return EXIT_VIOLATIONS


def cmd_replay(args: argparse.Namespace) -> int:
    if args.minimize:
        return cmd_minimize(args)
    try:
        result = replay(args.paths, at=args.at, require_idle=args.require_idle)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=args.json)
    if args.json:
        print(_json(result.to_dict()))
    else:
        try:
            records = collect(args.paths, needed_records(result))
        except (JournalError, OSError):
            records = {}  # the verdict stands; the story just has fewer details
        print_report(result, records, show_all=args.all)
    return result.exit_status


def cmd_convert(args: argparse.Namespace) -> int:
    """JSON Lines <-> journal database, record for record."""
    src, dst = args.source, args.destination
    try:
        with atomic_output(dst, force=args.force) as tmp:
            source = entries([src])
            if dst.endswith((".jsonl", ".ndjson", ".json")):
                n = write_jsonl((to_record(e) for e in source), tmp)
            else:
                with Journal(tmp) as journal:
                    journal.create_views(journal_views())
                    batch = []
                    n = 0
                    for entry in source:
                        batch.append(to_record(entry))
                        if len(batch) == 4096:
                            n += journal.append(batch)
                            batch = []
                    n += journal.append(batch)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    print(f"wrote {n} records to {dst}")
    return EXIT_CLEAN


def cmd_zoo(args: argparse.Namespace) -> int:
    """Run the bug zoo: each seeded bug under the legacy and the fixed policy."""
    from kvstate.zoo import CASES, run_case

    names = args.cases or sorted(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"kvstate: error: unknown case(s) {', '.join(unknown)}", file=sys.stderr)
        return EXIT_UNUSABLE
    paths = [
        os.path.join(args.out, f"{name}.{policy}.jsonl")
        for name in names
        for policy in ("legacy", "kvstate")
    ]
    try:
        for path in paths:
            refuse_existing(path, force=args.force)
    except JournalError as exc:
        return _unusable(exc, as_json=False)
    os.makedirs(args.out, exist_ok=True)
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("case", "upstream", "legacy policy", "kvstate policy"):
        table.add_column(column)
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
    console.print(table)
    console.print(
        Text(
            f"journals: {args.out}/CASE.legacy.jsonl and {args.out}/CASE.kvstate.jsonl; "
            f"explain one with: kvstate replay {args.out}/{names[0]}.legacy.jsonl"
        )
    )
    return EXIT_CLEAN if all_as_expected else EXIT_VIOLATIONS


def cmd_timeline(args: argparse.Namespace) -> int:
    try:
        line = timeline.build(args.paths, req=args.req, job=args.job)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=args.json)
    if args.json:
        print(_json(line.to_dict()))
    else:
        console = report_console()
        title = f"Timeline of {line.title}: {len(line.entries)} records"
        console.print(lanes_table(line.entries, line.violations, title, not console.is_terminal))
        for seq, found in sorted(line.violations.items()):
            for v in found:
                console.print(literal(f"seq {seq} {v.code.value}: {v.message}"))
    if not line.entries:
        print(f"kvstate: no record names {printable(line.title)}", file=sys.stderr)
    return EXIT_VIOLATIONS if line.violations else EXIT_CLEAN


def cmd_export(args: argparse.Namespace) -> int:
    try:
        with atomic_output(args.out, force=args.force) as tmp:
            if args.format == "perfetto":
                trace = export.perfetto(args.paths)
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(trace, f, ensure_ascii=False, allow_nan=False)
                n = len(trace["traceEvents"])
            else:
                n = write_jsonl((to_record(e) for e in entries(args.paths)), tmp)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    unit = "trace events" if args.format == "perfetto" else "records"
    hint = "; open it at ui.perfetto.dev" if args.format == "perfetto" else ""
    print(f"wrote {n} {unit} to {args.out}{hint}")
    return EXIT_CLEAN


def cmd_run(args: argparse.Namespace) -> int:
    """Run the engine simulator, journal it, audit the store, print a summary.

    The journal is written to a temporary file and renamed into place when
    the run ends, also when it is interrupted (SIGINT, SIGTERM, SIGHUP): the
    records so far are kept, and replay calls them UNFINISHED.
    """
    from rich.progress import BarColumn, Progress, TextColumn

    from kvstate.legacy import BUGS
    from kvstate.sim.faults import Faults
    from kvstate.sim.runtime import Simulation

    bugs = tuple(sorted(BUGS)) if args.legacy_bugs == "all" else None
    if args.legacy_bugs not in (None, "all"):
        bugs = tuple(b.strip() for b in args.legacy_bugs.split(",") if b.strip())
    try:
        config = SimConfig(
            requests=args.requests,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            shared_prefixes=args.shared_prefixes,
            prefix_share=args.prefix_share,
            followups=args.followups,
            blocks=args.blocks,
            block_size=args.block_size,
            world_size=args.world_size,
            token_budget=args.budget,
            store_latency_ms=args.store_latency,
            failure_rate=args.failure_rate,
            abort_rate=args.abort_rate,
            save_decode_cache=args.save_decode_cache,
            kv_role=args.kv_role,
            seed=args.seed,
            policy=args.policy,
            mode=args.mode,
            max_steps=args.max_steps,
            stall_steps=args.stall_steps,
            faults=Faults.parse(args.faults),
            **({"legacy_bugs": bugs} if bugs is not None else {}),
        )
        refuse_existing(args.journal, force=args.force)
    except (ValueError, JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    console = report_console()
    try:
        with (
            _terminations_interrupt(),
            atomic_output(args.journal, force=args.force, keep_on_interrupt=True) as tmp,
        ):
            sim = Simulation(config, journal=tmp)
            try:
                with Progress(
                    TextColumn(f"[bold]{config.policy}[/] {config.mode}"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total} requests · step {task.fields[step]}"),
                    console=console,
                    transient=True,
                    disable=not console.is_terminal,
                ) as bar:
                    task = bar.add_task("run", total=config.requests, step=0)
                    summary = sim.run(
                        lambda s: bar.update(task, completed=s.finished, step=s.steps)
                    )
            finally:
                sim.close()
    except KeyboardInterrupt as exc:
        print(
            f"kvstate: interrupted; the records so far are in {args.journal} "
            "(replay reports it UNFINISHED)",
            file=sys.stderr,
        )
        return _interrupted_status(exc)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    console.print(summary_table([summary]))
    verdict = replay([args.journal])
    console.print(summary_line(verdict))
    console.print(
        literal(f"journal: {args.journal}; explain it with: kvstate replay {args.journal}")
    )
    if summary.error is not None:
        print(f"kvstate: error: the run crashed: {printable(summary.error)}", file=sys.stderr)
        return EXIT_VIOLATIONS
    if summary.stopped is not None:
        why = {
            "max-steps": f"it reached --max-steps {config.max_steps}",
            "stalled": f"it made no progress for {config.stall_steps} steps",
        }.get(summary.stopped, summary.stopped)
        print(
            f"kvstate: error: the run stopped before the engine was idle: {why}; "
            f"{summary.finished} of {summary.requests} requests finished, and the journal "
            "records no engine_idle",
            file=sys.stderr,
        )
        return EXIT_UNUSABLE
    return verdict.exit_status


def cmd_demo(args: argparse.Namespace) -> int:
    """The same workload under the legacy connector and under kvstate, side by side."""
    from rich.progress import BarColumn, Progress, TextColumn

    from kvstate.live.demo import journal_path, mooncake_problem, run_policy

    console = report_console()
    master = None
    if args.master_url or args.master_rpc:
        from kvstate.live.master import MasterError, existing_master

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
        console.print(
            Text(f"notice: Mooncake cannot run here ({problem}); using the in-memory store.",
                 style="yellow")
        )  # fmt: skip
    paths = {policy: journal_path(args.out, policy) for policy in ("legacy", "kvstate")}
    try:
        for path in paths.values():
            refuse_existing(path, force=args.force)
        os.makedirs(args.out, exist_ok=True)
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    console.print(
        Text(
            f"kvstate demo: {args.requests} requests, {args.world_size} ranks, seed {args.seed}, "
            f"against {backend}: the connector before vLLM #52372, then kvstate's ledgers.",
            style="bold",
        )
    )
    runs = []
    try:
        with _terminations_interrupt():
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
                    atomic_output(paths[policy], force=args.force, keep_on_interrupt=True) as tmp,
                ):
                    task = bar.add_task(policy, total=config.requests, step=0)
                    run = run_policy(
                        config,
                        tmp,
                        use_mooncake=use_mooncake,
                        master=master,
                        progress=lambda s, t=task: bar.update(
                            t, completed=s.finished, step=s.steps
                        ),
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
        return _interrupted_status(exc)
    except Exception as exc:  # a master that would not start, a client setup that failed
        print(f"kvstate: error: {printable(exc)}", file=sys.stderr)
        return EXIT_UNUSABLE
    console.print(summary_table([r.summary for r in runs]))
    failed = [r.summary for r in runs if r.summary.error is not None]
    if failed:
        print(
            f"kvstate: error: the {failed[0].policy} run crashed: {printable(failed[0].error)}; "
            f"its journal {failed[0].journal} ends with engine_crashed",
            file=sys.stderr,
        )
        return EXIT_VIOLATIONS
    if use_mooncake:
        console.print(Text(f"Mooncake's own log: {os.path.join(args.out, 'mooncake.log')}"))
    legacy, fixed = runs[0].summary, runs[1].summary
    console.print(Text("Inspect the journals:", style="bold"))
    for line in (
        f"kvstate replay {paths['legacy']}            # the first violation, explained",
        f"kvstate replay {paths['kvstate']}           # clean",
        f"kvstate timeline {paths['legacy']} --req req-0",
        f"kvstate replay {paths['legacy']} --minimize {args.out}/repro.jsonl",
        f"kvstate export {paths['legacy']} --format perfetto {args.out}/legacy.trace.json",
    ):
        console.print(Text("  " + line))
    as_expected = legacy.poisoned_keys > 0 and fixed.poisoned_keys == 0 and not fixed.violations
    return EXIT_CLEAN if as_expected else EXIT_VIOLATIONS


def summary_table(summaries: list) -> Table:  # type: ignore[type-arg]
    """Runs side by side: what they did and what went wrong."""
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    for s in summaries:
        table.add_column(f"{s.policy} policy", justify="right")
    rows = [
        ("requests finished", lambda s: f"{s.finished}/{s.requests}"),
        ("refused (never fit the pool)", lambda s: s.rejected),
        ("engine steps", lambda s: s.steps),
        ("store jobs", lambda s: s.store_jobs),
        ("preemptions", lambda s: s.preemptions),
        ("bytes moved", lambda s: s.bytes_moved),
        ("throughput", lambda s: f"{s.throughput_mb_s:.1f} MB/s"),
        ("loads from the store", lambda s: s.loads),
        ("requests that read wrong KV", lambda s: s.wrong_kv_requests),
        ("poisoned keys", lambda s: f"{s.poisoned_keys} of {s.keys_stored}"),
        ("keys gone from the store", lambda s: s.keys_missing),
        ("crashes", lambda s: s.crashes),
        ("leaked pins", lambda s: s.leaked_pins),
    ]
    for name, value in rows:
        table.add_row(name, *(Text(str(value(s))) for s in summaries))
    codes = sorted({c for s in summaries for c in s.violations})
    for code in codes:
        table.add_row(f"replay: {code}", *(Text(str(s.violations.get(code, 0))) for s in summaries))
    if not codes:
        table.add_row("replay violations", *(Text("0") for _ in summaries))
    return table


def cmd_inspect(args: argparse.Namespace) -> int:
    """The terminal UI, or with --once the overview and violations as text."""
    path = args.path
    if not os.path.exists(path):
        return _unusable(RecordError("no such file", path=path), as_json=False)
    try:
        from .inspector import Inspector, once

        if args.once:
            text, status = once(path)
            report_console().print(text)
            return status
        app = Inspector(path, follow=args.follow)
    except ImportError as exc:
        print(f"kvstate: error: the inspector needs the 'tui' extra ({exc})", file=sys.stderr)
        return EXIT_UNUSABLE
    except (JournalError, OSError) as exc:
        return _unusable(exc, as_json=False)
    app.run()
    return EXIT_CLEAN


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstate",
        description="Journal, replay and check the lifecycle of KV-cache store jobs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser(
        "timeline",
        help="every record of one request (all generations) or one job, as lanes",
        description="Show the records of one request or one job across the scheduler and "
        "every rank, with the violations raised at them. Exit 1 if any is marked.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--req", help="request id")
    which.add_argument("--job", type=int, help="store job id")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=cmd_timeline)

    p = sub.add_parser(
        "inspect",
        help="a terminal UI to travel through a journal (--once: print and exit)",
        description="Requests, jobs, blocks, violations and events as of any seq. Keys: "
        "left/right a record, PgUp/PgDn a step, g go to seq, n/p next/previous violation, "
        "/ filter, Enter a row's timeline, ? help, q quit. The journal is opened read-only.",
    )
    p.add_argument("path", metavar="PATH", help="journal database or .jsonl file")
    p.add_argument("--follow", action="store_true", help="tail a journal being written")
    p.add_argument("--once", action="store_true", help="print the overview and violations")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "export",
        help="export a journal as a Perfetto trace or as JSON Lines",
        description="perfetto: Chrome trace-event JSON (a track per rank and one for the "
        "scheduler, job/DMA/put spans, markers for preemptions and violations). "
        "jsonl: the records as JSON Lines (merged and renumbered when several paths).",
    )
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("--format", choices=("perfetto", "jsonl"), required=True)
    p.add_argument("out", metavar="OUT", help="output file (refuses to overwrite)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "convert",
        help="convert between JSON Lines and a journal database",
        description="Copy every record from SOURCE to DESTINATION. A destination ending in "
        ".jsonl is written as JSON Lines, anything else as a journal database.",
    )
    p.add_argument("source")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
    p.set_defaults(func=cmd_convert)

    sim = SimConfig()  # the run command's defaults are the simulator's
    p = sub.add_parser(
        "run",
        help="run the engine simulator on the ledgers and journal it",
        description="A vLLM-shaped engine (continuous batching, chunked prefill, preemption "
        "under KV pressure, prefix caching) with a store connector on the ledgers, against "
        "the in-memory store. Audits every stored key at the end. Exit status: the replay "
        "verdict of the journal it wrote (0 clean, 1 violations).",
    )
    p.add_argument("--journal", default="run.db", help="journal database to write (run.db)")
    p.add_argument("--force", action="store_true", help="replace the journal if it exists")
    p.add_argument(
        "--max-steps",
        type=int,
        help="stop after this many engine steps; the journal then has no engine_idle and "
        "the command exits 2 (default: run until idle)",
    )
    p.add_argument(
        "--stall-steps",
        type=int,
        default=sim.stall_steps,
        help="stop (exit 2) after this many steps in a row without progress",
    )
    p.add_argument(
        "--faults",
        metavar="SPEC",
        help="inject faults: put-fail=R, no-space=R, evict=R, store-down@STEP, "
        "thread-crash@STEP (comma separated)",
    )
    p.add_argument("--policy", choices=("kvstate", "legacy"), default="kvstate")
    p.add_argument(
        "--legacy-bugs",
        metavar="LIST",
        help="old behaviours for --policy legacy: 'all' or a comma list "
        "(default: the connector before vLLM #52372)",
    )
    p.add_argument("--mode", choices=("deterministic", "threaded"), default="deterministic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=sim.requests)
    p.add_argument("--prompt-len", type=int, default=sim.prompt_len)
    p.add_argument("--output-len", type=int, default=sim.output_len)
    p.add_argument(
        "--shared-prefixes", type=int, default=sim.shared_prefixes, help="distinct shared prefixes"
    )
    p.add_argument(
        "--prefix-share", type=float, default=sim.prefix_share, help="prompt fraction shared"
    )
    p.add_argument(
        "--followups", type=float, default=sim.followups, help="fraction continuing a prompt"
    )
    p.add_argument("--blocks", type=int, default=sim.blocks, help="device blocks in the pool")
    p.add_argument("--block-size", type=int, default=sim.block_size)
    p.add_argument("--world-size", type=int, default=sim.world_size)
    p.add_argument("--budget", type=int, default=sim.token_budget, help="tokens per engine step")
    p.add_argument(
        "--store-latency", type=float, default=sim.store_latency_ms, help="mean ms per store call"
    )
    p.add_argument("--failure-rate", type=float, default=0.0, help="puts that fail")
    p.add_argument("--abort-rate", type=float, default=0.0, help="per request per step")
    p.add_argument("--save-decode-cache", action="store_true", help="also save decode blocks")
    p.add_argument(
        "--kv-role",
        choices=("kv_producer", "kv_consumer"),
        default="kv_producer",
        help="a consumer saves only decode blocks, and only with --save-decode-cache",
    )
    p.set_defaults(func=cmd_run)

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
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "zoo",
        help="replay every seeded upstream bug under the legacy and the fixed policy",
        description="Run the bug zoo (docs/bug-zoo.md): write a legacy journal and its fixed "
        "twin per case and replay both. Exit 0 when every legacy journal is flagged with "
        "its case's code and every fixed twin is clean.",
    )
    p.add_argument("cases", nargs="*", metavar="CASE", help="case names (default: all)")
    p.add_argument("--out", default="zoo", help="folder for the journals (default: ./zoo)")
    p.add_argument("--force", action="store_true", help="replace journals already in --out")
    p.set_defaults(func=cmd_zoo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt as exc:
        return _interrupted_status(exc)
    except BrokenPipeError:
        # `kvstate replay ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
