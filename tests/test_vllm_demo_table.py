"""``kvstate vllm-demo --connector mooncake --connector offloading``: one table, both connectors.

The engines are not run here (``tests/test_vllm.py`` and
``tests/test_vllm_offloading.py`` do, one connector each); the runs are
example journals replayed, so the table is checked on what it lays out.
"""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from replay.cli.harness._vllm_runs import ReleaseRun
from replay.cli.harness.vllm_demo import _table
from replay.verdict import replay

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(journal: str, counts: dict[str, int], label: str | None = None) -> ReleaseRun:
    path = str(EXAMPLES / journal)
    run = ReleaseRun("0.32.0", path, replay([path]), {}, counts, [], {})
    run.label = label
    return run


def test_both_connectors_side_by_side_each_figure_where_it_applies() -> None:
    mooncake = _run("poisoned_read.jsonl", {"requests": 96, "poisoned keys": 3})
    offloading = _run("clean.jsonl", {"requests": 32, "tier evictions": 27}, "as released")
    out = io.StringIO()
    Console(file=out, width=160).print(_table([(mooncake, 96), (offloading, 16)]))
    header, *lines = out.getvalue().rstrip().splitlines()
    first_end = header.index("(fixed)") + len("(fixed)")  # columns are right-justified
    second_end = header.index("as released") + len("as released")

    def cells(name: str) -> tuple[str, str]:
        line = next(x for x in lines if x.startswith(name)).ljust(second_end)
        return line[len(name) : first_end].strip(), line[first_end:second_end].strip()

    assert cells("requests") == ("96", "32")
    # a figure of one connector is blank under the other's column
    assert cells("poisoned keys") == ("3", "")
    assert cells("tier evictions") == ("", "27")
    assert cells("wrong outputs") == ("0/96", "0/16")
    assert cells("replay verdict")[1] == "clean"
