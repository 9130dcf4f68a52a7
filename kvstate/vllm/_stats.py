"""kvstate's figures on vLLM's own ``/metrics``, through the connector-stats path.

vLLM gathers each connector's telemetry as a ``KVConnectorStats`` (from the
workers' output and the scheduler's ``get_kv_connector_stats()``), sends it
to the process that logs, and there hands it to the connector class's
``KVConnectorPromMetrics``, which ``PrometheusStatLogger`` serves on
``/metrics`` with vLLM's labels (``model_name``, ``engine``). The journaled
connector classes (:mod:`kvstate.vllm._connector`) ride on that path:

- :class:`KvstateStats` carries the connector's own stats unchanged
  (``data["connector"]``) and, from the scheduler, what kvstate journaled and
  found since the last report: records, and findings of the live audit by
  code;
- :class:`KvstatePromMetrics` observes the connector's own metrics as vLLM
  would, and counts ``vllm:kvstate_records_total`` and
  ``vllm:kvstate_violations_total{code}``.

Imported by the connector classes only (it imports vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client import Counter
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class KvstateStats(KVConnectorStats):
    """A connector's own stats and kvstate's figures (see the module docstring).

    A subclass per connector names vLLM's connector class (:attr:`connector`),
    whose ``build_kv_connector_stats`` rebuilds its own stats on either side
    of a process boundary.
    """

    connector: ClassVar[Any] = None

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {"connector": None, "records": 0, "violations": {}}

    def own(self) -> KVConnectorStats | None:
        """The connector's own stats, rebuilt from their data (None: none)."""
        data = self.data.get("connector")
        return None if data is None else self.connector.build_kv_connector_stats(data)

    def is_empty(self) -> bool:
        own = self.own()
        return (own is None or own.is_empty()) and not (
            self.data["records"] or self.data["violations"]
        )

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.own() if isinstance(other, KvstateStats) else other
        mine = self.own()
        if mine is None or mine.is_empty():
            mine = theirs
        elif theirs is not None and not theirs.is_empty():
            mine = mine.aggregate(theirs)
        self.data["connector"] = None if mine is None else _data(mine)
        if isinstance(other, KvstateStats):
            self.data["records"] += other.data["records"]
            found = self.data["violations"]
            for code, n in other.data["violations"].items():
                found[code] = found.get(code, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        own = self.own()
        reduced = dict(own.reduce()) if own is not None and not own.is_empty() else {}
        reduced["kvstate_records"] = self.data["records"]
        reduced["kvstate_violations"] = sum(self.data["violations"].values())
        return reduced


def _data(stats: KVConnectorStats) -> Any:
    """A stats object's serializable payload (``to_dict()`` from vLLM 0.32;
    before it, the ``data`` field vLLM sent as it was)."""
    to_dict = getattr(stats, "to_dict", None)
    return to_dict() if to_dict is not None else stats.data


def since_last_report(
    connector: Any, own: KVConnectorStats | None, stats: type[KvstateStats]
) -> KvstateStats | None:
    """``connector``'s stats for vLLM: its own (``own``), and what its
    scheduler's journal recorded and its audit found since the last call."""
    out = stats()
    if own is not None and not own.is_empty():
        out.data["connector"] = _data(own)
    half = getattr(connector, "connector_scheduler", None)
    observer = getattr(half, "__dict__", {}).get("_kvstate_observer")
    recorder = getattr(observer, "recorder", None)
    counts = getattr(recorder, "live_counts", None)
    # A journal finish() ended (a watchdog's, on another thread, while vLLM
    # still steps) has no figures to add, and its counts are unmapped.
    if recorder is not None and counts is not None and not recorder.closed:
        records, found = connector.__dict__.get("_kvstate_reported", (0, {}))
        _, _, by_code = counts.read()  # the writer process's audit, as far as it got
        out.data["records"] = recorder.recorded - records
        out.data["violations"] = {
            code: n - found.get(code, 0) for code, n in by_code.items() if n > found.get(code, 0)
        }
        connector.__dict__["_kvstate_reported"] = (recorder.recorded, by_code)
    return None if out.is_empty() else out


class KvstatePromMetrics(KVConnectorPromMetrics):
    """The connector's own Prometheus metrics, and kvstate's two counters."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        own: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.own = own
        counter = self._counter_cls
        records = counter(
            name="vllm:kvstate_records",
            documentation="Records kvstate journaled for this connector's scheduler",
            labelnames=labelnames,
        )
        self.records = {i: records.labels(*v) for i, v in per_engine_labelvalues.items()}
        self.violations: Counter = counter(
            name="vllm:kvstate_violations",
            documentation="Findings of kvstate's live audit, by code",
            labelnames=[*labelnames, "code"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        own = transfer_stats_data.get("connector")
        if self.own is not None and own is not None:
            self.own.observe(own, engine_idx)
        self.records[engine_idx].inc(transfer_stats_data.get("records", 0))
        labels = self.per_engine_labelvalues[engine_idx]
        for code, n in transfer_stats_data.get("violations", {}).items():
            self.violations.labels(*labels, code).inc(n)


class ReportsFigures:
    """Mixed into a journaled connector class ahead of vLLM's: its stats and
    Prometheus metrics carry kvstate's figures beside the connector's own."""

    #: the connector's :class:`KvstateStats` subclass
    stats: ClassVar[type[KvstateStats]]

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        own = super().get_kv_connector_stats()  # type: ignore[misc]
        return since_last_report(self, own, self.stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return cls.stats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        own = super().build_prom_metrics(  # type: ignore[misc]
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return KvstatePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, own
        )
