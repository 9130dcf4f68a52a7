"""kvstate inside a real vLLM engine: every connector, journaled.

Each connector family is observed by an adapter (:mod:`kvstate.vllm.registry`):
the MooncakeStoreConnector and the OffloadingConnector in depth, every other
connector at vLLM's connector boundary (:mod:`kvstate.vllm.generic`). Two
ways in, the same observer behind both (see docs/vllm.md):

- ``KVTransferConfig(kv_connector="JournaledConnector",  # JournaledHMAConnector if HMA
  kv_connector_module_path="kvstate.vllm", kv_role="kv_both",
  kv_connector_extra_config={"kvstate_connector": "NixlConnector",
  "kvstate_journal_dir": "journals"})`` (or ``JournaledMooncakeStoreConnector``,
  ``JournaledOffloadingConnector``, which subclass those two);
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
    "JournaledConnector",
    "JournaledHMAConnector",
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
    if name in ("JournaledConnector", "JournaledHMAConnector"):
        from kvstate.vllm.generic import _wrapper

        return getattr(_wrapper, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
