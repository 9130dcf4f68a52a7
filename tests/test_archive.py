"""Parking settled state changes memory, never a verdict.

Every journal here is folded twice: by a ledger that keeps everything, and by
one that parks whatever has settled after every single record (the most
parking and unparking any journal can cause). Findings, record by record,
and the whole ledger at the end must be identical.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.archive import Archive
from kvstate.codec import Entry
from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.faults import Faults
from kvstate.harness.sim.runtime import simulate
from kvstate.harness.zoo import CASES, run_case
from kvstate.ledger import Ledger
from replay import replay
from replay.sources import entries


def fold_both(items: list[Entry]) -> tuple[Ledger, Ledger, int]:
    keeping = Ledger()
    parking = Ledger(archive=Archive(), park_after=1, sweep_every=1)
    findings = 0
    for entry in items:
        kept = keeping.apply(entry.seq, entry.step, entry.event)
        parked = parking.apply(entry.seq, entry.step, entry.event)
        assert [v.to_dict() for v in parked] == [v.to_dict() for v in kept], entry
        findings += len(kept)
    assert [v.to_dict() for v in parking.end()] == [v.to_dict() for v in keeping.end()]
    return keeping, parking, findings


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("policy", ["kvstate", "legacy"])
def test_zoo_cases_fold_the_same_parked(name: str, policy: str) -> None:
    items = run_case(CASES[name], policy).entries or []
    keeping, parking, _ = fold_both(items)
    assert parking == keeping


@pytest.mark.parametrize(
    ("policy", "faults"),
    [
        ("kvstate", ""),
        ("legacy", ""),
        ("kvstate", "put-fail=0.2,evict=0.3"),
        ("legacy", "evict=0.2,no-space=0.1"),
    ],
)
def test_simulated_runs_fold_the_same_parked(tmp_path: Path, policy: str, faults: str) -> None:
    path = tmp_path / "run.db"
    config = SimConfig(requests=60, policy=policy, faults=Faults.parse(faults), seed=3)
    simulate(config, journal=str(path))
    keeping, parking, findings = fold_both(list(entries([str(path)])))
    assert parking.archive.keys(), "nothing was parked: the test proves nothing"
    assert parking == keeping
    if policy == "legacy":
        assert findings, "the legacy run found nothing to compare"


def test_late_records_bring_parked_state_back(tmp_path: Path) -> None:
    """A second report and a second release of long-settled jobs are judged as if
    nothing had been parked (DOUBLE_REPORT and PIN_MISMATCH name the old seqs)."""
    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=5), journal=str(path))
    items = [e for e in entries([str(path)]) if e.event.kind != "engine_idle"]
    first_report = next(e for e in items if e.event.kind == "job_reported")
    first_release = next(e for e in items if e.event.kind == "pins_released")
    last = items[-1].seq
    late = [
        Entry(last + 1, items[-1].step, None, first_report.event),
        Entry(last + 2, items[-1].step, None, first_release.event),
    ]
    keeping, parking, _ = fold_both([*items, *late])
    assert parking == keeping
    codes = [v.code.value for v in keeping.apply(last + 3, items[-1].step, late[0].event)]
    assert codes == ["DOUBLE_REPORT"]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), requests=st.integers(4, 30))
def test_any_simulated_run_folds_the_same_parked(seed: int, requests: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "run.db")
        simulate(SimConfig(requests=requests, seed=seed, policy="legacy"), journal=path)
        keeping, parking, _ = fold_both(list(entries([path])))
    assert parking == keeping


def test_replay_result_shows_the_whole_ledger(tmp_path: Path) -> None:
    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=1), journal=str(path))
    result = replay([str(path)])
    keeping, _, _ = fold_both(list(entries([str(path)])))
    assert result.ledger == keeping
    assert len(result.ledger.jobs) == len(keeping.jobs)


def test_copies_share_what_was_parked_and_stay_independent() -> None:
    a = Archive()
    a.put(("job", 1), b"one")
    a.put(("job", 2), b"two")
    a.key_written("k", 10, 1)
    b = a.copy()
    assert a.take(("job", 1)) == b"one" and a.take(("job", 1)) is None
    assert b.take(("job", 1)) == b"one"  # the copy still has it
    b.put(("job", 3), b"three")
    assert a.take(("job", 3)) is None and len(a) == 1 and len(b) == 2
    assert sorted(b.keys()) == [("job", 2), ("job", 3)] and list(a.keys()) == [("job", 2)]
    b.take(("job", 2))
    assert list(b.keys()) == [("job", 3)]
    # Parked again and taken again: the older version below stays hidden.
    b.put(("job", 2), b"two again")
    assert b.take(("job", 2)) == b"two again" and b.take(("job", 2)) is None
    assert a.take(("job", 2)) == b"two"
    # One key log; each reads only the writes before the record it is at.
    b.key_written("k", 20, 2)
    a.key_written("k", 20, 2)  # a refold logs the same write: kept once
    assert a.key_writers("k", 15) == ((10,), 1)
    assert b.key_writers("k", 21) == ((10, 20), 1)
    assert a.key_writers("k", 10) == ((), None)


def test_time_travel_with_parking_matches_replay_at_every_target(tmp_path: Path) -> None:
    from replay.timetravel import TimeTravel

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=2, policy="legacy"), journal=str(path))
    travel = TimeTravel(str(path), snapshot_every=50, park_after=1, sweep_every=1)
    travel.index()
    for target in (travel.last_seq, 700, 1234, 3, 1233, 400, travel.last_seq - 1):
        assert travel.ledger_at(target) == replay([str(path)], at=target).ledger, target
    travel.stop()


def test_a_spare_ledger_folded_in_advance_changes_no_answer(tmp_path: Path) -> None:
    """The inspector folds a spare ledger behind the cursor while idle; going
    back from it, forward from it, or past it, and stopping it part-way, must
    all give the ledger that replay --at gives."""
    from replay.timetravel import TimeTravel

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=2, policy="legacy"), journal=str(path))
    travel = TimeTravel(str(path), snapshot_every=500, park_after=1, sweep_every=1)
    travel.index()
    calls = 0

    def after_one_check() -> bool:
        nonlocal calls
        calls += 1
        return calls > 1

    steps = [
        ("at", 1500), ("prepare", 1480), ("at", 1490), ("at", 1500),
        ("prepare", 1200), ("at", 1100), ("at", 1250),
        ("stop", 900), ("at", 950), ("at", 880),
        ("prepare", travel.last_seq), ("at", travel.last_seq - 3), ("at", travel.last_seq),
    ]  # fmt: skip
    for what, seq in steps:
        if what == "prepare":
            travel.prepare(seq)
        elif what == "stop":
            calls = 0
            travel.prepare(seq, cancel=after_one_check)  # stopped after 256 records
            assert travel._spare is not None and travel._spare[0] < seq
        else:
            assert travel.ledger_at(seq) == replay([str(path)], at=seq).ledger, (what, seq)
            held = [h[1] for h in (travel._cursor, travel._spare) if h is not None]
            assert len({id(h) for h in held}) == len(held), "the spare is the cursor's ledger"
    travel.stop()


def test_step_start_finds_the_step_before_wherever_it_starts(tmp_path: Path) -> None:
    from replay.timetravel import TimeTravel

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=2, policy="legacy"), journal=str(path))
    travel = TimeTravel(str(path))
    items = list(entries([str(path)]))
    step_of = {e.seq: e.step for e in items}
    sched = [e for e in items if e.event.side != "worker"]
    for here in range(2, travel.last_seq + 1, 37):
        back = travel.step_start(here, -1)
        earlier = [e for e in items if e.seq < here and e.step < step_of[here]]
        if not earlier:
            assert back == 1
            continue
        previous = earlier[-1].step
        assert back == min(e.seq for e in items if e.seq < here and e.step == previous), here
    assert sched, "no scheduler records: the test proves nothing"
    travel.stop()


@pytest.mark.parametrize("policy", ["kvstate", "legacy"])
@pytest.mark.parametrize("faults", ["put-fail=0.1", "no-space=0.3,evict=0.2", "thread-crash@200"])
def test_live_ledgers_that_park_decide_the_same(tmp_path: Path, policy: str, faults: str) -> None:
    """The guards a connector embeds park the generation of every request that
    ended; given a SpillArchive (what a connector passes as archive=) that goes
    to disk, and not one decision changes: the journals are the same, record
    for record, and so are the run's counts."""
    from kvstate.harness.sim.runtime import Simulation
    from kvstate.spill import SpillArchive

    parked: list[int] = []
    spills: list[SpillArchive] = []

    def run(name: str, *, spill: bool) -> tuple[object, list[object]]:
        config = SimConfig(requests=48, policy=policy, seed=4, faults=Faults.parse(faults))
        sim = Simulation(config, journal=str(tmp_path / name))
        guards = [sim.sched_ledger, *(w.ledger for w in sim.workers)]
        archives = [g._gens._archive for g in guards]
        if spill:
            archives = [SpillArchive() for _ in guards]
            spills.extend(archives)
            for guard, archive in zip(guards, archives, strict=True):
                guard._gens._archive = archive
        try:
            summary = sim.run()
            parked.append(sum(len(a) for a in archives))
        finally:
            sim.close()
        records = [(e.event.kind, e.event) for e in entries([str(tmp_path / name)])]
        return attrs.evolve(summary, elapsed_s=0.0, journal=None), records

    kept_summary, kept = run("kept.db", spill=False)
    spilled_summary, spilled = run("spilled.db", spill=True)
    assert spilled == kept and spilled_summary == kept_summary
    assert len(kept) > 1000
    assert parked[0] > 0 and parked[1] > 0, parked  # both parked, the second on disk
    assert all(not s.in_memory for s in spills), "the spill fell back to memory"
    for s in spills:
        s.close()


def fold_with(archive: Archive, items: list[Entry]) -> tuple[Ledger, list[dict[str, object]]]:
    ledger = Ledger(archive=archive, park_after=1, sweep_every=1)
    found = [v.to_dict() for e in items for v in ledger.apply(e.seq, e.step, e.event)]
    return ledger, found + [v.to_dict() for v in ledger.end()]


def test_the_spill_archive_folds_like_the_memory_one(tmp_path: Path) -> None:
    from kvstate.spill import SpillArchive

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=60, seed=6, policy="legacy"), journal=str(path))
    items = list(entries([str(path)]))
    keeping, _, _ = fold_both(items)
    spill = SpillArchive()
    spilled, found = fold_with(spill, items)
    _, expected = fold_with(Archive(), items)
    assert found == expected and spilled == keeping
    assert not spill.in_memory and len(spill) > 0


def test_a_full_disk_keeps_the_rest_in_memory_and_changes_nothing(tmp_path: Path) -> None:
    """SQLITE_FULL part-way (the temporary database may not grow): what could not
    be written stays in memory, and every finding is still the same."""
    from kvstate.spill import SpillArchive

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=60, seed=6, policy="legacy"), journal=str(path))
    items = list(entries([str(path)]))
    keeping, _, _ = fold_both(items)
    _, expected = fold_with(Archive(), items)
    spill = SpillArchive()
    assert spill._db is not None
    pages = spill._db.execute("PRAGMA page_count").fetchone()[0]
    spill._db.execute(f"PRAGMA max_page_count = {pages + 3}")
    spilled, found = fold_with(spill, items)
    assert spill.in_memory, "the disk never filled up: the test proves nothing"
    assert found == expected and spilled == keeping


def test_unreadable_temporary_storage_is_an_error_not_a_wrong_answer() -> None:
    from kvstate.errors import TemporaryStorageError
    from kvstate.spill import SpillArchive

    spill = SpillArchive()
    spill.put(("job", 1), b"x")
    spill._flush_puts()
    assert spill._db is not None
    spill._db.close()
    with pytest.raises(TemporaryStorageError, match=r"temporary storage .* not at fault"):
        spill.take(("job", 2))


def test_a_full_tmpdir_is_blamed_on_the_environment_not_the_journal(tmp_path: Path) -> None:
    """A 64 KiB tmpfs as TMPDIR: replay of a journal whose parked state
    outgrows it exits 3 (the environment), naming where, with no traceback;
    with room, the same journal replays."""
    import os
    import subprocess
    import sys

    tiny = tmp_path / "tiny"
    tiny.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)]
    if subprocess.run(mount, capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (it needs root)")
    try:
        journal = tmp_path / "legacy.db"
        simulate(SimConfig(requests=3000, seed=1, policy="legacy"), journal=str(journal))
        done = subprocess.run(
            [sys.executable, "-m", "replay", "replay", str(journal), "--limit", "1"],
            env={**os.environ, "TMPDIR": str(tiny)},
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 3, done.stderr[-2000:]
        assert f"{tiny} ($TMPDIR)" in done.stderr and "not at fault" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        subprocess.run(["umount", str(tiny)], check=False)
    assert replay([str(journal)]).verdict == "violations"  # the journal was fine


@pytest.mark.parametrize("spill", [False, True])
def test_a_long_running_worker_keeps_what_is_live(spill: bool) -> None:
    """A worker ledger that saved thousands of jobs keeps in memory only what
    is live: the generation of each ended request is parked, and comes back
    when the request is named again. Given a SpillArchive, what is parked is
    on disk: memory holds none of it. (What the audit keeps is the fold's
    business; it is off here.)"""
    from kvstate import JobSpec, Recorder, WorkerLedger
    from kvstate.errors import DuplicateJobError
    from kvstate.spill import SpillArchive

    rec = Recorder.in_memory(block_size=16, world_size=1, audit="off")
    archive = SpillArchive() if spill else Archive()
    worker = WorkerLedger(0, rec, archive=archive)
    for job in range(3000):
        req = f"r{job}"
        worker.register(JobSpec(job, req, 0, (f"k{job}",)))
        with worker.run(job) as run:
            run.put_done(stored=1, existed=0)
            run.save_offset(16)
        worker.preemption_seen(req, 0)
        assert worker.retire(req, 0)
    assert worker.jobs_received == 3000
    assert not worker._specs and not worker._running and not worker._pending
    assert len(worker._gens) == 0 and len(archive) == 3000
    if isinstance(archive, SpillArchive):
        # nothing parked in memory but the batch not yet written
        archive._flush_puts()
        assert not archive.in_memory and not archive._top.own and not archive._puts
    # a parked request's generation comes back when named
    assert not worker.is_live(7) and worker.newest_gen("r7") == 0
    assert worker.retire("r7", 0)  # nothing outstanding
    with pytest.raises(DuplicateJobError):
        worker.register(JobSpec(7, "r7", 0, ("k7",)))  # still a duplicate


def test_the_parked_id_filter_never_says_no_to_a_member() -> None:
    """Past the first filter's capacity too (it grows by larger ones); "maybe"
    for a non-member is rare, and only costs a lookup that finds nothing."""
    from kvstate._maybe import MaybeSet

    seen = MaybeSet()
    members = [("job", i) for i in range(250_000)] + [f"req-{i}" for i in range(1000)]
    for m in members:
        seen.add(m)
    assert all(m in seen for m in members)
    wrong = sum(("job", -i) in seen for i in range(1, 20_001))
    assert wrong < 20_000 * 0.05, wrong
