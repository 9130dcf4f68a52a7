"""The simulator end to end: on a preemption-heavy workload the legacy policy
poisons keys and makes requests read wrong KV; the fixed policy shows none
and its journal replays clean, in deterministic and threaded modes; a seed
gives the same journal byte for byte."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.runtime import Simulation, simulate
from replay import replay
from replay.cli import main


@pytest.mark.parametrize("seed", range(6))
def test_legacy_poisons_and_fixed_is_clean_deterministic(seed: int) -> None:
    legacy = simulate(SimConfig(policy="legacy", seed=seed))
    fixed = simulate(SimConfig(policy="kvstate", seed=seed))
    assert legacy.preemptions > 0 and fixed.preemptions > 0
    assert legacy.poisoned_keys > 0 and legacy.wrong_kv_requests > 0
    assert {"POISONED_READ", "POISONED_KEY", "WRONG_KV_LOADED"} <= set(legacy.violations)
    assert (fixed.poisoned_keys, fixed.wrong_kv_requests, fixed.crashes) == (0, 0, 0)
    assert fixed.violations == {} and fixed.finished == fixed.requests
    assert fixed.loads > 0  # the store was really read back by later requests


@pytest.mark.parametrize("seed", range(2))
def test_threaded_mode(seed: int) -> None:
    fixed = simulate(SimConfig(policy="kvstate", seed=seed, mode="threaded"))
    assert fixed.violations == {} and fixed.poisoned_keys == 0 and fixed.finished == 96
    legacy = simulate(SimConfig(policy="legacy", seed=seed, mode="threaded"))
    assert legacy.poisoned_keys > 0 and "POISONED_READ" in legacy.violations


def jsonl_of(tmp_path: Path, name: str, config: SimConfig) -> str:
    db, out = tmp_path / f"{name}.db", tmp_path / f"{name}.jsonl"
    sim = Simulation(config, journal=db)
    sim.run()
    sim.close()
    assert main(["convert", str(db), str(out)]) == 0
    return out.read_text()


def test_deterministic_runs_repeat_byte_for_byte(tmp_path: Path) -> None:
    config = SimConfig(policy="legacy", seed=3, requests=40)
    a = jsonl_of(tmp_path, "a", config)
    b = jsonl_of(tmp_path, "b", config)
    assert a == b and len(a.splitlines()) > 1000
    c = jsonl_of(tmp_path, "c", SimConfig(policy="legacy", seed=4, requests=40))
    assert c != a


def test_decode_saves_and_failures_and_aborts_stay_clean() -> None:
    config = SimConfig(
        seed=1, save_decode_cache=True, failure_rate=0.1, abort_rate=0.002, requests=64
    )
    summary = simulate(config)
    assert summary.violations == {}
    assert summary.aborted > 0 and summary.poisoned_keys == 0


def test_a_full_store_is_survived() -> None:
    summary = simulate(SimConfig(seed=2, requests=48, store_capacity_bytes=64 * 40))
    assert summary.violations == {} and summary.keys_stored <= 40


def test_run_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fixed, legacy = tmp_path / "fixed.db", tmp_path / "legacy.db"
    assert main(["run", "--requests", "48", "--journal", str(fixed)]) == 0
    out = capsys.readouterr().out
    assert "requests that read wrong KV" in out and "verdict: clean" in out
    assert main(["run", "--requests", "96", "--policy", "legacy", "--journal", str(legacy)]) == 1
    assert "POISONED_READ" in capsys.readouterr().out
    assert main(["replay", "--json", str(legacy)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {v["code"] for v in report["violations"]} >= {"POISONED_READ", "POISONED_KEY"}
    assert main(["run", "--journal", str(fixed)]) == 2  # refuses to overwrite
    assert "already exists" in capsys.readouterr().err


def test_a_journaled_run_keeps_no_history_and_counts_what_replay_finds(tmp_path: Path) -> None:
    """With a journal the simulator keeps no entry in memory (a run of any
    length holds what is live): its summary folds the journal back from
    disk, and counts exactly what replay of that journal finds. Without a
    journal it keeps them, and counts the same."""
    from collections import Counter

    from replay import replay

    config = SimConfig(policy="legacy", seed=2, requests=48)
    db = tmp_path / "run.db"
    sim = Simulation(config, journal=db)
    try:
        summary = sim.run()
        assert sim.recorder.entries is None
    finally:
        sim.close()
    found = Counter(v.code.value for v in replay([str(db)]).violations if not v.is_warning)
    assert summary.violations == dict(sorted(found.items())) and found["POISONED_READ"] > 0
    assert simulate(config).violations == summary.violations


def test_ctrl_c_while_jobs_are_abandoned_leaves_no_job_to_report_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C can land while the run's end abandons its suspended jobs (in
    the flush of one job's report); the jobs not yet closed must still
    report before the journal closes. Left suspended, a job generator was
    finalized by the garbage collector after ``close()``: its report hit the
    closed journal and ``kvstate run`` printed a traceback after "interrupted"."""
    journal = tmp_path / "run.db"
    sim = Simulation(SimConfig(requests=400), journal=journal)
    suspended = []

    def interrupt_with_both_ranks_in_a_store_call(_summary: object) -> None:
        if sum(gen is not None for gen, _at in sim._ranks_left) == sim.config.world_size:
            suspended.extend(gen for gen, _at in sim._ranks_left)
            real = sim.recorder.flush_before_raising

            def interrupted_once() -> None:  # the first abandoned job's flush
                monkeypatch.setattr(sim.recorder, "flush_before_raising", real)
                raise KeyboardInterrupt

            monkeypatch.setattr(sim.recorder, "flush_before_raising", interrupted_once)
            raise RuntimeError("stop")  # a crash: the run's end abandons both jobs

    with pytest.raises(KeyboardInterrupt):
        try:
            sim.run(interrupt_with_both_ranks_in_a_store_call)
        finally:
            sim.close()
    assert len(suspended) == 2
    assert all(gen.gi_frame is None for gen in suspended)  # both ran to their end
    assert replay([str(journal)]).unfinished
    with sqlite3.connect(journal) as db:
        kinds = [kind for (kind,) in db.execute("SELECT kind FROM records")]
    assert kinds.count("job_started") and kinds.count("job_reported") >= kinds.count("job_started")
