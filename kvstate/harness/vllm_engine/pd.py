"""A prefill/decode pair of engines, started together and waited for (see :mod:`.pd_engine`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from kvstate.harness.vllm_engine.engine_run import start_engine

#: the pair's engines, in the order they are started (the decode's result is read first)
ROLES = ("prefill", "decode")
ENGINE = "kvstate.harness.vllm_engine.pd_engine"


def run_pair(
    python: Path,
    config: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    stall_s: float,
    *,
    run: str,
    prefill: dict[str, Any] | None = None,
    decode: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start the prefill and the decode engine of ``run`` at once (as a proxy runs
    them) with ``config``, each one's updated with ``prefill`` or ``decode``;
    each one's result.

    Each journals under ``workdir/{role}-journals`` when ``config["mode"]`` is
    ``journal``. The decode is waited for first: the prefill ends once the
    decode has its outputs and every held block is free.
    """
    started = {}
    # the prefill's bootstrap server: a free port, so that two pairs never meet
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        for role in ROLES:
            cfg = {**config, "role": role, "run": run, "work": str(workdir),
                   "journal_dir": str(workdir / f"{role}-journals"),
                   "bootstrap_port": port}  # fmt: skip
            cfg.update((prefill if role == "prefill" else decode) or {})
            started[role] = start_engine(python, cfg, workdir, role, env, stall_s, module=ENGINE)
        done = {"decode": started["decode"].result()}
        done["prefill"] = started["prefill"].result()
    finally:
        for engine in started.values():  # one that failed leaves no engine behind
            if engine.process.poll() is None:
                engine.process.kill()
                engine.process.wait()
    return done
