"""vLLM's OffloadingConnector as an :class:`~kvstate.vllm.adapter.Adapter`.

Two shapes: per-job completion (vLLM #39186, 0.21.0 on;
:mod:`kvstate.vllm.offloading._hooks`) and, before it, transfers named by request,
observed through a per-job view (:mod:`kvstate.vllm.offloading._per_request`). Its
journals follow the offloading protocol (:mod:`kvstate.tier_events`).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstate.tier_events import OFFLOADING
from kvstate.vllm._compat import OFFLOADING_ONLY, vllm_version
from kvstate.vllm.adapter import Adapter, Unrecognised
from kvstate.vllm.offloading import _hooks as _offloading
from kvstate.vllm.offloading import _per_request

_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"


class OffloadingAdapter(Adapter):
    """The OffloadingConnector: loads, stores, flushes and its tier."""

    name = "offloading"
    additions = ("load_enqueued", "flush_requested", "flush_done", "tier_stored", "tier_evicted")
    protocol = OFFLOADING

    def recognise(self) -> tuple[str, tuple[Any, Any]] | None:
        found = _offloading.classes()
        if found is not None:
            return "per-job", found
        # Before per-job completion (vLLM #39186, 0.21.0) the connector names
        # its transfers by request: observed through a per-job view.
        older = _per_request.classes()
        if older is not None:
            return "per-request", older
        try:
            importlib.import_module(f"{_offloading.PACKAGE}.scheduler")
        except ImportError:
            return None  # no OffloadingConnector in this vLLM
        raise Unrecognised(
            f"vLLM {vllm_version()}: the OffloadingConnector has not a shape kvstate observes "
            f"(missing: {', '.join(_offloading.missing()) or 'the per-request shape'})"
        )

    def patch(self, found: tuple[str, tuple[Any, Any]]) -> None:
        shape, (scheduler, worker) = found
        hooks = _offloading.OffloadingHooks if shape == "per-job" else _per_request.PerRequestHooks
        hooks(self.process, scheduler, worker).patch()

    def flavor(self, found: Any) -> str:
        return OFFLOADING_ONLY  # named where no Mooncake store shape is (older releases)

    def claims(self, found: Any) -> tuple[type, ...]:
        try:
            module = importlib.import_module(_CONNECTOR)
        except ImportError:
            return ()
        cls = getattr(module, "OffloadingConnector", None)
        return (cls,) if isinstance(cls, type) else ()
