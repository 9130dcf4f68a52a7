"""What a journal's writer keeps to write its checkpoints (retention: :mod:`kvstate.checkpoint`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from . import checkpoint
from .codec import Entry
from .folder import Folder
from .ledger import Ledger
from .spill import SpillArchive
from .violations import Violation


class Checkpoints:
    """The fold, as replay folds the journal (``ledger``: one already folding
    so, the live audit's; else one of its own), and its findings, the first
    :data:`~kvstate.checkpoint.MAX_FINDINGS` listed and the rest counted."""

    def __init__(self, ledger: Ledger | None = None) -> None:
        #: whether this folds the records itself (else the live audit does)
        self._folds = ledger is None
        ledger = ledger if ledger is not None else Ledger(archive=SpillArchive())
        self._folder = Folder(ledger, listed=checkpoint.MAX_FINDINGS)

    @property
    def ledger(self) -> Ledger:
        return self._folder.ledger  # type: ignore[return-value]

    @property
    def found(self) -> list[Violation]:
        """The findings listed so far."""
        return self._folder.found

    @property
    def omitted(self) -> int:
        """The findings counted and not listed."""
        return self._folder.omitted

    def committed(self, entries: Iterable[Entry], found: list[Violation]) -> None:
        """A batch is committed: fold it, where this folds itself; else keep
        ``found``, what the live audit's fold (this one's ledger) found in it."""
        if self._folds:
            found = self._folder.batch(entries)
        if found:
            self._folder.keep(found)

    def parts(self) -> Iterator[bytes]:
        """The checkpoint after the last batch folded."""
        return checkpoint.parts(self.ledger, self.found, omitted=self.omitted)
