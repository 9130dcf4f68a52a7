"""Imports point one way: journal <- kvstate core <- vLLM observer <- harness, and
core <- replay <- tui <- cli (which may drive the harness).

Every import in every module (at the top or inside a function) is resolved
and checked against its layer, so an import pointing the wrong way fails
here, not in a user's process that happened not to load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: layer -> the layers it may import from (its own included)
ALLOWED = {
    "journal": {"journal"},
    "core": {"journal", "core"},
    "replay": {"journal", "core", "replay"},
    "tui": {"journal", "core", "replay", "tui"},
    "observer": {"journal", "core", "observer"},
    "harness": {"journal", "core", "observer", "harness"},
    "cli": {"journal", "core", "replay", "tui", "harness", "cli"},
}
#: third-party packages the core and the journal must never import
HEAVY = {"torch", "textual", "mooncake", "numpy", "rich", "vllm"}


#: folder (or module file) -> layer, the most specific first
FOLDERS = (
    ("journal", "journal"),
    ("kvstate/harness", "harness"),
    ("kvstate/vllm", "observer"),
    ("kvstate", "core"),
    ("replay/cli", "cli"),
    ("replay/__main__", "cli"),
    ("replay/tui", "tui"),
    ("replay", "replay"),
)


def layer(module: str) -> str | None:
    """The layer of a module, by the folder it lives in (None: not ours)."""
    path = module.replace(".", "/")
    for folder, name in FOLDERS:
        if path == folder or path.startswith(folder + "/"):
            return name
    return None


def modules() -> list[tuple[str, Path]]:
    found = []
    for package in ("journal", "kvstate", "replay"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join(parts), path))
    return found


def imports(module: str, path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not node.module:  # from . import x: x may be a module
                out += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
            else:
                out.append((name, node.lineno))
    return out


@pytest.mark.parametrize(("module", "path"), modules(), ids=[m for m, _ in modules()])
def test_imports_point_one_way(module: str, path: Path) -> None:
    mine = layer(module)
    assert mine is not None
    wrong = []
    for name, line in imports(module, path):
        theirs = layer(name)
        if theirs is not None and theirs not in ALLOWED[mine]:
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {name} ({theirs})")
        if mine in ("journal", "core") and name.split(".")[0] in HEAVY:
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {name}")
    assert not wrong, "\n".join(wrong)


def loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(done.stdout.split())


def test_import_kvstate_stays_light() -> None:
    loaded = loaded_after("import kvstate")
    heavy = {m for m in loaded if m.split(".")[0] in HEAVY}
    harness = {m for m in loaded if m.startswith(("kvstate.harness", "replay"))}
    assert not heavy and not harness, sorted(heavy | harness)


def test_the_command_line_loads_no_simulator_until_asked() -> None:
    loaded = loaded_after("import replay.cli; replay.cli.build_parser()")
    assert not {m for m in loaded if m.startswith("kvstate.harness")}
    assert not {m for m in loaded if m.split(".")[0] in {"torch", "textual", "mooncake"}}


def test_the_layer_test_catches_a_wrong_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvstate.harness.sim import engine\nfrom replay import report\n")
    found = [layer(name) for name, _ in imports("kvstate.ledger", bad)]
    assert found == ["harness", "replay"]
    assert not {"harness", "replay"} <= ALLOWED["core"]


def test_the_top_level_face_is_small_and_every_error_shares_one_base() -> None:
    import inspect

    import kvstate
    from kvstate import errors, violations

    assert len(kvstate.__all__) <= 10, kvstate.__all__
    for module in (errors, violations):
        for _name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Exception) and cls.__module__ == module.__name__:
                assert issubclass(cls, kvstate.KvstateError), cls


def targets(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports, type-checking imports
    included: ``from kvstate import events`` is the module ``kvstate.events``,
    ``from kvstate import Recorder`` the package ``kvstate`` (its
    ``__init__``, which imports the recorder)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for name in names:
        while name and name not in known:  # a name in a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def library_graph() -> dict[str, set[str]]:
    """Every module of journal/, kvstate/ (the vLLM observer and the harness
    included) and replay/, and which of them each imports."""
    found = dict(modules())
    known = set(found)
    return {module: targets(module, path, known) for module, path in found.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_library_has_no_import_cycle() -> None:
    """A helper module is a leaf of its own concept: it imports neither the
    ledger nor the worker that use it, not even for typing; and no two
    modules of the journal, the core, the observer, the harness or replay
    import each other, through any number of others."""
    graph = library_graph()
    for module in ("journal.segments", "kvstate.vllm.generic", "replay.pairs", "kvstate"):
        assert module in graph  # the whole library is graphed
    found = cycle(graph)
    assert found is None, " -> ".join(found or ())


def dynamic_imports(source: str) -> list[str]:
    """Where ``source`` imports by name at run time (importlib, ``__import__``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if "importlib" in names or (module or "").startswith("importlib"):
                found.append(f"line {node.lineno}: importlib")
        elif isinstance(node, ast.Name) and node.id == "__import__":
            found.append(f"line {node.lineno}: __import__")
    return found


def test_the_journal_loads_no_application_code() -> None:
    """A record crosses from kvstate into the journal once, as rows
    (docs/architecture.md, "The write path"): the journal never imports
    kvstate, and neither may it load an application's code by name (as its
    writer process once loaded kvstate's codec from a string), which the
    import graph cannot see."""
    for path in sorted((ROOT / "journal").glob("*.py")):
        assert dynamic_imports(path.read_text()) == [], path.name


def test_the_dynamic_import_check_sees_one() -> None:
    assert dynamic_imports("import importlib\nimportlib.import_module('kvstate')\n")
    assert dynamic_imports("from importlib import import_module\n")
    assert dynamic_imports("__import__('kvstate')\n")
    assert dynamic_imports("import json\n") == []


def test_the_graph_counts_what_a_from_import_names(tmp_path: Path) -> None:
    source = tmp_path / "x.py"
    source.write_text("from kvstate import Recorder\nfrom kvstate import events\nimport journal\n")
    known = {"kvstate", "kvstate.events", "journal", "kvstate.x"}
    assert targets("kvstate.x", source, known) == {"kvstate", "kvstate.events", "journal"}


def test_the_cycle_check_catches_a_cycle() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


#: the fold's helpers and the job run: leaves of their own concept
HELPERS = (
    "kvstate._reads",
    "kvstate._quiescence",
    "kvstate._parking",
    "kvstate._copies",
    "kvstate._ledger_state",
    "kvstate.jobrun",
    "kvstate.policy",
)
#: the ledgers that use them
LEDGERS = {"kvstate.ledger", "kvstate.worker", "kvstate.scheduler", "kvstate.recorder"}


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("helper", HELPERS)
def test_a_helper_reaches_no_ledger_not_even_for_typing(helper: str) -> None:
    graph = library_graph()
    assert helper in graph
    assert not reaches(graph, helper) & LEDGERS


def test_the_reach_check_sees_an_indirect_import() -> None:
    graph = {"kvstate._reads": {"kvstate.state"}, "kvstate.state": {"kvstate.ledger"}}
    assert "kvstate.ledger" in reaches(graph, "kvstate._reads")


#: file names more than one library module has, each with one meaning: a
#: connector family's half of a concept, a package's own errors, and a
#: command named for the concept it runs (replay/cli/X.py runs replay/X.py)
SAME_MEANING = {
    "_hooks.py": "the patches of one connector family's adapter (kvstate/vllm/<family>/)",
    "_worker.py": "the worker half of one connector family's adapter",
    "errors.py": "a package's own errors (journal's, kvstate's)",
    "export.py": "kvstate export: replay/cli/ runs replay/export.py",
    "timeline.py": "kvstate timeline: replay/cli/ runs replay/timeline.py",
    "watch.py": "kvstate watch: replay/cli/ runs replay/watch.py",
    "zoo.py": "kvstate zoo: replay/cli/harness/ runs kvstate/harness/zoo.py",
}


def test_no_two_modules_share_a_name_with_two_meanings() -> None:
    names: dict[str, list[str]] = {}
    for module, path in modules():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(module)
    repeated = {name: found for name, found in names.items() if len(found) > 1}
    assert set(repeated) <= set(SAME_MEANING), {
        name: found for name, found in repeated.items() if name not in SAME_MEANING
    }
