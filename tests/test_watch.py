"""``kvstate watch``: journals followed as they are written, their figures, /metrics.

The figures come from the same fold as ``kvstate replay``: for a journal
that holds every side, the violations by code must be replay's. A journal
read while its writer commits is folded commit by commit, the lag said
until it catches up; a tampered one is named with its seq and exit 2.
"""

from __future__ import annotations

import socket
import sqlite3
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from journal import Journal
from kvstate.prometheus import FiguresCollector, serve
from replay.cli import main
from replay.verdict import replay
from replay.watch import Watcher

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A legacy run and its fixed twin, written by the simulator."""
    folder = tmp_path_factory.mktemp("runs")
    for name, policy in (("legacy", ["--policy", "legacy"]), ("fixed", [])):
        argv = ["run", "--journal", str(folder / f"{name}.db"), "--seed", "3"]
        main([*argv, "--requests", "40", *policy])
    return folder


def _codes(path: Path) -> Counter[str]:
    result = replay([str(path)])
    return Counter(v.code.value for v in result.violations)


def test_once_reports_replays_violations_for_each_journal(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["watch", str(runs), "--once"]) == 1
    out = capsys.readouterr().out
    assert "legacy.db" in out and "fixed.db" in out
    watcher = Watcher(runs)
    while watcher.poll():
        pass
    figures = {Path(f.journal).stem: f for f in watcher.figures()}
    watcher.close()
    assert figures["legacy"].violations == _codes(runs / "legacy.db") != Counter()
    assert figures["fixed"].violations == Counter() == _codes(runs / "fixed.db")
    fixed = figures["fixed"]
    assert fixed.closed == "engine_idle" and fixed.jobs_in_flight == 0 and fixed.pins_held == 0
    first = replay([str(runs / "legacy.db")]).violations[0].seq
    assert figures["legacy"].first_violation_seq == first


def test_a_journal_is_folded_commit_by_commit_as_it_is_written(runs: Path, tmp_path: Path) -> None:
    with Journal(str(runs / "fixed.db"), readonly=True) as source:
        rows = list(source.stored_rows())
    folder = tmp_path / "live"
    folder.mkdir()
    watcher = Watcher(folder)
    assert not watcher.poll() and watcher.figures() == []
    seen = []
    with Journal(str(folder / "growing.db")) as journal:
        for start in range(0, len(rows), 500):
            journal.append_rows(rows[start : start + 500])
            assert watcher.poll()
            (f,) = watcher.figures()
            assert f.folded == f.written == min(start + 500, len(rows))
            assert f.lag_records() == 0 and f.lag_seconds() == 0.0
            seen.append(f.closed)
    watcher.close()
    assert seen[-1] == "engine_idle" and set(seen[:-1]) == {None}


def test_a_tampered_journal_is_named_with_its_seq_and_exit_2(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tampered.db"
    path.write_bytes((runs / "fixed.db").read_bytes())
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER records_refuse_update")
    conn.execute("UPDATE records SET step = 999 WHERE seq = 40")
    conn.commit()
    conn.close()
    assert main(["watch", str(tmp_path), "--once"]) == 2
    out = capsys.readouterr().out
    assert "tampered.db" in out and "seq" in out
    assert "Traceback" not in out


def test_a_bad_metrics_address_is_exit_2(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["watch", str(runs), "--once", "--metrics", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_metrics_are_served_in_prometheus_conventions(runs: Path) -> None:
    watcher = Watcher(runs)
    while watcher.poll():
        pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = serve(f"127.0.0.1:{port}", FiguresCollector(watcher.figures, budget=1 << 30))
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        stop()
        watcher.close()
    legacy = _codes(runs / "legacy.db")
    for code, n in legacy.items():
        line = next(
            x
            for x in text.splitlines()
            if x.startswith("kvstate_violations_total{") and f'code="{code}"' in x
        )
        assert line.endswith(f" {float(n)}"), line
    assert "# TYPE kvstate_records_total counter" in text
    assert "kvstate_disk_budget_bytes 1.073741824e+09" in text
    assert "kvstate_writer_up 1.0" in text


def test_import_kvstate_does_not_import_prometheus_client() -> None:
    code = "import kvstate, sys; print('prometheus_client' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr


def test_the_shipped_rules_and_dashboard_name_only_published_metrics() -> None:
    import json
    import re

    from kvstate.figures import Figures

    figures = Figures(journal="j.db", first_violation_seq=3, last_write=0.0, budget_short_bytes=0)
    figures.violations["POISONED_READ"] = 1
    published = set()
    collector = FiguresCollector(lambda: [figures], budget=1, skipped=lambda: 0)
    for family in collector.collect():
        published |= {sample.name for sample in family.samples}
    ops = ROOT / "docs" / "ops"
    rules = (ops / "kvstate-alerts.yml").read_text()
    dashboard = json.loads((ops / "kvstate-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = set(re.findall(r"kvstate_[a-z_]+", rules + "\n".join(exprs)))
    assert named and named <= published, named - published
