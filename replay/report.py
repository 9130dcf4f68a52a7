"""The human report of ``kvstate replay``, rendered with rich.

Every string that comes from a journal is wrapped in :class:`rich.text.Text`,
so a request id such as ``[red]x[/red]`` is printed literally, never as
markup. Rich drops colours by itself when the output is not a terminal.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.console import Group as RichGroup
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvstate.codec import Entry
from kvstate.ledger import Ledger
from kvstate.state import StoreJobState
from kvstate.violations import CODE_ORDER, Code, Violation

from .explain import Group, describe, explain, group, lane
from .safe import literal, printable
from .verdict import ReplayResult, story_of

_ENTITY_COLUMNS = ("job", "req", "gen", "rank", "block", "key")


def _cell(value: object) -> Text:
    return literal(value)


def _box(plain: bool) -> box.Box:
    return box.ASCII if plain else box.SIMPLE_HEAD


def _findings_table(
    result: ReplayResult, findings: list[Violation], title: str, plain: bool
) -> Table:
    table = Table(title=title, box=_box(plain), title_justify="left", expand=False)
    table.add_column("seq", justify="right")
    table.add_column("code", style="bold")
    for name in _ENTITY_COLUMNS:
        if any(getattr(v, name) is not None for v in findings):
            table.add_column(name)
    table.add_column("message", overflow="fold")
    shown = [c.header for c in table.columns]
    for v in findings:
        cells: list[RenderableType] = [_cell(v.seq), Text(v.code.value, style="red")]
        cells += [_cell(getattr(v, name)) for name in _ENTITY_COLUMNS if name in shown]
        message = literal(v.message)
        if v.chain:
            message.append("\nchain: " + " → ".join(map(str, v.chain)), style="dim")
        where = result.where(v.seq)
        if where:
            message.append(
                f"\nfrom {printable(where['file'])} seq {where['file_seq']}", style="dim"
            )
        cells.append(message)
        table.add_row(*cells)
    return table


def _groups_table(groups: list[Group], limit: int, plain: bool) -> Table:
    shown = groups[:limit]
    more = (
        f" (the first {len(shown)} of {len(groups)}; --limit N for more)"
        if len(groups) > limit
        else ""
    )
    table = Table(
        title=f"Root causes{more}; --all lists every violation",
        box=_box(plain),
        title_justify="left",
    )
    table.add_column("#", justify="right")
    table.add_column("first seq", justify="right")
    table.add_column("root cause")
    table.add_column("violations")
    table.add_column("first message", overflow="fold")
    for i, g in enumerate(shown, 1):
        first = g.first
        message = literal(first.message)
        if first.chain:
            message.append("\nchain: " + " → ".join(map(str, first.chain)), style="dim")
        codes = "\n".join(f"{code.value} ×{n}" for code, n in g.codes())
        table.add_row(
            _cell(i), _cell(first.seq), literal(g.title), Text(codes, style="red"), message
        )
    return table


def code_summary(result: ReplayResult, groups: list[Group]) -> Table:
    """One row per code, in the documented order: how many, how many root causes, where first."""
    table = Table(title="Summary by code", box=box.SIMPLE_HEAD, title_justify="left")
    for name, justify in (("code", "left"), ("violations", "right"), ("root causes", "right"),
                          ("first seq", "right")):  # fmt: skip
        table.add_column(name, justify="left" if justify == "left" else "right")
    counts: Counter[Code] = Counter(v.code for v in result.violations)
    causes: Counter[Code] = Counter()
    for g in groups:
        for code, _n in g.codes():
            causes[code] += 1
    first: dict[Code, int] = {}
    for v in result.violations:
        first.setdefault(v.code, v.seq)
    for code in sorted(counts, key=CODE_ORDER.__getitem__):
        table.add_row(Text(code.value, style="red"), _cell(counts[code]), _cell(causes[code]),
                      _cell(first[code]))  # fmt: skip
    return table


def lanes_of(entries: Iterable[Entry]) -> list[str]:
    """The lanes these records fall in, in lane order: scheduler, each rank, audit."""
    return sorted({lane(e.event) for e in entries}, key=_lane_order)


def lane_cells(
    entry: Entry,
    lanes: Sequence[str],
    here: Sequence[Violation],
    where: Callable[[int], dict[str, Any]] | None = None,
) -> list[Text]:
    """One timeline row: seq, (file:seq), step, the record in its lane, its violations marked.

    The one definition of a timeline row, shared by ``kvstate timeline`` and
    the inspector's timeline screen.
    """
    cells: list[Text] = [_cell(entry.seq)]
    if where is not None:
        origin = where(entry.seq)
        name = os.path.basename(str(origin.get("file", "")))
        cells.append(literal(f"{name}:{origin.get('file_seq', '')}"))
    cells.append(_cell(entry.step))
    own = lane(entry.event)
    for name in lanes:
        if own != name:
            cells.append(Text(""))
            continue
        text = literal(describe(entry.event))
        if here:
            text.stylize("bold red")
            text.append("  <- " + ", ".join(v.code.value for v in here), style="bold red")
        cells.append(text)
    return cells


def lane_columns(lanes: Sequence[str], merged: bool) -> list[str]:
    """The column names of :func:`lane_cells`'s rows."""
    return ["seq", *(["file:seq"] if merged else []), "step", *lanes]


def lanes_table(
    entries: Sequence[Entry],
    marks: Mapping[int, Sequence[Violation]],
    title: str,
    plain: bool,
    where: Callable[[int], dict[str, Any]] | None = None,
) -> Table:
    """Records as lanes (scheduler, one per rank, audit); violations marked on their row.

    With ``where`` (merged journals) each row also names its file and own seq.
    """
    lanes = lanes_of(entries)
    table = Table(title=literal(title), box=_box(plain), title_justify="left")
    for name in lane_columns(lanes, where is not None):
        if name in ("seq", "step"):
            table.add_column(name, justify="right")
        else:
            table.add_column(name, overflow="fold")
    for entry in entries:
        table.add_row(*lane_cells(entry, lanes, marks.get(entry.seq, ()), where))
    return table


def chain_timeline(
    v: Violation,
    records: Mapping[int, Entry],
    plain: bool,
    where: Callable[[int], dict[str, Any]] | None = None,
) -> Table:
    """The violation's chain and its own record as lanes."""
    seqs = sorted({s for s in (*v.chain, v.seq) if s in records})
    return lanes_table([records[s] for s in seqs], {v.seq: [v]}, "Timeline", plain, where)


def _lane_order(name: str) -> tuple[int, int]:
    if name == "scheduler":
        return (0, 0)
    if name.startswith("rank "):
        return (1, int(name.split()[1]))
    return (2, 0)


def summary_line(result: ReplayResult, groups: int | None = None) -> Text:
    text = Text()
    text.append(f"{result.events} records · verdict: ")
    if result.violations:
        counts = Counter(v.code for v in result.violations)
        by_code = ", ".join(
            f"{code.value} ×{n}"
            for code, n in sorted(counts.items(), key=lambda c: CODE_ORDER[c[0]])
        )
        text.append(f"{len(result.violations)} violation(s)", style="bold red")
        if groups is not None:
            text.append(f" from {groups} root cause(s)")
        text.append(f" ({by_code})")
    else:
        text.append("clean", style="bold green")
    if result.unfinished:
        text.append(
            " · UNFINISHED: the journal ends before engine_idle, so LEAKED_PIN, "
            "MISSING_REPORT and HELD_FOREVER were not checked",
            style="bold yellow",
        )
    resumed = result.from_checkpoint
    if resumed is not None:
        text.append(
            f" · FROM_CHECKPOINT: records 1..{resumed.seq} were removed by retention; "
            "their findings are the checkpoint's",
            style="bold yellow",
        )
    if result.warnings:
        text.append(f" · {len(result.warnings)} warning(s)", style="yellow")
    return text


def ledger_tables(ledger: Ledger, plain: bool = False) -> list[Table]:
    """The ledger as tables: requests, held blocks, jobs, and each rank's request state."""
    requests = Table(title="Requests", box=_box(plain), title_justify="left")
    for name in ("req", "gen", "state", "table", "held"):
        requests.add_column(name)
    for req, request in sorted(ledger.requests.items()):
        for gen, inc in sorted(request.incarnations.items()):
            requests.add_row(
                _cell(req), _cell(gen), _cell(inc.state), _cell(inc.table), _cell(inc.held or "")
            )
    blocks = Table(title="Blocks with holders", box=_box(plain), title_justify="left")
    for name in ("block", "refs", "epoch"):
        blocks.add_column(name, justify="right")
    for block, state in sorted(ledger.blocks.items()):
        if state.refs:
            blocks.add_row(_cell(block), _cell(state.refs), _cell(state.epoch))
    jobs = Table(title="Store jobs", box=_box(plain), title_justify="left")
    for name in (*JOB_COLUMNS, "ranks"):
        jobs.add_column(name)
    for _job_id, job in sorted(ledger.jobs.items()):
        lanes = " ".join(f"{r}:{rj.phase}" for r, rj in sorted(job.ranks.items()))
        jobs.add_row(*job_cells(job), _cell(lanes))
    ranks = Table(title="Rank request state", box=_box(plain), title_justify="left")
    for name in ("rank", "req", "gen", "live jobs", "saved offset", "skipped", "retry", "ended"):
        ranks.add_column(name)
    for rank, rl in sorted(ledger.ranks.items()):
        for req, st in sorted(rl.requests.items()):
            ranks.add_row(
                _cell(rank),
                _cell(req),
                _cell(st.gen),
                _cell(sorted(st.live_jobs)),
                _cell(st.saved_offset),
                _cell(st.skipped or ""),
                _cell(st.retry_tokens or ""),
                _cell(st.ended or ""),
            )
    return [requests, blocks, jobs, ranks]


#: the columns of :func:`job_cells`
JOB_COLUMNS = ("job", "req/gen", "tokens", "reads", "pins", "completions", "released")


def job_cells(job: StoreJobState) -> list[Text]:
    """A job's row (:data:`JOB_COLUMNS`): id, incarnation, tokens, the blocks it
    reads, its pins, completions, released (the ledger tables here and the
    inspector's Jobs view share it)."""
    return [
        _cell(job.job),
        _cell(f"{job.req}/{job.gen}"),
        _cell(f"{job.token_start}-{job.token_end}"),
        _cell(list(job.reads)),
        _cell(list(job.pins)),
        _cell(f"{job.completions}/{job.world_size}"),
        _cell("yes" if job.released_seq is not None else "no"),
    ]


def needed_records(result: ReplayResult) -> set[int]:
    """The seqs the report tells about: the first violation and its chain."""
    if not result.violations:
        return set()
    return story_of(result.violations[0])


def render(
    result: ReplayResult,
    records: Mapping[int, Entry] | None = None,
    *,
    show_all: bool = False,
    limit: int = 20,
    plain: bool = False,
) -> RichGroup:
    """The whole human report: the verdict, a summary by code, the first
    violation told as a story, then one row per root cause (or, with
    ``show_all``, per violation), at most ``limit`` rows."""
    records = records or {}
    parts: list[RenderableType] = []
    header = Text("kvstate replay: ", style="bold")
    header.append(printable(", ".join(result.paths)))
    parts.append(header)
    if result.at is not None:
        parts.append(Text(f"ledger after seq {result.at}", style="bold"))
        parts.extend(ledger_tables(result.ledger, plain))
    groups = group(result.violations)
    parts.append(summary_line(result, len(groups) if result.violations else None))
    foreign = result.folded.foreign_loads
    if foreign:
        parts.append(
            Text(
                f"{foreign} load(s) of keys another engine wrote (key_loaded): not judged "
                "here, as this run cannot know what they should hold; kvstate fleet-check "
                "with the writer's journal traces any that took poisoned bytes",
                style="yellow",
            )
        )
    if result.violations:
        parts.append(code_summary(result, groups))
        first = result.violations[0]
        heading = f"First violation: {first.code.value} at seq {first.seq}"
        parts.append(Text(heading, style="bold red"))
        parts.append(Padding(literal(explain(first, records)), (0, 0, 0, 2)))
        where = result.where if result.origin is not None else None
        if records:
            parts.append(chain_timeline(first, records, plain, where))
        if show_all:
            shown = result.violations[:limit]
            title = "Violations"
            if len(result.violations) > limit:
                title += f" (the first {limit} of {len(result.violations)}; --limit N for more)"
            parts.append(_findings_table(result, shown, title, plain))
        else:
            parts.append(_groups_table(groups, limit, plain))
    if result.warnings:
        shown = result.warnings[:limit]
        title = "Warnings"
        if len(result.warnings) > limit:
            title += f" (the first {limit} of {len(result.warnings)})"
        parts.append(_findings_table(result, shown, title, plain))
    return RichGroup(*parts)


#: the width of a report written to a pipe or a file when ``COLUMNS`` is not set
PIPED_WIDTH = 80


def report_console(*, stderr: bool = False) -> Console:
    """A console for reports: the terminal's width; when piped, ``COLUMNS``
    if set, else 80 columns, as for any text meant for a terminal or a
    pager. Wider lanes fold within their column; ``COLUMNS=200`` widens them."""
    console = Console(stderr=stderr)
    if not console.is_terminal:
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() and int(columns) > 20 else PIPED_WIDTH
        console = Console(width=width, stderr=stderr)
    return console


def emit(console: Console, *renderables: RenderableType) -> None:
    """Print; when piped, without the trailing spaces rich pads table cells with."""
    if console.is_terminal:
        console.print(*renderables)
        return
    with console.capture() as captured:
        console.print(*renderables)
    text = "\n".join(line.rstrip() for line in captured.get().split("\n"))
    console.file.write(text)
    console.file.flush()


def print_report(
    result: ReplayResult,
    records: Mapping[int, Entry] | None = None,
    *,
    show_all: bool = False,
    limit: int = 20,
    console: Console | None = None,
) -> None:
    console = console or report_console()
    plain = not console.is_terminal
    emit(console, render(result, records, show_all=show_all, limit=limit, plain=plain))
