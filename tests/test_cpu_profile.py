"""The real-vLLM benchmark row's attribution: kvstate's CPU apart from vLLM's."""

from __future__ import annotations

import gc
import threading

from kvstate.harness.vllm_engine.cpu_profile import Attribution, summary


def burn(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def test_nested_calls_are_charged_to_the_innermost_category() -> None:
    prof = Attribution()
    inner = prof.wrap("vllm", burn)

    def patch(n: int) -> int:  # kvstate's patch around vLLM's method
        return burn(n) + inner(n)

    outer = prof.wrap("kvstate", patch)
    for _ in range(20):
        outer(20_000)
    mine = prof.on_thread(threading.current_thread().name)
    share = mine["kvstate"] / (mine["kvstate"] + mine["vllm"])
    assert 0.3 < share < 0.7, mine  # the same work on each side
    assert prof.calls[("kvstate", threading.current_thread().name)] == 20
    assert prof.nested[("kvstate", threading.current_thread().name)] == 20


def test_calibration_takes_the_wrappers_own_cost_out() -> None:
    prof = Attribution()
    prof.calibrate(rounds=2000)
    assert prof.own_ns > 0

    def empty() -> None:
        return None

    wrapped = prof.wrap("kvstate", empty)
    for _ in range(2000):
        wrapped()
    thread = threading.current_thread().name
    raw = prof.ns[("kvstate", thread)] / 2000
    corrected = prof.on_thread(thread)["kvstate"] / 2000
    assert corrected < raw / 2  # an empty function costs (close to) nothing once corrected


class Scheduler:
    """Named like vLLM's: its ``schedule`` calls count the engine steps."""

    def schedule(self) -> int:
        return burn(2_000)


def test_warm_up_steps_are_not_counted_and_patches_come_off() -> None:
    original = Scheduler.__dict__["schedule"]
    prof = Attribution(warmup=2)
    prof.patch(Scheduler, "schedule", "vllm")
    sched = Scheduler()
    for _ in range(2):
        sched.schedule()
    assert prof.ns  # the warm-up was measured...
    sched.schedule()  # ...and forgotten when the first counted step began
    got = summary(prof)
    assert got["steps"] == 1 and got["warmup_steps"] == 2
    assert got["vllm_us_per_step"] > 0 and got["kvstate_us_per_step"] == 0
    prof.restore()
    assert Scheduler.__dict__["schedule"] is original


def test_the_wrappers_cost_is_sampled_in_the_run_at_each_counted_step() -> None:
    """Not only in a warm loop before it: between two stretches of engine work
    a wrapper costs more, and the correction must be that figure."""
    prof = Attribution(warmup=1)
    prof.patch(Scheduler, "schedule", "vllm")
    try:
        sched = Scheduler()
        sched.schedule()  # the warm-up step takes no sample
        assert prof.own_ns == 0.0
        for _ in range(3):
            sched.schedule()
        assert prof.own_ns > 0.0  # the run's own samples
        got = summary(prof)
        assert got["steps"] == 3 and got["wrapper_ns"] > 0
    finally:
        prof.restore()


def test_a_collection_is_charged_to_gc_not_to_the_call_it_fell_in() -> None:
    prof = Attribution()
    cycles: list[list[object]] = [[] for _ in range(100_000)]
    for cell in cycles:
        cell.append(cell)  # garbage only a collection frees

    def call() -> None:
        cycles.clear()
        gc.collect()

    wrapped = prof.wrap("kvstate", call)
    gc.callbacks.append(prof.collecting)
    try:
        wrapped()
    finally:
        gc.callbacks.remove(prof.collecting)
    mine = prof.on_thread(threading.current_thread().name)
    assert mine["gc"] > 10 * mine["kvstate"], mine
