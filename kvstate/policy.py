"""Policies: the connector decisions the upstream fixes changed, as a seam.

A ledger makes each of these decisions the fixed way by itself. A policy
object given to a ledger (``policy=``) sees every record that ledger makes
(:meth:`observe`) and is asked, at each decision, whether to replace the
fixed decision with another. :mod:`kvstate.harness.legacy` uses it to run
the connector as it was before the fixes, for the bug zoo, so that replay
can show what the old code did wrong.

A connector in production passes no policy. The ledgers then skip the seam
entirely (one ``is None`` test per decision), and the fixed decisions are
the only ones there are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from . import events as ev
from .jobspec import JobSpec


class SchedulerView(Protocol):
    """What a scheduler policy may ask of its ledger (a ``SchedulerLedger``)."""

    @property
    def step(self) -> int: ...
    def current_gen(self, req: str, hook: str = ...) -> int: ...
    def held_generations(self, req: str) -> list[int]: ...
    def outstanding(self, req: str) -> bool: ...
    def release_held(self, req: str, gen: int | None = None) -> None: ...


class WorkerView(Protocol):
    """What a worker policy may ask of its rank (:class:`kvstate.worker.WorkerLedger`)."""

    @property
    def step(self) -> int: ...
    def spec(self, job: int) -> JobSpec | None: ...


class SchedulerPolicy:
    """The scheduler-side decisions. Each method gets the fixed decision and
    returns the one to make; this base class keeps every fixed one."""

    def observe(self, ledger: SchedulerView, event: ev.Event) -> None:
        """``ledger`` has just recorded ``event``."""

    def assign_mode(self, ledger: SchedulerView, req: str, fixed: ev.Mode) -> ev.Mode:
        """Append or replace (fixed: from the engine's resumed flag, vLLM #46595)."""
        return fixed

    def job_table(self, ledger: SchedulerView, req: str, fixed: list[int]) -> list[int]:
        """The table a new job reads (fixed: the engine's current one, vLLM #54853)."""
        return fixed

    def job_pins(self, ledger: SchedulerView, req: str, fixed: tuple[int, ...]) -> tuple[int, ...]:
        """What a new job pins (fixed: every block it may read, vLLM #52372)."""
        return fixed

    def finish_hold(self, ledger: SchedulerView, req: str, fixed: bool) -> bool:
        """Whether a finish keeps the table (fixed: only when the engine asks).
        Runs before the finish is recorded: an old ``assert`` may raise here."""
        return fixed

    def finished_sending(self, ledger: SchedulerView, req: str) -> None:
        """Every rank finished saving ``req`` (fixed: nothing waits for this)."""


class WorkerPolicy:
    """The worker-side decisions, like :class:`SchedulerPolicy`. Called with
    the worker ledger's lock held."""

    def observe(self, ledger: WorkerView, event: ev.Event) -> None:
        """``ledger`` has just recorded ``event``."""

    def retire_blocked(self, ledger: WorkerView, req: str, gen: int, fixed: bool) -> bool:
        """Whether ``(req, gen)`` may not retire yet (fixed: a job of that very
        incarnation is unreported; vLLM #51637 counted per request id)."""
        return fixed

    def live_at_start(self, ledger: WorkerView, job: int, fixed: bool) -> bool:
        """The dequeue check (fixed: the job is among its request's live jobs)."""
        return fixed

    def effect_allowed(self, ledger: WorkerView, job: int, fixed: bool) -> bool:
        """May a job change its request's state (fixed: only while live, vLLM #52466)."""
        return fixed

    def kv_event_parents(
        self, spec: JobSpec, stored: Sequence[str], fixed: list[str | None]
    ) -> list[str | None]:
        """Each stored key's parent (fixed: from the request's hash chain)."""
        return fixed
