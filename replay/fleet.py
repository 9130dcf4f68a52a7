"""A fleet's runs checked in parallel, and joined across runs with SQL.

Each run (its journals, grouped by :mod:`replay.runs`) is replayed on its own
worker, which writes the run's facts (:mod:`replay.facts`). Locally the
workers are a process pool sized to the machine; with Ray they are Ray tasks
on a cluster whose nodes see the same paths. Either way each run's verdict is
exactly its replay's. DuckDB then reads every facts file at once and finds
what no single run can show: keys poisoned in one run and loaded in another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import attrs

from journal import JournalError

from .facts import SOURCES_KEY, VERDICT_KEY, RunVerdict, sources_signature, write_facts


def facts_path(facts_dir: str, run: str) -> str:
    """Where a run's facts go: a readable, file-safe name, unique per run."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run)[:60]
    digest = hashlib.sha256(run.encode()).hexdigest()[:8]
    return os.path.join(facts_dir, f"{safe}-{digest}.parquet")


def _stored(out: str, paths: Sequence[str]) -> RunVerdict | None:
    """The verdict stored with an up-to-date facts file; None when there is
    none or it is stale. A file there that kvstate did not write is refused."""
    if not os.path.exists(out):
        return None
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(out).metadata or {}
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        meta = {}
    if SOURCES_KEY not in meta:
        raise JournalError(f"{out}: exists and is not a kvstate facts file; not replaced")
    if meta[SOURCES_KEY].decode() != sources_signature(paths) or VERDICT_KEY not in meta:
        return None
    return RunVerdict(**{**json.loads(meta[VERDICT_KEY]), "paths": tuple(paths), "facts": out})


def check_run(run: str, paths: Sequence[str], facts_dir: str) -> RunVerdict:
    """One worker's task: replay a run and write its facts (or reuse them)."""
    out = facts_path(facts_dir, run)
    try:
        stored = _stored(out, paths)
        if stored is not None:
            return stored
        return write_facts(run, paths, out, force=os.path.exists(out))
    except (JournalError, OSError) as exc:
        return RunVerdict(run, tuple(paths), 0, "unusable", 2, {}, False, error=str(exc))


T = TypeVar("T")


def _local(task: Callable[..., T], calls: list[tuple[Any, ...]], workers: int) -> list[T]:
    if workers <= 1 or len(calls) <= 1:
        return [task(*call) for call in calls]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(task, *call) for call in calls]
        return [f.result() for f in futures]


def _on_ray(task: Callable[..., T], calls: list[tuple[Any, ...]], address: str | None) -> list[T]:
    try:
        import ray
    except ImportError as exc:
        raise JournalError(
            "--ray needs Ray: pip install 'kvstate[ray]' (it is an optional extra)"
        ) from exc
    started = not ray.is_initialized()
    if started:
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    try:
        remote = ray.remote(task)
        return list(ray.get([remote.remote(*call) for call in calls]))
    finally:
        if started:
            ray.shutdown()


def map_runs(
    task: Callable[..., T],
    calls: list[tuple[Any, ...]],
    *,
    workers: int | None = None,
    ray_address: str | bool | None = False,
) -> list[T]:
    """``task(*call)`` for every call (one run each), in order, each on a worker.

    ``ray_address``: False runs a local process pool of ``workers`` (default:
    the machine's cores); None starts a local Ray instance; a string joins
    that Ray cluster. ``task`` must be a module-level function (it is pickled
    by name) and its results picklable.
    """
    if ray_address is not False:
        return _on_ray(task, calls, ray_address if isinstance(ray_address, str) else None)
    return _local(task, calls, workers or os.cpu_count() or 1)


def check_runs(
    runs: dict[str, list[str]],
    facts_dir: str,
    *,
    workers: int | None = None,
    ray_address: str | bool | None = False,
) -> list[RunVerdict]:
    """Every run's verdict and facts, in run order (see :func:`map_runs`)."""
    os.makedirs(facts_dir, exist_ok=True)
    calls = [(run, paths, facts_dir) for run, paths in runs.items()]
    return map_runs(check_run, calls, workers=workers, ray_address=ray_address)


#: wrong loads (the KV a request of one run loaded was not what it should
#: be) of keys poisoned in another run (they read back wrong there, or a job
#: whose device read was poisoned wrote them), with the writing job's enqueue
#: and poisoned read named in the writer's files. Only wrong loads: a key
#: name says nothing of which store held it, and a load that read the right
#: bytes came from a store the poisoned put never reached. A load the loader
#: could not judge (``key_loaded``: another engine wrote the key) counts
#: when its digest is the one the writer's audit read back as poisoned.
CROSS_RUN_SQL = """
WITH jobs AS (
    SELECT run, job, arg_min(file, seq) AS file, arg_min(file_seq, seq) AS file_seq,
           arg_min(req, seq) AS req
    FROM facts WHERE fact = 'key_written'
    GROUP BY run, job
),
poisoned AS (
    SELECT run, key, arg_min(job, seq) AS job,
           max(digest) FILTER (WHERE fact = 'key_verified') AS digest
    FROM facts
    WHERE (fact = 'key_written' AND verdict = 'poisoned_read')
       OR (fact = 'key_verified' AND NOT ok)
    GROUP BY run, key
),
read_poisoned AS (
    SELECT run, job, arg_min(file, seq) AS file, arg_min(file_seq, seq) AS file_seq FROM facts
    WHERE fact = 'violation' AND code = 'POISONED_READ'
    GROUP BY run, job
)
SELECT l.run AS loaded_run, l.file AS loaded_file, l.file_seq AS loaded_seq,
       l.req AS loaded_req, l.gen AS loaded_gen, l.key, l.ok AS load_ok,
       p.run AS written_run, j.file AS written_file, j.file_seq AS written_seq,
       p.job AS written_job, j.req AS written_req,
       r.file AS poisoned_read_file, r.file_seq AS poisoned_read_seq
FROM facts AS l
JOIN poisoned AS p ON p.key = l.key AND p.run <> l.run
LEFT JOIN jobs AS j ON j.run = p.run AND j.job = p.job
LEFT JOIN read_poisoned AS r ON r.run = p.run AND r.job = p.job
WHERE l.fact = 'key_loaded'
  -- judged by the loader, or (a key another engine wrote) the very bytes the
  -- writer's audit read back as poisoned
  AND (NOT l.ok OR (l.ok IS NULL AND l.digest = p.digest))
ORDER BY l.run, l.seq, p.run
"""


def connect(facts: Sequence[str]) -> Any:
    """A DuckDB connection with the view ``facts`` over the given Parquet files."""
    import duckdb

    # DuckDB draws a progress bar on stdout for a query over 2 s: on a fleet's
    # facts it lands inside --json and --sql output, so it is off.
    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    files = ", ".join("'" + f.replace("'", "''") + "'" for f in facts)
    con.execute(f"CREATE VIEW facts AS SELECT * FROM read_parquet([{files}], union_by_name=true)")
    return con


def iter_cross_run(facts: Sequence[str], batch: int = 10_000) -> Iterator[dict[str, Any]]:
    """Loads of keys poisoned in another run, with both runs' records named,
    in order, fetched ``batch`` rows at a time: a fleet's millions of rows
    never sit in Python's memory at once."""
    if not facts:
        return
    con = connect(facts)
    try:
        cursor = con.execute(CROSS_RUN_SQL)
        names = [d[0] for d in cursor.description]
        while rows := cursor.fetchmany(batch):
            for row in rows:
                yield dict(zip(names, row, strict=True))
    finally:
        con.close()


def cross_run(facts: Sequence[str]) -> list[dict[str, Any]]:
    """Every row of :func:`iter_cross_run`, in a list (a small fleet's)."""
    return list(iter_cross_run(facts))


@attrs.frozen
class CrossRun:
    """The cross-run join summed up in DuckDB: what a report prints."""

    #: wrong loads of keys poisoned in another run
    total: int
    #: loaded run -> the runs that poisoned what it loaded -> wrong loads
    sources: dict[str, dict[str, int]]
    #: the first rows of :func:`iter_cross_run`, in its order
    first: list[dict[str, Any]]


def cross_run_summary(facts: Sequence[str], limit: int) -> CrossRun:
    """The join's count per pair of runs, and its first ``limit`` rows.

    Two queries, each folded inside DuckDB (a count, and an ORDER BY with a
    LIMIT, which keeps only the top rows), so the report's memory does not
    grow with the number of wrong loads, and DuckDB writes no temporary
    table anywhere.
    """
    if not facts:
        return CrossRun(0, {}, [])
    con = connect(facts)
    try:
        pairs = con.execute(
            f"SELECT loaded_run, written_run, count(*) FROM ({CROSS_RUN_SQL}) "
            "GROUP BY loaded_run, written_run"
        ).fetchall()
        cursor = con.execute(f"{CROSS_RUN_SQL} LIMIT {int(limit)}")
        names = [d[0] for d in cursor.description]
        first = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    finally:
        con.close()
    sources: dict[str, dict[str, int]] = {}
    for loaded, written, n in sorted(pairs):
        sources.setdefault(loaded, {})[written] = n
    return CrossRun(sum(n for _, _, n in pairs), sources, first)
