"""The fleet row: simulated engine runs checked by ``fleet-check`` with 1 and 2
local workers, and the cross-run join in DuckDB.

The runs are the simulator's fleet (``kvstate run --engines N --store shared``,
the first engine on the legacy connector), so the join has poison to find.
Each check runs in a fresh interpreter, its facts in a new folder: nothing is
reused between the worker counts. Peak memory is per process: the check's
own (one worker checks in process) or its largest pool worker.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

_CHECK = (
    "import os, resource, time\n"
    "from replay.fleet import check_runs\n"
    "from replay.runs import group\n"
    "t = time.perf_counter()\n"
    "vs = check_runs(group([sys.argv[1]]), sys.argv[2], workers=int(sys.argv[3]))\n"
    "s = time.perf_counter() - t\n"
    "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
    "out = {'seconds': s, 'records': sum(v.events for v in vs), 'runs': len(vs),\n"
    "       'worker_peak_mb': kids}"
)
_JOIN = (
    "import glob, time\n"
    "from replay.fleet import cross_run\n"
    "t = time.perf_counter()\n"
    "rows = cross_run(sorted(glob.glob(sys.argv[1] + '/*.parquet')))\n"
    "out = {'seconds': time.perf_counter() - t, 'rows': len(rows)}"
)


def make_fleet(folder: str, runs: int, requests: int) -> None:
    """``runs`` engines of one workload on one store, the first one legacy."""
    from kvstate.harness.sim.fleet import simulate_fleet
    from kvstate.harness.sim.runtime import SimConfig

    config = SimConfig(requests=requests, blocks=32, seed=5)
    # bulk: the fleet is the input, not what is measured; the same journals
    simulate_fleet(config, folder, engines=runs, legacy_engines=1, shared_store=True, bulk=True)


def measure(child: Any, runs: int, requests: int, workers: tuple[int, ...]) -> dict[str, Any]:
    """``child(code, *args)`` runs code in a fresh interpreter (the runner's)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "fleet")
        os.makedirs(folder)
        make_fleet(folder, runs, requests)
        points = []
        for n in workers:
            facts = os.path.join(tmp, f"facts-{n}")
            got = child(_CHECK, folder, facts, str(n))
            # one worker checks in its own process: that process is the worker
            peak = got["peak_mb"] if n == 1 else got["worker_peak_mb"]
            points.append(
                {
                    "workers": n,
                    "seconds": got["seconds"],
                    "records": got["records"],
                    "rate": got["records"] / got["seconds"],
                    "worker_peak_mb": peak,
                }
            )
        join = child(_JOIN, os.path.join(tmp, f"facts-{workers[-1]}"))
        journals = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".db")]
        disk = sum(os.path.getsize(p) for p in journals)
    return {"runs": runs, "points": points, "join": join, "journal_bytes": disk}


def extrapolate(fleet: dict[str, Any], records: int = 100_000_000) -> dict[str, float]:
    """A straight line from the measured points (said so wherever it is shown):
    hours for ``records`` on one worker, and the second worker's efficiency
    (its speedup over one, halved), which W workers are assumed to keep."""
    one, *more = fleet["points"]
    speedup = more[-1]["rate"] / one["rate"] if more else 1.0
    return {
        "records": records,
        "hours_one_worker": records / one["rate"] / 3600,
        "efficiency": speedup / 2 if more else 1.0,
    }


def fleets(child: Any, runs: int) -> list[dict[str, Any]]:
    """``runs`` runs with 1 and 2 workers, and a quarter as many with 2 (peak
    memory per worker against the fleet's size)."""
    small = measure(child, max(2, runs // 4), 60, (2,))
    return [small, measure(child, runs, 60, (1, 2))]


def summary(fleets: list[dict[str, Any]]) -> tuple[float, str]:
    """The row's records/s with 2 workers, and its note."""
    small, big = fleets
    one, two = big["points"]
    line = extrapolate(big)
    note = (
        f"{big['runs']} runs, {one['records']:,} records: {one['seconds']:.1f} s on 1 worker, "
        f"{two['seconds']:.1f} s on 2; peak per worker {two['worker_peak_mb']:.0f} MB "
        f"({small['points'][0]['worker_peak_mb']:.0f} MB at {small['runs']} runs); "
        f"the DuckDB join {big['join']['seconds']:.2f} s, {big['join']['peak_mb']:.0f} MB; "
        f"100M records, extrapolated in a straight line: {line['hours_one_worker']:.1f} h "
        f"on 1 worker, {line['hours_one_worker'] / (64 * line['efficiency']):.2f} h on 64 at "
        f"the second worker's efficiency ({line['efficiency']:.2f})"
    )
    return float(two["rate"]), note
