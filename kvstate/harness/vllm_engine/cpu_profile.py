"""Whose CPU the engine thread spends: kvstate's observer, or vLLM's scheduler and connector.

The benchmark row this feeds compares kvstate's CPU on vLLM's engine thread
with what vLLM itself spends scheduling there (its scheduler and its store
connector), per engine step, in one run. That ratio is what holds on a GPU,
where the model's forward pass no longer hides either.

It is measured by exclusive attribution, not sampling: every function of
interest is wrapped, each wrapper reads the thread's CPU clock
(``time.thread_time_ns``) on the way in and out, and a per-thread stack
charges each stretch of CPU time to the innermost category running. vLLM's
``Scheduler.schedule`` and ``update_from_output``, every method of the
connector class the engine calls, and the methods of the connector's halves
that kvstate's patches call are ``vllm``; the patches :func:`kvstate.vllm.install`
puts around them are ``kvstate``. So a kvstate patch inside vLLM's
scheduler is charged to kvstate, and vLLM's own method inside the patch
back to vLLM. What the wrappers themselves cost (two reads of the thread's
clock and the bookkeeping) is sampled in the run, once per engine step with
the caches as the engine left them, and taken out of each side by its call
count. A warm loop's figure (about 2 us here) is a third of what a wrapper
costs between two stretches of engine work: corrected by it, kvstate's
hooks, many small calls, were charged several microseconds each that were
the profiler's.

Used by :mod:`kvstate.harness.vllm_engine.in_venv` when a run's config asks for
``profile``; never part of :mod:`kvstate.vllm`.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import types
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from kvstate.vllm._patches import Patches

_clock = time.thread_time_ns
#: the call that begins an engine step
_STEP = "vllm:Scheduler.schedule"


class Attribution:
    """CPU nanoseconds by (category, thread), exclusive of nested categories."""

    def __init__(self, *, warmup: int = 0) -> None:
        #: engine steps not counted: what runs once per process (opening the
        #: journals, registering KV caches) must not be charged to every step
        self.warmup = warmup
        self.steps = 0
        self.ns: Counter[tuple[str, str]] = Counter()
        #: wrapped calls by (category, thread), and calls nested directly in them
        self.calls: Counter[tuple[str, str]] = Counter()
        self.nested: Counter[tuple[str, str]] = Counter()
        #: exclusive nanoseconds by ``category:qualified name``, every thread
        self.by_name: Counter[str] = Counter()
        #: wrapper costs charged to each name, in units of one wrapper's own cost
        self.name_calls: defaultdict[str, float] = defaultdict(float)
        #: what one wrapper charges to its own category, and to its caller's
        self.own_ns = 0.0
        self.leak_ns = 0.0
        #: wrapper costs sampled in the run: (samples, own ns, leaked ns) summed
        self._in_run = [0, 0.0, 0.0]
        self._probe: tuple[Attribution, Callable[[], None]] | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._patches = Patches()

    def wrap(self, category: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function``, charging the CPU it spends (less nested categories) to ``category``."""
        local = self._local
        ns, calls, nested, by_name = self.ns, self.calls, self.nested, self.by_name
        name_calls = self.name_calls
        lock = self._lock
        name = f"{category}:{function.__qualname__}"

        def charged(*args: Any, **kwargs: Any) -> Any:
            stack = local.__dict__.get("stack")
            if stack is None:
                stack = local.stack = []
                local.thread = threading.current_thread().name
            now = _clock()
            thread = local.thread
            if stack:
                outer = stack[-1]
                with lock:
                    ns[(outer[0], thread)] += now - outer[1]
                    by_name[outer[2]] += now - outer[1]
                    nested[(outer[0], thread)] += 1
                    name_calls[outer[2]] += self.leak_ns / max(self.own_ns, 1.0)
            if name == _STEP:
                self._step()
                now = _clock()  # the probe's sample in _step is nobody's
            frame: list[Any] = [category, now, name]
            stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                end = _clock()
                stack.pop()
                with lock:
                    ns[(category, thread)] += end - frame[1]
                    by_name[name] += end - frame[1]
                    calls[(category, thread)] += 1
                    name_calls[name] += 1
                if stack:
                    stack[-1][1] = end

        return functools.wraps(function)(charged)

    def collecting(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: the interpreter's collections are a category of their own.

        A collection runs on whichever thread allocated past the threshold,
        inside whatever function it was in: vLLM's, or a kvstate hook. A
        full collection of an engine's heap takes milliseconds; charged to
        the call it fell in, one of them is more than a step's worth of
        either side. It is the process's, not either side's: ``gc``.
        """
        local = self._local
        stack = local.__dict__.get("stack")
        if not stack:
            return  # outside every wrapped call: nobody's
        now = _clock()
        thread = local.thread
        if phase == "start":
            outer = stack[-1]
            with self._lock:
                self.ns[(outer[0], thread)] += now - outer[1]
                self.by_name[outer[2]] += now - outer[1]
            stack.append(["gc", now, "gc:collect"])
        elif stack[-1][0] == "gc":
            frame = stack.pop()
            with self._lock:
                self.ns[("gc", thread)] += now - frame[1]
                self.by_name["gc:collect"] += now - frame[1]
            if stack:
                stack[-1][1] = now

    def calibrate(self, rounds: int = 20000) -> None:
        """Measure what a wrapper costs, before the run, so :meth:`on_thread` can take it out.

        Two empty functions, one wrapped in the other: the inner one's
        exclusive time is one wrapper's own cost (two clock reads and the
        bookkeeping), the outer one's is that plus what a nested wrapper
        leaves to its caller. This warm loop is only the estimate until the
        run's own samples (:meth:`_sample`) replace it.
        """
        probe, outer = self._probe_pair()
        for _ in range(rounds):
            outer()
        thread = threading.current_thread().name
        own = probe.ns[("inner", thread)] / rounds
        self.own_ns = own
        self.leak_ns = max(0.0, probe.ns[("outer", thread)] / rounds - own)

    @staticmethod
    def _probe_pair() -> tuple[Attribution, Callable[[], None]]:
        probe = Attribution()

        def empty() -> None:
            return None

        return probe, probe.wrap("outer", probe.wrap("inner", empty))

    def _sample(self) -> None:
        """One probe call at each counted step's start, with the caches as the
        engine left them.

        A wrapper costs several times more between two stretches of engine
        work than in a warm loop (its code and the thread's clock out of the
        caches): corrected by the warm figure, every small call would be
        charged that difference, and kvstate's hooks are many small calls.
        The mean of one sample per step is what each wrapper costs here.
        """
        if self._probe is None:
            self._probe = self._probe_pair()
        probe, outer = self._probe
        probe.ns.clear()
        outer()
        thread = threading.current_thread().name
        own = probe.ns[("inner", thread)]
        tally = self._in_run
        tally[0] += 1
        tally[1] += own
        tally[2] += max(0, probe.ns[("outer", thread)] - own)
        self.own_ns = tally[1] / tally[0]
        self.leak_ns = tally[2] / tally[0]

    def _step(self) -> None:
        self.steps += 1
        if self.steps == self.warmup + 1:
            with self._lock:  # the counts so far were the warm-up's
                self.ns.clear()
                self.calls.clear()
                self.nested.clear()
                self.by_name.clear()
                self.name_calls.clear()
        if self.steps > self.warmup:
            self._sample()

    def patch(self, owner: Any, name: str, category: str) -> None:
        """Replace ``owner.name`` by its charged version (undone by :meth:`restore`)."""
        self._patches.replace(owner, name, self.wrap(category, getattr(owner, name)))

    def restore(self) -> None:
        self._patches.restore()

    def on_thread(self, thread: str) -> dict[str, float]:
        """Nanoseconds by category on one thread, less what the wrappers cost."""
        return {
            cat: max(
                0.0, n - self.own_ns * self.calls[(cat, t)] - self.leak_ns * self.nested[(cat, t)]
            )
            for (cat, t), n in self.ns.items()
            if t == thread
        }


def _methods(cls: type) -> list[str]:
    """The plain functions a class defines itself (not inherited, not dunder,
    not static or class methods, which a wrapper would turn into methods)."""
    return [
        name
        for name, value in vars(cls).items()
        if isinstance(value, types.FunctionType) and not name.startswith("__")
    ]


def instrument(
    journal_dir: str,
    *,
    fingerprint: bool,
    warmup: int = 50,
    detail: bool = False,
    connector: str = "mooncake",
) -> tuple[Attribution, Callable[[], None]]:
    """Install kvstate's observer with vLLM's side and kvstate's side charged apart.

    Returns the attribution and a function that puts every method back.
    The first ``warmup`` steps are not counted. ``detail`` also charges
    kvstate's own layers by name (observers, recorder, pipe), for a
    breakdown of the kvstate side; it adds wrappers, not CPU to either side.
    vLLM's methods are wrapped first, so kvstate's patches wrap the charged
    versions; then each of kvstate's patches is wrapped in turn.

    ``connector`` is ``"mooncake"`` (vLLM's MooncakeStoreConnector) or
    ``"offloading"`` (its OffloadingConnector; there the tier manager's
    ``prepare_store`` and ``prepare_load`` are vLLM's side, and kvstate's
    side adds the tap it puts on that manager's two methods,
    :class:`~kvstate.vllm.offloading._scheduler.ManagerTap`), ``"example"``
    (vLLM's ExampleConnector) or ``"pd"`` (vLLM's MooncakeConnector in one
    engine of a P/D pair), the last two through the generic adapter. The host
    tier's copies run on a thread of their own and are on neither side of
    the engine thread's split.
    """
    import kvstate.vllm

    prof = Attribution(warmup=warmup)
    prof.calibrate()
    facade, *halves = _connector_classes(connector)
    from vllm.v1.core.sched.scheduler import Scheduler

    # vLLM's side at its entry points only: the scheduler's two calls and the
    # connector class the engine calls (every connector call goes through
    # it). Each wrapper costs a few microseconds in the run and the
    # correction for it is an average: wrapping every helper of the
    # connector's halves would make most of either side the profiler's.
    for name in ("schedule", "update_from_output"):
        prof.patch(Scheduler, name, "vllm")
    for name in _methods(facade):
        prof.patch(facade, name, "vllm")
    # Below kvstate's patches, vLLM's methods they call are vLLM's: which
    # those are, install() says (undone at once; it opens no journal).
    kvstate.vllm.install(journal_dir, fingerprint=fingerprint)
    hooked = [(o, n) for o, n in kvstate.vllm.patched() if o in halves and not n.startswith("__")]
    kvstate.vllm.uninstall()
    for owner, name in hooked:
        prof.patch(owner, name, "vllm")
    if connector == "offloading":
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        for name in ("prepare_store", "prepare_load"):  # under kvstate's proxy
            prof.patch(CPUOffloadingManager, name, "vllm")
    kvstate.vllm.install(journal_dir, fingerprint=fingerprint)
    for owner, name in list(kvstate.vllm.patched()):
        # the engine thread's patches (the sending thread's are apart; a
        # constructor runs once)
        if owner in (facade, *halves) and not name.startswith("__"):
            prof.patch(owner, name, "kvstate")
    if connector == "offloading":
        from kvstate.vllm.offloading._scheduler import ManagerTap

        for name in ("prepare_store", "prepare_load"):
            prof.patch(ManagerTap, name, "kvstate")
    if connector in ("example", "pd"):
        # The generic adapter hooks each connector object, not its class:
        # its hooks are charged where the object's methods call them.
        from kvstate.vllm.generic._hooks import ConnectorHooks

        for name in ("matched", "allocated", "build", "finished", "output", "reset"):
            prof.patch(ConnectorHooks, name, "kvstate")
    # The hand-over of each group (kvstate.vllm._commit), on kvstate's own
    # thread: not the engine thread's, and reported beside the row.
    from kvstate.vllm._commit import GroupCommit

    prof.patch(GroupCommit, "send", "kvstate")

    if detail:
        # kvstate's own layers, for a breakdown of the kvstate side (by_name)
        from kvstate.process_writer import ProcessWriter
        from kvstate.recorder import Recorder
        from kvstate.vllm._process import ObservedProcess
        from kvstate.vllm._store_jobs import SchedulerObserver
        from kvstate.vllm.mooncake._worker import WorkerObserver

        observers: list[type] = [SchedulerObserver, WorkerObserver, GroupCommit]
        if connector == "offloading":
            from kvstate.vllm.offloading._scheduler import OffloadingSchedulerObserver
            from kvstate.vllm.offloading._worker import OffloadingWorkerObserver

            observers += [OffloadingSchedulerObserver, OffloadingWorkerObserver]
        for cls in observers:
            for name in _methods(cls):
                if (cls, name) != (GroupCommit, "send"):  # wrapped above
                    prof.patch(cls, name, "kvstate")
        prof.patch(Recorder, "record", "kvstate")
        prof.patch(ProcessWriter, "_send", "kvstate")
        prof.patch(ObservedProcess, "observe", "kvstate")
        import kvstate.process_writer as pw

        for module_name in ("os", "signal"):  # the pipe write and the held signals
            module = getattr(pw, module_name)
            proxy = types.SimpleNamespace(**vars(module))
            for fn in ("write", "pthread_sigmask"):
                if hasattr(module, fn):
                    setattr(proxy, fn, prof.wrap("kvstate", getattr(module, fn)))
            setattr(pw, module_name, proxy)

    gc.callbacks.append(prof.collecting)

    def undo() -> None:
        kvstate.vllm.uninstall()
        prof.restore()
        gc.callbacks.remove(prof.collecting)

    return prof, undo


def _connector_classes(connector: str) -> list[type]:
    """The connector class the engine calls, then its scheduler and worker halves."""
    if connector == "mooncake":
        from kvstate.vllm._compat import detect

        found = detect()
        return [
            found.cls("connector", "MooncakeStoreConnector"),
            found.cls("scheduler", "MooncakeStoreScheduler"),
            found.cls("worker", "MooncakeStoreWorker"),
        ]
    if connector == "offloading":
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        from kvstate.vllm.offloading import _hooks as _offloading

        halves = _offloading.classes()
        if halves is None:
            raise RuntimeError("this vLLM's OffloadingConnector has not the shape kvstate observes")
        return [OffloadingConnector, *halves]
    if connector == "example":
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )

        return [ExampleConnector]  # the generic adapter patches no half of it
    if connector == "pd":  # a P/D pair's engine: vLLM's MooncakeConnector, the generic adapter's
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            MooncakeConnector,
        )

        return [MooncakeConnector]
    raise ValueError(
        f"connector must be 'mooncake', 'offloading', 'example' or 'pd', not {connector!r}"
    )


def summary(prof: Attribution) -> dict[str, Any]:
    """The engine thread's split, per step: what the benchmark row reports."""
    steps = prof.steps - prof.warmup
    per_name = {
        name: round((n - prof.own_ns * prof.name_calls[name]) / 1000 / max(steps, 1), 1)
        for name, n in prof.by_name.items()
    }
    main = prof.on_thread("MainThread")
    kv, vl = main.get("kvstate", 0), main.get("vllm", 0)
    collected = main.get("gc", 0)
    handing = prof.on_thread("kvstate-commit").get("kvstate", 0)
    return {
        "steps": steps,
        "warmup_steps": prof.warmup,
        "kvstate_us_per_step": round(kv / 1000 / max(steps, 1), 1),
        # kvstate's thread that hands the engine's records to the writer
        # process: CPU of this process, not the engine thread's
        "kvstate_commit_thread_us_per_step": round(handing / 1000 / max(steps, 1), 1),
        "vllm_us_per_step": round(vl / 1000 / max(steps, 1), 1),
        "ratio": round(kv / vl, 4) if vl else None,
        "gc_us_per_step": round(collected / 1000 / max(steps, 1), 1),
        "wrapper_ns": round(prof.own_ns + prof.leak_ns),
        "top_us_per_step": dict(sorted(per_name.items(), key=lambda kv: -kv[1])[:30]),
    }
