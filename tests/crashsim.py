"""A journal writer to kill: the ledgers driven through steps of a small,
clean workload, reporting after each ``begin_step`` the last seq whose commit
returned. Used by the kill tests and by the soak command
(``python -m tests.crashsim --kills 5000``).

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


def drive(
    path: str, report_fd: int, seed: int, synchronous: str = "NORMAL", writer: str = "thread"
) -> None:
    """Write steps forever (until killed), reporting each committed seq on ``report_fd``
    (and first, with the writer process, ``pid N``: that process's id)."""
    rng = random.Random(seed)
    rec = Recorder.open(
        path, block_size=4, world_size=2, synchronous=synchronous, process=writer == "process"
    )
    sched = SchedulerLedger(rec)
    workers = [WorkerLedger(r, rec) for r in range(2)]
    free = list(range(64))
    running: dict[str, list[int]] = {}
    n = 0
    while True:
        committed = rec.recorded  # every record so far: begin_step commits them
        step = sched.begin_step()
        if step == 1 and writer == "process":  # it starts at the first commit
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
    parser.add_argument("--writer", choices=("thread", "process"), default="thread")
    args = parser.parse_args(argv)
    started = time.monotonic()
    total = 0
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.kills):
            _committed, found = kill_once(folder, seed, args.synchronous, args.writer)
            total += found
            os.unlink(os.path.join(folder, f"kill-{seed}.db"))
    print(
        f"{args.kills} kills ({args.synchronous}): every journal opened, verified and "
        f"replayed; {total} records checked; no committed record lost "
        f"({time.monotonic() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
