"""The inspector's fold thread: the ledger views are built off the UI thread.

Folding a million-record journal to an arbitrary seq takes a snapshot copy
and up to tens of thousands of records; done on the UI thread it would hold
every key behind it. Here the UI says which ``(seq, tab, filter)`` it wants
and goes on; this thread folds, builds that view's rows from the ledger it
alone touches (the ledger is mutated by the next fold, so nothing else may
read it), and leaves the finished view to be picked up. A newer wish aborts
the fold in progress: holding an arrow key costs one fold, not one per key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from replay.timetravel import TimeTravel

from ._views import LEDGER_VIEWS, Filter, TableView, TextView

#: what a view is of: cursor seq, tab, filter text
Wish = tuple[int, str, str]
View = TableView | TextView


class Folder:
    """One background thread that folds to the latest wish and builds its view."""

    def __init__(self, tt: TimeTravel, on_ready: Callable[[], None] | None = None) -> None:
        """``on_ready`` is called from the fold thread each time a view is finished
        (the inspector posts itself a message: textual's post_message is thread-safe)."""
        self._tt = tt
        self._on_ready = on_ready
        self._cond = threading.Condition()
        self._wish: tuple[int, str, Filter] | None = None
        self._ready: tuple[Wish, View] | None = None
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="inspector-fold", daemon=True)
        self._thread.start()

    def want(self, seq: int, tab: str, flt: Filter) -> None:
        """Ask for ``tab`` as of ``seq``; replaces any earlier wish not yet served."""
        with self._cond:
            self._wish = (seq, tab, flt)
            self._cond.notify()

    def take(self) -> tuple[Wish, View] | None:
        """The view finished since the last call, if any."""
        with self._cond:
            ready, self._ready = self._ready, None
            return ready

    @property
    def idle(self) -> bool:
        """No wish waiting, no fold running."""
        with self._cond:
            return self._wish is None and not self._busy

    def close(self, *, wait: bool = True) -> None:
        """Stop: a fold in progress notices within a few hundred records."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if wait:
            self._thread.join()  # no deadline: a fold notices within a few hundred records

    def _interrupted(self) -> bool:
        return self._closing or self._wish is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wish is None and not self._closing:
                    self._cond.wait()
                if self._closing or self._wish is None:
                    return
                (seq, tab, flt), self._wish = self._wish, None
                self._busy = True
            try:
                ledger = self._tt.ledger_at(seq, cancel=self._interrupted)
                view = None if ledger is None else LEDGER_VIEWS[tab](ledger, seq, flt)
            finally:
                with self._cond:
                    self._busy = False
            if view is not None:
                with self._cond:
                    self._ready = ((seq, tab, str(flt)), view)
                if self._on_ready is not None:
                    self._on_ready()
                # Nothing else asked for: fold a spare ledger to the step
                # before, so going back (left, PgUp) starts a few records
                # away instead of up to a snapshot interval (thousands)
                # behind. A key arriving meanwhile stops it.
                if not self._interrupted():
                    behind = self._tt.step_start(seq, -1)
                    if behind < seq:
                        self._tt.prepare(behind, cancel=self._interrupted)
