"""The end-of-run checks of the fold: at ``engine_idle``, and where the journal ends.

When the engine is idle nothing may be outstanding: no job still pinning
blocks (LEAKED_PIN), no rank that received a job without reporting it
(MISSING_REPORT), no finished request still holding blocks from a hold
finish (HELD_FOREVER), no request that was never preempted or finished
still holding its table (LEAKED_BLOCKS, an addition: a lost
``request_preempted`` or ``request_finished`` shows here). Each finding is
reported once, however many ``engine_idle`` records follow.

A function of the fold's state (:class:`~kvstate._ledger_state.LedgerState`), called only by its
fold. It looks at what is in memory: parking keeps out only what these
checks could not flag (see :mod:`kvstate._parking`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .state import RUNNING
from .violations import Code, Violation, finding

if TYPE_CHECKING:
    from ._ledger_state import LedgerState


def check_quiescent(ledger: LedgerState, seq: int, out: list[Violation]) -> None:
    """Append the LEAKED_PIN, MISSING_REPORT and HELD_FOREVER findings at ``seq``."""
    first = ledger.first_report
    for job in ledger.jobs.values():
        if job.job in ledger.pinned and first(Code.LEAKED_PIN, job.job):
            why = (
                f"engine idle while job {job.job} still pins {list(job.pins)} "
                f"({job.completions} of {job.world_size} completions received)"
            )
            chain = (job.enqueued_seq, *job.completion_seqs)
            out.append(finding(Code.LEAKED_PIN, seq, why, *chain, of=job))
        if not ledger.observes_workers:
            continue  # a live scheduler cannot see the ranks' records
        # Ranks that received the job: one finding each. Ranks that never
        # did: one finding per job naming them, so the work here follows
        # the records, never the world_size a header declares.
        for rank, rj in sorted(job.ranks.items()):
            if rj.reported_seq is not None or not first(Code.MISSING_REPORT, (job.job, rank)):
                continue
            why = (
                f"engine idle, and rank {rank} received job {job.job} but never "
                f"reported it (last phase: {rj.phase})"
            )
            chain = (job.enqueued_seq, rj.received_seq)
            out.append(finding(Code.MISSING_REPORT, seq, why, *chain, rank=rank, of=job))
        absent = job.world_size - len(job.ranks)
        if absent > 0 and first(Code.MISSING_REPORT, (job.job, None)):
            rank = next(r for r in range(job.world_size) if r not in job.ranks)
            which = f"rank {rank}" if absent == 1 else f"{absent} ranks (first: rank {rank})"
            why = f"engine idle, and {which} never received job {job.job}"
            out.append(finding(Code.MISSING_REPORT, seq, why, job.enqueued_seq, rank=rank, of=job))
    for request in ledger.requests.values():
        for inc in request.incarnations.values():
            if inc.table and inc.state == RUNNING and first(Code.LEAKED_BLOCKS, (inc.req, inc.gen)):
                # Never preempted nor finished: its request_preempted or
                # request_finished was lost, or the engine leaked the table.
                why = (
                    f"engine idle while {inc.name}, never preempted or finished, still "
                    f"holds blocks {inc.table}"
                )
                out.append(
                    finding(Code.LEAKED_BLOCKS, seq, why, inc.table_seq, req=inc.req, gen=inc.gen)
                )
            if inc.held and first(Code.HELD_FOREVER, (inc.req, inc.gen)):
                why = (
                    f"engine idle while {inc.name} still holds blocks {inc.table} "
                    "from a hold finish"
                )
                out.append(
                    finding(Code.HELD_FOREVER, seq, why, inc.ended_seq, req=inc.req, gen=inc.gen)
                )


def check_ended(ledger: LedgerState) -> list[Violation]:
    """The journal ends here: UNFINISHED if it ends before the engine did.

    The quiescence checks run only at ``engine_idle``. A journal that stops
    elsewhere (a killed process, a truncated file, a removed tail) was never
    checked for leaked pins, missing reports or held blocks, so it must not
    read as plainly clean.
    """
    if ledger.stood_down is not None:
        why = (
            f"the observer stood down at {ledger.stood_down}; nothing after it was "
            "journaled, so the end-of-run checks (LEAKED_PIN, MISSING_REPORT, "
            "HELD_FOREVER) did not run"
        )
        return [finding(Code.UNFINISHED, ledger.last_seq or 0, why)]
    if ledger.last_kind in ("engine_idle", "engine_crashed") or ledger.last_seq is None:
        return []
    why = (
        f"the journal ends at seq {ledger.last_seq} ({ledger.last_kind}) without "
        "engine_idle or engine_crashed: the end-of-run checks (LEAKED_PIN, "
        "MISSING_REPORT, HELD_FOREVER) did not run"
    )
    return [finding(Code.UNFINISHED, ledger.last_seq, why)]
