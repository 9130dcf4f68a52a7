"""The event vocabulary of journal v1: one immutable value type per kind.

Each kind of the journal v1 contract (``docs/events.md``) is a frozen
``msgspec.Struct`` (``gc=False``: an event holds no cycles, so the cyclic
collector never walks the millions an engine writes). The types below are the
one definition of what a field may hold: msgspec checks them in C when a
record is decoded (ids are non-negative 64-bit integers, enumerations take
only their values, lists become tuples), and the same classes encode the
storage form (msgpack) and the interchange form (JSON Lines). vLLM's own KV
events and engine messages are msgspec Structs, so this costs an engine no
new dependency.

Building an event does not validate it: a connector pays only for the
struct (about 50-100 ns). Values are checked where records are decoded (the
journal writer's auditor, replay, every reader), which names the seq of a
bad record. A few cross-field rules (``token_end >= token_start``, the
journal version, finite numbers) live in ``__post_init__``, which msgspec
runs on construction and on decoding alike.

The envelope (``seq``, ``step``, ``ts``) belongs to the journal record, not
to the event; worker events carry ``rank`` as a field because the contract
lists it among their fields.

Unknown extra fields of an input record are kept in ``extra`` (a dict, or
None when there are none) so a round trip preserves them; the fold ignores
them.
"""

from __future__ import annotations

# The base is re-exported: readers name the field types and sides as ev.Id, ev.SIDE_WORKER.
from ._event_base import (  # noqa: F401
    EVENT_TYPES,
    INT_MAX,
    INT_MIN,
    JOURNAL_VERSION,
    MAX_BLOCK_SIZE,
    MAX_WORLD_SIZE,
    SIDE_AUDIT,
    SIDE_JOURNAL,
    SIDE_SCHEDULER,
    SIDE_WORKER,
    BlockSize,
    Event,
    Hashes,
    Id,
    Ids,
    Mode,
    Scalar,
    SkipReason,
    Strings,
    WorldSize,
    _finite,
    _kind,
)

# -- journal header ----------------------------------------------------------------


@_kind("journal_opened", SIDE_JOURNAL)
class JournalOpened(Event, frozen=True):
    """First record of every journal: format version and engine geometry."""

    version: int
    block_size: BlockSize
    world_size: WorldSize
    # descriptive only: any JSON scalar is accepted
    policy: Scalar = None
    engine: Scalar = None
    created: Scalar = None
    #: additions to the contract: the run every process of one engine run
    #: shares, and which process of it wrote this journal ("scheduler",
    #: "worker-0", ...; absent where one journal holds every side). Readers
    #: refuse to merge journals of different runs, or one process's twice.
    run: Scalar = None
    role: Scalar = None
    #: addition: the connector protocol the journal follows; "offloading"
    #: turns on the checks of :mod:`kvstate.tier_events`
    protocol: Scalar = None

    def __post_init__(self) -> None:
        if self.version != JOURNAL_VERSION or type(self.version) is not int:
            raise ValueError(
                f"unknown journal version {self.version!r} (this reader knows version 1)"
            )
        _finite(
            {
                "policy": self.policy,
                "engine": self.engine,
                "created": self.created,
                "run": self.run,
                "role": self.role,
                "protocol": self.protocol,
            },
        )


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
class RequestAdmitted(Event, frozen=True):
    """A new incarnation ``(req, gen)`` of a request starts."""

    req: str
    gen: Id
    prompt_tokens: Id
    hashes: Hashes | None = None


@_kind("request_resumed", SIDE_SCHEDULER)
class RequestResumed(Event, frozen=True):
    """A preempted request runs again as a new, greater generation."""

    req: str
    gen: Id


@_kind("blocks_assigned", SIDE_SCHEDULER)
class BlocksAssigned(Event, frozen=True):
    """Blocks join an incarnation's table (``append``) or become it (``replace``)."""

    req: str
    gen: Id
    blocks: Ids
    mode: Mode
    cached: Ids = ()


@_kind("request_preempted", SIDE_SCHEDULER)
class RequestPreempted(Event, frozen=True):
    """The incarnation's table refs are dropped; enqueued jobs keep their pins."""

    req: str
    gen: Id


@_kind("request_finished", SIDE_SCHEDULER)
class RequestFinished(Event, frozen=True):
    """Finish or abort, legal in any state; ``hold`` keeps the table refs."""

    req: str
    gen: Id
    hold: bool = False
    aborted: bool = False


@_kind("held_blocks_released", SIDE_SCHEDULER)
class HeldBlocksReleased(Event, frozen=True):
    """Drops the refs kept by a ``hold`` finish."""

    req: str
    gen: Id


@_kind("job_enqueued", SIDE_SCHEDULER)
class JobEnqueued(Event, frozen=True):
    """A store job of the current incarnation; its ``pins`` gain a ref each."""

    job: Id
    req: str
    gen: Id
    token_start: Id
    token_end: Id
    reads: Ids
    pins: Ids
    keys: Strings
    world_size: WorldSize
    parent: str | None = None

    def __post_init__(self) -> None:
        if self.token_end < self.token_start:
            raise ValueError(
                f"'token_end' ({self.token_end}) is before 'token_start' ({self.token_start})"
            )


@_kind("completions_received", SIDE_SCHEDULER)
class CompletionsReceived(Event, frozen=True):
    """The scheduler consumed ``count`` completion reports of ``job``."""

    job: Id
    count: Id


@_kind("pins_released", SIDE_SCHEDULER)
class PinsReleased(Event, frozen=True):
    """The job's pins are dropped, in the order given."""

    job: Id
    blocks: Ids


@_kind("engine_crashed", SIDE_SCHEDULER)
class EngineCrashed(Event, frozen=True):
    """The engine died."""

    error: str


@_kind("engine_idle", SIDE_SCHEDULER)
class EngineIdle(Event, frozen=True):
    """Quiescence: nothing may still be outstanding."""


# -- worker side -------------------------------------------------------------------


@_kind("job_received", SIDE_WORKER)
class JobReceived(Event, frozen=True):
    """The rank registered the job in its ledger before queueing it."""

    job: Id
    rank: Id


@_kind("preemption_seen", SIDE_WORKER)
class PreemptionSeen(Event, frozen=True):
    """The rank learned that ``(req, gen)`` is preempted or finished."""

    req: str
    gen: Id
    rank: Id


@_kind("job_started", SIDE_WORKER)
class JobStarted(Event, frozen=True):
    """Dequeued and passed the liveness check."""

    job: Id
    rank: Id


@_kind("job_skipped", SIDE_WORKER)
class JobSkipped(Event, frozen=True):
    """The job ends without a store call; touches no request state."""

    job: Id
    rank: Id
    reason: SkipReason


@_kind("dma_started", SIDE_WORKER)
class DmaStarted(Event, frozen=True):
    """The device read of the job's ``reads`` began.

    ``blocks`` (addition) names the blocks this transfer actually reads when
    it is fewer than ``reads`` (keys already in the store are not read
    again); only those are checked then. An empty list reads no block;
    without the field every block of ``reads`` is read.
    """

    job: Id
    rank: Id
    blocks: Ids | None = None


@_kind("dma_done", SIDE_WORKER)
class DmaDone(Event, frozen=True):
    """The device read finished; ``digest`` fingerprints the bytes read.

    ``expected`` (addition) is the fingerprint the same blocks had when the
    save was requested: a different ``digest`` proves by bytes that the
    transfer read someone else's KV. ``blocks`` as for ``dma_started``.
    """

    job: Id
    rank: Id
    digest: Scalar = None
    blocks: Ids | None = None
    expected: Scalar = None

    def __post_init__(self) -> None:
        _finite({"digest": self.digest, "expected": self.expected})


@_kind("put_done", SIDE_WORKER)
class PutDone(Event, frozen=True):
    """The store accepted the job's keys."""

    job: Id
    rank: Id
    stored: Id
    existed: Id


@_kind("put_failed", SIDE_WORKER)
class PutFailed(Event, frozen=True):
    """The store call failed."""

    job: Id
    rank: Id
    error: str


@_kind("offset_saved", SIDE_WORKER)
class OffsetSaved(Event, frozen=True):
    """Effect: the rank advanced its resume offset for ``req``."""

    job: Id
    rank: Id
    req: str
    offset: Id


@_kind("request_marked_skipped", SIDE_WORKER)
class RequestMarkedSkipped(Event, frozen=True):
    """Effect: the rank marked ``req`` as skipped under pressure."""

    job: Id
    rank: Id
    req: str


@_kind("retry_tokens_set", SIDE_WORKER)
class RetryTokensSet(Event, frozen=True):
    """Effect: the rank kept a token suffix for a KV-event retry."""

    job: Id
    rank: Id
    req: str
    start: Id
    count: Id


@_kind("retry_tokens_cleared", SIDE_WORKER)
class RetryTokensCleared(Event, frozen=True):
    """Effect: the rank dropped its retry state for ``req``."""

    job: Id
    rank: Id
    req: str


@_kind("kv_block_stored", SIDE_WORKER)
class KvBlockStored(Event, frozen=True):
    """A KV event was published for ``key`` with that parent."""

    job: Id
    rank: Id
    key: str
    parent: str | None


@_kind("request_retired", SIDE_WORKER)
class RequestRetired(Event, frozen=True):
    """Effect: the rank declared every save of ``(req, gen)`` done."""

    req: str
    gen: Id
    rank: Id


@_kind("job_reported", SIDE_WORKER)
class JobReported(Event, frozen=True):
    """The rank reported the job complete; every path out of a job ends here once."""

    job: Id
    rank: Id


# -- audit -------------------------------------------------------------------------


@_kind("key_verified", SIDE_AUDIT)
class KeyVerified(Event, frozen=True):
    """The value under ``key`` was read back and compared with its fingerprint."""

    key: str
    ok: bool
    expected: Scalar = None
    actual: Scalar = None
    #: addition: the store job whose put wrote the value, when the auditor knows it
    job: Id | None = None

    def __post_init__(self) -> None:
        _finite({"expected": self.expected, "actual": self.actual})


@_kind("load_verified", SIDE_AUDIT)
class LoadVerified(Event, frozen=True):
    """A request loaded ``key`` and compared it with what it should be."""

    req: str
    gen: Id
    key: str
    ok: bool
    #: addition: the store job whose put wrote the loaded value, when known
    job: Id | None = None


@_kind("key_loaded", SIDE_AUDIT)
class KeyLoaded(Event, frozen=True):
    """Addition: a request loaded ``key``, written by another engine.

    The loading process did not write the key, so it cannot say whether the
    bytes are right; ``digest`` is the fingerprint of what it loaded. A
    fleet check joins it with the writer's ``key_verified``: a load whose
    digest is the ``actual`` of a poisoned key took the poison.
    """

    req: str
    gen: Id
    key: str
    digest: str


@_kind("key_missing", SIDE_AUDIT)
class KeyMissing(Event, frozen=True):
    """Addition: the store had no value to read back under ``key``.

    ``reason`` says why: ``evicted`` (the store no longer has the key) or the
    error the read returned. This is not a poisoned key: nothing wrong was
    read, so it is no violation.
    """

    key: str
    reason: str


# -- journal side ------------------------------------------------------------------


@_kind("record_refused", SIDE_JOURNAL)
class RecordRefused(Event, frozen=True):
    """Addition: the connector recorded a record of kind ``refused`` whose
    values the contract refuses; the writer wrote this record in its place,
    at the same seq, so the journal stays readable. ``error`` says which
    field held what."""

    refused: str
    error: str


@_kind("observer_stood_down", SIDE_JOURNAL)
class ObserverStoodDown(Event, frozen=True):
    """Addition: the observer stopped journaling this connector here, and
    wrote nothing after it. What vLLM handed it is not what it reads (a unit
    test's hand-built object in place of vLLM's, a KV cache of several
    groups); ``reason`` says which. The journal is incomplete from here on:
    the fold runs no end-of-run check after it, and replay reports
    ``UNFINISHED`` naming the reason, never clean."""

    reason: str


def rank_of(event: Event) -> int | None:
    """The rank of a worker event; None for every other side."""
    return getattr(event, "rank", None) if event.side == SIDE_WORKER else None


# The additions for connectors that load as well as store are declared in a
# module of their own; importing it here registers them in EVENT_TYPES before
# any reader (codec, fold, recorder) builds its tables from it.
from . import tier_events as tier_events  # noqa: E402
from . import transfer_events as transfer_events  # noqa: E402
