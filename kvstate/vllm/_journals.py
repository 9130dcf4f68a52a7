"""Where an observed vLLM process writes its journals.

Each process (and each role in it) writes its own database, so no two
processes ever share a SQLite writer; ``kvstate replay DIR/*.db`` merges them
by their monotonic timestamps, which one host's processes share. The folder
comes from, in order: ``install(journal_dir=...)``, the connector's
``kv_connector_extra_config["kvstate_journal_dir"]``, the environment
variable ``KVSTATE_VLLM_JOURNAL_DIR``, else ``./kvstate-journals``. Every
journal's header names its run (:func:`run_name`) and its role, so replay
merges one engine's journals and refuses another engine's.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from journal import segments
from kvstate.figures import metrics_address
from kvstate.recorder import Recorder

ENV = "KVSTATE_VLLM_JOURNAL_DIR"
EXTRA_KEY = "kvstate_journal_dir"
RUN_KEY = "kvstate_run"
DEFAULT = "kvstate-journals"

#: set by ``install(journal_dir=...)``; wins over every other source
chosen_dir: Path | None = None


def journal_dir(vllm_config: Any = None) -> Path:
    if chosen_dir is not None:
        return chosen_dir
    extra: dict[str, Any] = {}
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is not None:
        extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    found = extra.get(EXTRA_KEY) or os.environ.get(ENV) or DEFAULT
    return Path(found)


#: ``kv_connector_extra_config`` keys: rotate each journal into segments at
#: this many bytes, or after this many seconds (journal.segments)
ROTATE_BYTES, ROTATE_SECONDS = "kvstate_rotate_bytes", "kvstate_rotate_seconds"
#: ``kv_connector_extra_config`` keys: keep each rotated journal within this
#: many bytes, or this many seconds, removing its oldest segments (journal.retention)
RETAIN_BYTES, RETAIN_SECONDS = "kvstate_retain_bytes", "kvstate_retain_seconds"
#: what the extra config asks for: rotation's bytes and seconds, retention's bytes and seconds
Rotation = tuple["int | None", "float | None", "int | None", "float | None"]
NO_ROTATION: Rotation = (None, None, None, None)


def rotation_of(vllm_config: Any = None) -> Rotation:
    """The rotation and retention the connector's extra config asks for:
    (rotate bytes, rotate seconds, retain bytes, retain seconds).

    A value that is not a positive number is refused with a ``ValueError``
    naming the key: no journal is opened, and the error is the process's
    (``kvstate.vllm.finish`` reports it; nothing is raised into vLLM).
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer else {}
    if not isinstance(extra, dict):
        return NO_ROTATION
    out: list[float | None] = []
    for key in (ROTATE_BYTES, ROTATE_SECONDS, RETAIN_BYTES, RETAIN_SECONDS):
        value = extra.get(key)
        if value is not None and (type(value) not in (int, float) or value <= 0):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a positive number")
        out.append(value)
    size, age, keep_size, keep_age = out
    return (
        None if size is None else int(size),
        None if age is None else float(age),
        None if keep_size is None else int(keep_size),
        None if keep_age is None else float(keep_age),
    )


#: ``kv_connector_extra_config`` key: ``HOST:PORT`` where the scheduler's
#: journal's writer process serves its figures on ``/metrics`` (docs/ops.md)
METRICS_KEY = "kvstate_metrics"


def metrics_of(vllm_config: Any = None) -> str | None:
    """The ``/metrics`` address the connector's extra config asks for (None: none).

    One address serves one recorder, so the scheduler's journal serves it
    and the workers' journals serve nothing (:func:`open_journal`). A value
    that is not ``HOST:PORT`` is refused as :func:`rotation_of` refuses its
    values: a ``ValueError`` naming the key, and no journal is opened.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer else {}
    value = extra.get(METRICS_KEY) if isinstance(extra, dict) else None
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError(f"not {value!r}")
        metrics_address(value)
    except ValueError as exc:
        raise ValueError(
            f"kv_connector_extra_config[{METRICS_KEY!r}] must be HOST:PORT "
            f"(for example 127.0.0.1:9464): {exc}"
        ) from None
    return value


#: the run name when vLLM's config gives none: one per process (a worker in
#: the engine's own process, the uniprocess executor, shares it), renewed by
#: :func:`new_fallback_run` when finish() ends the process's journals
_fallback = {"run": uuid.uuid4().hex}
#: config object id -> (the config, kept so its id is not reused; its run)
_unnamed: dict[int, tuple[Any, str]] = {}
#: (run, journal name) -> journals of it this process opened
_opened: dict[tuple[str, str], int] = {}


def new_fallback_run() -> None:
    """Journals opened from now on belong to a new run.

    Without it, a process that finishes and installs again (vLLM's unit tests
    under a journal folder per test) would name every folder's journals one
    run, and ``kvstate replay`` would merge unrelated tests into one fold.
    """
    _fallback["run"] = uuid.uuid4().hex
    _unnamed.clear()


def run_name(vllm_config: Any = None) -> str:
    """The run every process of one engine shares in its journals' headers.

    ``kv_connector_extra_config["kvstate_run"]`` when an operator names it
    (a fleet's runs by host and start, say); else vLLM's ``instance_id``,
    which the engine sets once and hands to every process it starts. A
    config that names neither (a unit test's) is a run of its own within the
    process's: the scheduler and the worker a test builds from one config
    share it, and another test's connectors, in the same process and the
    same folder, are never merged with them.
    """
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer else {}
    named = extra.get(RUN_KEY) if isinstance(extra, dict) else None
    if isinstance(named, str) and named:
        return named
    instance = getattr(vllm_config, "instance_id", "")
    if isinstance(instance, str) and instance:
        return f"vllm-{instance}"
    if vllm_config is None:
        return _fallback["run"]
    # a unit test's mocked config: the process's run, one per config object
    _, run = _unnamed.setdefault(
        id(vllm_config), (vllm_config, f"{_fallback['run']}-c{len(_unnamed) + 1}")
    )
    return run


def open_journal(
    folder: Path,
    role: str,
    *,
    block_size: int,
    world_size: int,
    engine: str,
    run: str,
    protocol: str | None = None,
    rotation: Rotation = NO_ROTATION,
    metrics: str | None = None,
    family: str | None = None,
) -> Recorder:
    """A new journal ``folder/{role}-{pid}.db`` (``-2``, ``-3``, ... when a
    connector of this process already wrote one); an existing file is never reused.

    Written by a writer process (:class:`kvstate.process_writer.ProcessWriter`): each group
    commit is one blob written to a pipe, by kvstate's commit thread
    (:mod:`kvstate.vllm._commit`), so SQLite, the hash chain and the audit
    never hold vLLM's GIL, and the encoding is not on vLLM's thread. A
    scheduler's journal is audited there as it is written (the fold of a
    scheduler that cannot see the ranks' records); a rank's journal names
    jobs whose specs it never writes, so ``kvstate replay`` of the merged
    journals judges it. If vLLM's process is killed, the writer still writes
    every commit it was handed and ends the journal with ``engine_crashed``.

    A connector of another protocol (vLLM's OffloadingConnector: ``protocol``
    ``"offloading"``) writes ``offloading-{role}-{pid}.db`` under a run of
    its own, so a process that runs both connectors (vLLM's MultiConnector)
    has a journal per connector and replay judges each apart.

    ``metrics`` (``HOST:PORT``, :func:`metrics_of`) has a scheduler's
    journal serve its figures on ``/metrics`` from its writer process, which
    audits it; a worker's journal is not audited there and serves nothing.
    Where two scheduler journals ask for one address at once (a process
    running both connectors, engines sharing a host), the first serves it
    and the other's writer says on its stderr that it could not; both
    journals are written all the same.
    """
    folder.mkdir(parents=True, exist_ok=True)
    # A process may build several connectors (vLLM's tests do; so does an
    # engine restarted in-process): each gets a journal of its own.
    # A connector observed by the generic adapter (``family``: its class)
    # writes ``{family}-{role}-{pid}.db`` under a run of its own, as does one
    # of another protocol: each of a MultiConnector's children is judged apart.
    prefix = family or protocol
    name = role if prefix is None else f"{prefix}-{role}"
    if prefix is not None:
        run = f"{run}-{prefix}"
    # The n-th connector of one run in this process (an engine restarted
    # in-process, a test that builds two schedulers from one config) is a
    # run of its own: its scheduler and its ranks all get the n-th journal
    # of their role in that run.
    n = _opened[run, name] = _opened.get((run, name), 0) + 1
    if n > 1:
        run = f"{run}-{n}"
    path = folder / f"{name}-{os.getpid()}.db"
    k = 1
    while path.exists() or segments.later_segments(str(path)):  # a journal's head may be gone
        k += 1
        path = folder / f"{name}-{os.getpid()}-{k}.db"
    scheduler = role == "scheduler"
    recorder = Recorder.open(
        path,
        block_size=block_size,
        world_size=world_size,
        policy="vllm",
        engine=engine,
        run=run,
        role=role,
        protocol=protocol,
        process=True,
        audit="commit" if scheduler else "off",
        # a first violation is said in vLLM's log, with vLLM's format and handlers
        logger=logging.getLogger("vllm.kvstate"),
        # what the audit found, readable at each step (vLLM's stats, kvstate.vllm._stats)
        live_counts=scheduler,
        # one address per recorder: the scheduler's, whose writer process audits it
        metrics=metrics if scheduler else None,
        rotate_bytes=rotation[0],
        rotate_seconds=rotation[1],
        retain_bytes=rotation[2],
        retain_seconds=rotation[3],
    )
    if scheduler:
        recorder.auditor.attach_scheduler()
    # The writer process starts with the journal, while vLLM builds its
    # engine: started at the first commit, its interpreter and imports (about
    # 0.3 s of CPU each) landed in the engine's first steps, on cores the
    # forward pass uses (the benchmark's journal on / off, docs/vllm.md).
    recorder.start_writer()
    return recorder
