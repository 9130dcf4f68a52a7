"""``kvstate inspect``: travel through a journal in a terminal UI.

Every view shows the ledger as of the cursor seq: move a record with
left/right, a step with PgUp/PgDn, jump with ``g`` or to the next/previous
violation with ``n``/``p``. The journal is opened read-only and every string
from it is shown literally (``rich.text.Text``, never markup).
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

from rich import box
from rich.console import Group as RichGroup
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Header, Input, Static, TabbedContent, TabPane

from journal import RecordError
from journal.database import BEFORE_FIRST
from kvstate.codec import Entry
from kvstate.ledger import Ledger
from kvstate.violations import CODE_ORDER, Violation
from replay.explain import describe, explain, lane
from replay.report import job_cells, lanes_table
from replay.safe import literal, printable
from replay.timeline import selector
from replay.timetravel import TimeTravel

TABS = ("overview", "requests", "jobs", "blocks", "violations", "events")
LEDGER_VIEWS = ("requests", "jobs", "blocks")
EVENTS_AROUND = 60
#: rows of the Requests and Jobs views: everything in flight, then the most recent
RECENT_ROWS = 400


def _t(value: object, style: str = "") -> Text:
    return literal(value, style)


class Filter:
    """``/`` filter: ``req R``, ``job J``, ``rank N``, ``kind K``, or a bare word."""

    def __init__(self, text: str = "") -> None:
        parts = text.split(maxsplit=1)
        self.field: str | None
        self.value: str
        if len(parts) == 2 and parts[0] in ("req", "job", "rank", "kind"):
            self.field, self.value = parts[0], parts[1].strip()
        else:
            self.field, self.value = ("any", text.strip()) if text.strip() else (None, "")

    def __bool__(self) -> bool:
        return self.field is not None

    def __str__(self) -> str:
        return "" if not self else f"{self.field} {self.value}"

    def matches(self, **fields: Any) -> bool:
        if not self:
            return True
        wanted = [self.field] if self.field != "any" else list(fields)
        return any(str(fields.get(name)) == self.value for name in wanted if name in fields)

    def record_matcher(self) -> Any:
        """A predicate over events in journal order. ``req R`` also takes the
        records of R's jobs (worker records name the job, not the request),
        ``job J`` the records of J and of its incarnation, as a timeline does."""
        if self.field == "req":
            return selector(self.value, None)
        if self.field == "job" and self.value.isdigit():
            return selector(None, int(self.value))

        def wanted(e: Any) -> bool:
            return self.matches(
                req=getattr(e, "req", None),
                job=getattr(e, "job", None),
                rank=getattr(e, "rank", None),
                kind=e.kind,
            )

        return wanted


def overview(tt: TimeTravel) -> RenderableType:
    """Journal, records, verdict, counts by kind, violations by code."""
    head = Text()
    head.append("journal ", style="bold")
    head.append(printable(tt.path))
    head.append(f"\nrecords {tt.last_seq}")
    if not tt.indexed:
        head.append(f" · indexing: {tt.indexed_seq} of {tt.last_seq}", style="yellow")
    verdict = Text("\nverdict ", style="bold")
    if tt.error is not None:
        verdict.append(f"unusable input: {printable(tt.error)}", style="bold red")
    elif not tt.indexed:
        verdict.append("(still reading)", style="yellow")
    elif tt.violations:
        verdict.append(f"{len(tt.violations)} violation(s)", style="bold red")
    else:
        verdict.append("clean", style="bold green")
    if tt.indexed and tt.error is None and tt.unfinished:
        verdict.append(
            " · UNFINISHED: the journal ends before engine_idle; end-of-run checks did not run",
            style="bold yellow",
        )
    kinds = Table(title="records by kind", box=box.SIMPLE_HEAD, title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("count", justify="right")
    for kind, n in sorted(tt.kinds.items(), key=lambda kv: -kv[1]):
        kinds.add_row(_t(kind), _t(n))
    codes = Table(title="violations by code", box=box.SIMPLE_HEAD, title_justify="left")
    codes.add_column("code")
    codes.add_column("count", justify="right")
    codes.add_column("first seq", justify="right")
    by_code: dict[Any, list[Violation]] = {}
    for v in tt.violations:
        by_code.setdefault(v.code, []).append(v)
    for code in sorted(by_code, key=lambda c: CODE_ORDER[c]):
        codes.add_row(_t(code.value, "red"), _t(len(by_code[code])), _t(by_code[code][0].seq))
    return RichGroup(head, verdict, Text(""), kinds, codes)


def _lanes(job: Any, ranks: list[int]) -> list[Text]:
    """One short text per rank: how far the job got there."""
    cells = []
    for rank in ranks:
        rj = job.ranks.get(rank)
        if rj is None:
            cells.append(_t("-", "dim"))
            continue
        steps = ["rcv"]
        if rj.skip_reason:
            steps.append(f"skip:{rj.skip_reason}")
        elif rj.started_seq is not None:
            steps.append("start")
        if rj.dma_seq is not None:
            steps.append("dma")
        if rj.put_ok is not None:
            steps.append("put" if rj.put_ok else "put!")
        if rj.reported_seq is not None:
            steps.append("reported")
        cells.append(_t(">".join(steps), "green" if rj.reported_seq is not None else "yellow"))
    return cells


class TextScreen(ModalScreen[None]):
    """A modal with a scrollable renderable (help, timelines); Esc or q closes it."""

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


HELP = """\
left / right     one record back / forward
PgUp / PgDn      the previous / next engine step
g                go to a seq
n / p            next / previous violation
/                filter: req R, job J, rank N, kind K, or a word (empty clears)
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
    #violations-table { height: 1fr; width: 1fr; }
    #violation-detail { height: 12; border-top: solid $accent; padding: 0 1; }
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
        {"move", "step", "edge", "goto", "violation", "filter", "help", "tab", "quit"}
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
        self.ledger: Ledger = self.tt.ledger_at(self.cursor)
        self._ledger_seq = self.cursor
        self._settle_timer: Any = None
        self._seen_last = self.tt.last_seq
        self._targets: dict[str, tuple[str, str | int]] = {}
        #: the whole journal's records that match the filter: (filter, last seq, entries)
        self._matched: tuple[str, int, list[Entry]] | None = None

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
        else:
            self.tt.index()
        # At most four refreshes a second, whatever the writer does.
        self._ticker = self.set_interval(0.25, self._tick)
        self.refresh_views()

    def on_unmount(self) -> None:
        self._ticker.stop()
        if self._settle_timer is not None:
            self._settle_timer.stop()
        self.tt.stop()

    def _tick(self) -> None:
        if not self.query("#status"):
            return  # the app is shutting down: the widgets are gone
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
        """Move the cursor. Views that need the folded ledger catch up once the
        keys stop coming; the status line and the event list follow at once."""
        seq = max(min(1, self.tt.last_seq), min(seq, self.tt.last_seq))
        if seq == self.cursor:
            return
        self.cursor = seq
        self._render_status()
        if self._active() in LEDGER_VIEWS:
            if self._settle_timer is not None:
                self._settle_timer.stop()
            self._settle_timer = self.set_timer(0.03, self.refresh_views)
        else:
            self.refresh_views()

    def _active(self) -> str:
        return self.query_one(TabbedContent).active

    def _folded(self) -> Ledger:
        """The ledger at the cursor, folded on demand."""
        if self._ledger_seq != self.cursor:
            self.ledger = self.tt.ledger_at(self.cursor)
            self._ledger_seq = self.cursor
        return self.ledger

    def action_move(self, delta: int) -> None:
        self.go(self.cursor + delta)

    def action_edge(self, direction: int) -> None:
        """Home: the first record; End: the last."""
        self.go(self.tt.last_seq if direction > 0 else min(1, self.tt.last_seq))

    def action_step(self, direction: int) -> None:
        self.go(self.tt.step_start(self.cursor, direction))

    def action_violation(self, direction: int) -> None:
        find = self.tt.next_violation if direction > 0 else self.tt.previous_violation
        found = find(self.cursor)
        if found is None:
            self.notify("no further violation" if direction > 0 else "no earlier violation")
            return
        self.go(found.seq)
        self.action_tab("violations")

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

        self.push_screen(
            AskScreen("filter (req R, job J, rank N, kind K, word):", str(self.filter)), chosen
        )

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
        wanted = selector(
            str(value) if what == "req" else None, int(value) if what == "job" else None
        )
        entries = [e for e in self.tt.entries(BEFORE_FIRST, self.tt.last_seq) if wanted(e.event)]
        marks: dict[int, list[Violation]] = {}
        for v in self.tt.violations:
            marks.setdefault(v.seq, []).append(v)
        shown = {e.seq: marks[e.seq] for e in entries if e.seq in marks}
        table = lanes_table(entries, shown, f"{len(entries)} records", plain=False)
        self.push_screen(TextScreen(table, f"timeline of {what} {value}"))

    # -- rendering ------------------------------------------------------------------------

    def refresh_views(self) -> None:
        if not self.query("#status"):
            return  # a timer fired while the app shuts down
        self._targets.clear()
        self._render_status()
        active = self.query_one(TabbedContent).active
        render = {
            "overview": self._render_overview,
            "requests": self._render_requests,
            "jobs": self._render_jobs,
            "blocks": self._render_blocks,
            "violations": self._render_violations,
            "events": self._render_events,
        }.get(active)
        if render is not None:
            render()

    def _render_status(self) -> None:
        entry = next(iter(self.tt.entries(self.cursor - 1, self.cursor)), None)
        text = Text()
        text.append(f"seq {self.cursor} of {self.tt.last_seq}", style="bold")
        if entry is not None:
            text.append(f" · step {entry.step} · {lane(entry.event)}: ")
            text.append(printable(describe(entry.event)))
        here = [v for v in self.tt.violations_upto(self.cursor) if v.seq == self.cursor]
        if here:
            text.append("  <- " + ", ".join(v.code.value for v in here), style="bold red")
        text.append("\n")
        if self.filter:
            text.append(f"filter: {printable(self.filter)}  ", style="yellow")
        if self.follow:
            text.append("following  ", style="green")
        if not self.tt.indexed:
            text.append(f"indexing {self.tt.indexed_seq}/{self.tt.last_seq}", style="yellow")
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

    def _row(
        self, table: DataTable, cells: list[Text], target: tuple[str, str | int] | None
    ) -> None:
        """Add a row; Enter on it opens the timeline of ``target`` (a req or a job)."""
        key = f"{table.id}:{table.row_count}"
        if target is not None and target[1] is not None:
            self._targets[key] = target
        table.add_row(*cells, key=key)

    def _render_requests(self) -> None:
        ledger = self._folded()
        ranks = sorted(ledger.ranks)  # the ranks that wrote records, not the declared world
        table = self._table(
            "requests-table", "req", "gen", "state", "table", "held",
            *(f"rank {r}: live jobs / saved" for r in ranks),
        )  # fmt: skip
        requests = [(req, r) for req, r in ledger.requests.items() if self.filter.matches(req=req)]
        # In flight first, then the most recently started: a million-record
        # journal has tens of thousands of finished requests.
        requests.sort(key=lambda item: (item[1].current.state == "running", item[1].newest_seq))
        for req, request in requests[-RECENT_ROWS:]:
            for gen, inc in sorted(request.incarnations.items()):
                cells = [_t(req), _t(gen), _t(inc.state), _t(inc.table), _t(inc.held or "")]
                for r in ranks:
                    st = ledger.ranks[r].requests.get(req) if r in ledger.ranks else None
                    cells.append(
                        _t(f"{sorted(st.live_jobs)} / {st.saved_offset}")
                        if st is not None and st.gen == gen
                        else _t("")
                    )
                self._row(table, cells, ("req", req))

    def _render_jobs(self) -> None:
        ledger = self._folded()
        # One lane per rank that wrote records (a header may declare many more).
        ranks = sorted(ledger.ranks) or [0]
        table = self._table(
            "jobs-table", "job", "req/gen", "tokens", "pins", "completions", "released",
            *(f"rank {r}" for r in ranks),
        )  # fmt: skip
        jobs = [(j, job) for j, job in ledger.jobs.items() if self._job_matches(j, job)]
        # Pinned (in flight) jobs first, then the most recent ones.
        jobs.sort(key=lambda item: (item[0] in ledger.pinned, item[0]))
        for job_id, job in sorted(jobs[-RECENT_ROWS:]):
            cells = [*job_cells(job), *_lanes(job, ranks)]
            self._row(table, cells, ("job", job_id))

    def _job_matches(self, job_id: int, job: Any) -> bool:
        if self.filter.field == "rank":
            return self.filter.value.isdigit() and int(self.filter.value) in job.ranks
        return self.filter.matches(job=job_id, req=job.req)

    def _render_blocks(self) -> None:
        ledger = self._folded()
        blocks = ledger.blocks
        pinned = {b for j in ledger.pinned for b in ledger.jobs[j].pins}
        strip = Text()
        for i, block in enumerate(range(max(blocks, default=-1) + 1)):
            state = blocks.get(block)
            refs = state.refs if state is not None else 0
            char = "." if refs == 0 else str(min(refs, 9))
            style = "bold yellow" if block in pinned else ("green" if refs else "dim")
            if state is not None and state.epoch_seq == self.cursor:
                style = "bold reverse red"  # handed to a new holder by this very record
            strip.append(f"{block:>4}:{char}", style=style)
            strip.append("\n" if (i + 1) % 16 == 0 else " ")
        legend = Text(
            "\nblock:refs  . free · digit: holders · yellow: pinned by a job · "
            "reverse red: new epoch at this record",
            style="dim",
        )
        self.query_one("#blocks-body", Static).update(RichGroup(strip, legend))

    def _render_violations(self) -> None:
        table = self._table("violations-table", "seq", "code", "entities", "message", "chain")
        found = self.tt.violations_upto(self.cursor)
        for v in found:
            fields = {"job": v.job, "req": v.req, "rank": v.rank, "kind": v.code.value}
            if not self.filter.matches(**fields):
                continue
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
        self._shown_violations = [
            v for v in found
            if self.filter.matches(job=v.job, req=v.req, rank=v.rank, kind=v.code.value)
        ]  # fmt: skip
        shown = self._shown_violations
        upto = [i for i, v in enumerate(shown) if v.seq <= self.cursor]
        # the first violation of the latest record at or before the cursor
        row = next(i for i in upto if shown[i].seq == shown[upto[-1]].seq) if upto else None
        if row is not None:
            # after the refresh: the columns take their widths from the new rows first
            self.call_after_refresh(table.move_cursor, row=row)
        self._tell(row)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "violations-table":
            self._tell(event.cursor_row)

    def _tell(self, row: int | None) -> None:
        """The highlighted violation in words, with its chain as lanes."""
        story = self.query_one("#violation-story", Static)
        shown = getattr(self, "_shown_violations", [])
        if row is None or row >= len(shown):
            story.update(Text("no violation up to this seq", style="dim"))
            return
        v = shown[row]
        records = {}
        for seq in (*v.chain, v.seq, v.seq - 1):
            entry = next(iter(self.tt.entries(seq - 1, seq)), None)
            if entry is not None:
                records[seq] = entry
        head = Text(f"{v.code.value} at seq {v.seq}\n", style="bold red")
        head.append(printable(explain(v, records)), style="")
        chain = sorted({s for s in (*v.chain, v.seq) if s in records})
        lanes = lanes_table([records[s] for s in chain], {v.seq: [v]}, "chain", plain=False)
        story.update(RichGroup(head, lanes))

    def _filtered(self) -> list[Entry]:
        """Every record of the whole journal that the filter takes (cached per filter)."""
        key = str(self.filter)
        if self._matched is None or self._matched[:2] != (key, self.tt.last_seq):
            wanted = self.filter.record_matcher()
            found = [e for e in self.tt.entries(BEFORE_FIRST, self.tt.last_seq) if wanted(e.event)]
            self._matched = (key, self.tt.last_seq, found)
        return self._matched[2]

    def _render_events(self) -> None:
        table = self._table("events-table", "seq", "step", "lane", "record", "violations")
        if self.filter:
            # The filter searches the whole journal; show the matches around the cursor.
            matched = self._filtered()
            here = bisect.bisect_left([e.seq for e in matched], self.cursor)
            entries = matched[max(0, here - EVENTS_AROUND) : here + EVENTS_AROUND]
        else:
            start = max(BEFORE_FIRST, self.cursor - EVENTS_AROUND)
            entries = self.tt.entries(start, min(self.tt.last_seq, self.cursor + EVENTS_AROUND))
        last = entries[-1].seq if entries else self.cursor
        marks: dict[int, list[str]] = {}
        for v in self.tt.violations_upto(max(last, self.cursor)):
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
        self.call_after_refresh(table.move_cursor, row=row)


def once(path: str | list[str]) -> tuple[RenderableType, int]:
    """``--once``: the overview and the violations, for CI logs and pipes.

    Returns the text and replay's exit status for the same bytes: 0 clean,
    1 violations. Unusable input raises, like replay (exit 2).
    """
    tt = TimeTravel(path)
    try:
        tt.index()
    finally:
        tt.stop()
    if tt.error is not None:
        raise tt.error
    if tt.empty:
        raise RecordError("journal is empty: no journal_opened record", path=tt.path)
    parts: list[RenderableType] = [overview(tt)]
    if tt.violations:
        table = Table(title="violations", box=box.SIMPLE_HEAD, title_justify="left")
        for column in ("seq", "code", "message"):
            table.add_column(column)
        for v in tt.violations:
            table.add_row(_t(v.seq), _t(v.code.value, "red"), _t(v.message))
        parts.append(table)
    return RichGroup(*parts), 1 if tt.violations else 0
