"""The fleet row: simulated engine runs checked by ``fleet-check`` with 1 and 2
local workers, and the cross-run join in DuckDB.

The runs are the simulator's fleets (``kvstate run --engines N --store
shared``, the first engine of each store on the legacy connector), so the join
has poison to find. They are made as one fleet per core, in parallel, each on
a store of its own: the fleet is the row's input, not what it measures. Each
check runs in a fresh interpreter, its facts in a new folder: nothing is
reused between the worker counts. Peak memory is per process: the check's own
(one worker checks in process) or its largest pool worker.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

#: what a run takes on disk, measured at 1,000 runs of 3,000 requests: 37
#: records a request, 82 bytes a record of journal, and the facts of the
#: three checks about a quarter of that again
RECORDS_PER_REQUEST = 38
BYTES_PER_RECORD = 82 * 1.25

_CHECK = (
    "import os, resource, time\n"
    "from replay.fleet import check_runs\n"
    "from replay.runs import group\n"
    "runs = group(sys.argv[1].split(os.pathsep))\n"
    "first = int(sys.argv[4])\n"
    "runs = dict(list(runs.items())[:first]) if first else runs\n"
    "t = time.perf_counter()\n"
    "vs = check_runs(runs, sys.argv[2], workers=int(sys.argv[3]))\n"
    "s = time.perf_counter() - t\n"
    "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
    "out = {'seconds': s, 'records': sum(v.events for v in vs), 'runs': len(vs),\n"
    "       'worker_peak_mb': kids}"
)
# what fleet-check's report does: the join counted and its first rows, in DuckDB
_JOIN = (
    "import glob, time\n"
    "from replay.fleet import cross_run_summary\n"
    "t = time.perf_counter()\n"
    "found = cross_run_summary(sorted(glob.glob(sys.argv[1] + '/*.parquet')), 20)\n"
    "out = {'seconds': time.perf_counter() - t, 'rows': found.total}"
)


def _make_store(folder: str, engines: int, requests: int) -> None:
    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.shared_store import simulate_fleet

    config = SimConfig(requests=requests, blocks=32, seed=5)
    # bulk: the same journals as a run checked while it runs, made faster
    simulate_fleet(config, folder, engines=engines, legacy_engines=1, shared_store=True, bulk=True)


def make_fleet(folder: str, runs: int, requests: int) -> list[str]:
    """``runs`` engines of ``requests`` requests each, as one shared-store
    fleet per core (their folders, returned), made in parallel."""
    stores = max(1, min(os.cpu_count() or 1, runs // 2))
    sizes = [runs // stores + (i < runs % stores) for i in range(stores)]
    folders = [os.path.join(folder, f"store-{i + 1}") for i in range(stores)]
    for f in folders:
        os.makedirs(f)
    spawn = multiprocessing.get_context("spawn")  # not a fork of the runner's heap
    with ProcessPoolExecutor(max_workers=stores, mp_context=spawn) as pool:
        for done in [
            pool.submit(_make_store, f, n, requests) for f, n in zip(folders, sizes, strict=True)
        ]:
            done.result()
    return folders


def fitting(requests: int, runs: int, folder: str) -> int:
    """``requests``, or fewer: as many as this disk holds twice over (the
    journals, and the facts of three checks)."""
    free = shutil.disk_usage(folder).free
    need = runs * requests * RECORDS_PER_REQUEST * BYTES_PER_RECORD
    return requests if 2 * need <= free else max(1, int(free / 2 / need * requests))


def measure(child: Any, runs: int, requests: int) -> list[dict[str, Any]]:
    """``child(code, *args)`` runs code in a fresh interpreter (the runner's).

    One fleet, checked with 1 and 2 workers, and its first quarter with 2
    (peak memory per worker against the fleet's size): ``[quarter, whole]``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        asked, requests = requests, fitting(requests, runs, tmp)
        folder = os.path.join(tmp, "fleet")
        t = time.perf_counter()
        folders = make_fleet(folder, runs, requests)
        made = time.perf_counter() - t
        paths = os.pathsep.join(folders)

        def check(workers: int, first: int) -> dict[str, Any]:
            facts = os.path.join(tmp, f"facts-{workers}-{first}")
            # no deadline of an hour: a loaded machine takes longer, and is no error
            got = child(_CHECK, paths, facts, str(workers), str(first), timeout=6 * 3600)
            # one worker checks in its own process: that process is the worker
            peak = got["peak_mb"] if workers == 1 else got["worker_peak_mb"]
            return {
                "workers": workers,
                "runs": got["runs"],
                "seconds": got["seconds"],
                "records": got["records"],
                "rate": got["records"] / got["seconds"],
                "worker_peak_mb": peak,
                "facts": facts,
            }

        quarter = max(2, runs // 4)
        points = [check(1, 0), check(2, 0)]
        small = check(2, quarter)
        join = child(_JOIN, points[-1]["facts"], timeout=6 * 3600)
        disk = sum(
            os.path.getsize(os.path.join(f, name))
            for f in folders
            for name in os.listdir(f)
            if name.endswith(".db")
        )
    for p in (*points, small):
        del p["facts"]
    whole = {
        "runs": runs,
        "requests": requests,
        "requests_asked": asked,
        "stores": len(folders),
        "make_seconds": made,
        "points": points,
        "join": join,
        "journal_bytes": disk,
    }
    return [{"runs": small["runs"], "points": [small]}, whole]


def extrapolate(fleet: dict[str, Any]) -> dict[str, float]:
    """The measured fleet's hours on one worker, and the second worker's
    efficiency (its speedup over one, halved), which W workers are assumed to
    keep: a straight line, said so wherever it is shown."""
    one, *more = fleet["points"]
    speedup = more[-1]["rate"] / one["rate"] if more else 1.0
    return {
        "records": one["records"],
        "hours_one_worker": one["seconds"] / 3600,
        "efficiency": speedup / 2 if more else 1.0,
    }


def summary(fleets: list[dict[str, Any]]) -> tuple[float, str]:
    """The row's records/s with 2 workers, and its note."""
    small, big = fleets
    one, two = big["points"]
    line = extrapolate(big)
    fit = (
        ""
        if big["requests"] == big["requests_asked"]
        else f" (of {big['requests_asked']:,} asked: what this disk holds)"
    )
    note = (
        f"{big['runs']:,} runs of {big['requests']:,} requests{fit}, {one['records']:,} "
        f"records, {big['journal_bytes'] / 1e9:.1f} GB: {one['seconds']:.0f} s on 1 worker, "
        f"{two['seconds']:.0f} s on 2; peak per worker {two['worker_peak_mb']:.0f} MB "
        f"({small['points'][0]['worker_peak_mb']:.0f} MB at {small['runs']} runs); "
        f"the DuckDB join {big['join']['seconds']:.1f} s, {big['join']['peak_mb']:.0f} MB; "
        f"extrapolated in a straight line: "
        f"{line['hours_one_worker'] * 3600 / (64 * line['efficiency']):.0f} s on 64 workers at "
        f"the second worker's efficiency ({line['efficiency']:.2f})"
    )
    return float(two["rate"]), note
