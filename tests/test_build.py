"""Each event kind is built in one place: :mod:`kvstate.build`.

The ledgers, the vLLM observers, the writer process, the harness and the
codec build records only through it; these tests fail on a record built
anywhere else in the library, and on a kind without its builder.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import msgspec
import pytest

import kvstate.tier_events
import kvstate.transfer_events
from kvstate import build
from kvstate.events import EVENT_TYPES

ROOT = Path(__file__).resolve().parent.parent
#: where the event classes are declared (their definitions, not records built)
DECLARED = {"kvstate/events.py", "kvstate/tier_events.py", "kvstate/transfer_events.py"}
CLASSES = {cls.__name__ for cls in EVENT_TYPES.values()}
assert kvstate.tier_events and kvstate.transfer_events  # their kinds are registered


def built_in(source: str) -> list[tuple[str, int]]:
    """Each call of an event class in ``source``: (class name, line)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in CLASSES:
                found.append((name, node.lineno))
    return found


def library_sources() -> list[Path]:
    return sorted(
        p for folder in ("journal", "kvstate", "replay") for p in (ROOT / folder).rglob("*.py")
    )


def test_no_record_is_built_outside_the_builders() -> None:
    elsewhere = []
    for path in library_sources():
        name = path.relative_to(ROOT).as_posix()
        if name in DECLARED or name == "kvstate/build.py":
            continue
        elsewhere += [f"{name}:{line}: {cls}" for cls, line in built_in(path.read_text())]
    assert elsewhere == []


def test_the_builders_build_each_kind_once_under_its_own_name() -> None:
    calls = built_in((ROOT / "kvstate" / "build.py").read_text())
    assert sorted(cls for cls, _ in calls) == sorted(CLASSES)  # each once
    for kind, cls in EVENT_TYPES.items():
        builder = getattr(build, kind)
        params = list(inspect.signature(builder).parameters)
        fields = [f for f in msgspec.structs.fields(cls) if f.name != "extra"]
        assert params == [f.name for f in fields], kind
        assert all(
            inspect.signature(builder).parameters[f.name].kind is inspect.Parameter.KEYWORD_ONLY
            for f in fields
        )


def test_the_scan_sees_a_record_built_by_name_or_through_a_module() -> None:
    source = "x = ev.JobStarted(job=1, rank=0)\ny = EngineIdle()\nz = build.engine_idle()\n"
    assert built_in(source) == [("JobStarted", 1), ("EngineIdle", 2)]


@pytest.mark.parametrize(
    ("made", "field"),
    [
        (
            lambda blocks: build.blocks_assigned(req="r", gen=0, blocks=blocks, mode="append"),
            "blocks",
        ),
        (lambda blocks: build.pins_released(job=1, blocks=blocks), "blocks"),
        (lambda blocks: build.dma_started(job=1, rank=0, blocks=blocks), "blocks"),
        (lambda jobs: build.flush_requested(jobs=jobs), "jobs"),
        (lambda jobs: build.cache_reset(jobs=jobs), "jobs"),
    ],
)
def test_a_record_keeps_no_list_of_the_callers(made: object, field: str) -> None:
    """vLLM appends to a block table in place and reuses its lists: a record
    that kept the caller's list would change after it was taken."""
    given = [3, 4]
    event = made(given)  # type: ignore[operator]
    given.append(5)
    assert getattr(event, field) == (3, 4)
    assert msgspec.json.decode(msgspec.json.encode(event), type=type(event)) == event


def test_a_builder_leaves_an_absent_sequence_absent() -> None:
    assert build.dma_started(job=1, rank=0).blocks is None
    assert build.request_admitted(req="r", gen=0, prompt_tokens=4).hashes is None
    assert build.request_admitted(req="r", gen=0, prompt_tokens=4, hashes=["a"]).hashes == ("a",)
