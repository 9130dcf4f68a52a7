"""kvstate inside a real vLLM engine: the MooncakeStoreConnector and the
OffloadingConnector, journaled.

Two ways in, the same observer behind both (see docs/vllm.md):

- ``KVTransferConfig(kv_connector="JournaledMooncakeStoreConnector",
  kv_connector_module_path="kvstate.vllm", kv_role="kv_both",
  kv_connector_extra_config={"kvstate_journal_dir": "journals"})``;
- :func:`install` in any process (a test suite, a ``sitecustomize``), which
  patches vLLM's connector classes in place.

vLLM keeps making every decision; each process writes its own journals
(``scheduler-PID.db``, ``worker-RANK-PID.db``), which ``kvstate replay``
merges. :func:`finish` audits the store and ends the journals.
"""

from __future__ import annotations

from typing import Any

from kvstate.vllm._compat import TESTED, Connector, UnsupportedVLLMError, detect
from kvstate.vllm._install import finish, install, installed, outstanding, patched, uninstall

__all__ = [
    "TESTED",
    "Connector",
    "JournaledMooncakeStoreConnector",
    "JournaledOffloadingConnector",
    "UnsupportedVLLMError",
    "detect",
    "finish",
    "install",
    "installed",
    "outstanding",
    "patched",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    # The connector class subclasses vLLM's, so it exists only where vLLM does;
    # ``import kvstate.vllm`` itself never imports vLLM.
    if name in ("JournaledMooncakeStoreConnector", "JournaledOffloadingConnector"):
        from kvstate.vllm import _connector

        return getattr(_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
