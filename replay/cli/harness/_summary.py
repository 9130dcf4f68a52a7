"""Simulation summaries side by side (``run`` and ``demo``)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from kvstate.violations import CODE_ORDER, Code


def summary_table(summaries: list[Any]) -> Table:
    """Runs side by side: what they did and what went wrong."""
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("")
    for s in summaries:
        table.add_column(f"{s.policy} policy", justify="right")
    rows = [
        ("requests finished", lambda s: f"{s.finished}/{s.requests}"),
        ("refused (never fit the pool)", lambda s: s.rejected),
        ("engine steps", lambda s: s.steps),
        ("store jobs", lambda s: s.store_jobs),
        ("preemptions", lambda s: s.preemptions),
        ("bytes moved", lambda s: s.bytes_moved),
        ("throughput", lambda s: f"{s.throughput_mb_s:.1f} MB/s"),
        ("loads from the store", lambda s: s.loads),
        ("requests that read wrong KV", lambda s: s.wrong_kv_requests),
        ("poisoned keys", lambda s: f"{s.poisoned_keys} of {s.keys_stored}"),
        ("keys gone from the store", lambda s: s.keys_missing),
        ("crashes", lambda s: s.crashes),
        ("leaked pins", lambda s: s.leaked_pins),
    ]
    for name, value in rows:
        table.add_row(name, *(Text(str(value(s))) for s in summaries))
    # in the contract's order (docs/events.md), not alphabetically
    codes = sorted({c for s in summaries for c in s.violations}, key=lambda c: CODE_ORDER[Code(c)])
    for code in codes:
        table.add_row(f"replay: {code}", *(Text(str(s.violations.get(code, 0))) for s in summaries))
    if not codes:
        table.add_row("replay violations", *(Text("0") for _ in summaries))
    return table
