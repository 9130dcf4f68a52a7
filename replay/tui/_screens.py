"""The inspector's modal screens: help text, a one-line question, a timeline.

Each one keeps the keys pressed while it is open (the inspector's
``check_action`` refuses its own view actions under a modal), and Esc or
``q`` closes it.
"""

from __future__ import annotations

import time

from rich.console import RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static
from textual.worker import get_current_worker

from journal.database import BEFORE_FIRST
from kvstate.codec import Entry
from kvstate.violations import Violation
from replay.report import lane_cells, lane_columns, lanes_of
from replay.timeline import selector
from replay.timetravel import TimeTravel

#: records between two looks at whether the timeline's scan was cancelled,
#: and between two progress lines while it reads
SCAN_CHUNK = 16384


class TextScreen(ModalScreen[None]):
    """A modal with a scrollable renderable (help); Esc or q closes it."""

    BINDINGS = [Binding("escape", "dismiss", "close"), Binding("q", "dismiss", "close")]

    def __init__(self, body: RenderableType, title: str) -> None:
        super().__init__()
        self.body = body
        self.heading = title

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="modal"):
            yield Static(Text(self.heading, style="bold"))
            yield Static(self.body, id="modal-body")
        yield Footer()

    def action_dismiss(self, result: None = None) -> None:  # type: ignore[override]
        self.dismiss(None)


class AskScreen(ModalScreen[str]):
    """One line of input (go to seq, filter); Enter accepts, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, prompt: str, value: str = "") -> None:
        super().__init__()
        self.prompt = prompt
        self.value = value

    def compose(self) -> ComposeResult:
        yield Static(Text(self.prompt))
        yield Input(value=self.value, id="ask")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss("\x00")


class TimelineScreen(ModalScreen[None]):
    """The timeline of one request or job: its records as lanes, as ``kvstate timeline`` shows.

    A request of a long decode has thousands of records. Drawn as one rich
    table inside a scrolling pane, every one of them was laid out before the
    screen appeared and again on each scroll: seconds with no feedback. Here
    the whole-journal scan runs on a thread while the screen already says
    what it is reading, and the rows go into a :class:`DataTable`, which
    draws only the rows on screen and scrolls sideways (left / right) when
    the lanes are wider than the terminal.
    """

    BINDINGS = [
        Binding("escape", "dismiss", "close"),
        Binding("q", "dismiss", "close"),
        # a lane at a time, not a character: the table's own left/right
        # moved one cell of text per press (140 presses to reach rank 1)
        Binding("right", "lanes(1)", "lanes right", priority=True),
        Binding("left", "lanes(-1)", "lanes left", priority=True),
        Binding("shift+right", "lanes(4)", "far right", show=False, priority=True),
        Binding("shift+left", "lanes(-4)", "far left", show=False, priority=True),
    ]

    def __init__(self, tt: TimeTravel, what: str, value: str | int) -> None:
        super().__init__()
        self.tt = tt
        self.what = what
        self.value = value
        #: set once the rows are on screen: how many records
        self.shown: int | None = None

    @property
    def title_text(self) -> str:
        return f"timeline of {self.what} {self.value}"

    def compose(self) -> ComposeResult:
        with Vertical(id="modal"):
            yield Static(Text(f"{self.title_text}: reading the journal…"), id="timeline-heading")
            # the seq column stays when the lanes scroll sideways
            yield DataTable(
                id="timeline-table", cursor_type="row", zebra_stripes=True, fixed_columns=1
            )
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self._read, thread=True, exclusive=True, name="timeline")

    def _read(self) -> None:
        """On a worker thread: find the records, then hand the rows to the UI thread."""
        worker = get_current_worker()
        wanted = selector(
            str(self.value) if self.what == "req" else None,
            int(self.value) if self.what == "job" else None,
        )
        last = self.tt.last_seq
        found: list[Entry] = []
        for n, entry in enumerate(self.tt.stream(BEFORE_FIRST, last), 1):
            if wanted(entry.event):
                found.append(entry)
            if n % SCAN_CHUNK == 0:
                if worker.is_cancelled:
                    return  # closed while reading
                self.app.call_from_thread(self._progress, entry.seq, last)
        marks: dict[int, list[Violation]] = {}
        if found:
            # The overview folds in the background: wait until it has passed
            # the last record shown, or a count read now is a count so far
            # (it grew between two openings). It watches progress, not time.
            while self.tt.indexing and self.tt.indexed_seq < found[-1].seq:
                if worker.is_cancelled:
                    return
                time.sleep(0.05)
            mine = {e.seq for e in found}
            for v in self.tt.violations_between(found[0].seq - 1, found[-1].seq):
                if v.seq in mine:  # not another job's records in between
                    marks.setdefault(v.seq, []).append(v)
        lanes = lanes_of(found)
        rows = [lane_cells(e, lanes, marks.get(e.seq, ())) for e in found]
        if not worker.is_cancelled:
            self.app.call_from_thread(self._fill, lane_columns(lanes, False), rows, len(marks))

    def _progress(self, seq: int, last: int) -> None:
        heading = f"{self.title_text}: reading the journal, seq {seq:,} of {last:,}…"
        self.query_one("#timeline-heading", Static).update(Text(heading))

    def _fill(self, columns: list[str], rows: list[list[Text]], marked: int) -> None:
        table = self.query_one("#timeline-table", DataTable)
        table.add_columns(*columns)
        table.add_rows(rows)
        heading = Text(f"{self.title_text}: {len(rows):,} records", style="bold")
        if marked:
            heading.append(f", {marked} with violations (red)", style="bold red")
        self.query_one("#timeline-heading", Static).update(heading)
        self.shown = len(rows)
        table.focus()

    def action_lanes(self, lanes: int) -> None:
        """Scroll sideways by ``lanes`` columns (the widths of the next ones)."""
        table = self.query_one("#timeline-table", DataTable)
        widths = [c.get_render_width(table) for c in table.ordered_columns[1:]]
        x, edge, target = int(table.scroll_x), 0, None
        starts = []
        for width in widths:
            starts.append(edge)
            edge += width
        if lanes > 0:
            ahead = [s for s in starts if s > x]
            target = ahead[min(lanes, len(ahead)) - 1] if ahead else x
        else:
            behind = [s for s in starts if s < x]
            target = behind[max(0, len(behind) + lanes)] if behind else 0
        table.scroll_to(x=target, animate=False)

    def action_dismiss(self, result: None = None) -> None:  # type: ignore[override]
        self.dismiss(None)
