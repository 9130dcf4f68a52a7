"""The benchmark run's outputs: the markdown table, the plots, the files.

``python -m benchmarks`` writes them into its folder; ``docs/perf/bench.md``
is the generated table the documentation quotes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.bench_fleet import extrapolate
from benchmarks.bench_hot_path import WORLD
from journal import atomic_output


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "| what | measured | target | ratio to target | met | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        measured = "not measured" if r["measured"] is None else f"{r['measured']:,.2f} {r['unit']}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(
            f"| {r['name']} | {measured} | {r['target']} | {ratio} | {met} | {r['note']} |"
        )
    lines += [
        "",
        "| running requests | mix | engine-process CPU per request per step (µs) |",
        "|---|---|---|",
    ]
    for s in report["step_overhead"]:
        lines.append(f"| {s['running']:,} | {s['mix']} | {s['us_per_request']:.2f} |")
    lines += [
        "",
        f"The guards (a scheduler and {WORLD} ranks, no journal, no audit) keep "
        f"{report['live_bytes_per_job']:,.0f} bytes per finished job in memory, "
        f"{report['live_bytes_per_job_spilled']:,.0f} when they park into a SpillArchive "
        f"(tracemalloc, heap after {report['live_jobs']:,} lifecycles less the heap after "
        "half of them; a SpillArchive's unwritten batch of up to 4,096 entries counts).",
    ]
    lines += ["", "| replayed records | seconds | records/s | peak MB |", "|---|---|---|---|"]
    for p in report["replay_points"]:
        lines.append(
            f"| {p['records']:,} | {p['seconds']:.2f} | {p['rate']:,.0f} | {p['peak_mb']:.0f} |"
        )
    return "\n".join(lines + _fleet_lines(report.get("fleets") or [])) + "\n"


def _fleet_lines(fleets: list[dict[str, Any]]) -> list[str]:
    """fleet-check against local workers, measured, then a straight line."""
    if not fleets:
        return []
    lines = [
        "",
        "| fleet runs | records | workers | seconds | records/s | peak MB per worker |",
        "|---|---|---|---|---|---|",
    ]
    for fleet in fleets:
        for p in fleet["points"]:
            lines.append(
                f"| {fleet['runs']:,} | {p['records']:,} | {p['workers']} | {p['seconds']:.1f} "
                f"| {p['rate']:,.0f} | {p['worker_peak_mb']:.0f} |"
            )
    big = fleets[-1]
    line = extrapolate(big)
    hours = line["hours_one_worker"]
    lines += [
        "",
        f"The fleet: {big['runs']:,} simulated engine runs of {big['requests']:,} requests, "
        f"{big['journal_bytes'] / 1e9:.2f} GB of journals, as {big['stores']} shared-store "
        f"fleets made in parallel in {big['make_seconds']:.0f} s (the input, not measured "
        f"above). "
        f"The cross-run join over {big['runs']:,} runs' facts: {big['join']['seconds']:.2f} s, "
        f"{big['join']['peak_mb']:.0f} MB peak, {big['join']['rows']:,} wrong loads found. "
        f"Measured: {line['records']:,} records take {hours:.2f} h on one worker. "
        f"Extrapolated in a straight line, not measured: W workers at the second worker's "
        f"efficiency ({line['efficiency']:.2f}) take {hours:.2f} / ({line['efficiency']:.2f} W) "
        f"h ({hours * 60 / (16 * line['efficiency']):.1f} min on 16, "
        f"{hours * 60 / (64 * line['efficiency']):.1f} min on 64).",
    ]
    return lines


def plots(report: dict[str, Any], out: Path, *, force: bool) -> list[Path]:
    """PNGs of replay time and peak memory against journal length, and of the
    per-step overhead against running requests (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    points = report["replay_points"]
    records = [p["records"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.loglog(records, [p["seconds"] for p in points], "o-")
    left.set(xlabel="journal records", ylabel="replay seconds", title="replay time")
    right.semilogx(records, [p["peak_mb"] for p in points], "o-")
    right.axhline(300, color="red", linestyle="--", label="target 300 MB")
    right.set(xlabel="journal records", ylabel="peak MB", title="replay peak memory")
    right.set_ylim(bottom=0)
    right.legend()
    fig.tight_layout()
    steps = report["step_overhead"]
    fig2, ax = plt.subplots(figsize=(5, 4))
    for mix in dict.fromkeys(s["mix"] for s in steps):
        mine = [s for s in steps if s["mix"] == mix]
        ax.semilogx(
            [s["running"] for s in mine], [s["us_per_request"] for s in mine], "o-", label=mix
        )
    ax.axhline(0.5, color="red", linestyle="--", label="target (decode)")
    ax.set(
        xlabel="running requests",
        ylabel="µs per request per step",
        title="ledger cost per engine step (CPU)",
    )
    ax.set_ylim(bottom=0)
    ax.legend()
    fig2.tight_layout()
    written = []
    for name, figure in (("replay.png", fig), ("step.png", fig2)):
        path = out / name
        with atomic_output(str(path), force=force) as tmp:
            figure.savefig(tmp, format="png", dpi=100)
        written.append(path)
        plt.close(figure)
    return written


#: what a run writes into its folder
OUTPUTS = ("bench.json", "bench.md", "replay.png", "step.png")


def write(report: dict[str, Any], out: Path, *, force: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (
        ("bench.json", json.dumps(report, indent=1) + "\n"),
        ("bench.md", markdown(report)),
    ):
        path = out / name
        with atomic_output(str(path), force=force) as tmp:
            Path(tmp).write_text(text)
        written.append(path)
    return written + plots(report, out, force=force)
