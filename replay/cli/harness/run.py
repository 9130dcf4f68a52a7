"""``kvstate run``: the engine simulator on the ledgers, journaled and audited."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from journal import JournalError, OutputExists, journal_output, refuse_existing, segments
from journal.rotation import Rotation

from ...report import emit, report_console, summary_line
from ...safe import literal, printable
from ...verdict import replay
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

if TYPE_CHECKING:
    from kvstate.harness.sim.config import SimConfig


def add_parser(sub: Subparsers) -> None:
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
        default=None,
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
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--shared-prefixes", type=int, default=None, help="distinct shared prefixes")
    p.add_argument("--prefix-share", type=float, default=None, help="prompt fraction shared")
    p.add_argument("--followups", type=float, default=None, help="fraction continuing a prompt")
    p.add_argument("--blocks", type=int, default=None, help="device blocks in the pool")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--budget", type=int, default=None, help="tokens per engine step")
    p.add_argument("--store-latency", type=float, default=None, help="mean ms per store call")
    p.add_argument("--failure-rate", type=float, default=0.0, help="puts that fail")
    p.add_argument("--abort-rate", type=float, default=0.0, help="per request per step")
    p.add_argument("--save-decode-cache", action="store_true", help="also save decode blocks")
    p.add_argument(
        "--kv-role",
        choices=("kv_producer", "kv_consumer"),
        default="kv_producer",
        help="a consumer saves only decode blocks, and only with --save-decode-cache",
    )
    kept = p.add_argument_group(
        "rotation and retention",
        "rotate the journal into segments (NAME.000002.db, ...) and keep it within a "
        "budget, its oldest segments removed once the next begins with a checkpoint "
        "(docs/journal.md, Segments and Retention)",
    )
    for flag, kind, metavar, what in (
        ("--rotate-bytes", int, "BYTES", "begin a new segment at this size"),
        ("--rotate-seconds", float, "S", "begin a new segment at this age"),
        (
            "--retain-bytes",
            int,
            "BYTES",
            "keep the journal within this many bytes (at least twice --rotate-bytes)",
        ),
        ("--retain-seconds", float, "S", "remove segments last written longer ago than this"),
    ):
        kept.add_argument(flag, type=_positive(kind), metavar=metavar, help=what)
    fleet = p.add_argument_group(
        "a fleet",
        "several engines of this configuration, one after another, each journaled as a run "
        "of its own (FOLDER/engine-NNN.db); check them together with kvstate fleet-check",
    )
    fleet.add_argument("--engines", type=int, default=1, help="how many engines")
    fleet.add_argument(
        "--store",
        choices=("own", "shared"),
        default="own",
        help="shared: every engine uses one store, so later engines load what earlier "
        "engines stored",
    )
    fleet.add_argument(
        "--legacy-engines",
        type=int,
        default=0,
        metavar="K",
        help="the first K engines run the legacy connector (--legacy-bugs)",
    )
    fleet.add_argument(
        "--bulk",
        action="store_true",
        help="write each journal from a thread, without the writer's own audit: the same "
        "records, about 3 times faster (each run is replayed afterwards all the same)",
    )
    p.set_defaults(func=run)


def _positive(kind: Callable[[str], float]) -> Callable[[str], float]:
    """An option's type: a positive number of ``kind`` (argparse says which option)."""

    def parse(text: str) -> float:
        value = kind(text)
        if not value > 0:  # also refuses nan
            raise ValueError(text)
        return value

    parse.__name__ = f"positive {kind.__name__}"  # argparse's "invalid positive int value"
    return parse


def run(args: argparse.Namespace) -> int:
    """Run the engine simulator, journal it, audit the store, print a summary.

    The journal is written to a temporary file and renamed into place when
    the run ends, also when it is interrupted (SIGINT, SIGTERM, SIGHUP): the
    records so far are kept, and replay calls them UNFINISHED.
    """
    from rich.progress import BarColumn, Progress, TextColumn

    from kvstate.harness.legacy import BUGS
    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.faults import Faults
    from kvstate.harness.sim.runtime import Simulation, check_journal

    bugs = tuple(sorted(BUGS)) if args.legacy_bugs == "all" else None
    if args.legacy_bugs not in (None, "all"):
        bugs = tuple(b.strip() for b in args.legacy_bugs.split(",") if b.strip())
    try:
        # Options left out take the simulator's own defaults (SimConfig).
        given = {
            "requests": args.requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "shared_prefixes": args.shared_prefixes,
            "prefix_share": args.prefix_share,
            "followups": args.followups,
            "blocks": args.blocks,
            "block_size": args.block_size,
            "world_size": args.world_size,
            "token_budget": args.budget,
            "store_latency_ms": args.store_latency,
            "stall_steps": args.stall_steps,
            "legacy_bugs": bugs,
        }
        config = SimConfig(
            failure_rate=args.failure_rate,
            abort_rate=args.abort_rate,
            save_decode_cache=args.save_decode_cache,
            kv_role=args.kv_role,
            seed=args.seed,
            policy=args.policy,
            mode=args.mode,
            max_steps=args.max_steps,
            faults=Faults.parse(args.faults),
            **{name: value for name, value in given.items() if value is not None},
        )
        rotation = _rotation(args)
        if args.engines > 1 or args.legacy_engines:
            return _fleet(args, config, rotation)
        refuse_existing(args.journal, force=args.force)
        folder = os.path.dirname(args.journal)
        if os.path.isdir(folder or ".") and segments.later_segments(args.journal):
            # a rotated journal: --force would replace its first segment alone,
            # and the segments after it would follow neither journal
            raise OutputExists(
                f"{args.journal}: a journal of this name has later segments (it rotated); "
                "--force replaces one file, never a journal of segments: give the new "
                "journal a name of its own"
            )
        if rotation is not None and os.path.lexists(args.journal):
            # the replacement is written beside it and renamed over it, which
            # its segments, named after the file written, would not follow
            raise OutputExists(
                f"{args.journal}: already exists; a rotated journal is never written over "
                "another: give it a name of its own"
            )
        # The journal's folder is made for it (docs/ops.md's first example
        # writes journals/NAME.db in an empty folder); nothing else is.
        if folder:
            os.makedirs(folder, exist_ok=True)
    except (ValueError, JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    console = report_console()
    try:
        with (
            terminations_interrupt(),
            journal_output(args.journal, force=args.force) as tmp,
        ):
            sim = Simulation(config, journal=tmp, rotation=rotation)
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
        return interrupted_status(exc)
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    emit(console, summary_table([summary]))
    try:
        check_journal(args.journal)  # still there since the summary read it?
        verdict = replay([args.journal])
    except (JournalError, OSError) as exc:
        return unusable(exc, as_json=False)
    emit(console, summary_line(verdict))
    emit(
        console, literal(f"journal: {args.journal}; explain it with: kvstate replay {args.journal}")
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


def _rotation(args: argparse.Namespace) -> Rotation | None:
    """The rotation and retention the options ask for (None: neither), checked
    before any file is made: a value ``Rotation`` refuses is a ``ValueError``
    naming it, and retention without the writer process (``--bulk``) is refused,
    since the writer process writes the checkpoints it removes segments after."""
    values = (args.rotate_bytes, args.rotate_seconds, args.retain_bytes, args.retain_seconds)
    if all(value is None for value in values):
        return None
    if args.rotate_bytes is None and args.rotate_seconds is None:
        raise ValueError(
            "--retain-bytes and --retain-seconds remove whole segments: give --rotate-bytes "
            "or --rotate-seconds too"
        )
    rotation = Rotation(
        max_bytes=args.rotate_bytes,
        max_seconds=args.rotate_seconds,
        keep_bytes=args.retain_bytes,
        keep_seconds=args.retain_seconds,
    )
    if rotation.retains and args.bulk:
        raise ValueError(
            "--retain-bytes and --retain-seconds need the writer process, which writes the "
            "checkpoints retention removes segments after; --bulk writes without it"
        )
    return rotation


def _fleet(args: argparse.Namespace, config: SimConfig, rotation: Rotation | None) -> int:
    """``--engines N``: the engines one after another, a journal each in a folder."""
    from kvstate.harness.sim.shared_store import engine_journal, simulate_fleet

    folder = args.journal if args.journal != "run.db" else "fleet"
    os.makedirs(folder, exist_ok=True)
    for index in range(1, args.engines + 1):
        # Each engine's journal is new: nothing a user already has is replaced.
        refuse_existing(engine_journal(folder, index), force=False)
    done = simulate_fleet(
        config,
        folder,
        engines=args.engines,
        legacy_engines=args.legacy_engines,
        shared_store=args.store == "shared",
        bulk=args.bulk,
        rotation=rotation,
    )
    console = report_console()
    emit(console, summary_table([summary for _, summary in done]))
    status = EXIT_CLEAN
    for path, _ in done:
        verdict = replay([path])
        status = max(status, verdict.exit_status)
        emit(console, literal(f"{path}: {verdict.verdict}"))
    emit(
        console,
        literal(f"journals in {folder}; check them together with: kvstate fleet-check {folder}"),
    )
    return status
