"""The auditor: the one fold, run on what a recorder records.

The live ledgers (:mod:`kvstate.scheduler`, :mod:`kvstate.worker`) are
guards: they keep only what the connector's decisions need. Every invariant
is checked by the fold (:class:`~kvstate.ledger.Ledger` and
:class:`~kvstate.rank.RankLedger`), and an :class:`Auditor` runs that fold
on the records of one recorder:

* ``inline``: each record is folded as it is recorded, on the caller's
  thread, so a strict ledger raises at the call that breached an invariant
  (tests, tools, the simulator; this costs the caller the fold);
* ``commit``: the records are folded where the journal is written, after
  each commit (the writer thread, or the writer process, the default of
  :meth:`Recorder.open`): the caller pays only for its guards and the
  hand-over. A writer process folds a batch once it is durable, so its
  findings come back with the answer to the next commit; a strict ledger
  raises them at its first call after that (:mod:`kvstate.placement`
  fixes where, when the journal opens);
* ``off``: nothing is folded live; ``kvstate replay`` judges the journal.

What the fold is depends on what the recorder carries, known once the
ledgers are attached: a scheduler and its ranks together are judged as
replay judges a whole journal; a scheduler alone cannot count the ranks'
reports (``observes_workers=False``); ranks alone learn what a job is from
the specs they registered, and flag records of a job they never registered
as ``UNLEDGERED_JOB``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

from . import events as ev
from .archive import Archive
from .codec import Entry
from .folder import Folder
from .ledger import Ledger
from .rank import JobInfo, RankLedger, RanksAlone
from .violations import LISTED_FINDINGS, Violation

#: what a writer process folds for a recorder (see :meth:`Auditor.remote_config`)
Fold = Literal["scheduler", "scheduler+workers"]

AUDIT_MODES = ("inline", "commit", "off")


class Auditor:
    """Folds one recorder's records and keeps every finding in :attr:`violations`."""

    def __init__(self, mode: str = "inline") -> None:
        if mode not in AUDIT_MODES:
            raise ValueError(f"audit must be one of {', '.join(AUDIT_MODES)}, not {mode!r}")
        self.mode = mode
        #: the findings so far, in seq order: the first :data:`LISTED_FINDINGS`
        self.violations: list[Violation] = []
        #: findings counted and not listed (past :data:`LISTED_FINDINGS`)
        self.omitted = 0
        #: findings of a ``commit`` audit not yet taken by a ledger (see
        #: :meth:`take_new`); the writer thread adds, the ledgers take. As
        #: many at most as are listed: where no ledger takes them (the vLLM
        #: observer records without one), the oldest stay and later ones are
        #: dropped, as they are from :attr:`violations`
        self.untaken: list[Violation] = []
        #: whether findings are listed here at all: not in a writer process,
        #: which reports each batch's findings to the engine and keeps none
        self.lists = True
        self._untaken_lock = threading.Lock()
        self._header: Entry | None = None
        self._scheduler = False
        self._archive: Archive | None = None
        #: whether ranks record here, and the specs each registers
        self._workers = False
        self._specs: dict[int, Mapping[int, JobInfo]] = {}
        #: the whole-journal or scheduler fold (None for ranks alone, or before the first record)
        self.ledger: Ledger | None = None
        #: the rank folds when no scheduler records to this recorder
        self.ranks: dict[int, RankLedger] = {}
        #: the loop that folds into one of them (built with the first record)
        self._folder: Folder | None = None
        self._built = False
        #: called once, with the first finding that is not a warning
        self.on_first: Callable[[Violation], None] | None = None
        self._first_told = False

    # -- what the recorder carries -------------------------------------------------

    def attach_scheduler(self, archive: Archive | None = None) -> None:
        """A scheduler records here, parking what it settles in ``archive``.

        An inline fold runs beside it, on the caller's thread, and parks
        there too (in memory when none is given), as replay does; a commit
        audit's fold runs where the journal is written and keeps its own.
        """
        self._scheduler = True
        if self.mode == "inline":
            self._archive = archive if archive is not None else Archive()

    def attach_rank(self, rank: int, specs: Mapping[int, JobInfo]) -> None:
        """Rank ``rank`` records here and registers its jobs' specs in ``specs``."""
        self._workers = True
        self._specs[rank] = specs

    # -- folding ------------------------------------------------------------------

    def header(self, entry: Entry) -> None:
        """The journal's first record."""
        self._header = entry

    def _build(self) -> Folder:
        self._built = True
        if self._scheduler:
            self.ledger = Ledger(observes_workers=self._workers, archive=self._archive)
            self._folder = Folder(self.ledger)
            if self._header is not None:
                h = self._header
                self._folder.fold(h.seq, h.step, h.event)
        else:
            self.ledger = None
            self.ranks = {
                rank: RankLedger(rank, specs, knows_all_jobs=False)
                for rank, specs in self._specs.items()
            }
            self._folder = Folder(RanksAlone(self.ranks))
        return self._folder

    def fold(self, seq: int, step: int, event: ev.Event) -> list[Violation]:
        """Fold one record; returns its findings (also kept in :attr:`violations`).

        A record the fold refuses as a journal (a second header describing
        another engine) raises :class:`journal.RecordError`, as replay would.
        """
        folder = self._folder if self._folder is not None else self._build()
        found = folder.fold(seq, step, event)
        if found:
            self._list(found, untaken=self.mode != "inline")  # inline, the caller acts now
            self._tell_first(found)
        return found

    def _list(self, found: list[Violation], *, listed: bool = True, untaken: bool = True) -> None:
        """Keep ``found`` in :attr:`violations` (unless ``listed`` is False:
        already there) and :attr:`untaken`, each up to :data:`LISTED_FINDINGS`."""
        if not self.lists:
            return
        if listed:
            room = LISTED_FINDINGS - len(self.violations)
            self.violations += found[: max(room, 0)]
            self.omitted += max(0, len(found) - max(room, 0))
        if untaken:
            with self._untaken_lock:
                room = LISTED_FINDINGS - len(self.untaken)
                self.untaken += found[: max(room, 0)]

    def _tell_first(self, found: list[Violation]) -> None:
        if self._first_told or self.on_first is None:
            return
        first = next((v for v in found if not v.is_warning), None)
        if first is not None:
            self._first_told = True
            self.on_first(first)

    def fold_batch(self, entries: list[Entry]) -> list[Violation]:
        """Fold a committed batch (the ``commit`` mode's writer side, in this
        process or the writer process); returns its findings."""
        folder = self._folder if self._folder is not None else self._build()
        found = folder.batch(entries)
        if found:
            self._list(found, untaken=self.mode != "inline")
            self._tell_first(found)
        return found

    def take_new(self) -> list[Violation]:
        """Findings since the last call (what a strict ledger raises at its next call)."""
        with self._untaken_lock:
            new, self.untaken = self.untaken, []
        return new

    def add_found(self, found: list[Violation], *, folded: bool = False) -> None:
        """Findings no ledger call took: folded elsewhere (the writer process),
        or by :meth:`fold` already (``folded``: kept, not counted twice)."""
        if found:
            self._list(found, listed=not folded)
            self._tell_first(found)

    @property
    def wants_specs(self) -> bool:
        """Whether the ranks' job specs are needed: ranks alone record here."""
        return not self._scheduler and self.mode != "off"

    def remote_config(self) -> Fold | None:
        """What a writer process must fold for this recorder: ``scheduler`` or
        ``scheduler+workers``; None when it cannot (ranks alone: the specs
        they register are not in the journal) or the audit is not ``commit``."""
        if self.mode != "commit" or not self._scheduler:
            return None
        return "scheduler+workers" if self._workers else "scheduler"

    @classmethod
    def remote(cls, config: Fold, archive: Archive | None) -> Auditor:
        """The auditor a writer process runs for :meth:`remote_config`'s ``config``."""
        auditor = cls("commit")
        auditor.lists = False  # each batch's findings go back with its answer
        auditor._scheduler = True
        auditor._archive = archive  # the writer process's spill
        auditor._workers = config == "scheduler+workers"
        return auditor

    def rank_ledger(self, rank: int) -> RankLedger:
        """The fold's state of one rank (for tools and tests; the guards do not read it)."""
        if not self._built:
            self._build()
        if self.ledger is not None:
            return self.ledger.rank(rank)
        return self.ranks[rank]

    def state(self) -> Any:
        """The fold itself: the :class:`Ledger`, or the rank ledgers by rank."""
        if not self._built:
            self._build()
        return self.ledger if self.ledger is not None else self.ranks
