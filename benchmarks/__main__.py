"""``python -m benchmarks [--quick] [--out DIR] [--force]``: the performance table.

``--update day`` measures only the compressed day's rows (rotation and
retention, ``benchmarks/bench_retention.py``), ``--update vllm`` only the
rows of kvstate's CPU on vLLM's engine thread (one profiled run per
connector, and one of a P/D pair's decode engine,
``benchmarks/bench_vllm_step.py``), and puts them into the
table already in ``--out``, replacing the rows of that name: the other rows
stay as their run measured them (each row's ratio is of one run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

from benchmarks.report import OUTPUTS, markdown, write
from benchmarks.runner import run
from journal import OutputExists, refuse_existing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the test suite)")
    parser.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md")
    parser.add_argument("--force", action="store_true", help="replace earlier results")
    parser.add_argument(
        "--update",
        choices=("day", "vllm"),
        help="measure only these rows and put them into the table in --out",
    )
    args = parser.parse_args(argv)
    if args.update:
        return _update(Path(args.out), args.quick, args.update)
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


def _update(out: Path, quick: bool, which: str) -> int:
    """``--update day|vllm``: those rows measured now, in the table of an earlier run."""
    import json

    from benchmarks.runner import VLLM_ROW, Sizes, day_rows, vllm_row

    try:
        report = json.loads((out / "bench.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"python -m benchmarks: error: {out / 'bench.json'}: {exc}", file=sys.stderr)
        return 2
    if which == "day":
        rows, report["day"] = day_rows(Sizes.of(quick).day_jobs)
    else:
        mooncake, report["vllm_profile"] = vllm_row(quick)
        offloading, report["vllm_offloading_profile"] = vllm_row(quick, "offloading")
        example, report["vllm_example_profile"] = vllm_row(quick, "example")
        pair, report["vllm_pd_profile"] = vllm_row(quick, "pd")
        rows = [mooncake, offloading, example, pair]
    fresh = [attrs.asdict(r) for r in rows]
    names = {r["name"] for r in fresh}
    if which == "vllm":  # a table from before the rows were named by connector
        names.add(VLLM_ROW)
    kept = [r for r in report["rows"] if r["name"] not in names]
    # the rows where the table had them (the vLLM rows after the demo's)
    at = next((i for i, r in enumerate(report["rows"]) if r["name"] in names), len(kept))
    report["rows"] = kept[:at] + fresh + kept[at:]
    print(markdown(report), end="")
    for path in write(report, out, force=True):  # this command's own outputs, updated
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
