"""A fleet: engines sharing one store, checked run by run in parallel, and
joined across runs with DuckDB (replay/fleet.py, replay/facts.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.shared_store import simulate_fleet
from replay import replay
from replay.cli import main
from replay.cli._common import to_json
from replay.fleet import check_runs, connect, cross_run, cross_run_summary, facts_path
from replay.runs import group


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three engines of one workload on one store; the first on the legacy connector."""
    folder = tmp_path_factory.mktemp("fleet") / "journals"
    folder.mkdir()
    config = SimConfig(requests=60, blocks=32, seed=5)
    simulate_fleet(config, str(folder), engines=3, legacy_engines=1, shared_store=True)
    return folder


def check(folder: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    status = main(["fleet-check", "--json", str(folder), *argv])
    return status, json.loads(capsys.readouterr().out)


def test_each_run_verdict_is_its_own_replay_and_the_poison_is_traced_across_runs(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, report = check(fleet, capsys, "--workers", "2", "--facts", str(tmp_path / "f"))
    assert status == 1
    runs = report["runs"]
    assert [Path(r["paths"][0]).name for r in runs] == [
        "engine-001.db",
        "engine-002.db",
        "engine-003.db",
    ]
    for r in runs:  # exactly what replaying the run by itself says
        alone = replay(r["paths"])
        codes: dict[str, int] = {}
        for v in alone.violations:
            codes[v.code.value] = codes.get(v.code.value, 0) + 1
        assert (r["verdict"], r["exit_status"], r["codes"]) == (
            alone.verdict,
            alone.exit_status,
            codes,
        )
    legacy, fixed = runs[0], runs[1:]
    assert "POISONED_READ" in legacy["codes"]
    crossed = report["cross_run"]
    wrong = crossed  # wrong loads only
    assert not any(row["load_ok"] for row in crossed)
    # every wrong load of the fixed engines is a key the legacy engine poisoned
    for r in fixed:
        assert set(r["codes"]) <= {"WRONG_KV_LOADED"}  # no bug of their own
        mine = [row for row in wrong if row["loaded_run"] == r["run"]]
        assert len(mine) == r["codes"].get("WRONG_KV_LOADED", 0)
    assert wrong and {row["written_run"] for row in wrong} == {legacy["run"]}
    assert all(row["written_job"] is not None and row["written_seq"] for row in wrong)
    assert all(row["written_file"].endswith("engine-001.db") for row in wrong)


def test_one_worker_and_several_give_the_same_report(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one = check(fleet, capsys, "--workers", "1", "--facts", str(tmp_path / "a"))
    two = check(fleet, capsys, "--workers", "2", "--facts", str(tmp_path / "b"))

    def without_facts_paths(report: dict) -> dict:
        return {**report, "runs": [{**r, "facts": None} for r in report["runs"]]}

    assert without_facts_paths(one[1]) == without_facts_paths(two[1]) and one[0] == two[0]


def test_the_report_sums_up_the_join_in_duckdb_and_json_streams_every_row(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fleet's wrong loads can be millions: the text report counts them in
    DuckDB and fetches only --limit rows; --json writes them a row at a time.
    Both must say exactly what the whole join in one list says."""
    facts = tmp_path / "f"
    check_runs(group([str(fleet)]), str(facts), workers=1)
    files = sorted(str(f) for f in facts.iterdir())
    rows = cross_run(files)
    assert len(rows) > 3
    summary = cross_run_summary(files, 3)
    assert summary.total == len(rows) and summary.first == rows[:3]
    pairs: dict[str, dict[str, int]] = {}
    for row in rows:
        into = pairs.setdefault(row["loaded_run"], {})
        into[row["written_run"]] = into.get(row["written_run"], 0) + 1
    assert summary.sources == pairs

    status = main(["fleet-check", "--json", str(fleet), "--facts", str(facts)])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert status == 1 and report["cross_run"] == rows
    assert out == to_json(report) + "\n"  # the same bytes as one json.dumps

    status = main(["fleet-check", str(fleet), "--facts", str(facts), "--limit", "2"])
    text = capsys.readouterr().out
    assert status == 1
    assert f"{len(rows)} wrong loads of keys poisoned in another run:" in text
    assert f"... {len(rows) - 2} more" in text
    for run, by in pairs.items():
        assert f"{sum(by.values())} of its" in text.split(run + ":")[1].splitlines()[1]


def test_own_stores_share_no_poison(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "own"
    folder.mkdir()
    config = SimConfig(requests=40, blocks=32, seed=5)
    simulate_fleet(config, str(folder), engines=2, legacy_engines=1, shared_store=False)
    status, report = check(folder, capsys)
    assert report["cross_run"] == [] and report["runs"][1]["verdict"] == "clean"
    assert status == 1  # the legacy engine's own violations


def test_facts_are_reused_refreshed_or_refused(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = group([str(fleet)])
    facts = str(tmp_path / "facts")
    first = check_runs(runs, facts, workers=1)
    stamp = {v.run: os.stat(v.facts).st_mtime_ns for v in first if v.facts}
    again = check_runs(runs, facts, workers=1)
    assert again == first  # the same verdicts, from the files' metadata
    assert {v.run: os.stat(v.facts).st_mtime_ns for v in again if v.facts} == stamp
    # a journal that changed is replayed again
    copy = tmp_path / "copy"
    shutil.copytree(fleet, copy, ignore=shutil.ignore_patterns("kvstate-facts"))
    moved = group([str(copy)])
    check_runs(moved, facts, workers=1)
    # a file kvstate did not write is never replaced
    run = next(iter(runs))
    Path(facts_path(facts, run)).write_text("not ours")
    (verdict, *_) = check_runs({run: runs[run]}, facts, workers=1)
    assert verdict.exit_status == 2 and "not a kvstate facts file" in (verdict.error or "")
    assert Path(facts_path(facts, run)).read_text() == "not ours"


def test_sql_over_the_facts(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sql = (
        "SELECT run, count(*) FILTER (WHERE fact = 'key_loaded' AND NOT ok) AS wrong "
        "FROM facts GROUP BY run ORDER BY run"
    )
    status, rows = check(fleet, capsys, "--facts", str(tmp_path / "f"), "--sql", sql)
    assert status == 0 and [r["wrong"] > 0 for r in rows] == [True, True, True]
    assert main(["fleet-check", str(fleet), "--facts", str(tmp_path / "f"), "--sql", "SELEC"]) == 2
    assert "--sql" in capsys.readouterr().err


def test_export_parquet_is_the_runs_facts(fleet: Path, tmp_path: Path) -> None:
    out = tmp_path / "one.parquet"
    assert main(["export", "--format", "parquet", str(fleet / "engine-001.db"), str(out)]) == 0
    assert main(["export", "--format", "parquet", str(fleet / "engine-001.db"), str(out)]) == 2
    crossed = cross_run([str(out)])
    assert crossed == []  # one run: nothing crosses
    assert main(["export", "--format", "parquet", str(fleet), str(tmp_path / "all")]) == 0
    files = sorted((tmp_path / "all").glob("*.parquet"))
    assert len(files) == 3 and cross_run([str(f) for f in files])


def test_the_simulator_fleet_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "cli"
    argv = ["run", "--journal", str(folder), "--engines", "2", "--legacy-engines", "1"]
    status = main([*argv, "--store", "shared", "--requests", "30", "--seed", "5"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped to the terminal
    assert status == 1 and f"kvstate fleet-check {folder}" in out
    assert sorted(p.name for p in folder.iterdir()) == ["engine-001.db", "engine-002.db"]
    assert main([*argv, "--requests", "30"]) == 2  # never replaces an engine's journal


def test_a_local_ray_instance_gives_the_same_report(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray", reason="the optional extra kvstate[ray]")
    local = check(fleet, capsys, "--workers", "2", "--facts", str(tmp_path / "local"))
    on_ray = check(fleet, capsys, "--ray", "--facts", str(tmp_path / "ray"))

    def without_facts_paths(report: dict) -> dict:
        return {**report, "runs": [{**r, "facts": None} for r in report["runs"]]}

    assert on_ray[0] == local[0] == 1
    assert without_facts_paths(on_ray[1]) == without_facts_paths(local[1])


def test_replay_of_a_folder_replays_each_run_as_alone(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["replay", "--json", "--workers", "2", str(fleet)])
    reports = json.loads(capsys.readouterr().out)
    assert status == 1 and len(reports) == 3
    for report in reports:
        alone = replay(report["paths"])
        assert report["verdict"] == alone.verdict
        assert [v["code"] for v in report["violations"]] == [v.code.value for v in alone.violations]
    # the human report: each run's own, in run order
    assert main(["replay", str(fleet), "--limit", "1"]) == 1
    out = capsys.readouterr().out
    names = [line.split(":")[0] for line in out.splitlines() if line.startswith("run ")]
    assert names == [f"run {r['run']}" for r in reports]
    # files of several runs are refused unless asked to group them
    files = [str(p) for p in sorted(fleet.glob("*.db"))]
    assert main(["replay", *files]) == 2
    capsys.readouterr()
    assert main(["replay", "--by-run", "--workers", "1", *files]) == 1


def test_a_load_of_another_engines_key_is_judged_by_its_digest(tmp_path: Path) -> None:
    """A real engine cannot judge a key another engine wrote: it journals
    key_loaded with the digest of what it loaded. The fleet join counts such
    a load as wrong exactly when the digest is the one the writer's audit
    read back as poisoned, and names the writer's job and request."""
    from journal import write_jsonl
    from kvstate import events as ev
    from kvstate.codec import to_record
    from kvstate.recorder import Recorder

    def journal(name: str, run: str, events: list[ev.Event]) -> str:
        header = ev.JournalOpened(version=1, block_size=4, world_size=1, run=run)
        rec = Recorder(header, keep=True, audit="off")
        for e in events:
            rec.record(e, 0)
        path = str(tmp_path / name)
        write_jsonl((to_record(e) for e in rec.entries or []), path)
        return path

    writer = journal(
        "a.jsonl",
        "run-a",
        [
            ev.RequestAdmitted(req="w", gen=0, prompt_tokens=8),
            ev.BlocksAssigned(req="w", gen=0, blocks=(0, 1), mode="append"),
            ev.JobEnqueued(
                job=7,
                req="w",
                gen=0,
                token_start=0,
                token_end=8,
                keys=("k1", "k2"),
                reads=(0, 1),
                pins=(0, 1),
                world_size=1,
            ),
            ev.KeyVerified(key="k1", ok=False, expected="e1", actual="poison", job=7),
            ev.KeyVerified(key="k2", ok=True, expected="e2", actual="e2", job=7),
        ],
    )
    loader = journal(
        "b.jsonl",
        "run-b",
        [
            ev.RequestAdmitted(req="r", gen=0, prompt_tokens=8),
            ev.KeyLoaded(req="r", gen=0, key="k1", digest="poison"),  # A's poisoned bytes
            ev.KeyLoaded(req="r", gen=0, key="k1", digest="e1"),  # right bytes, elsewhere
            ev.KeyLoaded(req="r", gen=0, key="k2", digest="e2"),  # a key A wrote well
        ],
    )
    assert replay([loader]).verdict == "clean"  # nothing to judge within run B
    facts = str(tmp_path / "facts")
    check_runs({"run-a": [writer], "run-b": [loader]}, facts, workers=1)
    found = cross_run([facts_path(facts, run) for run in ("run-a", "run-b")])
    assert [(w["loaded_run"], w["key"], w["written_job"], w["written_req"]) for w in found] == [
        ("run-b", "k1", 7, "w")
    ]
    assert found[0]["loaded_seq"] == 3  # the load of the poisoned digest, not the other


def test_a_run_that_loaded_another_engines_keys_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Replayed alone, a run with key_loaded records is clean of its own bugs
    and says that what it loaded from elsewhere is judged across runs."""
    from journal import write_jsonl
    from kvstate import events as ev
    from kvstate.codec import to_record
    from kvstate.recorder import Recorder

    rec = Recorder(ev.JournalOpened(version=1, block_size=4, world_size=1), keep=True)
    for e in (
        ev.RequestAdmitted(req="r", gen=0, prompt_tokens=8),
        ev.KeyLoaded(req="r", gen=0, key="k1", digest="d"),
        ev.KeyLoaded(req="r", gen=0, key="k2", digest="d"),
        ev.EngineIdle(),
    ):
        rec.record(e, 0)
    path = str(tmp_path / "b.jsonl")
    write_jsonl((to_record(e) for e in rec.entries or []), path)
    assert main(["replay", path]) == 0
    out = capsys.readouterr().out
    assert "2 load(s) of keys another engine wrote" in out and "fleet-check" in out


def test_a_bulk_fleet_is_the_same_journals_made_faster(fleet: Path, tmp_path: Path) -> None:
    """Benchmarks make their fleets in bulk (a writer thread, no audit in the
    writer): the records, their timestamps and hash chain must be the same."""
    import sqlite3

    folder = tmp_path / "journals"  # the fixture's folder name: the same run names
    folder.mkdir()
    config = SimConfig(requests=60, blocks=32, seed=5)
    made = simulate_fleet(
        config, str(folder), engines=3, legacy_engines=1, shared_store=True, bulk=True
    )
    assert len(made) == 3
    for name in sorted(p.name for p in fleet.glob("*.db")):
        rows = []
        for path in (fleet / name, folder / name):
            with sqlite3.connect(path) as db:
                rows.append(db.execute("SELECT * FROM records ORDER BY seq").fetchall())
        assert rows[0] == rows[1] and len(rows[0]) > 100, name


def test_the_fleet_command_in_bulk_writes_the_same_journals(
    fleet: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    import kvstate.harness.sim.shared_store as sim_fleet

    asked: list[bool] = []

    def spy(*args: object, **kwargs: object) -> object:
        asked.append(bool(kwargs.get("bulk")))
        return simulate_fleet(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_fleet, "simulate_fleet", spy)
    folder = tmp_path / "journals"
    argv = ["run", "--journal", str(folder), "--engines", "3", "--legacy-engines", "1"]
    argv += ["--store", "shared", "--requests", "60", "--blocks", "32", "--seed", "5", "--bulk"]
    assert main(argv) == 1  # the legacy engine's violations
    assert asked == [True]
    capsys.readouterr()
    for name in ("engine-001.db", "engine-003.db"):
        with sqlite3.connect(fleet / name) as a, sqlite3.connect(folder / name) as b:
            query = (
                "SELECT seq, kind, step, rank, ts, payload FROM records WHERE seq > 0 ORDER BY seq"
            )
            assert a.execute(query).fetchall() == b.execute(query).fetchall(), name


def test_duckdb_draws_no_progress_bar_into_the_output(fleet: Path, tmp_path: Path) -> None:
    """A query over a fleet's facts runs for seconds, and DuckDB then draws a
    progress bar on stdout, inside fleet-check's --json and --sql output."""
    verdicts = check_runs(group([str(fleet)]), str(tmp_path / "f"), workers=1)
    con = connect([v.facts for v in verdicts if v.facts])
    try:
        assert con.execute("SELECT current_setting('enable_progress_bar')").fetchone() == (False,)
    finally:
        con.close()


@pytest.mark.parametrize("command", ["replay", "fleet-check"])
def test_the_ray_switch_never_takes_the_path_for_an_address(command: str) -> None:
    from replay.cli import build_parser
    from replay.cli._common import ray_address

    args = build_parser().parse_args([command, "--ray", "runs/"])
    assert args.paths == ["runs/"] and ray_address(args) is None
    args = build_parser().parse_args([command, "--ray-address", "ray://head:10001", "runs/"])
    assert args.paths == ["runs/"] and ray_address(args) == "ray://head:10001"
    assert ray_address(build_parser().parse_args([command, "runs/"])) is False


def test_fleet_check_writes_nothing_into_the_folder_it_checks(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.name for p in fleet.iterdir())
    main(["fleet-check", str(fleet)])
    out = capsys.readouterr().out
    assert sorted(p.name for p in fleet.iterdir()) == before
    for name in before:  # every run named with its files
        assert name in out
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "kvstate" / "facts"
    assert any(cache.rglob("*.parquet"))
