"""``kvstate inspect``: travel through a journal in a terminal UI.

Every view shows the ledger as of the cursor seq: move a record with
left/right, a step with PgUp/PgDn, jump with ``g`` or to the next/previous
violation with ``n``/``p``. The journal is opened read-only and every string
from it is shown literally (``rich.text.Text``, never markup).
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import sys
import time
from typing import Any

from rich.console import Group as RichGroup
from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane

from journal.database import BEFORE_FIRST
from kvstate.violations import Violation
from replay.explain import describe, explain, lane
from replay.report import lanes_table
from replay.safe import printable
from replay.timetravel import TimeTravel

from ._folder import Folder, View, Wish
from ._matches import Matches
from ._screens import AskScreen, TextScreen, TimelineScreen
from ._views import LEDGER_VIEWS, Filter, TableView, Target, TextView, _t, overview

TABS = ("overview", "requests", "jobs", "blocks", "violations", "events")
EVENTS_AROUND = 60
#: how often settled() looks whether the view on screen is the one wanted (seconds)
SETTLE_POLL = 0.01


class FoldReady(Message):
    """The fold thread finished a ledger view (posted from that thread)."""


#: the Violations view shows this many (a few screens), the latest up to the cursor
VIOLATIONS_SHOWN = 120


HELP = """\
left / right     one record back / forward
PgUp / PgDn      the previous / next engine step
Home / End       the first / last record
Shift+left/right scroll a view wider than the terminal sideways
                 (in a timeline: left / right)
g                go to a seq
n / p            next / previous violation
/                filter: req R, job J, rank N, kind K, or a word (empty clears,
                 Esc keeps the one in force)
Enter            on a row: the timeline of its request or job
1..6             overview, requests, jobs, blocks, violations, events
?                this help
q                quit
"""


class Inspector(App[None]):
    """The journal inspector."""

    TITLE = "kvstate inspect"
    CSS = """
    #status { height: 2; padding: 0 1; background: $boost; }
    TabbedContent { height: 1fr; }
    TabPane { height: 1fr; padding: 0; }
    DataTable { height: 1fr; }
    #timeline-heading { height: auto; }
    #violations-table { height: 1fr; width: 1fr; }
    #violation-detail { height: 2fr; min-height: 12; border-top: solid $accent; padding: 0 1; }
    #modal { padding: 1 2; border: round $accent; }
    AskScreen { align: center middle; }
    AskScreen > Static { width: 60; }
    AskScreen > Input { width: 60; }
    """
    # The footer shows the five keys one cannot guess (n, p, /, ?, q), so they
    # fit 80 columns; ? lists the rest.
    BINDINGS = [
        Binding("left", "move(-1)", "prev record", show=False, priority=True),
        Binding("right", "move(1)", "next record", show=False, priority=True),
        Binding("pageup", "step(-1)", "prev step", show=False, priority=True),
        Binding("pagedown", "step(1)", "next step", show=False, priority=True),
        Binding("home", "edge(-1)", "first record", show=False, priority=True),
        Binding("shift+left", "sideways(-1)", "scroll left", show=False, priority=True),
        Binding("shift+right", "sideways(1)", "scroll right", show=False, priority=True),
        Binding("end", "edge(1)", "last record", show=False, priority=True),
        Binding("g", "goto", "go to seq", show=False),
        Binding("n", "violation(1)", "next viol."),
        Binding("p", "violation(-1)", "prev viol."),
        Binding("slash", "filter", "filter"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        *(Binding(str(i + 1), f"tab('{name}')", name, show=False) for i, name in enumerate(TABS)),
    ]
    #: the actions of the main view, which a modal screen must not trigger
    VIEW_ACTIONS = frozenset(
        {"move", "step", "edge", "sideways", "goto", "violation", "filter", "help", "tab", "quit"}
    )

    def __init__(
        self, path: str | list[str], *, follow: bool = False, background: bool = True
    ) -> None:
        super().__init__()
        self.tt = TimeTravel(path)
        self.follow = follow
        self.background = background
        self.cursor = min(1, self.tt.last_seq)
        self.filter = Filter()
        #: the ledger views are folded and built on their own thread (None: here)
        self.folder: Folder | None = None
        #: what each ledger view on screen shows: (seq, tab, filter)
        self._shown: dict[str, Wish] = {}
        #: what Violations and Events were last drawn for: (seq, tab, filter, found, last)
        self._drawn: dict[str, tuple[int, str, str, int, int]] = {}
        self._frozen = False
        self._seen_last = self.tt.last_seq
        self._targets: dict[str, tuple[str, str | int]] = {}
        #: what the filter takes of the whole journal (records, violations), cached
        self.matches = Matches(self.tt)
        self._shown_violations: list[Violation] = []

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Keys pressed in a modal (help, a timeline, go to, filter) stay there."""
        return not (action in self.VIEW_ACTIONS and len(self.screen_stack) > 1)

    # -- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status")
        with TabbedContent(initial="overview", id="tabs"):
            with TabPane("Overview", id="overview"), VerticalScroll():
                yield Static(id="overview-body")
            with TabPane("Requests", id="requests"):
                yield DataTable(id="requests-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Jobs", id="jobs"):
                yield DataTable(id="jobs-table", cursor_type="row", zebra_stripes=True)
            with TabPane("Blocks", id="blocks"), VerticalScroll():
                yield Static(id="blocks-body")
            with TabPane("Violations", id="violations"):
                yield DataTable(id="violations-table", cursor_type="row")
                with VerticalScroll(id="violation-detail"):
                    yield Static(id="violation-story")
            with TabPane("Events", id="events"):
                yield DataTable(id="events-table", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "read-only"
        # The indexing thread is pure Python: hand the interpreter back to the
        # UI more often than the default 5 ms so keys stay responsive meanwhile.
        sys.setswitchinterval(0.0005)
        if self.background:
            self.tt.start(follow=self.follow)
            self.folder = Folder(self.tt, on_ready=self._fold_ready)
        else:
            self.tt.index()
        # At most four refreshes a second, whatever the writer does.
        self._ticker = self.set_interval(0.25, self._tick)
        self.refresh_views()

    def on_unmount(self) -> None:
        self._ticker.stop()
        if self.folder is not None:
            self.folder.close()
        self.tt.stop()

    async def action_quit(self) -> None:
        """Quit at once: the threads are told to stop here and joined as the app unmounts."""
        if self.folder is not None:
            self.folder.close(wait=False)
        self.tt.stop(wait=False)
        self.exit()

    async def settled(self, timeout: float = 60.0) -> None:
        """Wait until the active view shows the cursor (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tab = self._active()
            if tab not in LEDGER_VIEWS or self._shown.get(tab) == self._wish(tab):
                return
            await asyncio.sleep(SETTLE_POLL)

    def _tick(self) -> None:
        if not self.query("#status"):
            return  # the app is shutting down: the widgets are gone
        if self.tt.indexed and not self._frozen:
            # The index of a million records is millions of long-lived objects;
            # left to the cyclic collector, each full pass stalls a key for
            # hundreds of milliseconds. They live until the app ends: freeze them.
            gc.freeze()
            self._frozen = True
        if self.follow and self.tt.last_seq != self._seen_last:
            at_end = self.cursor == self._seen_last
            self._seen_last = self.tt.last_seq
            if at_end:
                self.cursor = self.tt.last_seq
            self.refresh_views()
        elif self.query_one(TabbedContent).active == "overview":
            self._render_overview()
        self._render_status()

    # -- actions ----------------------------------------------------------------------

    def go(self, seq: int) -> None:
        """Move the cursor. The status line and the views that read records
        follow at once; the ledger views catch up from the fold thread."""
        seq = max(min(1, self.tt.last_seq), min(seq, self.tt.last_seq))
        if seq == self.cursor:
            return
        self.cursor = seq
        self.refresh_views()

    def _active(self) -> str:
        return self.query_one(TabbedContent).active

    def _wish(self, tab: str) -> Wish:
        return (self.cursor, tab, str(self.filter))

    def _render_ledger_view(self, tab: str) -> None:
        """Show ``tab`` as of the cursor: built here, or asked of the fold thread."""
        if self._shown.get(tab) == self._wish(tab):
            return
        if self.folder is None:
            ledger = self.tt.ledger_at(self.cursor)
            self._show(self._wish(tab), LEDGER_VIEWS[tab](ledger, self.cursor, self.filter))
        else:
            self.folder.want(self.cursor, tab, self.filter)

    def _fold_ready(self) -> None:
        """Called on the fold thread: hand the news to the UI thread."""
        self.post_message(FoldReady())

    @on(FoldReady)
    def _pick_up(self) -> None:
        """A view the fold thread finished goes on screen if it is still the one wanted."""
        if self.folder is None or not self.query("#status"):
            return
        ready = self.folder.take()
        if ready is not None and ready[0] == self._wish(ready[0][1]):
            self._show(*ready)
            self._render_status()

    def _show(self, wish: Wish, view: View) -> None:
        tab = wish[1]
        if isinstance(view, TableView):
            table = self._table(f"{tab}-table", *view.columns)
            for cells, target in view.rows:
                self._row(table, cells, target)
        elif isinstance(view, TextView):
            self.query_one(f"#{tab}-body", Static).update(view.body)
        self._shown[tab] = wish

    def action_move(self, delta: int) -> None:
        self.go(self.cursor + delta)

    def action_edge(self, direction: int) -> None:
        """Home: the first record; End: the last."""
        self.go(self.tt.last_seq if direction > 0 else min(1, self.tt.last_seq))

    def action_sideways(self, direction: int) -> None:
        """Shift+left/right: scroll the active view by half its width. Plain
        left/right move the cursor record, so tables and the blocks pane wider
        than the terminal (the Events view's violations, the Jobs lanes) need
        keys of their own."""
        active = self._active()
        panes = self.query(f"#{active}-table") or self.query(f"#{active} VerticalScroll")
        if panes:
            pane = panes.first()
            step = max(8, pane.size.width // 2)
            pane.scroll_to(x=pane.scroll_x + direction * step, animate=False)

    def action_step(self, direction: int) -> None:
        self.go(self.tt.step_start(self.cursor, direction))

    def action_violation(self, direction: int) -> None:
        """n / p: works while the index is still reading, on what it has found so far."""
        find = self.tt.next_violation if direction > 0 else self.tt.previous_violation
        found = find(self.cursor)
        if found is None:
            message = "no further violation" if direction > 0 else "no earlier violation"
            if not self.tt.indexed:
                message += f" found yet (indexed {self.tt.indexed_seq} of {self.tt.last_seq})"
            self.notify(message)
            return
        # Switch first: moving the cursor on a ledger tab would set the fold
        # thread on a view that is about to be hidden.
        self.query_one(TabbedContent).active = "violations"
        self._focus_table()
        self.go(found.seq)
        self.refresh_views()

    def action_tab(self, name: str) -> None:
        self.query_one(TabbedContent).active = name
        self.refresh_views()
        self._focus_table()

    def action_goto(self) -> None:
        def chosen(value: str | None) -> None:
            if value and value.strip().isdigit():
                self.go(int(value.strip()))
            elif value and value != "\x00":
                self.notify(f"not a seq: {value!r}", severity="warning")

        self.push_screen(AskScreen("go to seq:"), chosen)

    def action_filter(self) -> None:
        def chosen(value: str | None) -> None:
            if value is None or value == "\x00":
                return
            self.filter = Filter(value)
            self.refresh_views()

        # An empty box: what is typed is the new filter, not appended to the
        # old one, which the prompt shows (Esc keeps it, Enter on empty clears).
        now = str(self.filter)
        prompt = "filter (req R, job J, rank N, kind K, word)"
        prompt += f"; now: {now}; Enter on empty clears, Esc keeps" if now else ":"
        self.push_screen(AskScreen(prompt), chosen)

    def action_help(self) -> None:
        self.push_screen(TextScreen(Text(HELP), "keys"))

    def on_tabbed_content_tab_activated(self, _event: TabbedContent.TabActivated) -> None:
        self.refresh_views()
        self._focus_table()

    def _focus_table(self) -> None:
        """Rows take the keyboard (up/down, Enter) on the tabs that have a table."""
        active = self.query_one(TabbedContent).active
        tables = self.query(f"#{active}-table")
        if tables:
            tables.first().focus()
        else:
            # Leave the hidden table: a focused widget pulls its tab back to front.
            scrolls = self.query(f"#{active} VerticalScroll")
            if scrolls:
                scrolls.first().focus()
            else:
                self.set_focus(None)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        target = self._targets.get(event.row_key.value or "")
        if target is not None:
            self.open_timeline(*target)

    def open_timeline(self, what: str, value: str | int) -> None:
        """The timeline of a request or job, read on a thread (see TimelineScreen)."""
        self.push_screen(TimelineScreen(self.tt, what, value))

    # -- rendering ------------------------------------------------------------------------

    def refresh_views(self) -> None:
        if not self.query("#status"):
            return  # a timer fired while the app shuts down
        self._render_status()
        active = self.query_one(TabbedContent).active
        if active in LEDGER_VIEWS:
            self._render_ledger_view(active)
            return
        if active == "overview":
            self._render_overview()
            return
        # Violations and Events are drawn again only when what they show can
        # differ: a tab switch posts its own refresh after the one the key
        # asked for, and a table of a few screens is the cost of a key.
        drawn = (*self._wish(active), len(self.tt.violations), self.tt.last_seq)
        if self._drawn.get(active) == drawn:
            return
        if active == "violations":
            self._render_violations()
        elif active == "events":
            self._render_events()
        self._drawn[active] = drawn

    def _render_status(self) -> None:
        entry = next(iter(self.tt.entries(self.cursor - 1, self.cursor)), None)
        text = Text()
        text.append(f"seq {self.cursor} of {self.tt.last_seq}", style="bold")
        if entry is not None:
            text.append(f" · step {entry.step} · {lane(entry.event)}: ")
            text.append(printable(describe(entry.event)))
        here = self.tt.violations_between(self.cursor - 1, self.cursor)
        if here:
            text.append("  <- " + ", ".join(v.code.value for v in here), style="bold red")
        text.append("\n")
        if self.filter:
            text.append(f"filter: {printable(self.filter)}  ", style="yellow")
        if self.follow:
            text.append("following  ", style="green")
        if not self.tt.indexed:
            text.append(f"indexing {self.tt.indexed_seq}/{self.tt.last_seq}  ", style="yellow")
        active = self._active()
        shown = self._shown.get(active)
        if active in LEDGER_VIEWS and shown is not None and shown != self._wish(active):
            text.append(f"showing seq {shown[0]}, folding to {self.cursor}", style="yellow")
        self.query_one("#status", Static).update(text)

    def _render_overview(self) -> None:
        self.query_one("#overview-body", Static).update(overview(self.tt))

    def _table(self, table_id: str, *columns: str) -> DataTable:
        """The table emptied of rows; columns are rebuilt only when they change."""
        table = self.query_one(f"#{table_id}", DataTable)
        if [c.label.plain for c in table.columns.values()] == list(columns):
            table.clear()
        else:
            table.clear(columns=True)
            table.add_columns(*columns)
        return table

    def _row(self, table: DataTable, cells: list[Text], target: Target | None) -> None:
        """Add a row; Enter on it opens the timeline of ``target`` (a req or a job)."""
        key = f"{table.id}:{table.row_count}"
        if target is not None and target[1] is not None:
            self._targets[key] = target
        else:
            self._targets.pop(key, None)
        table.add_row(*cells, key=key)

    def _put_cursor(self, table: DataTable, row: int) -> None:
        """Highlight ``row`` of a table just refilled, in the same paint.

        Refilling a table scrolls it to the top; moving the cursor then
        scrolls again once the table has measured its rows, so every key
        painted the table twice. The table keeps its height from the last
        fill (the views hold about as many rows each time), so scroll now,
        before the paint, to where the cursor row will be in view.
        """
        visible = max(1, table.scrollable_content_region.height - 1)  # less the header
        if row >= visible:
            table.scroll_to(y=row - visible // 2, animate=False, immediate=True)
        table.move_cursor(row=row)

    def _render_violations(self) -> None:
        table = self._table("violations-table", "seq", "code", "entities", "message", "chain")
        shown, row = self.matches.violation_page(self.filter, self.cursor, VIOLATIONS_SHOWN)
        for v in shown:
            entities = ", ".join(
                f"{n} {getattr(v, n)}"
                for n in ("job", "req", "gen", "rank", "block", "key")
                if getattr(v, n) is not None
            )
            target = ("job", v.job) if v.job is not None else ("req", v.req) if v.req else None
            cells = [
                _t(v.seq), _t(v.code.value, "red"), _t(entities), _t(v.message),
                _t(" > ".join(map(str, v.chain))),
            ]  # fmt: skip
            self._row(table, cells, target)
        self._shown_violations = shown
        if row is not None:
            self._put_cursor(table, row)
        self._tell(row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "violations-table":
            self._tell(event.cursor_row)

    def _tell(self, row: int | None) -> None:
        """The highlighted violation in words, with its chain as lanes."""
        story = self.query_one("#violation-story", Static)
        shown = self._shown_violations
        if row is None or row >= len(shown):
            story.update(Text("no violation up to this seq", style="dim"))
            return
        v = shown[row]
        records = {}
        for seq in (*v.chain, v.seq, v.seq - 1):
            entry = next(iter(self.tt.entries(seq - 1, seq)), None)
            if entry is not None:
                records[seq] = entry
        head = Text(f"{v.code.value} at seq {v.seq}", style="bold red")
        chain = sorted({s for s in (*v.chain, v.seq) if s in records})
        lanes = lanes_table([records[s] for s in chain], {v.seq: [v]}, "chain", plain=False)
        # the chain first: on a short terminal the words scroll, the records stay
        story.update(RichGroup(head, lanes, Text(printable(explain(v, records)))))

    def _render_events(self) -> None:
        table = self._table("events-table", "seq", "step", "lane", "record", "violations")
        if self.filter:
            # The filter searches the whole journal; show the matches around the cursor.
            matched = self.matches.records(self.filter)
            here = bisect.bisect_left([e.seq for e in matched], self.cursor)
            entries = matched[max(0, here - EVENTS_AROUND) : here + EVENTS_AROUND]
        else:
            start = max(BEFORE_FIRST, self.cursor - EVENTS_AROUND)
            entries = self.tt.entries(start, min(self.tt.last_seq, self.cursor + EVENTS_AROUND))
        first = entries[0].seq if entries else self.cursor
        last = entries[-1].seq if entries else self.cursor
        marks: dict[int, list[str]] = {}
        for v in self.tt.violations_between(first - 1, last):
            marks.setdefault(v.seq, []).append(v.code.value)
        row = 0
        for entry in entries:
            e: Any = entry.event
            job, req = getattr(e, "job", None), getattr(e, "req", None)
            style = "bold reverse" if entry.seq == self.cursor else ""
            target: tuple[str, str | int] | None = (
                ("job", job) if job is not None else (("req", req) if req else None)
            )
            cells = [
                _t(entry.seq, style), _t(entry.step), _t(lane(e)), _t(describe(e), style),
                _t(", ".join(marks.get(entry.seq, [])), "red"),
            ]  # fmt: skip
            self._row(table, cells, target)
            if entry.seq <= self.cursor:
                row = table.row_count - 1
        self._put_cursor(table, row)
