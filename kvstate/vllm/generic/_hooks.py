"""The generic adapter's hooks: one connector object's scheduler-side calls, journaled.

vLLM's scheduler calls its connector object; the object's own methods are
replaced on the object (its ``__dict__``), each calling vLLM's method
unchanged and handing what it answered to the object's
:class:`~kvstate.vllm.generic._observer.ConnectorObserver` through the
process's :meth:`~kvstate.vllm._process.ObservedProcess.observe`, so an
observer error never reaches vLLM.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from kvstate.vllm._process import ObservedProcess, _world_size
from kvstate.vllm.generic._observer import ConnectorObserver

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
#: classes observed through their children, never as themselves
_THROUGH_CHILDREN = ("MultiConnector", "JournaledConnector", "JournaledHMAConnector")


class ConnectorHooks:
    """Hooks ``KVConnectorBase_V1.__init__`` and, per scheduler-side object, its calls."""

    def __init__(self, process: ObservedProcess, base: type, role: Any) -> None:
        self.process = process
        self.base = base
        self.scheduler_role = getattr(role, "SCHEDULER", None)
        #: request_finished_all_groups may call request_finished: one finish, not two
        self._finishing = threading.local()

    def patch(self) -> None:
        self.process.patches.around(self.base, "__init__", self.init)

    def init(self, original: Any, conn: Any, *args: Any, **kw: Any) -> None:
        original(conn, *args, **kw)
        self.process.observe(self.attach, conn, args, kw)

    def attach(self, conn: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        """Observe ``conn`` if it is a scheduler-side object nobody else journals."""
        role = kw.get("role", args[1] if len(args) > 1 else None)
        if role is not self.scheduler_role or type(conn).__name__ in _THROUGH_CHILDREN:
            return
        if isinstance(conn, self.process.claimed) or not hasattr(conn, "__dict__"):
            return
        state = conn.__dict__
        if "_kvstate_hooked" in state:
            return  # a subclass's __init__ ran the base's twice
        state["_kvstate_hooked"] = True
        state["_kvstate_config"] = kw.get("vllm_config", args[0] if args else None)
        for name, hook in self._hooks().items():
            if callable(getattr(type(conn), name, None)):
                state[name] = functools.partial(hook, getattr(conn, name), conn)

    def _hooks(self) -> dict[str, Callable[..., Any]]:
        return {
            "get_num_new_matched_tokens": self.matched,
            "update_state_after_alloc": self.allocated,
            "build_connector_meta": self.build,
            "request_finished": self.finished,
            "request_finished_all_groups": self.finished,
            "update_connector_output": self.output,
            "reset_cache": self.reset,
        }

    # -- the object's observer -------------------------------------------------------

    def observer(self, conn: Any) -> ConnectorObserver | None:
        observer = conn.__dict__.get("_kvstate_observer")
        if observer and not observer.closed:  # every call after the first: no lock
            return observer
        return self.process.of(conn, self._new)

    def _new(self, conn: Any) -> ConnectorObserver:
        config = conn.__dict__.get("_kvstate_config")
        cache = getattr(config, "cache_config", None)
        block_size = int(getattr(cache, "block_size", 0) or 16)
        world = _world_size(config)
        family = type(conn).__name__
        recorder = self.process.open(config, "scheduler", block_size, world, family=family)
        return ConnectorObserver(recorder, block_size=block_size, world_size=world)

    # -- the calls -------------------------------------------------------------------

    def matched(self, original: Any, conn: Any, request: Any, computed: int) -> Any:
        answer = original(request, computed)
        observer = self.observer(conn)
        if observer is not None:
            self.process.observe(observer.matched, request, computed, answer)
        return answer

    def allocated(self, original: Any, conn: Any, request: Any, blocks: Any, external: int) -> Any:
        result = original(request, blocks, external)
        observer = self.observer(conn)
        if observer is not None:
            self.process.observe(observer.allocated, request, blocks, external)
        return result

    def build(self, original: Any, conn: Any, scheduler_output: Any) -> Any:
        meta = original(scheduler_output)
        observer = conn.__dict__.get("_kvstate_observer")
        if not observer or observer.closed:  # the first step, not observed, or could not be made
            observer = self.observer(conn)
        if observer is not None:
            # every step: the observer's own try, not observe()'s frame (same outcome)
            try:
                observer.after_build(scheduler_output)
            except Exception as exc:
                self.process.failed(observer.after_build, exc)
        return meta

    def finished(self, original: Any, conn: Any, request: Any, *args: Any, **kw: Any) -> Any:
        nested = getattr(self._finishing, "now", False)
        self._finishing.now = True
        try:
            answer = original(request, *args, **kw)
        finally:
            self._finishing.now = nested
        if not nested:  # the outer call is vLLM's; an inner one is the connector's own
            observer = self.observer(conn)
            if observer is not None:
                self.process.observe(observer.finished_by, request, answer)
        return answer

    def output(self, original: Any, conn: Any, connector_output: Any) -> Any:
        result = original(connector_output)
        out = connector_output
        if not (out.finished_recving or out.finished_sending or out.invalid_block_ids
                or getattr(out, "failed_recving", None)):  # fmt: skip
            return result  # most steps: nothing reported, nothing to journal
        observer = self.observer(conn)
        if observer is not None:
            self.process.observe(observer.output, connector_output)
        return result

    def reset(self, original: Any, conn: Any, *args: Any, **kw: Any) -> Any:
        answer = original(*args, **kw)
        observer = self.observer(conn)
        if observer is not None:
            self.process.observe(observer.reset, answer)
        return answer
