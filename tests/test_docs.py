"""The documentation runs as written.

* The quickstart's Python runs and prints what it says.
* Every ``console`` block in README.md and docs/ is a transcript: each
  ``$`` line is run with bash in a fresh folder holding a copy of
  ``examples/`` (the blocks of one page share that folder, in order), and
  the output below it must be what the command prints. A line ``...``
  stands for any number of lines (an excerpt); whitespace runs compare as
  one space, so column padding may differ. Blocks that only show how to
  call a command on your own files are ``sh`` blocks and are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
MARK = "<<<kvstate-docs-command>>>"
STATUS = "<<<kvstate-docs-status>>>"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_quickstart_runs_and_prints_what_it_claims() -> None:
    first, long_running = python_blocks(DOCS / "quickstart.md")
    proc = subprocess.run([sys.executable, "-c", first], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[(0, (5, 4))]", "False", "clean 19"]
    # An engine that runs for weeks: settled state parked in a SpillArchive.
    proc = subprocess.run([sys.executable, "-c", long_running], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["0 4000 4000", "0 0"]


def console_blocks(page: Path) -> list[list[tuple[str, list[str]]]]:
    """Each console block as (command, expected output lines) pairs."""
    blocks = []
    for body in re.findall(r"```console\n(.*?)```", page.read_text(), flags=re.S):
        pairs: list[tuple[str, list[str]]] = []
        for line in body.splitlines():
            if line.startswith("$ "):
                pairs.append((line[2:], []))
            elif pairs:
                pairs[-1][1].append(line)
        blocks.append(pairs)
    return blocks


def norm(line: str) -> str:
    return " ".join(line.split())


def matches(expected: list[str], actual: list[str]) -> bool:
    """``expected`` equals ``actual``, where a ``...`` line matches any lines."""
    want = [norm(x) for x in expected]
    got = [norm(x) for x in actual]
    while got and not got[-1]:
        got.pop()
    parts: list[list[str]] = [[]]
    for line in want:
        if line == "...":
            parts.append([])
        else:
            parts[-1].append(line)
    if len(parts) == 1:
        return got == parts[0]
    first, *middle, last = parts
    if got[: len(first)] != first or (last and got[len(got) - len(last) :] != last):
        return False
    at = len(first)
    end = len(got) - len(last)
    for part in middle:
        while at <= end - len(part) and got[at : at + len(part)] != part:
            at += 1
        if at > end - len(part):
            return False
        at += len(part)
    return True


def run_block(pairs: list[tuple[str, list[str]]], folder: Path) -> list[tuple[list[str], int]]:
    # Each command's status is printed after it, and restored, so that a
    # transcript's own `echo $?` still sees the command before it.
    script = "\n".join(
        f"echo '{MARK}'; (exit ${{_s:-0}})\n{cmd} 2>&1\n_s=$?; echo \"{STATUS}$_s\""
        for cmd, _ in pairs
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "COLUMNS": "160",
    }
    done = subprocess.run(
        ["bash", "-c", script], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )
    outputs = []
    for out in done.stdout.split(MARK + "\n")[1:]:
        lines = out.splitlines()
        status = int(lines.pop().removeprefix(STATUS))
        outputs.append((lines, status))
    return outputs


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_console_transcripts_are_what_the_commands_print(page: Path, tmp_path: Path) -> None:
    blocks = console_blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no console block")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    for pairs in blocks:
        outputs = run_block(pairs, tmp_path)
        assert len(outputs) == len(pairs)
        for (cmd, expected), (actual, status) in zip(pairs, outputs, strict=True):
            assert "Traceback" not in "\n".join(actual), (cmd, actual)
            # A transcript shows a command working: unusable input (2) only
            # where the transcript itself shows the error line.
            assert status != 2 or any("error:" in line for line in expected), (cmd, actual)
            if expected:
                assert matches(expected, actual), f"{page.name}: `$ {cmd}` printed:\n" + "\n".join(
                    actual
                )


def test_the_matcher_can_fail() -> None:
    assert matches(["a", "...", "c"], ["a", "b", "b", "c"])
    assert not matches(["a", "...", "c"], ["a", "b"])
    assert not matches(["a", "b"], ["a", "x"])
    assert matches(["a   b"], ["a b", ""])


def test_the_api_reference_names_every_public_name() -> None:
    import journal
    import kvstate
    import replay

    text = (DOCS / "api.md").read_text()
    missing = [
        f"{module.__name__}.{name}"
        for module in (journal, kvstate, replay)
        for name in module.__all__
        if f"`{name}" not in text and f" {name}" not in text
    ]
    assert not missing, missing
