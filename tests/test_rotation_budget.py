"""The byte budget holds, or says why it cannot (issue 45, item 3).

Each segment of a journal that keeps a budget begins with a checkpoint,
which grows with the history it carries. Where it outgrows the rotation
size asked, the rotation size in force grows to it (a segment never holds
fewer bytes of records than of checkpoint), said once on stderr and
published; where the budget cannot hold the segment being written at its
full size, that is said and published too, never overrun in silence; and
the journal's files stay within the budget at every commit otherwise.

The journal layer is checked with an opaque checkpoint of a chosen size;
kvstate's own, through a recorder's writer process and its ``/metrics``.
"""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

import msgpack
import pytest

from journal import Journal
from journal import segments as seg
from journal.rotation import Rotation
from journal.segments import Rotating, file_bytes

ROTATE = 16_384


def _rotating(first: Path, rotation: Rotation, size: list[int]) -> Rotating:
    """A writer whose checkpoint is ``size[0]`` bytes that do not compress,
    and a few bytes naming the seq it follows."""

    def checkpoint() -> list[bytes]:
        return [os.urandom(size[0]), b"after-%d" % rotating.journal.head()[0]]

    rotating = Rotating(Journal(first), rotation, synchronous="NORMAL", checkpoint=checkpoint)
    return rotating


def _journal_bytes(first: Path) -> int:
    """What the journal's files take on disk now (each with its log)."""
    return sum(file_bytes(path) for _, path in _present(first))


def _present(first: Path) -> list[tuple[int, str]]:
    head = [(1, str(first))] if first.exists() else []
    return head + [(int(p.split(".")[-2]), p) for p in seg.later_segments(str(first))]


def _commit(rotating: Rotating, c: int) -> None:
    """Commit ``c``: ten records of some 200 bytes each, then the writer's
    rotation check (and its retention)."""
    pack = msgpack.packb
    rotating.journal.append_rows(
        [(c * 10 + i, "k", c, None, c, pack({"n": "x" * 200})) for i in range(1, 11)]
    )
    rotating.committed()


def test_a_checkpoint_over_the_rotation_size_grows_it_once_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "engine.db"
    rotation = Rotation(max_bytes=ROTATE, keep_bytes=10_000_000)
    size = [3 * ROTATE]
    rotating = _rotating(first, rotation, size)
    c = 0
    while rotating.index < 2:
        _commit(rotating, c)
        c += 1
    checkpoint = size[0] + len(b"after-%d" % rotating.journal.head()[0])
    assert rotation.checkpoint_bytes == checkpoint
    assert rotation.rotate_bytes == checkpoint > ROTATE
    # the records of the new segment: more than the size asked, fewer than
    # its checkpoint, and it is not due yet
    begun = file_bytes(rotating.journal.path)
    while file_bytes(rotating.journal.path) - begun < 2 * ROTATE:
        _commit(rotating, c)
        c += 1
    assert rotating.index == 2 and not rotation.due(rotating.journal)
    while rotating.index < 5:
        _commit(rotating, c)
        c += 1
    rotating.journal.close()
    said = [x for x in capsys.readouterr().err.splitlines() if "rotation size" in x]
    assert len(said) == 1, said  # the same growth each time: said once
    assert f"its checkpoint is {checkpoint} bytes" in said[0]
    assert f"rotates at {checkpoint} bytes of records" in said[0]
    seqs = []
    for journal in seg.segments(first):
        with journal:
            seqs += [row[0] for row in journal.stored_rows()]
    assert seqs == list(range(1, c * 10 + 1))


def test_a_rotation_size_over_the_checkpoint_stays_as_asked(tmp_path: Path) -> None:
    first = tmp_path / "engine.db"
    rotation = Rotation(max_bytes=ROTATE, keep_bytes=10_000_000)
    rotating = _rotating(first, rotation, [ROTATE // 4])
    for c in range(60):
        _commit(rotating, c)
    rotating.journal.close()
    assert rotating.index >= 3 and rotation.rotate_bytes == ROTATE
    assert 0 < rotation.checkpoint_bytes < ROTATE and rotation.short_bytes == 0


def test_the_journal_stays_within_its_budget_at_every_commit(tmp_path: Path) -> None:
    """With checkpoints over the rotation size, and growing: after every
    commit (and the writer's rotation and retention that follow it) the
    journal's files hold no more than the budget, and retention had to
    remove segments to keep it."""
    first = tmp_path / "engine.db"
    keep = 400_000
    rotation = Rotation(max_bytes=ROTATE, keep_bytes=keep)
    size = [2 * ROTATE]
    rotating = _rotating(first, rotation, size)
    peak = 0
    for c in range(400):
        size[0] = 2 * ROTATE + 40 * c  # a history that grows as records come
        _commit(rotating, c)
        assert rotation.short_bytes == 0
        peak = max(peak, _journal_bytes(first))
        assert peak <= keep, (c, peak, rotation.rotate_bytes)
    rotating.journal.close()
    assert len(rotating.removed) >= 3 and not first.exists()
    assert rotation.rotate_bytes == rotation.checkpoint_bytes > 2 * ROTATE
    assert peak > keep // 2  # the budget was what bounded it


def test_a_budget_that_cannot_hold_the_segment_says_so_and_by_how_much(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget the rotation allows (twice its size) but whose segments'
    checkpoints outgrow it: what it lacks is kept and said, retention
    removes every older segment, and the journal goes over the budget by no
    more than it said. A checkpoint that shrinks again: it holds again."""
    first = tmp_path / "engine.db"
    keep = 2 * ROTATE * 4
    rotation = Rotation(max_bytes=ROTATE, keep_bytes=keep)
    size = [keep // 2]
    rotating = _rotating(first, rotation, size)
    c, first_short = 0, 0
    while rotating.index < 4:
        _commit(rotating, c)
        c += 1
        if rotating.index > 1:
            first_short = first_short or rotation.short_bytes
            assert rotation.short_bytes > 0
            # over the budget by no more than said, every older segment removed
            assert _journal_bytes(first) <= keep + rotation.short_bytes
            assert [p for _, p in _present(first)] == [rotating.journal.path]
    said = capsys.readouterr().err
    assert said.count(f"the budget of {keep} bytes cannot hold the segment") == 1, said
    assert f"goes up to {first_short} bytes over its budget" in said
    size[0] = 1_000
    while rotating.index < 6:
        _commit(rotating, c)
        c += 1
    rotating.journal.close()
    assert rotation.short_bytes == 0 and rotation.rotate_bytes == ROTATE
    assert "the budget holds again" in capsys.readouterr().err


def test_a_folder_of_journals_holds_the_sum_of_their_budgets(tmp_path: Path) -> None:
    """``retain_bytes`` is each journal's (under vLLM: the scheduler's and
    each worker's): the folder holds up to their sum, more than any one
    budget, so ``kvstate watch --disk-budget`` is given at least the sum."""
    keep = 200_000
    writers = []
    for role in ("scheduler", "worker-0", "worker-1"):
        rotation = Rotation(max_bytes=ROTATE, keep_bytes=keep)
        writers.append(_rotating(tmp_path / f"{role}.db", rotation, [ROTATE]))
    peak = 0
    for c in range(100):
        for rotating in writers:
            _commit(rotating, c)
        folder = sum(p.stat().st_size for p in tmp_path.iterdir())
        assert folder <= len(writers) * keep
        peak = max(peak, folder)
    for rotating in writers:
        rotating.journal.close()
        assert rotating.removed and rotating.rotation is not None
        assert rotating.rotation.short_bytes == 0
    assert keep < peak <= len(writers) * keep


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _jobs(rec: object, n: int) -> None:
    """``n`` store jobs on one rank, a commit each (their history is what
    the checkpoint carries)."""
    from kvstate import JobSpec, SchedulerLedger, WorkerLedger

    sched = SchedulerLedger(rec)  # type: ignore[arg-type]
    worker = WorkerLedger(0, rec)  # type: ignore[arg-type]
    for i in range(n):
        req = f"r{i}"
        sched.begin_step()
        sched.admit(req, 16)
        sched.assign_blocks(req, [i % 64], resumed=False)
        keys = [f"k{i:x}"]
        job = sched.enqueue_store_job(req, 0, 16, keys)
        worker.register(JobSpec(job, req, sched.current_gen(req), keys))
        with worker.run(job) as run:
            run.dma_started()
            run.dma_done(digest=i)
            run.put_done(stored=1, existed=0)
            run.save_offset(16)
        sched.update_connector_output(WorkerLedger.aggregate([worker.take_completed()]))
        sched.release_ready()
        sched.request_finished(req)
        worker.preemption_seen(req, 0)
        worker.retire(req, 0)
        rec.commit()  # type: ignore[attr-defined]


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("kvstate_journal_"):
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            values[name] = float(value)
    return values


@pytest.mark.parametrize("keep", [10_000_000, 16_384])
def test_the_writer_process_grows_the_rotation_size_and_publishes_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], keep: int
) -> None:
    """kvstate's own checkpoint, through ``Recorder.open``: it outgrows a
    rotation size of 8 KiB, and the writer's ``/metrics`` shows the size in
    force, the checkpoint and (a budget of 16 KiB) what the budget lacks;
    the writer's stderr says both."""
    from kvstate import Recorder

    address = f"127.0.0.1:{_port()}"
    path = tmp_path / "engine.db"
    rec = Recorder.open(path, block_size=16, world_size=1, metrics=address,
                        rotate_bytes=8_192, retain_bytes=keep)  # fmt: skip
    try:
        _jobs(rec, 300)
        rec.commit(settle=True)
        rec.commit(settle=True)  # answered once the rotation after the one before is done
        figures = _scrape(address)
        disk = sum(file_bytes(p) for _, p in _present(path))
    finally:
        rec.close(raise_found=False)
    err = capfd.readouterr().err
    checkpoint = figures["kvstate_journal_checkpoint_bytes"]
    assert checkpoint > 8_192 and figures["kvstate_journal_rotate_bytes"] == checkpoint
    assert "more than the rotation size of 8192" in err
    short = figures["kvstate_journal_budget_short_bytes"]
    if keep == 16_384:
        assert short > 0 and f"the budget of {keep} bytes cannot hold" in err
        assert disk <= keep + short
    else:
        assert short == 0 and "cannot hold" not in err
        assert disk <= keep


def test_the_sizes_are_published_where_known_and_absent_where_not() -> None:
    from kvstate.figures import Figures
    from kvstate.prometheus import FiguresCollector

    names = ("rotate_bytes", "checkpoint_bytes", "budget_short_bytes")
    known = Figures(journal="w.db", rotate_bytes=300_000, checkpoint_bytes=300_000)
    known.budget_short_bytes = 1234
    unknown = Figures(journal="watched.db")  # kvstate watch knows none of them
    published: dict[tuple[str, str], float] = {}
    for family in FiguresCollector(lambda: [known, unknown]).collect():
        for sample in family.samples:
            published[sample.name, sample.labels.get("journal", "")] = sample.value
    for name in names:
        assert published[f"kvstate_journal_{name}", "w.db"] == getattr(known, name)
        assert (f"kvstate_journal_{name}", "watched.db") not in published
