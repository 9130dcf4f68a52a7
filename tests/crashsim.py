"""A journal writer to kill: the ledgers driven through steps of a small,
clean workload, reporting after each ``begin_step`` the last seq whose commit
returned. Used by the kill tests and by the soak command
(``python -m tests.crashsim --kills 5000``; ``--writer retain`` kills the
writer process itself while it rotates and removes segments).

After every SIGKILL the journal must open, its hash chain must verify, every
record whose commit returned must be there, and replay must work on it.

``writer`` is where the journal is written: ``thread`` (a thread of the
killed process: SQLite's own durability under SIGKILL) or ``process`` (the
default writer process, which outlives the kill long enough to write what
it was handed and end the journal with ``engine_crashed``).
"""

from __future__ import annotations

import argparse
import os
import random
import select
import signal
import sys
import tempfile
import time

from journal import Journal
from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger

#: the rotation and retention of ``writer="retain"``: a segment every few
#: steps, so that a kill at a random moment often lands in a rotation
RETAIN = {"rotate_bytes": 65_536, "retain_bytes": 3 * 65_536}


def drive(
    path: str, report_fd: int, seed: int, synchronous: str = "NORMAL", writer: str = "thread"
) -> None:
    """Write steps forever (until killed), reporting each committed seq on ``report_fd``
    (and first, with the writer process, ``pid N``: that process's id).

    ``writer="retain"``: the writer process, rotating into small segments and
    removing the oldest (:data:`RETAIN`); each step's commit waits until it
    is durable before its seq is reported, since the kill is for the writer."""
    rng = random.Random(seed)
    retain = writer == "retain"
    rec = Recorder.open(
        path,
        block_size=4,
        world_size=2,
        synchronous=synchronous,
        process=writer in ("process", "retain"),
        **(RETAIN if retain else {}),  # type: ignore[arg-type]
    )
    sched = SchedulerLedger(rec)
    workers = [WorkerLedger(r, rec) for r in range(2)]
    free = list(range(64))
    running: dict[str, list[int]] = {}
    n = 0
    while True:
        if retain:
            rec.commit()  # returns once durable in the writer process
        committed = rec.recorded  # every record so far: begin_step commits them
        step = sched.begin_step()
        if step == 1 and writer in ("process", "retain"):  # it starts at the first commit
            os.write(report_fd, f"pid {rec.writer.pid}\n".encode())  # type: ignore[union-attr]
        os.write(report_fd, f"{committed}\n".encode())
        for w in workers:
            w.begin_step(step)
        if len(running) < 4 and len(free) >= 2:
            req = f"r{n}"
            n += 1
            sched.admit(req, 8)
            blocks = [free.pop(), free.pop()]
            sched.assign_blocks(req, blocks, resumed=False)
            running[req] = blocks
        for req in list(running):
            job = sched.enqueue_store_job(req, 0, 8, [f"k{req}a", f"k{req}b"])
            state = sched.job(job)
            for w in workers:
                w.register(JobSpec(job, state.req, state.gen, state.keys))
            for w in workers:
                with w.run(job) as run:
                    if run.live:
                        run.dma_started()
                        run.dma_done()
                        run.put_done(stored=2, existed=0)
                        run.save_offset(8)
            completed = WorkerLedger.aggregate(w.take_completed() for w in workers)
            sched.update_connector_output(completed)
            sched.release_ready()
            if rng.random() < 0.3:
                if rng.random() < 0.5:
                    sched.preempt(req)
                    for w in workers:
                        w.preemption_seen(req, sched.current_gen(req))
                sched.request_finished(req)
                free.extend(running.pop(req))


def check(path: str, committed: int, writer: str = "thread") -> int:
    """Verify a killed journal; returns how many records it holds. Raises on a breach.

    A journal of the writer process must end with the ``engine_crashed`` it
    wrote for the killed engine, and that CRASH must be its only finding.
    """
    from kvstate.violations import Code
    from replay import replay

    with Journal(path, readonly=True) as journal:
        seqs = [r.seq for r in journal.records()]  # verifies the hash chain
    if seqs != list(range(1, len(seqs) + 1)):
        raise AssertionError(f"{path}: seqs are not 1..{len(seqs)}")
    if len(seqs) < committed:
        raise AssertionError(
            f"{path}: commit of seq {committed} returned, journal ends at {len(seqs)}"
        )
    if seqs:
        result = replay([path])
        found = result.violations
        if writer == "process":
            if [(v.code, v.seq) for v in found] != [(Code.CRASH, seqs[-1])]:
                raise AssertionError(f"{path}: not ended by the writer process: {found[:3]}")
        elif found:
            raise AssertionError(f"{path}: violations after a kill: {found[:3]}")
    return len(seqs)


def check_retained(path: str, committed: int) -> tuple[int, bool]:
    """Verify a journal whose writer process was killed while it rotated and
    removed segments; returns (records it holds, whether its head was removed).

    Every later segment begins with a checkpoint; what remains reads as one
    chain from the oldest segment's checkpoint (or the header) to a last seq
    at or after the last durable commit; replay restores the checkpoint and
    finds nothing but the journal's unfinished end.
    """
    from journal import segments
    from kvstate.checkpoint import Resumed
    from kvstate.violations import Code
    from replay import replay
    from replay.sources import read_path

    for later in segments.later_segments(path):
        with Journal(later, readonly=True) as journal:
            if journal.checkpoint() is None:
                raise AssertionError(f"{later}: a later segment without its checkpoint")
    items = list(read_path(path))  # every segment's chain verified, and each link between
    resumed = items[0].entry.event if items and type(items[0].entry.event) is Resumed else None
    start = resumed.seq if resumed is not None else 0
    seqs = [item.seq for item in items if type(item.entry.event) is not Resumed]
    if seqs != list(range(start + 1, start + 1 + len(seqs))):
        raise AssertionError(f"{path}: seqs are not {start + 1}..{start + len(seqs)}")
    last = seqs[-1] if seqs else start
    if last < committed:
        raise AssertionError(
            f"{path}: commit of seq {committed} was durable, journal ends at {last}"
        )
    result = replay([path])
    if result.violations:
        raise AssertionError(f"{path}: violations after a kill: {result.violations[:3]}")
    codes = {w.code for w in result.warnings}
    if not codes <= {Code.UNFINISHED, Code.FROM_CHECKPOINT} or Code.UNFINISHED not in codes:
        raise AssertionError(f"{path}: not read as unfinished: {result.warnings[:3]}")
    return len(seqs), resumed is not None


def kill_writer_once(folder: str, seed: int) -> tuple[int, int, bool, bool]:
    """Run ``writer="retain"``, SIGKILL its writer process at a random moment
    (a rotation or a removal, often), then the engine; check the journal.

    Returns (last durable seq, records found, head removed, killed mid-rotation:
    the next segment's hidden file was left half made).
    """
    rng = random.Random(seed)
    path = os.path.join(folder, f"kill-{seed}.db")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            drive(path, write_fd, seed, writer="retain")
        finally:
            os._exit(3)
    os.close(write_fd)
    data = b""
    while b"pid " not in data or not data.endswith(b"\n"):
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        data += chunk
    writer = int(data.split(b"pid ")[1].split()[0])
    time.sleep(rng.uniform(0.05, 0.6))  # several rotations in
    os.kill(writer, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    committed = max((int(x) for x in data.decode().splitlines() if x.isdigit()), default=0)
    while not _gone(writer):
        time.sleep(0.01)
    found, removed = check_retained(path, committed)
    half_made = any(
        name.startswith(f".kill-{seed}.") and ".tmp" in name for name in os.listdir(folder)
    )
    return committed, found, removed, half_made


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody reaps counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def kill_once(
    folder: str, seed: int, synchronous: str = "NORMAL", writer: str = "thread"
) -> tuple[int, int]:
    """Fork a writer, SIGKILL it at a random moment, check the journal.

    Returns (seq of the last commit that returned, records found).
    """
    rng = random.Random(seed)
    path = os.path.join(folder, f"kill-{seed}.db")
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write until killed
        os.close(read_fd)
        try:
            drive(path, write_fd, seed, synchronous, writer)
        finally:
            os._exit(3)
    os.close(write_fd)
    # Wait for the first commit, then kill somewhere in the next 0-40 ms.
    select.select([read_fd], [], [], 10)
    time.sleep(rng.uniform(0, 0.04))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    lines = data.decode().splitlines()
    committed = max((int(x) for x in lines if x.isdigit()), default=0)
    for line in lines:
        if line.startswith("pid "):
            # The writer process drains what it was handed, then ends the
            # journal and exits: wait for that (it is not our child).
            pid = int(line.split()[1])
            while not _gone(pid):
                time.sleep(0.01)
    found = check(path, committed, writer)
    return committed, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SIGKILL a journal writer many times")
    parser.add_argument("--kills", type=int, default=2000)
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    parser.add_argument(
        "--writer",
        choices=("thread", "process", "retain"),
        default="thread",
        help="retain: SIGKILL the writer process itself while it rotates and removes segments",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    total = 0
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.kills):
            if args.writer == "retain":
                found = kill_writer_once(folder, seed)[1]
                for name in os.listdir(folder):  # its segments, and any half-made one
                    os.unlink(os.path.join(folder, name))
            else:
                _committed, found = kill_once(folder, seed, args.synchronous, args.writer)
                os.unlink(os.path.join(folder, f"kill-{seed}.db"))
            total += found
    print(
        f"{args.kills} kills ({args.synchronous}): every journal opened, verified and "
        f"replayed; {total} records checked; no committed record lost "
        f"({time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
