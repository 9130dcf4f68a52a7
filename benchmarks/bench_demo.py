"""What the ledgers cost the demo's workload, measured in one run.

``kvstate demo`` runs a preemption-heavy workload against a real Mooncake
store (torch block memory, a local master). A run of the same work without
the ledgers does not exist: the connector decides with them (which jobs are
live, when pins go back). So the throughput ratio is bounded from the run
itself. Every call into :class:`SchedulerLedger`, :class:`WorkerLedger` and
:class:`JobRun` is timed on the thread that makes it (outermost calls only;
the transfer inside ``with worker.run(job)`` is not a ledger call), and so is
the journal writer thread's work (but not twice: a batch written while
``begin_step`` waits for it is already in that call's time). Taking the
ledgers out could at best save all of that time::

    throughput(on) / throughput(off) >= 1 - (ledger calls + writer) / wall time

which bounds their cost from above (the writer's time counts in full,
though it may run while the engine waits on the store).

Run: ``python benchmarks/bench_demo.py [--requests N] [--store auto|mooncake|memory]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvstate import SchedulerLedger, WorkerLedger
from kvstate.harness.live.mooncake_demo import mooncake_problem, run_policy
from kvstate.harness.sim.config import SimConfig
from kvstate.thread_writer import JournalWriter
from kvstate.worker import JobRun

#: the calls a connector makes into the ledgers, besides their public methods:
#: a job's start (the liveness check) and its report (the one ``finally``)
_PRIVATE_CALLS = {JobRun: ("_start",), WorkerLedger: ("report",)}


class _Clock:
    """Seconds spent in the wrapped calls, per kind of thread."""

    def __init__(self) -> None:
        self.ledger = 0.0
        self.writer = 0.0
        #: writer batches written while an engine thread waited for them (that
        #: time is in ``ledger`` already, as the wait of ``begin_step``)
        self.writer_waited = 0.0
        self.calls = 0
        self.by_call: dict[str, float] = {}
        self._waiting = 0
        self._lock = threading.Lock()
        self._depth = threading.local()

    def timed(self, call: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            self._depth.n = depth + 1
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0:  # a call made from inside another is counted there
                    took = time.perf_counter() - start
                    with self._lock:
                        self.ledger += took
                        self.calls += 1
                        self.by_call[name] = self.by_call.get(name, 0.0) + took

        return wrapper

    def waited(self, call: Callable[..., Any]) -> Callable[..., Any]:
        """A commit: while it waits, the writer's work is the engine's wait."""

        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._waiting += 1
            try:
                return call(*args, **kwargs)
            finally:
                with self._lock:
                    self._waiting -= 1

        return wrapper

    def writing(self, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                with self._lock:
                    if self._waiting:
                        self.writer_waited += took
                    else:
                        self.writer += took

        return wrapper


def _methods(cls: type) -> list[str]:
    public = [
        name
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_") and not isinstance(value, staticmethod)
    ]
    # run() only builds the context manager: its work is _start and report
    return [n for n in public if n != "run"] + list(_PRIVATE_CALLS.get(cls, ()))


@contextlib.contextmanager
def instrumented(clock: _Clock) -> Iterator[None]:
    """Time every ledger call and the journal writer's batches while inside."""
    patched: list[tuple[type, str, Any]] = []
    try:
        for cls in (SchedulerLedger, WorkerLedger, JobRun):
            for name in _methods(cls):
                original = vars(cls)[name]
                patched.append((cls, name, original))
                setattr(cls, name, clock.timed(original, f"{cls.__name__}.{name}"))
        for name, wrap in (("_write", clock.writing), ("commit", clock.waited)):
            original = vars(JournalWriter)[name]
            patched.append((JournalWriter, name, original))
            setattr(JournalWriter, name, wrap(original))
        yield
    finally:
        for cls, name, original in reversed(patched):
            setattr(cls, name, original)


def measure(requests: int = 480, store: str = "auto", seed: int = 0) -> dict[str, Any]:
    """One kvstate-policy demo run, instrumented; the ledgers' share of its wall time."""
    problem = mooncake_problem()
    if store == "mooncake" and problem is not None:
        raise RuntimeError(f"Mooncake cannot run here: {problem}")
    use_mooncake = store != "memory" and problem is None
    config = SimConfig(requests=requests, world_size=2, block_bytes=32768, seed=seed)
    clock = _Clock()
    with tempfile.TemporaryDirectory() as tmp, instrumented(clock):
        start = time.perf_counter()
        run = run_policy(config, os.path.join(tmp, "kvstate.db"), use_mooncake=use_mooncake)
        wall = time.perf_counter() - start
    spent = clock.ledger + clock.writer
    return {
        "store": "mooncake" if use_mooncake else "memory",
        "requests": requests,
        "finished": run.summary.finished,
        "store_jobs": run.summary.store_jobs,
        "wall_s": wall,
        "ledger_s": clock.ledger,
        "writer_s": clock.writer,
        "writer_waited_s": clock.writer_waited,
        "slowest_calls": dict(sorted(clock.by_call.items(), key=lambda kv: -kv[1])[:5]),
        "ledger_calls": clock.calls,
        "share": spent / wall,
        "ratio_bound": 1 - spent / wall,
        "clean": run.summary.error is None and not run.summary.violations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=480)
    parser.add_argument("--store", choices=("auto", "mooncake", "memory"), default="auto")
    args = parser.parse_args()
    print(json.dumps(measure(args.requests, args.store), indent=1))


if __name__ == "__main__":
    main()
