"""The human report of ``kvstate replay``, rendered with rich.

Every string that comes from a journal is wrapped in :class:`rich.text.Text`,
so a request id such as ``[red]x[/red]`` is printed literally, never as
markup. Rich drops colours by itself when the output is not a terminal.
"""

from __future__ import annotations

from collections import Counter

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvstate.ledger import Ledger
from kvstate.violations import CODE_ORDER, Violation

from .engine import ReplayResult

_ENTITY_COLUMNS = ("job", "req", "gen", "rank", "block", "key")


def _cell(value: object) -> Text:
    return Text("" if value is None else str(value))


def _findings_table(result: ReplayResult, findings: list[Violation], title: str) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", expand=False)
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
        message = Text(v.message)
        if v.chain:
            message.append("\nchain: " + " → ".join(map(str, v.chain)), style="dim")
        where = result.where(v.seq)
        if where:
            message.append(f"\nfrom {where['file']} seq {where['file_seq']}", style="dim")
        cells.append(message)
        table.add_row(*cells)
    return table


def summary_line(result: ReplayResult) -> Text:
    text = Text()
    text.append(f"{result.events} records · verdict: ")
    if result.violations:
        counts = Counter(v.code for v in result.violations)
        by_code = ", ".join(
            f"{code.value} ×{n}"
            for code, n in sorted(counts.items(), key=lambda c: CODE_ORDER[c[0]])
        )
        text.append(f"{len(result.violations)} violation(s)", style="bold red")
        text.append(f" ({by_code})")
    else:
        text.append("clean", style="bold green")
    if result.warnings:
        text.append(f" · {len(result.warnings)} warning(s)", style="yellow")
    return text


def ledger_tables(ledger: Ledger) -> list[Table]:
    """The ledger as tables: requests, held blocks, jobs, and each rank's request state."""
    requests = Table(title="Requests", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("req", "gen", "state", "table", "held"):
        requests.add_column(name)
    for req, request in sorted(ledger.requests.items()):
        for gen, inc in sorted(request.incarnations.items()):
            requests.add_row(
                _cell(req), _cell(gen), _cell(inc.state), _cell(inc.table), _cell(inc.held or "")
            )
    blocks = Table(title="Blocks with holders", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("block", "refs", "epoch"):
        blocks.add_column(name, justify="right")
    for block, state in sorted(ledger.blocks.items()):
        if state.refs:
            blocks.add_row(_cell(block), _cell(state.refs), _cell(state.epoch))
    jobs = Table(title="Store jobs", box=box.SIMPLE_HEAD, title_justify="left")
    for name in ("job", "req/gen", "tokens", "pins", "completions", "released", "ranks"):
        jobs.add_column(name)
    for job_id, job in sorted(ledger.jobs.items()):
        lanes = " ".join(f"{r}:{rj.phase}" for r, rj in sorted(job.ranks.items()))
        jobs.add_row(
            _cell(job_id),
            _cell(f"{job.req}/{job.gen}"),
            _cell(f"{job.token_start}-{job.token_end}"),
            _cell(list(job.pins)),
            _cell(f"{job.completions}/{job.world_size}"),
            _cell("yes" if job.released_seq is not None else "no"),
            _cell(lanes),
        )
    ranks = Table(title="Rank request state", box=box.SIMPLE_HEAD, title_justify="left")
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


def render(result: ReplayResult) -> Group:
    """The whole human report."""
    parts: list[RenderableType] = []
    header = Text("kvstate replay: ", style="bold")
    header.append(", ".join(result.paths))
    parts.append(header)
    if result.at is not None:
        parts.append(Text(f"ledger after seq {result.at}", style="bold"))
        parts.extend(ledger_tables(result.ledger))
    parts.append(summary_line(result))
    if result.violations:
        parts.append(_findings_table(result, result.violations, "Violations"))
    if result.warnings:
        parts.append(_findings_table(result, result.warnings, "Warnings"))
    return Group(*parts)


def report_console() -> Console:
    """A console for reports: the terminal's width, or a wide page when piped.

    Rich assumes 80 columns when the output is not a terminal; messages then
    wrap into narrow table cells that are hard to grep in CI logs.
    """
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    return console


def print_report(result: ReplayResult, console: Console | None = None) -> None:
    (console or report_console()).print(render(result))
