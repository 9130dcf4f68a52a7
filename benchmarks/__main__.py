"""``python -m benchmarks [--quick] [--out DIR] [--force]``: the performance table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.report import OUTPUTS, markdown, write
from benchmarks.runner import run
from journal import OutputExists, refuse_existing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md")
    parser.add_argument("--force", action="store_true", help="replace earlier results")
    args = parser.parse_args(argv)
    try:  # before minutes of measuring, not after
        for name in OUTPUTS:
            refuse_existing(Path(args.out) / name, force=args.force)
    except OutputExists as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 2
    report = run(args.quick)
    print(markdown(report), end="")
    try:
        for path in write(report, Path(args.out), force=args.force):
            print(f"wrote {path}")
    except OutputExists as exc:
        print(f"python -m benchmarks: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
