"""The ``kvstate`` command line: one module per command.

Each command module has ``add_parser(sub)`` and ``run(args)``. Building the
parser imports only the light command modules; what a command needs beyond
the core (the simulator, Mooncake, textual) is imported inside its ``run``,
so ``kvstate replay`` never loads the simulator and ``import replay.cli``
stays cheap.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from kvstate.errors import TemporaryStorageError
from kvstate.extras import MissingExtra, missing_extra

from ._common import EXIT_ENVIRONMENT, EXIT_UNUSABLE, Parser, interrupted_status, log_to_stderr

#: command name -> module, in the order ``kvstate --help`` lists them
COMMANDS = (
    "replay",
    "timeline",
    "inspect",
    "export",
    "convert",
    "fleet_check",
    "pd_check",
    "watch",
    # the commands that drive the harness, in their own folder
    "harness.run",
    "harness.demo",
    "harness.vllm_demo",
    "harness.zoo",
)


def build_parser() -> Parser:
    parser = Parser(
        prog="kvstate",
        description="Journal, replay and check the lifecycle of KV-cache store jobs.",
    )
    parser.add_argument("--version", action="version", version=f"kvstate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvstate")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status."""
    args = build_parser().parse_args(argv)
    log_to_stderr()
    try:
        return int(args.func(args))
    except KeyboardInterrupt as exc:
        return interrupted_status(exc)
    except TemporaryStorageError as exc:
        # Every command, one place: the environment failed, not the journal.
        print(f"kvstate: error: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    except MissingExtra as exc:
        # An option whose optional extra is not installed (as --ray says it).
        print(f"kvstate: error: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    except ModuleNotFoundError as exc:
        # An extra's module imported where no check came first: said the same way.
        missing = missing_extra(exc)
        if missing is None:
            raise
        print(f"kvstate: error: {missing}", file=sys.stderr)
        return EXIT_UNUSABLE
    except BrokenPipeError:
        # `kvstate replay ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0


__all__ = ["COMMANDS", "EXIT_UNUSABLE", "build_parser", "main"]
