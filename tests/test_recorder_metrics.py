"""A recorder's writer process serves the journal's figures; the first violation is logged once.

``Recorder.open(..., metrics=HOST:PORT)``: the writer process, which
already folds each committed batch, keeps the journal's figures and serves
them on ``/metrics``, so the engine's thread pays nothing more. The audit's
first finding is logged once, at warning level, naming the code, the job,
the request and the ``kvstate replay`` command that explains it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstate import Recorder, SchedulerLedger


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _overrun(rec: Recorder) -> None:
    """Two table overruns (64 tokens over one 16-token block), two steps apart."""
    s = SchedulerLedger(rec, strict=False)
    s.begin_step()
    s.admit("r", 64)
    s.assign_blocks("r", [1], resumed=False)
    s.enqueue_store_job("r", 0, 64, ["k0", "k1", "k2", "k3"])
    rec.commit(settle=True)
    s.begin_step()
    s.admit("q", 64)
    s.assign_blocks("q", [2], resumed=False)
    s.enqueue_store_job("q", 0, 64, ["j0", "j1", "j2", "j3"])
    rec.commit(settle=True)


def test_the_writer_process_serves_the_journals_figures(tmp_path: Path) -> None:
    address = f"127.0.0.1:{_port()}"
    path = tmp_path / "served.db"
    rec = Recorder.open(path, block_size=16, world_size=1, metrics=address)
    try:
        _overrun(rec)
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        rec.close(raise_found=False)
    overruns = [
        line
        for line in text.splitlines()
        if line.startswith("kvstate_violations_total{") and 'code="TABLE_OVERRUN"' in line
    ]
    assert len(overruns) == 1 and overruns[0].endswith(" 2.0"), overruns
    assert f'journal="{path}"' in overruns[0]
    records = next(x for x in text.splitlines() if x.startswith("kvstate_records_total{"))
    assert records.endswith(f" {float(rec.recorded)}"), (records, rec.recorded)


def test_the_first_violation_is_logged_once_with_the_command_that_explains_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "logged.db"
    rec = Recorder.open(path, block_size=16, world_size=1)
    with caplog.at_level(logging.WARNING, logger="kvstate"):
        _overrun(rec)
        rec.close(raise_found=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstate"]
    assert len(lines) == 1, lines  # two overruns, one line
    (line,) = lines
    assert "TABLE_OVERRUN" in line and "request r" in line and "job" in line
    assert line.endswith(f"kvstate replay {path}")


def test_a_metrics_address_that_is_not_host_port_is_refused_before_a_file_exists(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        Recorder.open(tmp_path / "x.db", block_size=16, world_size=1, metrics="9464")
    assert not (tmp_path / "x.db").exists()


def test_without_the_metrics_extra_it_says_what_to_install_before_a_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstate.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(MissingExtra, match=re.escape("pip install 'kvstate[metrics]'")):
        Recorder.open(tmp_path / "x.db", block_size=16, world_size=1, metrics="127.0.0.1:9464")
    assert list(tmp_path.iterdir()) == []


def _vllm_config(**extra: object) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_the_vllm_observer_reads_a_metrics_address_from_the_extra_config() -> None:
    from kvstate.vllm._journals import metrics_of

    assert metrics_of(None) is None and metrics_of(_vllm_config()) is None
    assert metrics_of(_vllm_config(kvstate_metrics="0.0.0.0:9464")) == "0.0.0.0:9464"
    for bad in ("9464", "host:port", 9464, True, ""):
        with pytest.raises(ValueError, match="kvstate_metrics"):
            metrics_of(_vllm_config(kvstate_metrics=bad))


def test_under_vllm_the_schedulers_journal_serves_its_figures_and_a_workers_none(
    tmp_path: Path,
) -> None:
    """One address per recorder: the scheduler's journal, which its writer
    process audits, serves it; a worker's journal given the same settings
    serves nothing (its port stays free)."""
    from kvstate.vllm._journals import open_journal

    served, free = f"127.0.0.1:{_port()}", f"127.0.0.1:{_port()}"
    settings = {"block_size": 16, "world_size": 1, "engine": "vllm test", "run": "r"}
    scheduler = open_journal(tmp_path, "scheduler", metrics=served, **settings)  # type: ignore[arg-type]
    worker = open_journal(tmp_path, "worker-0", metrics=free, **settings)  # type: ignore[arg-type]
    try:
        _overrun(scheduler)
        worker.commit()
        with urllib.request.urlopen(f"http://{served}/metrics", timeout=30) as r:
            text = r.read().decode()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{free}/metrics", timeout=5)
    finally:
        scheduler.close(raise_found=False)
        worker.close(raise_found=False)
    assert 'role="scheduler"' in text and 'code="TABLE_OVERRUN"' in text


def test_live_counts_give_the_engine_the_writers_findings_without_waiting(tmp_path: Path) -> None:
    rec = Recorder.open(tmp_path / "counted.db", block_size=16, world_size=1, live_counts=True)
    counts = rec.live_counts
    assert counts is not None and counts.read() == (0, None, {})
    _overrun(rec)  # each step settled: the writer has folded it
    folded, first, by_code = counts.read()
    assert by_code == {"TABLE_OVERRUN": 2}
    assert folded == rec.recorded
    assert first == rec.violations[0].seq
    rec.close(raise_found=False)
    assert not Path(counts.path).exists()  # the recorder's file, removed with it


def test_live_counts_read_after_close_give_the_last_figures_and_never_raise() -> None:
    """vLLM's engine thread reads them at every step; ``finish()`` (a
    watchdog's, on another thread) may close them in between. A read that
    raised there went into vLLM and ended the engine."""
    from kvstate.live_counts import LiveCounts

    counts = LiveCounts.create()
    writer = LiveCounts(counts.path, owner=False)
    writer.store(12, 7, {"POISONED_KEY": 2})
    assert counts.read() == (12, 7, {"POISONED_KEY": 2})
    writer.close()
    counts.close()
    assert counts.read() == (12, 7, {"POISONED_KEY": 2})
    assert not os.path.exists(counts.path)  # the engine's file, removed by its owner
