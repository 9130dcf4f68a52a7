"""What the inspector shows, built from folded state and nothing else.

Each builder here is a pure function of a ledger (or of the index) and the
filter: no widgets, no I/O. The inspector calls them on its fold thread for
the ledger views, so the screen only ever receives finished rows, and a
view costs what it shows: at most :data:`RECENT_ROWS` rows, however long
the journal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from typing import Any, Protocol

import attrs
from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.console import Group as RichGroup
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvstate.ledger import Ledger
from kvstate.violations import Code
from replay.report import JOB_COLUMNS, job_cells
from replay.safe import literal, printable
from replay.timeline import selector

#: rows of the Requests and Jobs views (a few screens): in flight first, then
#: the most recent; a table re-renders every row it holds on each key
RECENT_ROWS = 120

#: Enter on a row opens the timeline of this (``("req", R)`` or ``("job", J)``)
Target = tuple[str, "str | int"]


def _t(value: object, style: str = "") -> Text:
    return literal(value, style)


@attrs.frozen
class TableView:
    """Rows for one of the inspector's tables, as of ``seq``."""

    seq: int
    columns: tuple[str, ...]
    rows: list[tuple[list[Text], Target | None]]


@attrs.frozen
class TextView:
    """A renderable for one of the inspector's text panes, as of ``seq``."""

    seq: int
    body: RenderableType


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


class Indexed(Protocol):
    """What the overview reads: the inspector's index, or ``--once``'s single pass."""

    path: str
    last_seq: int
    error: Exception | None
    #: the seq the records begin after (0, or a checkpoint's: journal.retention)
    first_seq: int

    @property
    def kinds(self) -> Mapping[str, int]: ...
    @property
    def indexed_seq(self) -> int: ...
    @property
    def indexed(self) -> bool: ...
    @property
    def unfinished(self) -> bool: ...
    @property
    def violations(self) -> Sized: ...
    def codes(self) -> list[tuple[Code, int, int]]: ...


def overview(tt: Indexed) -> RenderableType:
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
        verdict.append(f"{len(tt.violations):,} violation(s)", style="bold red")
    else:
        verdict.append("clean", style="bold green")
    if tt.first_seq > 0:
        verdict.append(
            f" · FROM_CHECKPOINT: records 1..{tt.first_seq} were removed by retention",
            style="bold yellow",
        )
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
    found = list(tt.codes())  # counted as the index grows: no rescan
    if not found:
        # No empty table: say there is nothing, or that it is not known yet.
        none = "none so far" if not tt.indexed else "none"
        return RichGroup(head, verdict, Text(""), kinds, Text(f"violations by code: {none}"))
    codes = Table(title="violations by code", box=box.SIMPLE_HEAD, title_justify="left")
    codes.add_column("code")
    codes.add_column("count", justify="right")
    codes.add_column("first seq", justify="right")
    for code, count, first in found:
        codes.add_row(_t(code.value, "red"), _t(count), _t(first))
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


def requests_view(ledger: Ledger, seq: int, flt: Filter) -> TableView:
    """Requests and their incarnations: in flight first, then the most recent."""
    ranks = sorted(ledger.ranks)  # the ranks that wrote records, not the declared world
    columns = (
        "req", "gen", "state", "table", "held",
        *(f"rank {r}: live jobs / saved" for r in ranks),
    )  # fmt: skip
    requests = [(req, r) for req, r in ledger.requests.items() if flt.matches(req=req)]
    # In flight first, then the most recently started: a million-record
    # journal has tens of thousands of finished requests.
    requests.sort(key=lambda item: (item[1].current.state == "running", item[1].newest_seq))
    rows: list[tuple[list[Text], Target | None]] = []
    for req, request in requests[-RECENT_ROWS:]:
        for gen, inc in sorted(request.incarnations.items()):
            cells = [_t(req), _t(gen), _t(inc.state), _t(inc.table), _t(inc.held or "")]
            for r in ranks:
                st = ledger.ranks[r].requests.get(req)
                cells.append(
                    _t(f"{sorted(st.live_jobs)} / {st.saved_offset}")
                    if st is not None and st.gen == gen
                    else _t("")
                )
            rows.append((cells, ("req", req)))
    return TableView(seq, columns, rows)


def _job_matches(flt: Filter, job_id: int, job: Any) -> bool:
    if flt.field == "rank":
        return flt.value.isdigit() and int(flt.value) in job.ranks
    return flt.matches(job=job_id, req=job.req)


def jobs_view(ledger: Ledger, seq: int, flt: Filter) -> TableView:
    """Store jobs with a lane per rank: pinned (in flight) first, then the most recent."""
    # One lane per rank that wrote records (a header may declare many more).
    ranks = sorted(ledger.ranks) or [0]
    columns = (*JOB_COLUMNS, *(f"rank {r}" for r in ranks))
    jobs = [(j, job) for j, job in ledger.jobs.items() if _job_matches(flt, j, job)]
    jobs.sort(key=lambda item: (item[0] in ledger.pinned, item[0]))
    rows: list[tuple[list[Text], Target | None]] = [
        ([*job_cells(job), *_lanes(job, ranks)], ("job", job_id))
        for job_id, job in sorted(jobs[-RECENT_ROWS:])
    ]
    return TableView(seq, columns, rows)


class BlockStrip:
    """Blocks as ``number:refs`` cells, as many to a line as the width allows.

    A fixed 16 to a line (112 columns) wrapped mid-cell at 80 and 100
    columns; every cell here is as wide as the widest block number, and a
    line holds as many whole cells as fit.
    """

    def __init__(self, cells: list[tuple[int, str, str]]) -> None:
        #: (block, refs character, style)
        self.cells = cells
        self.cell_width = len(str(max((b for b, _, _ in cells), default=0))) + 2

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        per_line = max(1, (options.max_width + 1) // (self.cell_width + 1))
        line = Text()
        for i, (block, char, style) in enumerate(self.cells):
            if i % per_line:
                line.append(" ")
            line.append(f"{block:>{self.cell_width - 2}}:{char}", style=style)
            if (i + 1) % per_line == 0:
                yield line
                line = Text()
        if line:
            yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.cell_width, options.max_width)


def blocks_view(ledger: Ledger, seq: int, flt: Filter) -> TextView:
    """Every block: holders, pins, and the ones handed to a new holder at ``seq``."""
    blocks = ledger.blocks
    pinned = {b for j in ledger.pinned for b in ledger.jobs[j].pins}
    cells = []
    for block in range(max(blocks, default=-1) + 1):
        state = blocks.get(block)
        refs = state.refs if state is not None else 0
        char = "." if refs == 0 else str(min(refs, 9))
        style = "bold yellow" if block in pinned else ("green" if refs else "dim")
        if state is not None and state.epoch_seq == seq:
            style = "bold reverse red"  # handed to a new holder by this very record
        cells.append((block, char, style))
    legend = Text(
        "\nblock:refs  . free · digit: holders · yellow: pinned by a job · "
        "reverse red: new epoch at this record",
        style="dim",
    )
    return TextView(seq, RichGroup(BlockStrip(cells), legend))


#: the views that need the ledger folded to the cursor, and their builders
LEDGER_VIEWS: dict[str, Callable[[Ledger, int, Filter], TableView | TextView]] = {
    "requests": requests_view,
    "jobs": jobs_view,
    "blocks": blocks_view,
}
