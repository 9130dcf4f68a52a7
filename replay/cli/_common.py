"""What every command shares: exit statuses, error lines, JSON output and
signal handling.

Exit statuses follow the contract: 0 clean, 1 at least one violation,
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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from journal import RecordError

from ..safe import printable

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]
else:
    Subparsers = argparse._SubParsersAction

EXIT_CLEAN = 0
EXIT_VIOLATIONS = 1
EXIT_UNUSABLE = 2
#: an addition to the contract: the machine failed kvstate (a full TMPDIR),
#: not the input
EXIT_ENVIRONMENT = 3


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad arguments too; keep its usage line and our prefix.

    Every option with a default says it in ``--help``.
    """

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        default = action.default
        unset = default is None or default is False or default is argparse.SUPPRESS
        shown = action.option_strings and not unset
        if shown and "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return action

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_UNUSABLE, f"kvstate: error: {message}\n")


def add_worker_options(group: Any) -> None:
    """``--workers``, ``--ray`` and ``--ray-address``: where each run of a fleet is replayed.

    ``--ray`` is a plain switch: an optional value would take the journal's
    path for a Ray address (``kvstate replay --ray DIR`` then asked for PATH).
    """
    group.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="local worker processes"
    )
    group.add_argument(
        "--ray",
        action="store_true",
        help="each run as a Ray task, on a local Ray instance started for the command "
        "(the optional extra kvstate[ray])",
    )
    group.add_argument(
        "--ray-address",
        metavar="URL",
        help="each run as a Ray task on the cluster at URL (implies --ray)",
    )


def ray_address(args: argparse.Namespace) -> str | bool | None:
    """``--ray`` / ``--ray-address`` as :func:`replay.fleet.map_runs` takes them:
    False (local workers), None (a local Ray instance) or the cluster's address."""
    if args.ray_address:
        return str(args.ray_address)
    return None if args.ray else False


def unusable(exc: Exception, *, as_json: bool) -> int:
    """Report unusable input on one line (and as JSON with ``--json``); exit 2.

    A closed pipe is not bad input (``kvstate run | head``): it goes on to
    :func:`replay.cli.main`, which ends quietly.
    """
    if isinstance(exc, BrokenPipeError):
        raise exc
    message = printable(exc)
    print(f"kvstate: error: {message}", file=sys.stderr)
    if as_json:
        out: dict[str, object] = {"verdict": "unusable", "error": str(exc)}
        if isinstance(exc, RecordError):
            out.update(
                {k: v for k, v in (("file", exc.path), ("line", exc.line), ("seq", exc.seq)) if v}
            )
        print(to_json(out))
    return EXIT_UNUSABLE


def to_json(obj: object) -> str:
    """Standard JSON for stdout: no NaN, and ASCII only, so no control character
    from a journal string can reach a terminal raw."""
    return json.dumps(obj, ensure_ascii=True, allow_nan=False)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, turned into an exception so cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def terminations_interrupt() -> Iterator[None]:
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


def interrupted_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal, as a shell reports a process ended by it."""
    return 128 + (exc.signum if isinstance(exc, Interrupted) else signal.SIGINT)


#: the format of kvstate's lines in a host's log: the level, then one prefix,
#: the logger's name (``kvstate``, ``kvstate.watch``)
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """Say kvstate's log lines on stderr, where systemd and a container's log
    collector look, in :data:`LOG_FORMAT`; a host (or a test runner) that
    configured Python's logging already keeps its own handlers."""
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
        # the watcher's progress too (a journal ended, a file now a journal)
        logging.getLogger("kvstate.watch").setLevel(logging.INFO)
