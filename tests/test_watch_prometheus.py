"""A real Prometheus scrapes ``kvstate watch`` while the simulator writes, and fires the alert.

Debian's ``prometheus`` is started on loopback with the shipped rules
(``docs/ops/kvstate-alerts.yml``), scraping ``kvstate watch`` every second.
The simulator then writes two journals into the watched folder: a run of
the legacy connector and its fixed twin, the same seed. The violation alert
for the legacy journal must go pending, then firing; for the fixed one it
must never appear, for longer than the alert's ``for`` once Prometheus has
scraped the whole clean journal.

Every wait watches progress (the processes' CPU until Prometheus is ready,
then its rule evaluations, which it scrapes from itself), never a deadline:
a loaded machine only makes it slower.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from journal import Journal
from kvstate.harness.live.master import free_ports
from kvstate.harness.vllm_engine.watchdog import Stall, cpu_ticks

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "ops" / "kvstate-alerts.yml"
#: a wait that stops moving for this long fails the test (CPU and evaluations both still)
STALL_S = 120.0
KVSTATE = [sys.executable, "-m", "replay"]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait(
    what: str,
    done: Callable[[], bool],
    marks: Callable[[], object],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    """Poll ``done`` while ``marks()`` keeps changing (see the module docstring)
    and every process of ``procs`` runs (Prometheus evaluates its rules on
    whether or not ``kvstate watch`` is still there to scrape)."""
    stall = Stall(STALL_S, marks(), time.monotonic())
    while not done():
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"waiting for {what}: {p.args[:4]} exited with {p.returncode}")
        if stall.stalled(marks(), time.monotonic()):
            pytest.fail(f"waiting for {what}: nothing moved for {STALL_S:.0f} s")
        time.sleep(0.2)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Path, str, list[subprocess.Popen[bytes]]]]:
    folder = tmp_path / "journals"
    folder.mkdir()
    with _watched(tmp_path, folder) as started:
        yield started


@contextlib.contextmanager
def _watched(
    tmp_path: Path, folder: Path
) -> Iterator[tuple[Path, str, list[subprocess.Popen[bytes]]]]:
    """``kvstate watch`` of ``folder`` and a Prometheus scraping it with the rules."""
    if shutil.which("prometheus") is None:
        pytest.fail("Debian's prometheus is not installed (make system-packages installs it)")
    watch_at, prom_at = (f"127.0.0.1:{port}" for port in free_ports(2))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        "scrape_configs:\n"
        f"  - {{job_name: kvstate, static_configs: [{{targets: [{json.dumps(watch_at)}]}}]}}\n"
        # itself, for its rule evaluations: the progress every wait below watches
        f"  - {{job_name: prometheus, static_configs: [{{targets: [{json.dumps(prom_at)}]}}]}}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [*KVSTATE, "watch", str(folder), "--metrics", watch_at, "--interval", "0.2"],
            env=env,
            stdout=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={prom_at}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        yield folder, f"http://{prom_at}", procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def _query(base: str, promql: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    result: list[dict[str, Any]] = _get(url)["data"]["result"]
    return result


def _evaluations(base: str) -> float:
    rows = _query(base, 'sum(prometheus_rule_group_iterations_total{rule_group=~".*;kvstate"})')
    return float(rows[0]["value"][1]) if rows else 0.0


def test_the_violation_alert_fires_for_the_legacy_run_and_never_for_its_fixed_twin(
    prometheus: tuple[Path, str, list[subprocess.Popen[bytes]]],
) -> None:
    folder, base, procs = prometheus

    def cpu() -> object:
        return tuple(cpu_ticks(p.pid) for p in procs)

    _wait("Prometheus to be ready", lambda: _ready(base), cpu, procs)
    # the simulator writes both journals while they are watched and scraped
    runs = {"legacy": ["--policy", "legacy"], "fixed": []}
    for name, policy in runs.items():
        subprocess.run(
            [*KVSTATE, "run", "--journal", str(folder / f"{name}.db"), "--seed", "3",
             "--requests", "60", *policy],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            check=False,
        )  # fmt: skip

    seen: dict[str, list[str]] = {"legacy": [], "fixed": []}

    def states() -> None:
        for alert in _get(f"{base}/api/v1/alerts")["data"]["alerts"]:
            if alert["labels"].get("alertname") != "KvstateViolation":
                continue
            name = Path(alert["labels"]["journal"]).stem
            if not seen[name] or seen[name][-1] != alert["state"]:
                seen[name].append(alert["state"])

    def marks() -> object:
        return _evaluations(base)  # Prometheus evaluating the rules: what every wait needs

    def legacy_fired() -> bool:
        states()
        return "firing" in seen["legacy"]

    _wait("the violation alert of the legacy run", legacy_fired, marks, procs)
    assert seen["legacy"][:2] == ["pending", "firing"], seen

    # The fixed twin: every record scraped, then longer than the rule's `for`
    # (10 s at one evaluation a second) without an alert.
    with Journal(str(folder / "fixed.db"), readonly=True) as journal:
        records = journal.head()[0]
    query = f'kvstate_records_total{{journal=~".*fixed.db"}} == {records}'
    _wait("the fixed run's figures", lambda: bool(_query(base, query)), marks, procs)
    start = _evaluations(base)

    def long_enough() -> bool:
        states()
        return _evaluations(base) >= start + 15

    _wait("fifteen evaluations of the rules", long_enough, marks, procs)
    assert seen["fixed"] == [], seen

    # No new finding comes (the legacy run ended): the page resolves, a
    # minute after the last one, though the journal holds its findings.
    def resolved() -> bool:
        states()
        return not _alerts(base, "KvstateViolation")

    _wait("the violation alert to resolve", resolved, marks, procs)
    assert seen["legacy"] == ["pending", "firing"] and seen["fixed"] == [], seen
    assert _query(base, 'kvstate_violations_total{journal=~".*legacy.db"}')


def _alerts(base: str, name: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"].get("alertname") == name]


def test_a_restart_does_not_page_again_a_silent_writer_does_and_a_deleted_journal_goes(
    tmp_path: Path,
) -> None:
    """The watcher starts beside a finished legacy run (its findings already
    written: counted, never paged again) and a journal open but not written
    for an hour (its writer stuck): the silent alert fires, the violation
    alert never does. The legacy journal is then deleted: its series go."""
    from tests.builder import legacy_run

    plain = legacy_run(tmp_path)
    folder = tmp_path / "journals"
    folder.mkdir()
    shutil.copyfile(plain, folder / "legacy.db")
    with Journal(plain, readonly=True) as source:
        rows = list(source.stored_rows())
    stuck = folder / "stuck.db"
    with Journal(stuck) as journal:
        journal.append_rows(rows[:100])  # no engine_idle: still open
    an_hour_ago = time.time() - 3600
    os.utime(stuck, (an_hour_ago, an_hour_ago))
    with _watched(tmp_path, folder) as (_, base, procs):

        def cpu() -> object:
            return tuple(cpu_ticks(p.pid) for p in procs)

        def marks() -> object:
            return _evaluations(base)

        _wait("Prometheus to be ready", lambda: _ready(base), cpu, procs)
        _wait("the silent writer's alert", lambda: bool(_firing(base, "KvstateJournalSilent")),
              marks, procs)  # fmt: skip
        (silent,) = _firing(base, "KvstateJournalSilent")
        assert Path(silent["labels"]["journal"]).name == "stuck.db"
        legacy = 'kvstate_violations_total{journal=~".*legacy.db"}'
        _wait("the legacy run's figures", lambda: bool(_query(base, legacy)), marks, procs)
        start = _evaluations(base)
        paged = []

        def long_enough() -> bool:
            paged.extend(_alerts(base, "KvstateViolation"))
            return _evaluations(base) >= start + 15

        _wait("fifteen evaluations of the rules", long_enough, marks, procs)
        assert paged == []  # written before the watcher began: not new
        (folder / "legacy.db").unlink()
        records = 'kvstate_records_total{journal=~".*legacy.db"}'
        _wait("the deleted journal's series to go", lambda: not _query(base, records),
              marks, procs)  # fmt: skip
        assert _query(base, 'kvstate_records_total{journal=~".*stuck.db"}')


def _firing(base: str, name: str) -> list[dict[str, Any]]:
    return [a for a in _alerts(base, name) if a["state"] == "firing"]


def test_the_shipped_rules_are_valid() -> None:
    if shutil.which("promtool") is None:
        pytest.fail("Debian's prometheus is not installed (make system-packages installs it)")
    done = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout
