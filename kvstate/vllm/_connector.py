"""The connector classes vLLM loads through ``kv_connector_module_path``."""

from __future__ import annotations

from typing import Any

from kvstate.vllm._compat import STORE
from kvstate.vllm._install import install
from kvstate.vllm._stats import KvstateStats, ReportsFigures

install()  # patches the classes below before any instance exists

_base: Any = __import__(f"{STORE}.connector", fromlist=["MooncakeStoreConnector"])


class MooncakeStoreFigures(KvstateStats):
    connector = _base.MooncakeStoreConnector


class JournaledMooncakeStoreConnector(ReportsFigures, _base.MooncakeStoreConnector):
    """vLLM's MooncakeStoreConnector, unchanged, with every transition journaled.

    The journals go to ``kv_connector_extra_config["kvstate_journal_dir"]``
    (or ``$KVSTATE_VLLM_JOURNAL_DIR``, or ``./kvstate-journals``). Its stats
    carry kvstate's figures to vLLM's ``/metrics`` (:mod:`kvstate.vllm._stats`).
    """

    stats = MooncakeStoreFigures


_offload: Any = __import__(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    fromlist=["OffloadingConnector"],
)


class OffloadingFigures(KvstateStats):
    connector = _offload.OffloadingConnector


class JournaledOffloadingConnector(ReportsFigures, _offload.OffloadingConnector):
    """vLLM's OffloadingConnector, unchanged, with every transition journaled
    (the journals and the figures as for :class:`JournaledMooncakeStoreConnector`)."""

    stats = OffloadingFigures
