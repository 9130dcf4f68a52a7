"""The live figures of one journal: what an operator's dashboard and alerts read.

Whoever folds a journal while it is written keeps a :class:`Figures` for it
(``kvstate watch``, following a folder of journals) and
:mod:`kvstate.prometheus` publishes them on ``/metrics``. They come from the
fold itself, not from a second count: the records folded, the findings it
made, the jobs it holds in flight and the pins it holds. What the fold has
not reached yet is the audit's lag, in records and in seconds.

A journal a rank wrote alone is counted but not audited here: a rank's
records are judged with its scheduler's (``kvstate replay`` of the run), as
the writer process's audit leaves them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import attrs

from . import events as ev
from .violations import Violation

#: the kinds that begin a job, and the one that ends it (either protocol)
_BEGINS = frozenset({"job_enqueued", "load_enqueued"})
_ENDS = "pins_released"
#: the records that end a journal
_CLOSES = frozenset({"engine_idle", "engine_crashed"})


def metrics_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port), for whoever serves ``/metrics``;
    :class:`ValueError` for anything else (checked before a file is made)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"metrics takes HOST:PORT (for example 127.0.0.1:9464), not {address!r}")
    return host.strip("[]"), int(port)


@attrs.define
class Figures:
    """One journal's figures (see the module docstring)."""

    journal: str
    run: str = ""
    role: str = ""
    #: whether its records are folded here (a rank's alone are not)
    audited: bool = True
    #: records folded, and the last seq the file holds
    folded: int = 0
    written: int = 0
    bytes: int = 0
    segments: int = 1
    #: segments retention removed (journal.retention)
    segments_removed: int = 0
    #: where the journal rotates (a recorder's writer process knows): the
    #: rotation size in force (the one asked, or grown to the checkpoint's),
    #: the bytes of the checkpoint the current segment begins with, and what
    #: the byte budget lacks to hold that segment at its full size (0: it
    #: holds); None where unknown (``kvstate watch``)
    rotate_bytes: int | None = None
    checkpoint_bytes: int | None = None
    budget_short_bytes: int | None = None
    violations: Counter[str] = attrs.field(factory=Counter)
    #: findings by code in records written since the reader began (a watcher
    #: that finds a journal already written counts its backlog above only):
    #: what pages, so that neither a finished run nor a restart pages again
    new_violations: Counter[str] = attrs.field(factory=Counter)
    first_violation_seq: int | None = None
    #: how often the writer's retention removed a segment before this reader
    #: read it, and the reader went on from the oldest segment's checkpoint
    overtaken: int = 0
    #: when (seconds since the epoch) the journal's file was last written
    last_write: float | None = None
    jobs_in_flight: int = 0
    pins_held: int = 0
    #: when (monotonic seconds) the fold last had nothing left to read; None
    #: while it has not caught up yet
    caught_up_at: float | None = None
    #: the kind of its closing record (``engine_idle``, ``engine_crashed``), once written
    closed: str | None = None
    #: why the journal cannot be read on (a broken chain, a refused record), if so
    error: str | None = None

    def header(self, event: ev.JournalOpened) -> None:
        self.run = "" if event.run is None else str(event.run)
        self.role = "" if event.role is None else str(event.role)
        self.audited = not self.role.startswith("worker")

    def fold(
        self, kinds: Iterable[str], found: Iterable[Violation], ledger: Any, *, new_after: int = 0
    ) -> None:
        """Count folded records of ``kinds`` and their findings; ``ledger`` is
        the fold they went through (None where this journal is not audited).
        Findings at seqs after ``new_after`` are new (:attr:`new_violations`)."""
        n = 0
        for kind in kinds:
            n += 1
            if kind in _BEGINS:
                self.jobs_in_flight += 1
            elif kind == _ENDS:
                self.jobs_in_flight -= 1
            elif kind in _CLOSES:
                self.closed = kind
        self.folded += n
        for v in found:
            if v.is_warning:
                continue
            self.violations[v.code.value] += 1
            if v.seq > new_after:
                self.new_violations[v.code.value] += 1
            if self.first_violation_seq is None:
                self.first_violation_seq = v.seq
        if ledger is not None:
            self.pins_held = len(ledger.pinned)

    def lag_records(self) -> int:
        """Records the file holds that the fold has not reached."""
        return max(0, self.written - self.folded)

    def lag_seconds(self, now: float | None = None) -> float:
        """How long the fold has been behind the file (0 while caught up)."""
        if not self.lag_records() or self.caught_up_at is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - self.caught_up_at)

    def silent_seconds(self, now: float | None = None) -> float:
        """Seconds since the journal's file was last written (0: not known)."""
        if self.last_write is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.last_write)

    def status(self) -> str:
        """One line for a terminal."""
        state = self.error or (self.closed or "open")
        found = sum(self.violations.values())
        first = f" (first at seq {self.first_violation_seq})" if found else ""
        audit = "" if self.audited else "  (a rank's: judged with its scheduler)"
        return (
            f"{self.run or '-'}  {self.role or 'all'}  {state}  {self.folded} records  "
            f"{found} violation(s){first}  {self.jobs_in_flight} job(s) in flight  "
            f"lag {self.lag_records()}{audit}"
        )
