"""kvstate: the lifecycle of asynchronous KV-cache store jobs, journaled and checked.

Every scheduler and worker transition is an immutable event
(:mod:`kvstate.events`) appended to a journal (:mod:`journal`) and folded into
the reference ledger (:class:`Ledger`). Connectors embed
:class:`SchedulerLedger` and one :class:`WorkerLedger` per rank; replay folds
a journal offline with the same code.
"""

from .codec import Entry, from_record, to_record
from .ledger import Ledger
from .rank import RankLedger
from .recorder import Recorder
from .scheduler import SchedulerLedger
from .violations import Code, InvariantViolation, Violation
from .worker import JobRun, JobSpec, WorkerLedger

__all__ = [
    "Code",
    "Entry",
    "InvariantViolation",
    "JobRun",
    "JobSpec",
    "Ledger",
    "RankLedger",
    "Recorder",
    "SchedulerLedger",
    "Violation",
    "WorkerLedger",
    "from_record",
    "to_record",
]
