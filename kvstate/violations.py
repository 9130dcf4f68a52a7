"""Violation codes (spec section 6), the :class:`Violation` value, and the
exceptions strict mode raises.

Each code is defined once here. The fold detects it; replay reports it; a
live ledger in strict mode raises the code's exception at once. Exceptions
are explicit classes, never ``assert``, so they survive ``python -O``.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs


class Code(str, enum.Enum):
    """Every violation and warning code. Values are the stable public names."""

    # -- spec section 6: violations --
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
    # -- spec section 6: warnings (do not change the verdict) --
    RELEASE_ORDER = "RELEASE_ORDER"
    # -- additions (docs/events.md): warnings only --
    STEP_REGRESSED = "STEP_REGRESSED"
    NOTHING_HELD = "NOTHING_HELD"
    DUPLICATE_RECEIVE = "DUPLICATE_RECEIVE"
    # -- spec section 8: the journal ends before the engine did --
    UNFINISHED = "UNFINISHED"

    def __str__(self) -> str:
        return self.value


WARNING_CODES = frozenset(
    {
        Code.RELEASE_ORDER,
        Code.STEP_REGRESSED,
        Code.NOTHING_HELD,
        Code.DUPLICATE_RECEIVE,
        Code.UNFINISHED,
    }
)

#: the order of the spec's table, used to sort summaries
CODE_ORDER = {code: i for i, code in enumerate(Code)}

_ENTITIES = ("job", "req", "gen", "rank", "block", "key")


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
        """The JSON form of spec section 7: code, seq, message, chain, entities."""
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


# -- strict mode exceptions ------------------------------------------------------------


class InvariantViolation(Exception):
    """A live ledger in strict mode met a violation; ``violation`` says which."""

    code: Code | None = None

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        super().__init__(f"{violation.code.value} at seq {violation.seq}: {violation.message}")


def _exception(code: Code) -> type[InvariantViolation]:
    name = "".join(part.title() for part in code.value.split("_")) + "Error"
    return type(name, (InvariantViolation,), {"code": code, "__module__": __name__})


StaleGenerationError = _exception(Code.STALE_GENERATION)
PoisonedReadError = _exception(Code.POISONED_READ)
ForeignBlockReadError = _exception(Code.FOREIGN_BLOCK_READ)
TableOverrunError = _exception(Code.TABLE_OVERRUN)
DoubleReportError = _exception(Code.DOUBLE_REPORT)
PhantomCompletionError = _exception(Code.PHANTOM_COMPLETION)
EarlyReleaseError = _exception(Code.EARLY_RELEASE)
PinMismatchError = _exception(Code.PIN_MISMATCH)
RefcountUnderflowError = _exception(Code.REFCOUNT_UNDERFLOW)
PrematureRetireError = _exception(Code.PREMATURE_RETIRE)
OffsetRewoundError = _exception(Code.OFFSET_REWOUND)
ParentChainBrokenError = _exception(Code.PARENT_CHAIN_BROKEN)
IdReusedError = _exception(Code.ID_REUSED)
LeakedPinError = _exception(Code.LEAKED_PIN)
MissingReportError = _exception(Code.MISSING_REPORT)
HeldForeverError = _exception(Code.HELD_FOREVER)
PoisonedKeyError = _exception(Code.POISONED_KEY)
WrongKvLoadedError = _exception(Code.WRONG_KV_LOADED)
CrashError = _exception(Code.CRASH)
UnledgeredJobError = _exception(Code.UNLEDGERED_JOB)
CausalityError = _exception(Code.CAUSALITY)

EXCEPTIONS: dict[Code, type[InvariantViolation]] = {
    cls.code: cls  # type: ignore[misc]
    for cls in InvariantViolation.__subclasses__()
    if cls.code is not None
}


def raise_for(violations: list[Violation]) -> None:
    """Strict mode: raise the exception of the first non-warning violation."""
    for violation in violations:
        if not violation.is_warning:
            raise EXCEPTIONS[violation.code](violation)
