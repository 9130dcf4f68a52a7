"""Journals' live figures on ``/metrics``, in Prometheus's conventions.

:class:`FiguresCollector` turns :class:`~kvstate.figures.Figures` into
metric families when Prometheus scrapes (``prometheus_client``'s custom
collector), so a scrape costs a read of the figures and nothing on the
path that writes or folds records. Every family is labelled with the
journal's ``run``, ``role`` and file (``journal``); counters end in
``_total``, sizes say their unit.

======================================  =======  =======================================
metric                                  type     what
======================================  =======  =======================================
kvstate_records_total                   counter  records folded (or counted, a rank's)
kvstate_journal_records                 gauge    records the file holds
kvstate_journal_bytes                   gauge    the file's size on disk
kvstate_journal_segments                gauge    segments the journal is made of
kvstate_journal_segments_removed_total  counter  segments retention removed
kvstate_journal_rotate_bytes            gauge    the rotation size in force (a writer's)
kvstate_journal_checkpoint_bytes        gauge    the current segment's checkpoint (a writer's)
kvstate_journal_budget_short_bytes      gauge    what the budget lacks for that segment
kvstate_violations_total                counter  findings by ``code``
kvstate_violations_new_total            counter  findings in records written since it began
kvstate_journal_overtaken_total         counter  segments retention removed before read
kvstate_journal_silent_seconds          gauge    seconds since the file was last written
kvstate_first_violation_seq             gauge    seq of the first finding (absent: none)
kvstate_jobs_in_flight                  gauge    jobs enqueued and not yet ended
kvstate_pins_held                       gauge    jobs whose device blocks are pinned
kvstate_audit_lag_records               gauge    records written, not yet folded
kvstate_audit_lag_seconds               gauge    how long the fold has been behind
kvstate_journal_open                    gauge    1 until engine_idle or engine_crashed
kvstate_journal_readable                gauge    0 once a record cannot be read on
kvstate_writer_up                       gauge    1 while the watcher or writer runs
kvstate_disk_budget_bytes               gauge    the bytes the folder may hold (if set)
kvstate_watch_files_skipped             gauge    files in the folder that are not journals
======================================  =======  =======================================

``prometheus_client`` is imported here only, and ``import kvstate`` never
imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .figures import Figures, metrics_address

LABELS = ("run", "role", "journal")


class FiguresCollector(Collector):
    """The figures ``source()`` returns at each scrape, as metric families.

    ``budget`` is the disk budget in bytes, when one is set.
    """

    def __init__(
        self,
        source: Callable[[], Iterable[Figures]],
        *,
        budget: int | None = None,
        skipped: Callable[[], int] | None = None,
    ) -> None:
        self.source = source
        self.budget = budget
        #: how many files of the folder a watcher skips (None: not a watcher)
        self.skipped = skipped

    def collect(self) -> Iterator[Any]:
        figures = list(self.source())

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=LABELS)

        records = CounterMetricFamily(
            "kvstate_records", "Records folded (a rank's journal: counted)", labels=LABELS
        )
        written = gauge("kvstate_journal_records", "Records the journal file holds")
        size = gauge("kvstate_journal_bytes", "The journal file's size on disk")
        segments = gauge("kvstate_journal_segments", "Segments the journal is made of")
        removed = CounterMetricFamily(
            "kvstate_journal_segments_removed",
            "Segments retention removed, oldest first, each after a checkpoint",
            labels=LABELS,
        )
        rotate = gauge("kvstate_journal_rotate_bytes", "The rotation size in force")
        checkpoint = gauge(
            "kvstate_journal_checkpoint_bytes", "Bytes of the current segment's checkpoint"
        )
        short = gauge(
            "kvstate_journal_budget_short_bytes",
            "Bytes the retention budget lacks to hold the segment being written (0: it holds)",
        )
        violations = CounterMetricFamily(
            "kvstate_violations", "Findings of the audit, by code", labels=(*LABELS, "code")
        )
        new = CounterMetricFamily(
            "kvstate_violations_new",
            "Findings in records written since this reader began, by code (what pages)",
            labels=(*LABELS, "code"),
        )
        overtaken = CounterMetricFamily(
            "kvstate_journal_overtaken",
            "Times retention removed a segment before it was read (read on from a checkpoint)",
            labels=LABELS,
        )
        silent = gauge("kvstate_journal_silent_seconds", "Seconds since the file was last written")
        first = gauge("kvstate_first_violation_seq", "Seq of the journal's first finding")
        in_flight = gauge("kvstate_jobs_in_flight", "Jobs enqueued and not yet ended")
        pins = gauge("kvstate_pins_held", "Jobs whose device blocks are pinned")
        lag = gauge("kvstate_audit_lag_records", "Records written and not yet folded")
        lag_s = gauge("kvstate_audit_lag_seconds", "How long the fold has been behind")
        open_ = gauge("kvstate_journal_open", "1 until engine_idle or engine_crashed")
        readable = gauge("kvstate_journal_readable", "0 once a record cannot be read on")
        for f in figures:
            labels = [f.run, f.role, f.journal]
            records.add_metric(labels, f.folded)
            written.add_metric(labels, f.written)
            size.add_metric(labels, f.bytes)
            segments.add_metric(labels, f.segments)
            removed.add_metric(labels, f.segments_removed)
            if f.rotate_bytes is not None:  # known to a writer process that rotates
                rotate.add_metric(labels, f.rotate_bytes)
            if f.checkpoint_bytes is not None:
                checkpoint.add_metric(labels, f.checkpoint_bytes)
            if f.budget_short_bytes is not None:
                short.add_metric(labels, f.budget_short_bytes)
            for code, n in sorted(f.violations.items()):
                violations.add_metric([*labels, code], n)
            # every code the journal holds, at 0 until a new one: the series
            # exists before it grows, so a rate sees its first new finding
            for code in sorted(f.violations):
                new.add_metric([*labels, code], f.new_violations[code])
            overtaken.add_metric(labels, f.overtaken)
            if f.last_write is not None:
                silent.add_metric(labels, f.silent_seconds())
            if f.first_violation_seq is not None:
                first.add_metric(labels, f.first_violation_seq)
            in_flight.add_metric(labels, f.jobs_in_flight)
            pins.add_metric(labels, f.pins_held)
            lag.add_metric(labels, f.lag_records())
            lag_s.add_metric(labels, f.lag_seconds())
            open_.add_metric(labels, 0 if f.closed else 1)
            readable.add_metric(labels, 0 if f.error else 1)
        yield from (records, written, size, segments, removed, violations, new, overtaken)
        yield from (silent, first, in_flight)
        yield pins
        yield from (lag, lag_s, open_, readable)
        yield from (rotate, checkpoint, short)
        yield GaugeMetricFamily("kvstate_writer_up", "1 while the watcher or writer runs", 1)
        if self.skipped is not None:
            yield GaugeMetricFamily(
                "kvstate_watch_files_skipped",
                "Files in the folder skipped as not journals (the log says why)",
                self.skipped(),
            )
        if self.budget is not None:
            yield GaugeMetricFamily(
                "kvstate_disk_budget_bytes", "The bytes the journals may hold", self.budget
            )


def serve(address: str, collector: Collector) -> Callable[[], None]:
    """Serve ``collector`` on ``http://HOST:PORT/metrics``; returns the stop function.

    Raises :class:`ValueError` for an address that is not ``HOST:PORT``.
    """
    host, port = metrics_address(address)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join()

    return stop
