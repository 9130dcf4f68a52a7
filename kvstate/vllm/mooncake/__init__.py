"""vLLM's MooncakeStoreConnector as an :class:`~kvstate.vllm.adapter.Adapter`.

Its shapes are :mod:`kvstate.vllm._compat`'s, its hooks
:mod:`kvstate.vllm.mooncake._hooks`'s: a scheduler half journaling the store jobs
and their pins on top of the requests' lifecycle, a worker half journaling
each rank's puts and gets.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kvstate.vllm._compat import STORE, Connector, UnsupportedVLLMError, detect
from kvstate.vllm.adapter import Adapter, Unrecognised
from kvstate.vllm.mooncake._hooks import SchedulerHooks, WorkerHooks


class MooncakeStoreAdapter(Adapter):
    """The MooncakeStoreConnector: store jobs, pins, puts and fingerprints."""

    name = "mooncake_store"
    additions = ("key_loaded", "key_missing", "observer_stood_down", "record_refused")

    def recognise(self) -> Connector | None:
        try:
            if importlib.util.find_spec(STORE) is None:
                return None
        except ImportError:  # no vllm.distributed... at all
            return None
        try:
            return detect()
        except UnsupportedVLLMError as exc:
            raise Unrecognised(str(exc)) from exc

    def patch(self, found: Connector) -> None:
        SchedulerHooks(self.process, found).patch()
        WorkerHooks(self.process, found).patch()

    def claims(self, found: Connector) -> tuple[type, ...]:
        return (found.cls("connector", "MooncakeStoreConnector"),)

    def flavor(self, found: Any) -> str:
        return str(found.flavor)
