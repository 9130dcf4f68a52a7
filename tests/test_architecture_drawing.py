"""docs/architecture.md draws the write path module by module: each step
names a module and what in it runs, and both must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## The write path, module by module"
STEP = re.compile(r"^\s+((?:kvstate|journal|replay)/[\w/]+\.py)\s+([A-Za-z_][\w.]*)")


def _steps() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    drawing = section.split("```", 2)[1]
    return [m.groups() for line in drawing.splitlines() if (m := STEP.match(line))]


def _defines(path: Path, dotted: str) -> bool:
    """Whether the module at ``path`` defines ``dotted`` (a name, or Class.member)."""
    tree = ast.parse(path.read_text(), str(path))
    scope: list[ast.stmt] = tree.body
    for part in dotted.split("."):
        found = None
        for node in scope:
            names: list[str] = []
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if part in names:
                found = node
                break
        if found is None:
            return False
        scope = found.body if isinstance(found, ast.ClassDef) else []
    return True


def test_the_drawing_names_the_three_contexts_and_both_packages() -> None:
    steps = _steps()
    assert len(steps) >= 20
    assert {path.split("/")[0] for path, _ in steps} == {"kvstate", "journal"}


def test_every_module_and_name_the_write_path_drawing_shows_exists() -> None:
    missing = []
    for path, name in _steps():
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path}: no such module")
        elif not _defines(file, name):
            missing.append(f"{path}: defines no {name}")
    assert missing == []
