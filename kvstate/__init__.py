"""kvstate: the lifecycle of asynchronous KV-cache store jobs, journaled and checked.

Every scheduler and worker transition is an immutable event
(:mod:`kvstate.events`) appended to a journal (:mod:`journal`) and folded into
the reference ledger (:class:`Ledger`). Connectors embed
:class:`SchedulerLedger` and one :class:`WorkerLedger` per rank, which keep
only what their decisions need; the recorder's audit (:mod:`kvstate.audit`)
runs the fold on the same records, live, and replay folds a journal offline
with the same code.

This package is the embeddable core: importing it loads no simulator, no
torch and no terminal UI. Harness code lives in :mod:`kvstate.harness`. The
top level is the embedder's face (``__all__``). Every error kvstate raises
on purpose, a misuse of the API, a breached invariant in strict mode or a
vLLM the observer cannot patch, derives from :class:`KvstateError`; the
journal's own errors (:class:`journal.JournalError`, and
:class:`journal.RecordError` for unusable input) and the operating system's
pass through as they are.
"""

from .errors import KvstateError
from .jobrun import JobRun
from .ledger import Ledger
from .recorder import Recorder
from .scheduler import SchedulerLedger
from .spill import SpillArchive
from .violations import Code, Violation
from .worker import JobSpec, WorkerLedger

#: the embedder's face; everything else is importable from its own module
#: (kvstate.errors and kvstate.violations for each exception, kvstate.state
#: for the fold's rows, kvstate.codec, kvstate.archive, kvstate.rank, ...)
__all__ = [
    "Code",
    "JobRun",
    "JobSpec",
    "KvstateError",
    "Ledger",
    "Recorder",
    "SchedulerLedger",
    "SpillArchive",
    "Violation",
    "WorkerLedger",
]
