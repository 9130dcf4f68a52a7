"""kvstate: the lifecycle of asynchronous KV-cache store jobs, journaled and checked.

Every scheduler and worker transition is an immutable event
(:mod:`kvstate.events`) appended to a journal (:mod:`journal`) and folded into
the reference ledger (:class:`Ledger`). Connectors embed
:class:`SchedulerLedger` and one :class:`WorkerLedger` per rank, which keep
only what their decisions need; the recorder's audit (:mod:`kvstate.audit`)
runs the fold on the same records, live, and replay folds a journal offline
with the same code.

This package is the embeddable core: importing it loads no simulator, no
torch and no terminal UI. Harness code lives in :mod:`kvstate.harness`.
"""

from .archive import Archive
from .codec import Entry, from_record, to_record
from .errors import (
    DuplicateJobError,
    LedgerUsageError,
    UnknownJobError,
    UnknownRequestError,
)
from .ledger import Ledger
from .rank import RankLedger
from .recorder import Recorder
from .scheduler import SchedulerLedger
from .spill import SpillArchive
from .state import (
    BlockState,
    Incarnation,
    RankJobState,
    RequestState,
    StoreJobState,
    StoreRequestState,
)
from .violations import (
    CausalityError,
    Code,
    CrashError,
    DoubleReportError,
    EarlyReleaseError,
    ForeignBlockReadError,
    HeldForeverError,
    IdReusedError,
    InvariantViolation,
    LeakedPinError,
    MissingReportError,
    OffsetRewoundError,
    ParentChainBrokenError,
    PhantomCompletionError,
    PinMismatchError,
    PoisonedKeyError,
    PoisonedReadError,
    PrematureRetireError,
    RefcountUnderflowError,
    StaleGenerationError,
    TableOverrunError,
    UnledgeredJobError,
    Violation,
    WrongKvLoadedError,
)
from .worker import JobRun, JobSpec, WorkerLedger

__all__ = [
    "Archive",
    "BlockState",
    "CausalityError",
    "Code",
    "CrashError",
    "DoubleReportError",
    "DuplicateJobError",
    "EarlyReleaseError",
    "Entry",
    "ForeignBlockReadError",
    "HeldForeverError",
    "IdReusedError",
    "Incarnation",
    "InvariantViolation",
    "JobRun",
    "JobSpec",
    "LeakedPinError",
    "Ledger",
    "LedgerUsageError",
    "MissingReportError",
    "OffsetRewoundError",
    "ParentChainBrokenError",
    "PhantomCompletionError",
    "PinMismatchError",
    "PoisonedKeyError",
    "PoisonedReadError",
    "PrematureRetireError",
    "RankJobState",
    "RankLedger",
    "Recorder",
    "RefcountUnderflowError",
    "RequestState",
    "SchedulerLedger",
    "SpillArchive",
    "StaleGenerationError",
    "StoreJobState",
    "StoreRequestState",
    "TableOverrunError",
    "UnknownJobError",
    "UnknownRequestError",
    "UnledgeredJobError",
    "Violation",
    "WorkerLedger",
    "WrongKvLoadedError",
    "from_record",
    "to_record",
]
