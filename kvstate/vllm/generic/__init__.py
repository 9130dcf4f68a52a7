"""Any vLLM connector, journaled at vLLM's connector boundary (``KVConnectorBase_V1``).

The adapter of every connector the factory can load (registered or by
``kv_connector_module_path``) and of each child of vLLM's ``MultiConnector``:
it journals what vLLM's core sees of the connector, from the scheduler's
calls and their answers (:mod:`kvstate.transfer_events`; the checks are
:mod:`kvstate._transfers`), and nothing of what only the connector sees.

Two ways in:

- :func:`kvstate.vllm.install` hooks ``KVConnectorBase_V1.__init__``: each
  scheduler-side connector object made from then on, whose class no specific
  adapter claims, is observed through its own methods (its object's, not
  its class's: another object of the class is left alone);
- ``kv_connector="JournaledConnector"``, ``kv_connector_module_path="kvstate.vllm"``,
  the connector to observe named in ``kv_connector_extra_config``
  (:mod:`kvstate.vllm.generic._wrapper`).

A child of ``MultiConnector`` is observed as itself, in a journal of its own:
vLLM's core calls the multi-connector, which calls every child with the
same step, so each child's journal is the whole lifecycle as that child saw
it. The multi-connector object itself is not journaled (it would repeat
its children).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstate import transfer_events as tx
from kvstate.vllm._compat import vllm_version
from kvstate.vllm.adapter import Adapter, Unrecognised
from kvstate.vllm.generic._hooks import BASE, ConnectorHooks

#: the scheduler-side calls of KVConnectorBase_V1 every connector answers
CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
)


class GenericAdapter(Adapter):
    """Every ``KVConnectorBase_V1`` object no specific adapter claims."""

    name = "generic"
    additions = tuple(
        cls.kind
        for cls in (
            tx.KvMatched,
            tx.RemoteLoadStarted,
            tx.TransferFinished,
            tx.BlocksInvalid,
            tx.CacheReset,
            tx.TransferParams,
        )
    )

    def recognise(self) -> Any:
        try:
            module = importlib.import_module(BASE)
        except ImportError:
            return None
        base = getattr(module, "KVConnectorBase_V1", None)
        role = getattr(module, "KVConnectorRole", None)
        if base is None or role is None:
            return None
        missing = [name for name in CALLS if not callable(getattr(base, name, None))]
        if missing or not hasattr(role, "SCHEDULER"):
            raise Unrecognised(
                f"vLLM {vllm_version()}: KVConnectorBase_V1 has not the shape the generic "
                f"adapter observes; missing: {', '.join(missing) or 'KVConnectorRole.SCHEDULER'}"
            )
        return base, role

    def patch(self, found: Any) -> None:
        base, role = found
        ConnectorHooks(self.process, base, role).patch()
