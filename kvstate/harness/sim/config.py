"""What a simulator run is asked to do, and what it reports.

:class:`SimConfig` holds every knob of a run (``kvstate run``'s options),
:func:`workload` makes its requests from the seed, and :class:`Summary`
counts what the run did and what went wrong (:mod:`.runtime` runs it).
"""

from __future__ import annotations

import random

import attrs

from kvstate.harness.legacy import BEFORE_52372, POLICIES

from .batching import Request
from .faults import Faults


@attrs.frozen
class SimConfig:
    """Every knob of a run. The defaults are a preemption-heavy workload."""

    requests: int = 96
    prompt_len: int = 80
    output_len: int = 24
    shared_prefixes: int = 3
    prefix_share: float = 0.6
    followups: float = 0.4
    arrivals_per_step: int = 6
    blocks: int = 40
    block_size: int = 16
    block_bytes: int = 64
    world_size: int = 2
    token_budget: int = 256
    store_latency_ms: float = 3.0
    #: puts that fail (TRANSFER_FAIL); the same as the ``put-fail`` fault
    failure_rate: float = 0.0
    #: injected faults (``kvstate run --faults``, see :mod:`kvstate.harness.sim.faults`)
    faults: Faults = attrs.Factory(Faults)
    abort_rate: float = 0.0
    store_capacity_bytes: int | None = None
    save_decode_cache: bool = False
    kv_role: str = "kv_producer"
    step_ms: float = 1.0
    seed: int = 0
    policy: str = "kvstate"
    #: the old behaviours the legacy policy runs with (see kvstate.harness.legacy.BUGS)
    legacy_bugs: tuple[str, ...] = tuple(sorted(BEFORE_52372))
    mode: str = "deterministic"
    model: str = "sim-model"
    #: stop after this many engine steps (None: run until idle). A run that
    #: stops here never records engine_idle: its end-of-run checks did not run.
    max_steps: int | None = None
    #: stop as stalled after this many steps in a row without progress (no
    #: token computed, no job reported, no request finished)
    stall_steps: int = 5000

    def __attrs_post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r} (kvstate or legacy)")
        if self.mode not in ("deterministic", "threaded"):
            raise ValueError(f"unknown mode {self.mode!r} (deterministic or threaded)")
        for name in ("blocks", "block_size", "block_bytes", "world_size", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1")
        for name in ("requests", "prompt_len", "output_len", "arrivals_per_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must not be negative")
        if self.prompt_len < 1 or self.arrivals_per_step < 1:
            raise ValueError("prompt-len and arrivals-per-step must be at least 1")
        if self.store_latency_ms < 0:
            raise ValueError("store-latency must not be negative")
        for name in ("failure_rate", "abort_rate", "prefix_share", "followups"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name.replace('_', '-')} must be between 0 and 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max-steps must be at least 1")
        if self.stall_steps < 1:
            raise ValueError("stall-steps must be at least 1")

    @property
    def effective_faults(self) -> Faults:
        """The faults to inject, with ``failure_rate`` folded into ``put-fail``."""
        if self.failure_rate > self.faults.put_fail:
            return attrs.evolve(self.faults, put_fail=self.failure_rate)
        return self.faults


@attrs.define
class Summary:
    """What a run did and what went wrong, counted from the engine and the audit."""

    policy: str
    mode: str
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    store_jobs: int = 0
    preemptions: int = 0
    bytes_moved: int = 0
    elapsed_s: float = 0.0
    keys_stored: int = 0
    poisoned_keys: int = 0
    wrong_kv_requests: int = 0
    loads: int = 0
    crashes: int = 0
    leaked_pins: int = 0
    violations: dict[str, int] = attrs.Factory(dict)
    journal: str | None = None
    #: requests refused at admission (they never fit the pool)
    rejected: int = 0
    #: keys the store no longer had when read back (evicted or unreadable)
    keys_missing: int = 0
    #: why the run ended without engine_idle: max-steps, stalled, crashed
    stopped: str | None = None
    #: the error that crashed the run, if one did
    error: str | None = None
    #: the request the first violation names (the one worth a timeline)
    first_violation_req: str | None = None

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_moved / 1e6 / self.elapsed_s if self.elapsed_s else 0.0


def workload(config: SimConfig) -> list[Request]:
    """Requests whose prompts share prefixes, so store keys repeat across them.

    Most prompts start with one of a few shared prefixes (a system prompt);
    a ``followups`` fraction continue an earlier request's prompt (the next
    turn of a conversation), which is when a store hit on an earlier
    request's keys matters most.
    """
    rng = random.Random(config.seed)
    length = config.prompt_len
    prefixes = [
        [rng.randrange(32000) for _ in range(length)] for _ in range(max(config.shared_prefixes, 1))
    ]
    shared = int(length * config.prefix_share)
    tail = min(config.block_size, length // 4)
    out: list[Request] = []
    for i in range(config.requests):
        earlier = i - 2 * config.arrivals_per_step
        if earlier > 0 and rng.random() < config.followups:
            base = out[rng.randrange(earlier)].prompt
            prompt = base[: length - tail] + [rng.randrange(32000) for _ in range(tail)]
        else:
            fresh = [rng.randrange(32000) for _ in range(length - shared)]
            prompt = rng.choice(prefixes)[:shared] + fresh
        out.append(Request(f"req-{i}", prompt, config.output_len))
    return out
