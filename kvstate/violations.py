"""Violation codes (docs/events.md, "Violation codes"), the :class:`Violation` value, and the
exceptions strict mode raises.

Each code is defined once here. The fold detects it; replay reports it; a
live ledger in strict mode raises the code's exception at once. Exceptions
are explicit classes, never ``assert``, so they survive ``python -O``.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import attrs

from .errors import KvstateError


class Code(str, enum.Enum):
    """Every violation and warning code. Values are the stable public names."""

    # -- docs/events.md, "Violation codes": violations --
    STALE_GENERATION = "STALE_GENERATION"
    POISONED_READ = "POISONED_READ"
    FOREIGN_BLOCK_READ = "FOREIGN_BLOCK_READ"
    TABLE_OVERRUN = "TABLE_OVERRUN"
    DOUBLE_REPORT = "DOUBLE_REPORT"
    PHANTOM_COMPLETION = "PHANTOM_COMPLETION"
    EARLY_RELEASE = "EARLY_RELEASE"
    PIN_MISMATCH = "PIN_MISMATCH"
    REFCOUNT_UNDERFLOW = "REFCOUNT_UNDERFLOW"
    PREMATURE_RETIRE = "PREMATURE_RETIRE"
    OFFSET_REWOUND = "OFFSET_REWOUND"
    PARENT_CHAIN_BROKEN = "PARENT_CHAIN_BROKEN"
    ID_REUSED = "ID_REUSED"
    LEAKED_PIN = "LEAKED_PIN"
    MISSING_REPORT = "MISSING_REPORT"
    HELD_FOREVER = "HELD_FOREVER"
    POISONED_KEY = "POISONED_KEY"
    WRONG_KV_LOADED = "WRONG_KV_LOADED"
    CRASH = "CRASH"
    UNLEDGERED_JOB = "UNLEDGERED_JOB"
    CAUSALITY = "CAUSALITY"
    # -- additions (docs/events.md): violations --
    LEAKED_BLOCKS = "LEAKED_BLOCKS"
    RECORD_REFUSED = "RECORD_REFUSED"
    # -- additions for connectors that load as well as store (kvstate.tier_events) --
    LOAD_STORE_OVERLAP = "LOAD_STORE_OVERLAP"
    STALE_COMPLETION = "STALE_COMPLETION"
    UNFLUSHED_REUSE = "UNFLUSHED_REUSE"
    TIER_READ_STALE = "TIER_READ_STALE"
    STORE_CURSOR_PAST_TABLE = "STORE_CURSOR_PAST_TABLE"
    PROMOTED_UNDER_LATE_WRITE = "PROMOTED_UNDER_LATE_WRITE"
    # -- additions for the lifecycle at vLLM's connector boundary (kvstate.transfer_events) --
    DELAYED_FREE_REUSED = "DELAYED_FREE_REUSED"
    LOAD_TARGET_RELEASED = "LOAD_TARGET_RELEASED"
    UNEXPECTED_TRANSFER = "UNEXPECTED_TRANSFER"
    DOUBLE_FINISH = "DOUBLE_FINISH"
    FAILED_LOAD_USED = "FAILED_LOAD_USED"
    MATCH_NOT_PURE = "MATCH_NOT_PURE"
    RESUME_APPENDED = "RESUME_APPENDED"
    # -- docs/events.md, "Violation codes": warnings (do not change the verdict) --
    RELEASE_ORDER = "RELEASE_ORDER"
    # -- additions (docs/events.md): warnings only --
    STEP_REGRESSED = "STEP_REGRESSED"
    NOTHING_HELD = "NOTHING_HELD"
    DUPLICATE_RECEIVE = "DUPLICATE_RECEIVE"
    # -- docs/events.md, "Complete and incomplete journals": it ends before the engine --
    UNFINISHED = "UNFINISHED"
    # -- addition (docs/events.md, "Retention"): the records before a checkpoint are gone --
    FROM_CHECKPOINT = "FROM_CHECKPOINT"
    # -- addition (docs/events.md, "A journal left in WAL mode"): not one file --
    WAL_LEFT = "WAL_LEFT"

    def __str__(self) -> str:
        return self.value


WARNING_CODES = frozenset(
    {
        Code.RELEASE_ORDER,
        Code.STEP_REGRESSED,
        Code.NOTHING_HELD,
        Code.DUPLICATE_RECEIVE,
        Code.UNFINISHED,
        Code.FROM_CHECKPOINT,
        Code.WAL_LEFT,
    }
)

#: codes the ledgers' guards decide from their own state: a strict ledger
#: raises them from the call that made the breaching record, once the record
#: is durable and the fold has found it (``tests/test_stateful.py`` checks
#: that the guards suspect every such finding). Every other code is found by
#: the fold alone and raises at the next ledger call after its batch was
#: audited, or at ``Recorder.close()``.
DECIDED_AT_THE_CALL = frozenset(
    {
        Code.TABLE_OVERRUN,
        Code.FOREIGN_BLOCK_READ,
        Code.ID_REUSED,
        Code.EARLY_RELEASE,
        Code.PHANTOM_COMPLETION,
        Code.STALE_GENERATION,
        Code.OFFSET_REWOUND,
        Code.DOUBLE_REPORT,
        Code.UNLEDGERED_JOB,
        Code.PREMATURE_RETIRE,
        Code.PARENT_CHAIN_BROKEN,
        Code.CRASH,
        Code.LEAKED_PIN,
        Code.MISSING_REPORT,
        Code.HELD_FOREVER,
    }
)

#: the order of the table in docs/events.md, used to sort summaries
CODE_ORDER = {code: i for i, code in enumerate(Code)}

_ENTITIES = ("job", "req", "gen", "rank", "block", "key")


#: findings a long-lived fold lists (the live audit, a writer's checkpoints);
#: later ones are counted. An engine that breaks an invariant every step,
#: observed for weeks, must not grow its process (or the writer process)
#: with the findings: the first ones explain the incident, the journal holds
#: every record, and replay lists every finding.
LISTED_FINDINGS = 10_000


@attrs.frozen(slots=True)
class Violation:
    """One breach found by the fold.

    ``seq`` is the record that breaks the invariant; ``chain`` the seqs of the
    earlier records it depends on, oldest first. Entity fields are set where
    they apply.
    """

    code: Code
    seq: int
    message: str
    chain: tuple[int, ...] = ()
    job: int | None = None
    req: str | None = None
    gen: int | None = None
    rank: int | None = None
    block: int | None = None
    key: str | None = None

    @property
    def is_warning(self) -> bool:
        return self.code in WARNING_CODES

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (docs/events.md, "The command line"): code, seq, message, chain,
        entities."""
        out: dict[str, Any] = {
            "code": self.code.value,
            "seq": self.seq,
            "message": self.message,
            "chain": list(self.chain),
        }
        for name in _ENTITIES:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def chain_of(*seqs: int | None) -> tuple[int, ...]:
    """A chain from the seqs that are known, sorted and without repeats."""
    return tuple(sorted({s for s in seqs if s is not None}))


class JobLike(Protocol):
    """Anything that names a job and its incarnation (read only)."""

    @property
    def job(self) -> int: ...
    @property
    def req(self) -> str: ...
    @property
    def gen(self) -> int: ...


def finding(
    code: Code,
    seq: int,
    message: str,
    *chain: int | None,
    of: JobLike | None = None,
    **entities: Any,
) -> Violation:
    """A :class:`Violation` with its chain built from the known seqs.

    ``of`` is the job the finding is about: its ``job``, ``req`` and ``gen``
    fill those entity fields (``entities`` may still override or add, e.g.
    ``rank`` or ``block``).
    """
    if of is not None:
        entities = {"job": of.job, "req": of.req, "gen": of.gen, **entities}
    return Violation(code, seq, message, chain_of(*chain), **entities)


# -- strict mode exceptions ------------------------------------------------------------


class InvariantViolation(KvstateError):
    """A live ledger in strict mode met a violation; ``violation`` says which."""

    code: Code | None = None

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        super().__init__(f"{violation.code.value} at seq {violation.seq}: {violation.message}")


# One class per code, so a connector can catch exactly the breach it expects.


class StaleGenerationError(InvariantViolation):
    """An effect came from a job whose generation is over on that rank."""

    code = Code.STALE_GENERATION


class PoisonedReadError(InvariantViolation):
    """A transfer read a block after it was handed to someone else."""

    code = Code.POISONED_READ


class ForeignBlockReadError(InvariantViolation):
    """A job would read a block that is neither in its table nor pinned by it."""

    code = Code.FOREIGN_BLOCK_READ


class TableOverrunError(InvariantViolation):
    """A job saves more tokens than the request's block table holds."""

    code = Code.TABLE_OVERRUN


class DoubleReportError(InvariantViolation):
    """A rank reported one job twice."""

    code = Code.DOUBLE_REPORT


class PhantomCompletionError(InvariantViolation):
    """More completions were received than ranks reported."""

    code = Code.PHANTOM_COMPLETION


class EarlyReleaseError(InvariantViolation):
    """A job's pins were released before every rank reported it."""

    code = Code.EARLY_RELEASE


class PinMismatchError(InvariantViolation):
    """A release names other blocks than the job pinned, or releases twice."""

    code = Code.PIN_MISMATCH


class RefcountUnderflowError(InvariantViolation):
    """A block was dropped by more holders than it had."""

    code = Code.REFCOUNT_UNDERFLOW


class PrematureRetireError(InvariantViolation):
    """A request was retired while one of its jobs was unreported."""

    code = Code.PREMATURE_RETIRE


class OffsetRewoundError(InvariantViolation):
    """A rank's saved offset went backwards."""

    code = Code.OFFSET_REWOUND


class ParentChainBrokenError(InvariantViolation):
    """A KV event named a parent other than the hash chain's."""

    code = Code.PARENT_CHAIN_BROKEN


class IdReusedError(InvariantViolation):
    """A job id or a generation was not greater than an earlier one."""

    code = Code.ID_REUSED


class LeakedPinError(InvariantViolation):
    """At idle, a job still pins blocks."""

    code = Code.LEAKED_PIN


class MissingReportError(InvariantViolation):
    """At idle, a rank never received or never reported a job."""

    code = Code.MISSING_REPORT


class HeldForeverError(InvariantViolation):
    """At idle, a hold finish was never released."""

    code = Code.HELD_FOREVER


class PoisonedKeyError(InvariantViolation):
    """A stored key holds KV that is not its tokens' KV."""

    code = Code.POISONED_KEY


class WrongKvLoadedError(InvariantViolation):
    """A load returned KV that is not what the key names."""

    code = Code.WRONG_KV_LOADED


class RecordRefusedError(InvariantViolation):
    """A record's values were refused by the contract; a ``record_refused`` stands in its place."""

    code = Code.RECORD_REFUSED


class CrashError(InvariantViolation):
    """The engine crashed."""

    code = Code.CRASH


class UnledgeredJobError(InvariantViolation):
    """A rank ran a job before registering it."""

    code = Code.UNLEDGERED_JOB


class CausalityError(InvariantViolation):
    """A record names a job or incarnation that does not exist (yet)."""

    code = Code.CAUSALITY


class LeakedBlocksError(InvariantViolation):
    """``engine_idle`` while an incarnation never preempted or finished holds blocks."""

    code = Code.LEAKED_BLOCKS


class LoadStoreOverlapError(InvariantViolation):
    """A load and a store of one request in flight at once (vLLM #46014)."""

    code = Code.LOAD_STORE_OVERLAP


class StaleCompletionError(InvariantViolation):
    """A completion of a job that already ended (vLLM #39186)."""

    code = Code.STALE_COMPLETION


class UnflushedReuseError(InvariantViolation):
    """A block a live store still reads handed on without a flush (vLLM #29870)."""

    code = Code.UNFLUSHED_REUSE


class TierReadStaleError(InvariantViolation):
    """A load of a tier key that is not held, or that is evicted or rewritten under it."""

    code = Code.TIER_READ_STALE


class StoreCursorPastTableError(InvariantViolation):
    """A resumed request's store starts past chunks it never stored again (vLLM #52211)."""

    code = Code.STORE_CURSOR_PAST_TABLE


class DelayedFreeReusedError(InvariantViolation):
    """A block a delayed free still keeps handed to another request (vLLM #45357, #52234)."""

    code = Code.DELAYED_FREE_REUSED


class LoadTargetReleasedError(InvariantViolation):
    """A block an asynchronous load still writes freed or handed on (vLLM #56104, #41269)."""

    code = Code.LOAD_TARGET_RELEASED


class UnexpectedTransferError(InvariantViolation):
    """A send or receive reported for a request with none outstanding (vLLM #25067)."""

    code = Code.UNEXPECTED_TRANSFER


class DoubleFinishError(InvariantViolation):
    """A second finish of one incarnation (vLLM #50297)."""

    code = Code.DOUBLE_FINISH


class FailedLoadUsedError(InvariantViolation):
    """Blocks reported invalid after the request ran on their load."""

    code = Code.FAILED_LOAD_USED


class MatchNotPureError(InvariantViolation):
    """``get_num_new_matched_tokens`` answered differently with nothing changed (LMCache #4955)."""

    code = Code.MATCH_NOT_PURE


class ResumeAppendedError(InvariantViolation):
    """A resumed incarnation's first table appended, not replaced (vLLM #46595)."""

    code = Code.RESUME_APPENDED


class PromotedUnderLateWriteError(InvariantViolation):
    """A promotion filled the tier while a store a cache reset discarded may
    still write its released chunk (vLLM 0.33.0's reset fence)."""

    code = Code.PROMOTED_UNDER_LATE_WRITE


EXCEPTIONS: dict[Code, type[InvariantViolation]] = {
    cls.code: cls for cls in InvariantViolation.__subclasses__() if cls.code is not None
}


def raise_for(violations: list[Violation]) -> None:
    """Strict mode: raise the exception of the first non-warning violation."""
    for violation in violations:
        if not violation.is_warning:
            raise EXCEPTIONS[violation.code](violation)
