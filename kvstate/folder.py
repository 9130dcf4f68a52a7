"""The one fold loop: records handed to a ledger in order.

Every reader folds through a :class:`Folder` (replay, export, time travel,
the inspector, watch, minimize), and so do the live audit, the checkpoints
a journal's writer keeps and the simulator's own check: it is the only
place in the library that calls a fold's ``apply`` (``tests/test_folder.py``
fails on another). What each caller adds lives here once:

* a journal whose head retention removed begins with a checkpoint
  (:class:`~kvstate.checkpoint.Resumed`): the fold goes on from it, and the
  findings of the removed records come first (:meth:`Folder.located`);
* a record the fold refuses as a journal (:class:`journal.RecordError`) is
  named with the file and line or seq it was read from;
* a long-lived fold lists its first findings and counts the rest
  (:meth:`Folder.keep`): an engine that breaks an invariant every step for
  weeks must not grow a process with them. The journal holds every record,
  and replay lists every finding.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from journal import RecordError

from . import events as ev
from .checkpoint import Resumed, restore
from .codec import Entry, Located
from .errors import TemporaryStorageError
from .ledger import Ledger
from .violations import Code, Violation


class Fold(Protocol):
    """What a :class:`Folder` folds into: the reference :class:`~kvstate.ledger.Ledger`,
    or ranks recording without their scheduler (:class:`~kvstate.rank.RanksAlone`)."""

    def apply(self, seq: int, step: int, event: ev.Event) -> list[Violation]: ...


class Folder:
    """Folds records into :attr:`ledger`, in the order given."""

    __slots__ = ("found", "ledger", "listed", "omitted")

    def __init__(self, ledger: Fold, *, listed: int | None = None) -> None:
        self.ledger = ledger
        #: how many findings :meth:`keep` lists (None: every one)
        self.listed = listed
        #: the findings kept so far, in seq order
        self.found: list[Violation] = []
        #: findings counted and not listed (past :attr:`listed`)
        self.omitted = 0

    def fold(self, seq: int, step: int, event: ev.Event) -> list[Violation]:
        """Fold one record; its findings.

        A record the fold refuses as a journal (a second header describing
        another engine) raises :class:`journal.RecordError`.
        """
        return self.ledger.apply(seq, step, event)

    def entries(self, entries: Iterable[Entry]) -> Iterator[tuple[Entry, list[Violation]]]:
        """Fold each entry as it is read; yields it with its findings."""
        apply = self.ledger.apply
        for entry in entries:
            yield entry, apply(entry.seq, entry.step, entry.event)

    def batch(self, entries: Iterable[Entry]) -> list[Violation]:
        """Fold a batch (a committed one, a whole journal in memory); its findings."""
        apply = self.ledger.apply
        found: list[Violation] = []
        for seq, step, _ts, event in entries:
            got = apply(seq, step, event)
            if got:
                found += got
        return found

    def located(self, items: Iterable[Located]) -> Iterator[tuple[Entry, list[Violation]]]:
        """Fold each record as it is read, knowing where it was read; yields it
        with its findings.

        The loop of the readers that judge a whole journal (replay, export,
        ``inspect --once``, time travel): unusable input raises
        :class:`journal.RecordError` naming the file and line or seq it was
        read from. A checkpoint (:class:`~kvstate.checkpoint.Resumed`) yields
        the findings of the records it stands for.
        """
        apply = self.ledger.apply
        for item in items:
            entry = item.entry
            if type(entry.event) is Resumed:
                # the journal's head was removed (journal.retention): the fold
                # goes on from its checkpoint, and the findings before it come first
                yield entry, self.resume(item)
                continue
            try:
                found = apply(entry.seq, entry.step, entry.event)
            except RecordError as exc:
                raise exc.located(path=item.path, line=item.line, seq=item.seq) from None
            yield entry, found

    def resume(self, item: Located) -> list[Violation]:
        """Restore :attr:`ledger` (a :class:`~kvstate.ledger.Ledger`, nothing
        folded yet) from the checkpoint ``item`` carries; returns the findings
        of the removed records, and a warning (``FROM_CHECKPOINT``) that the
        verdict covers them only as the checkpoint tells them."""
        resumed: Resumed = item.entry.event  # type: ignore[assignment]
        ledger = self.ledger
        if not isinstance(ledger, Ledger):
            raise RecordError("a checkpoint where no whole journal is folded",
                              path=item.path, seq=item.seq)  # fmt: skip
        if ledger.records:
            raise RecordError("a checkpoint after records: not where a journal begins",
                              path=item.path, seq=item.seq)  # fmt: skip
        try:
            found = restore(ledger, resumed)
        except (RecordError, TemporaryStorageError):
            raise  # the input named, or the machine's temporary storage (exit 3)
        except Exception as exc:  # a checkpoint of the right form holding the wrong values
            raise RecordError(
                f"the checkpoint cannot be restored: {type(exc).__name__}: {exc}",
                path=item.path,
                seq=item.seq,
            ) from None
        note = Violation(Code.FROM_CHECKPOINT, resumed.seq, resumed.describe())
        return [*found, note]

    def keep(self, found: list[Violation]) -> None:
        """Keep ``found`` in :attr:`found`, up to :attr:`listed`; count the rest."""
        if self.listed is None:
            self.found += found
            return
        room = max(self.listed - len(self.found), 0)
        self.found += found[:room]
        self.omitted += max(0, len(found) - room)


def fold_all(entries: Iterable[Entry], ledger: Ledger | None = None) -> list[Violation]:
    """Every finding of ``entries`` folded into ``ledger`` (a new one when not
    given), the end-of-journal check included: a journal in memory, judged whole."""
    ledger = ledger if ledger is not None else Ledger()
    return Folder(ledger).batch(entries) + ledger.end()
