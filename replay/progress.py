"""A progress bar on stderr for long passes over a journal (replay, --minimize).

Shown only when stderr is a terminal, so pipes and CI logs stay clean. The
total is the record count of a journal database when there is one path;
JSON Lines and merged journals show a running count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from journal import Journal, JournalError, is_journal_file

from .report import report_console


def _total(paths: Sequence[str]) -> int | None:
    if len(paths) != 1 or not is_journal_file(paths[0]):
        return None
    try:
        with Journal(paths[0], readonly=True) as journal:
            return len(journal)
    except JournalError:
        return None  # the pass itself reports the problem


@contextlib.contextmanager
def records_progress(paths: Sequence[str], what: str) -> Iterator[Callable[[int], None] | None]:
    """Yield a callback taking the records done so far, or None when not on a terminal."""
    console = report_console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    with Progress(
        TextColumn(f"{what}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("records"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=_total(paths))
        yield lambda done: bar.update(task, completed=done)
