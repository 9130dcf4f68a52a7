"""Running the real vLLM engine for the demo and the benchmarks: one engine per run.

Each engine runs in its release's venv (:mod:`kvstate.harness.vllm_engine.venvs`)
as a subprocess (:mod:`kvstate.harness.vllm_engine.in_venv`), against a Mooncake
master whose client configuration :func:`store_env` writes. What the runs
mean (journals merged, replayed, outputs compared with the reference) is
the command line's: ``replay/cli/harness/_vllm_runs.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import attrs

from kvstate.harness.live.master import MasterAddress
from kvstate.harness.vllm_engine.watchdog import wait

#: release -> the name of its journal in OUT
NAMES = {"0.27.1": "legacy", "0.32.0": "fixed"}


@attrs.define
class Workload:
    """The demo's knobs; the defaults poison the most in a run of a few minutes."""

    prompts: int = 96
    groups: int = 8
    blocks: int = 32
    max_seqs: int = 8
    max_tokens: int = 64
    #: seconds each put on the sending thread is delayed (the race's window)
    put_delay: float = 0.1
    seed: int = 0
    #: tensor-parallel ranks, each a worker process of vLLM's multiprocessing
    #: executor journaling on its own
    tp: int = 1
    #: seconds with no progress (no step with output, no put) after which a run
    #: is ended by its watchdog, however long it took (the journal says so)
    watchdog: float = 120.0

    def engine_config(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "groups": self.groups,
            "blocks": self.blocks,
            "max_seqs": self.max_seqs,
            "max_tokens": self.max_tokens,
            "put_delay": self.put_delay,
            "seed": self.seed,
            "tp": self.tp,
            "watchdog": self.watchdog,
        }


class DemoError(RuntimeError):
    """A run could not be made; the message says which and where its log is."""


@attrs.define
class Engine:
    """One engine run (:mod:`kvstate.harness.vllm_engine.in_venv`) in progress: its
    process and its files (config, result, heartbeat and log, named after the
    run, in the work folder)."""

    name: str
    process: subprocess.Popen[bytes]
    out: Path
    log: Path
    beat: Path
    #: the release file of a run that holds its store segment (see :meth:`release`)
    hold: Path | None
    stall_s: float

    def result(self) -> dict[str, Any]:
        """Wait for the run to end; its result.

        However long the run takes, it is waited for while its heartbeat or
        its log changes; one that shows neither for ``stall_s`` seconds
        (frozen, so its own watchdog could not end it) is killed. A run that
        leaves no result raises :class:`DemoError` with the log's tail.
        """
        status = wait(self.process, self.stall_s, self.beat, self.log)
        return self._read(status)

    def holding(self) -> dict[str, Any]:
        """Wait until a holding run has done its work (its result is written)
        while it keeps its store segment mounted; its result."""
        status = wait(self.process, self.stall_s, self.beat, self.log, until=self.out.exists)
        return self._read(status)

    def release(self) -> dict[str, Any]:
        """Let a holding run end (its segment goes with it); its result."""
        if self.hold is not None:
            self.hold.touch()
        return self.result()

    def _read(self, status: int | None) -> dict[str, Any]:
        if status is None:
            raise DemoError(
                f"{self.name}: the engine showed no progress and wrote nothing for "
                f"{self.stall_s:g} s; killed (log: {self.log})"
            )
        if not self.out.exists():
            tail = self.log.read_text(errors="replace").splitlines()[-15:]
            raise DemoError(
                f"{self.name}: the engine exited {status} without a result:\n" + "\n".join(tail)
            )
        return dict(json.loads(self.out.read_text()))


def start_engine(
    python: Path,
    config: dict[str, Any],
    workdir: Path,
    name: str,
    env: dict[str, str],
    stall_s: float,
    *,
    hold: bool = False,
    module: str = "kvstate.harness.vllm_engine.in_venv",
) -> Engine:
    """Start one engine run in ``python``'s venv (``module``: the engine side that
    reads the config, one of a P/D pair's engines for instance). With ``hold`` the engine,
    its work done and its result written, keeps running (and its Mooncake
    segment mounted: a segment's keys leave with the process that mounted
    it) until :meth:`Engine.release`."""
    cfg_path = workdir / f"{name}.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    beat_path = workdir / f"{name}.progress"
    hold_path = workdir / f"{name}.release" if hold else None
    extra = {"hold": str(hold_path)} if hold_path is not None else {}
    cfg_path.write_text(
        json.dumps({**config, **extra, "out": str(out_path), "heartbeat": str(beat_path)})
    )
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [str(python), "-m", module, str(cfg_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return Engine(name, child, out_path, log_path, beat_path, hold_path, stall_s)


def run_engine(
    python: Path,
    config: dict[str, Any],
    workdir: Path,
    name: str,
    env: dict[str, str],
    stall_s: float,
) -> dict[str, Any]:
    """One engine run, waited for (see :meth:`Engine.result`); its result."""
    return start_engine(python, config, workdir, name, env, stall_s).result()


def store_env(address: MasterAddress, path: Path, segment: str = "512MB") -> dict[str, str]:
    """Write the client configuration vLLM's connector reads; returns the variable naming it."""
    path.write_text(
        json.dumps(
            {
                "metadata_server": address.metadata_url,
                "master_server_address": address.rpc_address,
                "protocol": "tcp",
                "device_name": "",
                "global_segment_size": segment,
                "local_buffer_size": "64MB",
            }
        )
    )
    return {"MOONCAKE_CONFIG_PATH": str(path)}
