"""Per-process journals merge the same whatever order they are named in.

The scheduler and each rank write their own file. Replay merges them by
``ts``; where ``ts`` ties (a coarse clock; the simulator's virtual clock ties
whole steps), the protocol's causality orders them (replay/interleave.py).
The simulator's one-file journals are the ground truth: split per process,
merged in every order, they must give exactly the findings of the one file.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from journal import write_jsonl
from kvstate.codec import Entry, to_record
from kvstate.events import rank_of
from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.runtime import simulate
from replay import replay
from replay.cli import main
from replay.sources import read_path

from .builder import JournalBuilder


def split(path: Path) -> list[str]:
    """One JSON Lines file per process, each with the header and its own records
    (their ``ts`` kept: the virtual clock's, full of ties)."""
    entries = [located.entry for located in read_path(str(path))]
    header, rest = entries[0], entries[1:]
    files: dict[str, list[Entry]] = {}
    for entry in rest:
        rank = rank_of(entry.event)
        files.setdefault("sched" if rank is None else f"rank{rank}", []).append(entry)
    paths = []
    for name, items in sorted(files.items()):
        out = path.parent / f"{name}.jsonl"
        write_jsonl((to_record(e) for e in [header, *items]), out)
        paths.append(str(out))
    return paths


def findings(paths: list[str]) -> list[tuple[object, ...]]:
    result = replay(paths)
    return sorted(
        (v.code.value, v.job, v.req, v.gen, v.rank, v.block, v.key)
        for v in result.violations + result.warnings
    )


@pytest.mark.parametrize(
    "policy", ["kvstate", "legacy"], ids=["clean run", "legacy run with violations"]
)
def test_every_order_of_the_files_gives_the_one_files_findings(tmp_path: Path, policy: str) -> None:
    one = tmp_path / "run.db"
    simulate(
        SimConfig(policy=policy, world_size=2, requests=120, blocks=48, seed=5), journal=str(one)
    )
    expected = findings([str(one)])
    # the run really is what the test needs: ties everywhere, and for legacy
    # findings that depend on the scheduler's and the ranks' interleaving
    ts = [located.entry.ts for located in read_path(str(one))]
    assert len(ts) - len(set(ts)) > len(ts) // 2
    codes = {f[0] for f in expected}
    if policy == "legacy":
        assert {"POISONED_READ", "PREMATURE_RETIRE", "STALE_GENERATION"} <= codes
    else:
        assert not expected
    paths = split(one)
    assert len(paths) == 3
    for order in itertools.permutations(paths):
        assert findings(list(order)) == expected, order


def tied(world: int = 1) -> tuple[JournalBuilder, JournalBuilder]:
    """A scheduler and a rank journal whose records all carry the same ts."""
    return JournalBuilder(world_size=world), JournalBuilder(world_size=world)


def write_tied(tmp_path: Path, *builders: JournalBuilder) -> list[str]:
    paths = []
    for i, builder in enumerate(builders):
        for record in builder.records:
            record["ts"] = 0 if record["kind"] == "journal_opened" else 100
        paths.append(str(builder.write(tmp_path / f"{i}.jsonl")))
    return paths


def test_ties_follow_causality_not_the_argument_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sched, rank = tied()
    sched.admit("a", blocks=[1])
    sched.enqueue(0, "a", 0, reads=[1])
    sched.add("completions_received", job=0, count=1)
    sched.add("pins_released", job=0, blocks=[1])
    sched.add("request_finished", req="a", gen=0)
    sched.add("engine_idle")
    rank.run(0)
    rank.add("request_retired", req="a", gen=0, rank=0)
    paths = write_tied(tmp_path, sched, rank)
    for order in (paths, paths[::-1]):
        # rank first: job_received would precede job_enqueued (CAUSALITY), and
        # engine_idle would precede the rank's records (UNFINISHED)
        assert main(["replay", "--require-idle", *order]) == 0, capsys.readouterr()


def test_a_clock_going_backwards_in_one_file_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sched, rank = tied()
    sched.admit("a", blocks=[1])
    sched.enqueue(0, "a", 0, reads=[1])
    rank.run(0)
    a, b = write_tied(tmp_path, sched, rank)
    lines = Path(b).read_text().splitlines()
    lines[2] = lines[2].replace('"ts": 100', '"ts": 50')
    Path(b).write_text("\n".join(lines) + "\n")
    assert main(["replay", a, b]) == 2
    err = capsys.readouterr().err
    assert "1.jsonl:3 (seq 3): ts goes backwards (50 after 100)" in err
    # alone, the file's own order is all replay needs
    assert main(["replay", b]) == 1  # (a rank's records without their scheduler)
    assert "ts goes backwards" not in capsys.readouterr().err


def test_journals_of_different_runs_or_one_file_twice_are_not_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    simulate(SimConfig(requests=10, seed=1), journal=str(a))
    simulate(SimConfig(requests=10, seed=2), journal=str(b))
    # merged, two runs' ids collide: a verdict about a run that never happened
    for argv in (
        ["replay", str(a), str(b)],
        ["timeline", str(a), str(b), "--req", "req-1"],
        ["export", "--format", "jsonl", str(a), str(b), str(tmp_path / "out.jsonl")],
        ["convert", str(a), str(b), str(tmp_path / "out.db")],
    ):
        assert main(argv) == 2, argv
        assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.db").exists()
        err = capsys.readouterr().err
        assert f"{b}: a journal of run 'sim-" in err and "different runs" in err, err
    assert main(["replay", str(a), str(a)]) == 2
    assert "named twice" in capsys.readouterr().err
    (tmp_path / "link.db").symlink_to(a)
    assert main(["replay", str(a), str(tmp_path / "link.db")]) == 2
    assert "named twice" in capsys.readouterr().err
    # merging different runs is possible, on purpose, into a file of its own
    assert main(["convert", "--mixed-runs", str(a), str(b), str(tmp_path / "both.db")]) == 0
    capsys.readouterr()
    assert main(["replay", "--json", str(tmp_path / "both.db")]) == 1  # ids collide, as said


def test_a_copy_of_one_process_journal_is_not_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sched, rank = tied()
    sched.records[0].update(run="r1", role="scheduler")
    rank.records[0].update(run="r1", role="worker-0")
    sched.admit("a", blocks=[1])
    paths = write_tied(tmp_path, sched, rank)
    assert main(["replay", *paths]) == 0
    copy = tmp_path / "copy.jsonl"
    copy.write_text(Path(paths[0]).read_text())
    assert main(["replay", *paths, str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"{copy}: the scheduler journal of run 'r1', and so is {paths[0]}" in err


def test_a_job_whose_world_size_contradicts_the_header_is_unusable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    j = JournalBuilder(world_size=1)
    j.admit("a", blocks=[1])
    seq = j.enqueue(0, "a", 0, reads=[1])
    j.records[seq - 1]["world_size"] = 4
    assert main(["replay", str(j.write(tmp_path / "w.jsonl"))]) == 2
    err = capsys.readouterr().err
    assert f"w.jsonl:{seq} (seq {seq}): job_enqueued says world_size=4 for job 0" in err


def test_every_run_names_itself_and_its_processes_share_the_name(tmp_path: Path) -> None:
    def header(path: Path) -> object:
        return next(read_path(str(path))).entry.event

    simulate(SimConfig(requests=4, seed=1), journal=str(tmp_path / "1.db"))
    simulate(SimConfig(requests=4, seed=1), journal=str(tmp_path / "1again.db"))
    simulate(SimConfig(requests=4, seed=2), journal=str(tmp_path / "2.db"))
    one, again, two = (header(tmp_path / n) for n in ("1.db", "1again.db", "2.db"))
    assert one.run == again.run != two.run  # type: ignore[attr-defined]
    # the vLLM observer: the engine's instance id, which every process it starts has
    from types import SimpleNamespace

    from kvstate.vllm._journals import run_name

    config = SimpleNamespace(instance_id="ab12c", kv_transfer_config=None)
    assert run_name(config) == "vllm-ab12c"
    named = SimpleNamespace(kv_connector_extra_config={"kvstate_run": "host7-0930"})
    assert run_name(SimpleNamespace(instance_id="ab12c", kv_transfer_config=named)) == "host7-0930"
    assert run_name(None) == run_name(None)  # one process, one fallback name
