"""The event vocabulary of journal v1: one immutable value type per kind.

Each kind of the journal v1 contract (``docs/events.md``) is a frozen, slotted ``attrs``
class whose fields are validated at construction: ids are non-negative
integers, enumerations take only their values, block lists become tuples. The
envelope (``seq``, ``step``, ``ts``) belongs to the journal record, not to the
event; worker events carry ``rank`` as a field because the spec lists it
among their fields.

Unknown extra fields of an input record are kept in ``extra`` (keyword-only)
so a round trip preserves them; the fold ignores them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

import attrs

JOURNAL_VERSION = 1

SIDE_JOURNAL = "journal"
SIDE_SCHEDULER = "scheduler"
SIDE_WORKER = "worker"
SIDE_AUDIT = "audit"

MODES = ("append", "replace")
SKIP_REASONS = ("stale", "pressure", "empty", "error")

_EMPTY: Mapping[str, Any] = MappingProxyType({})
#: an attrs validator: (instance, attribute, value) -> None, raising on a bad value
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
_INF = float("inf")


# -- validators and converters -------------------------------------------------------
# Hand-written rather than attrs.validators.* compositions: these run on the
# connector's hot path and each costs one type check and one comparison.


#: ids and counts are signed 64-bit integers on disk
INT_MAX = 2**63 - 1
#: the largest ``world_size`` a journal can mean: replay never loops over
#: declared ranks, but a bound keeps reports and tools honest
MAX_WORLD_SIZE = 1 << 16
#: the largest ``block_size`` (tokens per block) a journal can mean
MAX_BLOCK_SIZE = 1 << 24


def _nonneg(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or not 0 <= value <= INT_MAX:
        raise ValueError(f"'{attribute.name}' must be a non-negative integer, not {value!r}")


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not int or not 0 < value <= INT_MAX:
        raise ValueError(f"'{attribute.name}' must be a positive integer, not {value!r}")


def _at_most(limit: int) -> Validator:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        _positive(_inst, attribute, value)
        if value > limit:
            raise ValueError(f"'{attribute.name}' {value} is larger than any engine ({limit})")

    return check


def _string(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not str:
        raise ValueError(f"'{attribute.name}' must be a string, not {value!r}")


def _opt_string(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and type(value) is not str:
        raise ValueError(f"'{attribute.name}' must be a string or null, not {value!r}")


def _boolean(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not bool:
        raise ValueError(f"'{attribute.name}' must be true or false, not {value!r}")


def _scalar(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and type(value) not in (str, int, float, bool):
        raise ValueError(f"'{attribute.name}' must be a string or number, not {value!r}")
    if type(value) is float and (value != value or value in (_INF, -_INF)):
        raise ValueError(f"'{attribute.name}' must be a finite number, not {value!r}")


def _one_of(values: tuple[str, ...]) -> Validator:
    def check(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in values:
            allowed = ", ".join(values)
            raise ValueError(f"'{attribute.name}' must be one of {allowed}, not {value!r}")

    return check


def _ids(value: Any) -> tuple[int, ...]:
    if type(value) not in (list, tuple):
        raise ValueError(f"expected a list of non-negative integers, not {value!r}")
    for v in value:
        if type(v) is not int or not 0 <= v <= INT_MAX:
            raise ValueError(f"expected non-negative integers, found {v!r}")
    return tuple(value)


def _strings(value: Any) -> tuple[str, ...]:
    if type(value) not in (list, tuple):
        raise ValueError(f"expected a list of strings, not {value!r}")
    for v in value:
        if type(v) is not str:
            raise ValueError(f"expected strings, found {v!r}")
    return tuple(value)


def _opt_hashes(value: Any) -> tuple[str | int, ...] | None:
    if value is None:
        return None
    if type(value) not in (list, tuple):
        raise ValueError(f"'hashes' must be a list, not {value!r}")
    for v in value:
        if type(v) not in (str, int) or (type(v) is int and not -INT_MAX - 1 <= v <= INT_MAX):
            raise ValueError(f"'hashes' must hold strings or 64-bit integers, found {v!r}")
    return tuple(value)


# -- the base class and the registry -------------------------------------------------

EVENT_TYPES: dict[str, type[Event]] = {}


@attrs.frozen(slots=True, kw_only=True)
class Event:
    """Base of every event kind. ``kind`` and ``side`` are class constants."""

    kind: ClassVar[str] = ""
    side: ClassVar[str] = ""
    #: payload fields in declaration order (everything but ``rank`` and ``extra``)
    payload_fields: ClassVar[tuple[str, ...]] = ()
    #: payload fields that must be present in an input record
    required_fields: ClassVar[tuple[str, ...]] = ()
    #: optional payload fields and their defaults (omitted from output when default)
    optional_fields: ClassVar[dict[str, Any]] = {}

    extra: Mapping[str, Any] = attrs.field(default=_EMPTY, kw_only=True, repr=False)

    def __copy__(self) -> Event:
        return self  # immutable: a copy would be the same value

    def __deepcopy__(self, memo: dict[int, Any]) -> Event:
        return self


E = TypeVar("E", bound="Event")


def _kind(name: str, side: str) -> Callable[[type[E]], type[E]]:
    """Register an event class under its journal kind name."""

    def register(cls: type[E]) -> type[E]:
        cls.kind = name
        cls.side = side
        fields = [a for a in attrs.fields(cls) if a.name not in ("extra", "rank")]
        cls.payload_fields = tuple(a.name for a in fields)
        cls.required_fields = tuple(a.name for a in fields if a.default is attrs.NOTHING)
        cls.optional_fields = {a.name: a.default for a in fields if a.default is not attrs.NOTHING}
        EVENT_TYPES[name] = cls
        return cls

    return register


# -- journal header ----------------------------------------------------------------


def _version(_inst: object, _attribute: attrs.Attribute[Any], value: Any) -> None:
    if value != JOURNAL_VERSION or type(value) is not int:
        raise ValueError(f"unknown journal version {value!r} (this reader knows version 1)")


@_kind("journal_opened", SIDE_JOURNAL)
@attrs.frozen(slots=True)
class JournalOpened(Event):
    """First record of every journal: format version and engine geometry."""

    version: int = attrs.field(validator=_version)
    block_size: int = attrs.field(validator=_at_most(MAX_BLOCK_SIZE))
    world_size: int = attrs.field(validator=_at_most(MAX_WORLD_SIZE))
    # descriptive only: any JSON scalar is accepted
    policy: Any = attrs.field(default=None, validator=_scalar)
    engine: Any = attrs.field(default=None, validator=_scalar)
    created: Any = attrs.field(default=None, validator=_scalar)


def header_problem(first: JournalOpened | None, event: Event) -> str | None:
    """Why ``event`` cannot come next in a journal whose header is ``first``.

    The first record must be ``journal_opened``; a later one (journals of
    one run merged) must describe the same engine. Every reader applies this
    check, so all tools refuse the same journals.
    """
    if first is None:
        if type(event) is not JournalOpened:
            return f"the first record must be journal_opened, found {event.kind}"
        return None
    if type(event) is JournalOpened and (event.block_size, event.world_size) != (
        first.block_size,
        first.world_size,
    ):
        return (
            f"journal_opened says block_size={event.block_size}, "
            f"world_size={event.world_size}; an earlier header said "
            f"block_size={first.block_size}, world_size={first.world_size}"
        )
    return None


# -- scheduler side ----------------------------------------------------------------


@_kind("request_admitted", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class RequestAdmitted(Event):
    """A new incarnation ``(req, gen)`` of a request starts."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    prompt_tokens: int = attrs.field(validator=_nonneg)
    hashes: tuple[str | int, ...] | None = attrs.field(default=None, converter=_opt_hashes)


@_kind("request_resumed", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class RequestResumed(Event):
    """A preempted request runs again as a new, greater generation."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)


@_kind("blocks_assigned", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class BlocksAssigned(Event):
    """Blocks join an incarnation's table (``append``) or become it (``replace``)."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    blocks: tuple[int, ...] = attrs.field(converter=_ids)
    mode: str = attrs.field(validator=_one_of(MODES))
    cached: tuple[int, ...] = attrs.field(default=(), converter=_ids)


@_kind("request_preempted", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class RequestPreempted(Event):
    """The incarnation's table refs are dropped; enqueued jobs keep their pins."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)


@_kind("request_finished", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class RequestFinished(Event):
    """Finish or abort, legal in any state; ``hold`` keeps the table refs."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    hold: bool = attrs.field(default=False, validator=_boolean)
    aborted: bool = attrs.field(default=False, validator=_boolean)


@_kind("held_blocks_released", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class HeldBlocksReleased(Event):
    """Drops the refs kept by a ``hold`` finish."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)


@_kind("job_enqueued", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class JobEnqueued(Event):
    """A store job of the current incarnation; its ``pins`` gain a ref each."""

    job: int = attrs.field(validator=_nonneg)
    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    token_start: int = attrs.field(validator=_nonneg)
    token_end: int = attrs.field(validator=_nonneg)
    reads: tuple[int, ...] = attrs.field(converter=_ids)
    pins: tuple[int, ...] = attrs.field(converter=_ids)
    keys: tuple[str, ...] = attrs.field(converter=_strings)
    world_size: int = attrs.field(validator=_at_most(MAX_WORLD_SIZE))
    parent: str | None = attrs.field(default=None, validator=_opt_string)

    def __attrs_post_init__(self) -> None:
        if self.token_end < self.token_start:
            raise ValueError(
                f"'token_end' ({self.token_end}) is before 'token_start' ({self.token_start})"
            )


@_kind("completions_received", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class CompletionsReceived(Event):
    """The scheduler consumed ``count`` completion reports of ``job``."""

    job: int = attrs.field(validator=_nonneg)
    count: int = attrs.field(validator=_nonneg)


@_kind("pins_released", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class PinsReleased(Event):
    """The job's pins are dropped, in the order given."""

    job: int = attrs.field(validator=_nonneg)
    blocks: tuple[int, ...] = attrs.field(converter=_ids)


@_kind("engine_crashed", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class EngineCrashed(Event):
    """The engine died."""

    error: str = attrs.field(validator=_string)


@_kind("engine_idle", SIDE_SCHEDULER)
@attrs.frozen(slots=True)
class EngineIdle(Event):
    """Quiescence: nothing may still be outstanding."""


# -- worker side -------------------------------------------------------------------


@_kind("job_received", SIDE_WORKER)
@attrs.frozen(slots=True)
class JobReceived(Event):
    """The rank registered the job in its ledger before queueing it."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)


@_kind("preemption_seen", SIDE_WORKER)
@attrs.frozen(slots=True)
class PreemptionSeen(Event):
    """The rank learned that ``(req, gen)`` is preempted or finished."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)


@_kind("job_started", SIDE_WORKER)
@attrs.frozen(slots=True)
class JobStarted(Event):
    """Dequeued and passed the liveness check."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)


@_kind("job_skipped", SIDE_WORKER)
@attrs.frozen(slots=True)
class JobSkipped(Event):
    """The job ends without a store call; touches no request state."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    reason: str = attrs.field(validator=_one_of(SKIP_REASONS))


@_kind("dma_started", SIDE_WORKER)
@attrs.frozen(slots=True)
class DmaStarted(Event):
    """The device read of the job's ``reads`` began.

    ``blocks`` (addition) names the blocks this transfer actually reads when
    it is fewer than ``reads`` (keys already in the store are not read
    again); only those are checked then.
    """

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    blocks: tuple[int, ...] = attrs.field(default=(), converter=_ids)


@_kind("dma_done", SIDE_WORKER)
@attrs.frozen(slots=True)
class DmaDone(Event):
    """The device read finished; ``digest`` fingerprints the bytes read.

    ``expected`` (addition) is the fingerprint the same blocks had when the
    save was requested: a different ``digest`` proves by bytes that the
    transfer read someone else's KV. ``blocks`` as for ``dma_started``.
    """

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    digest: Any = attrs.field(default=None, validator=_scalar)
    blocks: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    expected: Any = attrs.field(default=None, validator=_scalar)


@_kind("put_done", SIDE_WORKER)
@attrs.frozen(slots=True)
class PutDone(Event):
    """The store accepted the job's keys."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    stored: int = attrs.field(validator=_nonneg)
    existed: int = attrs.field(validator=_nonneg)


@_kind("put_failed", SIDE_WORKER)
@attrs.frozen(slots=True)
class PutFailed(Event):
    """The store call failed."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    error: str = attrs.field(validator=_string)


@_kind("offset_saved", SIDE_WORKER)
@attrs.frozen(slots=True)
class OffsetSaved(Event):
    """Effect: the rank advanced its resume offset for ``req``."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    req: str = attrs.field(validator=_string)
    offset: int = attrs.field(validator=_nonneg)


@_kind("request_marked_skipped", SIDE_WORKER)
@attrs.frozen(slots=True)
class RequestMarkedSkipped(Event):
    """Effect: the rank marked ``req`` as skipped under pressure."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    req: str = attrs.field(validator=_string)


@_kind("retry_tokens_set", SIDE_WORKER)
@attrs.frozen(slots=True)
class RetryTokensSet(Event):
    """Effect: the rank kept a token suffix for a KV-event retry."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    req: str = attrs.field(validator=_string)
    start: int = attrs.field(validator=_nonneg)
    count: int = attrs.field(validator=_nonneg)


@_kind("retry_tokens_cleared", SIDE_WORKER)
@attrs.frozen(slots=True)
class RetryTokensCleared(Event):
    """Effect: the rank dropped its retry state for ``req``."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    req: str = attrs.field(validator=_string)


@_kind("kv_block_stored", SIDE_WORKER)
@attrs.frozen(slots=True)
class KvBlockStored(Event):
    """A KV event was published for ``key`` with that parent."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)
    key: str = attrs.field(validator=_string)
    parent: str | None = attrs.field(validator=_opt_string)


@_kind("request_retired", SIDE_WORKER)
@attrs.frozen(slots=True)
class RequestRetired(Event):
    """Effect: the rank declared every save of ``(req, gen)`` done."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)


@_kind("job_reported", SIDE_WORKER)
@attrs.frozen(slots=True)
class JobReported(Event):
    """The rank reported the job complete; every path out of a job ends here once."""

    job: int = attrs.field(validator=_nonneg)
    rank: int = attrs.field(validator=_nonneg)


# -- audit -------------------------------------------------------------------------


@_kind("key_verified", SIDE_AUDIT)
@attrs.frozen(slots=True)
class KeyVerified(Event):
    """The value under ``key`` was read back and compared with its fingerprint."""

    key: str = attrs.field(validator=_string)
    ok: bool = attrs.field(validator=_boolean)
    expected: Any = attrs.field(default=None, validator=_scalar)
    actual: Any = attrs.field(default=None, validator=_scalar)
    #: addition: the store job whose put wrote the value, when the auditor knows it
    job: int | None = attrs.field(default=None, validator=attrs.validators.optional(_nonneg))


@_kind("load_verified", SIDE_AUDIT)
@attrs.frozen(slots=True)
class LoadVerified(Event):
    """A request loaded ``key`` and compared it with what it should be."""

    req: str = attrs.field(validator=_string)
    gen: int = attrs.field(validator=_nonneg)
    key: str = attrs.field(validator=_string)
    ok: bool = attrs.field(validator=_boolean)
    #: addition: the store job whose put wrote the loaded value, when known
    job: int | None = attrs.field(default=None, validator=attrs.validators.optional(_nonneg))


@_kind("key_missing", SIDE_AUDIT)
@attrs.frozen(slots=True)
class KeyMissing(Event):
    """Addition: the store had no value to read back under ``key``.

    ``reason`` says why: ``evicted`` (the store no longer has the key) or the
    error the read returned. This is not a poisoned key: nothing wrong was
    read, so it is no violation.
    """

    key: str = attrs.field(validator=_string)
    reason: str = attrs.field(validator=_string)


#: the effect kinds that a stale job must never write (spec section 6)
EFFECT_KINDS = frozenset(
    {
        "offset_saved",
        "request_marked_skipped",
        "retry_tokens_set",
        "retry_tokens_cleared",
        "request_retired",
    }
)


def rank_of(event: Event) -> int | None:
    """The rank of a worker event; None for every other side."""
    return getattr(event, "rank", None) if event.side == SIDE_WORKER else None


WORKER_KINDS = frozenset(k for k, c in EVENT_TYPES.items() if c.side == SIDE_WORKER)
SCHEDULER_KINDS = frozenset(k for k, c in EVENT_TYPES.items() if c.side == SIDE_SCHEDULER)
