"""A run's facts, for questions across runs: one Parquet file per run.

Replay judges one run. A fleet's incident asks across runs: which engine
first wrote the poisoned key these requests loaded, and who else read it.
Each run's replay emits rows of one table (``FACT_COLUMNS``), one ``fact``
kind per row:

* ``key_written``: a key of a ``job_enqueued``; ``verdict`` is
  ``poisoned_read`` when replay found the job's device read poisoned
  (``POISONED_READ``), else ``ok``; ``digest`` is the first ``dma_done``'s;
* ``key_verified``: a stored key read back after the run (``ok``; ``digest``
  is the fingerprint of the bytes read back, the ``actual``);
* ``key_loaded``: a request loaded a key (``ok``: it held what it should;
  null for a key another engine wrote, which this run cannot judge: then
  ``digest`` is the fingerprint of the bytes loaded);
* ``violation``: every finding, with its code, message and entities;
* ``request``: each incarnation's last scheduler record (``outcome``).

Every row names its ``run``, the ``file`` and ``file_seq`` it comes from and
its ``seq`` in the run's merged order. The file is written under a temporary
name and renamed, with the journals it was made from in its metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from journal import atomic_output, segments
from kvstate import events as ev
from kvstate.violations import Code

from .sources import open_stream
from .verdict import replay

FACT_COLUMNS = (
    ("run", "string"),
    ("fact", "string"),
    ("file", "string"),
    ("file_seq", "int64"),
    ("seq", "int64"),
    ("key", "string"),
    ("job", "int64"),
    ("req", "string"),
    ("gen", "int64"),
    ("rank", "int64"),
    ("ok", "bool_"),
    ("verdict", "string"),
    ("digest", "string"),
    ("code", "string"),
    ("outcome", "string"),
    ("message", "string"),
)
_BATCH = 65_536
#: Parquet metadata: the journals a facts file was made from, and the run's
#: verdict (so a fleet check does not replay an unchanged run again)
SOURCES_KEY = b"kvstate.sources"
VERDICT_KEY = b"kvstate.verdict"


@attrs.frozen
class RunVerdict:
    """One run's replay, as a fleet reports it (picklable: it crosses processes)."""

    run: str
    paths: tuple[str, ...]
    events: int
    verdict: str
    exit_status: int
    codes: dict[str, int]
    unfinished: bool
    facts: str | None = None
    error: str | None = None


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, kind)()) for name, kind in FACT_COLUMNS])


def sources_signature(paths: Sequence[str]) -> str:
    """The journals a facts file stands for: names, sizes and mtimes."""
    parts = []
    for path in paths:
        # a rotated journal is its segments (the first may have been removed)
        files = [p for p in (path, *segments.later_segments(path)) if os.path.exists(p)]
        for file in files:
            stat = os.stat(file)
            parts.append(f"{os.path.abspath(file)}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\n".join(parts)


def _rows(run: str, paths: Sequence[str], poisoned_jobs: set[int]) -> Iterator[dict[str, Any]]:
    stream, _ = open_stream(list(paths))
    digests: dict[int, str | None] = {}
    written: dict[int, list[dict[str, Any]]] = {}  # job -> its key rows, until dma_done
    outcome: dict[tuple[str, int], dict[str, Any]] = {}
    for item in stream:
        event, seq = item.entry.event, item.entry.seq
        where = {"run": run, "file": item.path, "file_seq": item.seq, "seq": seq}
        if isinstance(event, ev.JobEnqueued):
            verdict = "poisoned_read" if event.job in poisoned_jobs else "ok"
            rows = [
                {
                    **where,
                    "fact": "key_written",
                    "key": k,
                    "job": event.job,
                    "req": event.req,
                    "gen": event.gen,
                    "verdict": verdict,
                }
                for k in event.keys
            ]
            written[event.job] = rows
        elif isinstance(event, ev.DmaDone) and event.job not in digests:
            digests[event.job] = None if event.digest is None else str(event.digest)
            for row in written.pop(event.job, ()):
                yield {**row, "digest": digests[event.job]}
        elif isinstance(event, ev.KeyVerified):
            yield {
                **where,
                "fact": "key_verified",
                "key": event.key,
                "job": event.job,
                "ok": event.ok,
                "digest": None if event.actual is None else str(event.actual),
            }
        elif isinstance(event, (ev.LoadVerified, ev.KeyLoaded)):
            # Judged by the loader (``ok``), or another engine's key (``digest``).
            yield {
                **where,
                "fact": "key_loaded",
                "key": event.key,
                "req": event.req,
                "gen": event.gen,
                "job": getattr(event, "job", None),
                "ok": getattr(event, "ok", None),
                "digest": getattr(event, "digest", None),
            }
        elif isinstance(
            event, (ev.RequestAdmitted, ev.RequestResumed, ev.RequestPreempted, ev.RequestFinished)
        ):
            kind = event.kind
            if isinstance(event, ev.RequestFinished) and event.aborted:
                kind = "request_aborted"
            outcome[(event.req, event.gen)] = {
                **where,
                "fact": "request",
                "req": event.req,
                "gen": event.gen,
                "outcome": kind,
            }
    for rows in written.values():  # jobs whose DMA never finished: no digest
        yield from rows
    yield from outcome.values()


def write_facts(run: str, paths: Sequence[str], out: str, *, force: bool = False) -> RunVerdict:
    """Replay one run and write its facts to ``out`` (Parquet, atomically)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    result = replay(list(paths))
    findings = result.violations + result.warnings
    poisoned = {
        v.job for v in result.violations if v.code is Code.POISONED_READ and v.job is not None
    }
    verdict = RunVerdict(
        run,
        tuple(paths),
        result.events,
        result.verdict,
        result.exit_status,
        _count(v.code.value for v in result.violations),
        result.unfinished,
        facts=out,
    )
    stored = attrs.asdict(verdict, filter=lambda a, _: a.name not in ("paths", "facts"))
    schema = _schema().with_metadata(
        {
            SOURCES_KEY: sources_signature(paths).encode(),
            VERDICT_KEY: json.dumps(stored).encode(),
        }
    )

    def rows() -> Iterator[dict[str, Any]]:
        yield from _rows(run, paths, poisoned)
        origin = result.origin
        for v in findings:
            file, file_seq = origin.of(v.seq) if origin is not None else (paths[0], v.seq)
            yield {
                "run": run,
                "fact": "violation",
                "file": file,
                "file_seq": file_seq,
                "seq": v.seq,
                "key": v.key,
                "job": v.job,
                "req": v.req,
                "gen": v.gen,
                "rank": v.rank,
                "code": v.code.value,
                "message": v.message,
            }

    with atomic_output(out, force=force) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        # In batches: a run of any length holds one batch of rows at a time.
        batch: list[dict[str, Any]] = []
        for row in rows():
            batch.append(row)
            if len(batch) == _BATCH:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                batch = []
        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    return verdict


def _count(codes: Iterator[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for code in codes:
        out[code] = out.get(code, 0) + 1
    return out
