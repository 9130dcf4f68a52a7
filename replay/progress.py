"""A progress bar on stderr for long passes over a journal (replay, --minimize).

Shown only when stderr is a terminal, so pipes and CI logs stay clean. The
total is what the journal databases say as the pass opens them (a
:class:`replay.sources.Sized`, on the pass's own connection: the journal is
not opened again for a count); JSON Lines shows a running count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .report import report_console
from .sources import Sized


@contextlib.contextmanager
def records_progress(sized: Sized, what: str) -> Iterator[Callable[[int], None] | None]:
    """Yield a callback taking the records done so far, or None when not on a terminal.

    ``sized`` is given to the pass that reads the journal, which fills it in.
    """
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
        task = bar.add_task(what, total=None)
        yield lambda done: bar.update(task, completed=done, total=sized.total)
