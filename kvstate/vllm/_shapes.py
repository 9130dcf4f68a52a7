"""vLLM's own classes of what a connector is handed, to tell them from a test's.

Resolved once, when the hooks are made (only where vLLM is installed:
``import kvstate.vllm`` must not import vLLM). A class this vLLM does not
have is left out, and what would be checked against it is not checked.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from kvstate.vllm._stand_down import foreign, foreign_items

_OUTPUT = "vllm.v1.core.sched.output"


def _class(module: str, name: str) -> type | None:
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


@attrs.frozen
class Shapes:
    scheduler_output: type | None
    new_request: type | None
    cached_requests: type | None

    @classmethod
    def of_vllm(cls) -> Shapes:
        return cls(
            scheduler_output=_class(_OUTPUT, "SchedulerOutput"),
            new_request=_class(_OUTPUT, "NewRequestData"),
            cached_requests=_class(_OUTPUT, "CachedRequestData"),
        )

    def check_output(self, out: Any) -> None:
        """Raise :class:`~kvstate.vllm._stand_down.StandDown` unless ``out`` is
        vLLM's scheduler output, with vLLM's request data in it."""
        if self.scheduler_output is not None:
            foreign(out, self.scheduler_output, "the scheduler output")
        if self.new_request is not None:
            foreign_items(out.scheduled_new_reqs, self.new_request, "a new request's data")
        if self.cached_requests is not None:
            foreign(out.scheduled_cached_reqs, self.cached_requests, "the cached requests' data")
