"""Errors for misuse of the embedding API.

These are not invariant violations (those are
:class:`~kvstate.violations.InvariantViolation` and are journaled first):
they mean the connector asked about something the ledger has never heard
of, so nothing was recorded. Each names the id and the hook it was passed to.
"""

from __future__ import annotations


class KvstateError(Exception):
    """The base of every error kvstate raises on purpose: misuse of the API
    (:class:`LedgerUsageError`) and, in strict mode, a violated invariant
    (:class:`~kvstate.violations.InvariantViolation`)."""


class TemporaryStorageError(KvstateError):
    """The machine's temporary storage failed under kvstate (a full or broken
    ``TMPDIR``): state parked there cannot be read back. The journal and the
    records are not at fault; the command line exits 3, not 2."""


class LedgerUsageError(KvstateError):
    """A ledger method was called in a way the ledger cannot honour."""


class UnknownRequestError(LedgerUsageError, KeyError):
    """A hook named a request id that was never admitted."""

    def __init__(self, req: str, hook: str) -> None:
        self.req = req
        self.hook = hook
        super().__init__(f"{hook}: request {req!r} was never admitted")

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class UnknownJobError(LedgerUsageError, KeyError):
    """A hook named a store job id that this ledger never saw."""

    def __init__(self, job: int, hook: str, why: str = "was never enqueued") -> None:
        self.job = job
        self.hook = hook
        super().__init__(f"{hook}: job {job} {why}")

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateJobError(LedgerUsageError, ValueError):
    """A rank was asked to register a job it has already registered."""

    def __init__(self, job: int, rank: int) -> None:
        self.job = job
        self.rank = rank
        super().__init__(f"register: job {job} is already registered on rank {rank}")


class RefusedValueError(LedgerUsageError, ValueError):
    """A call would record a value the journal contract refuses (a negative
    block id, a string where an id goes, an object no codec can write).
    Nothing was recorded; the message names the kind and the field."""
