"""A journal writer to kill: the ledgers driven through steps of a small,
clean workload, reporting after each ``begin_step`` the last seq whose commit
returned. Used by the kill tests and by the soak command
(``python -m tests.crashsim --kills 5000``).

After every SIGKILL the journal must open, its hash chain must verify, every
record whose commit returned must be there, and replay must work on it.
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


def drive(path: str, report_fd: int, seed: int, synchronous: str = "NORMAL") -> None:
    """Write steps forever (until killed), reporting each committed seq on ``report_fd``."""
    rng = random.Random(seed)
    rec = Recorder.open(path, block_size=4, world_size=2, synchronous=synchronous)
    sched = SchedulerLedger(rec)
    workers = [WorkerLedger(r, rec) for r in range(2)]
    free = list(range(64))
    running: dict[str, list[int]] = {}
    n = 0
    while True:
        committed = rec.recorded  # every record so far: begin_step commits them
        step = sched.begin_step()
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


def check(path: str, committed: int) -> int:
    """Verify a killed journal; returns how many records it holds. Raises on a breach."""
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
        if result.violations:
            raise AssertionError(f"{path}: violations after a kill: {result.violations[:3]}")
    return len(seqs)


def kill_once(folder: str, seed: int, synchronous: str = "NORMAL") -> tuple[int, int]:
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
            drive(path, write_fd, seed, synchronous)
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
    committed = max((int(x) for x in data.split()), default=0)
    found = check(path, committed)
    return committed, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SIGKILL a journal writer many times")
    parser.add_argument("--kills", type=int, default=2000)
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    args = parser.parse_args(argv)
    started = time.monotonic()
    total = 0
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.kills):
            _committed, found = kill_once(folder, seed, args.synchronous)
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
