"""One fold loop: every reader, the live audit and the checkpoints fold through
kvstate.folder.Folder, the one place the library calls a fold's ``apply``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from journal import RecordError
from kvstate import events as ev
from kvstate.codec import Entry, Located
from kvstate.folder import Folder, fold_all
from kvstate.ledger import Ledger
from kvstate.violations import Code

ROOT = Path(__file__).resolve().parent.parent
#: where ``.apply(`` may be called: the loop, and a fold handing one record
#: to its part for one rank (inside Ledger.apply, and for ranks alone)
CALLERS = {"kvstate/folder.py", "kvstate/ledger.py", "kvstate/rank.py"}


def apply_uses() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for package in ("journal", "kvstate", "replay"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                # a call, or a bound method kept for a loop (``apply = ledger.apply``)
                if isinstance(node, ast.Attribute) and node.attr == "apply":
                    found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    return found


def test_exactly_one_loop_in_the_library_calls_the_folds_apply() -> None:
    calls = apply_uses()
    assert set(calls) == CALLERS, calls


def _entries() -> list[Entry]:
    events: list[ev.Event] = [
        ev.JournalOpened(version=1, block_size=16, world_size=1),
        ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16),
        ev.BlocksAssigned(req="r", gen=0, blocks=(1,), mode="replace"),
        ev.RequestFinished(req="r", gen=0),
        ev.RequestFinished(req="r", gen=0),  # a second finish: DOUBLE_FINISH
        ev.RequestAdmitted(req="r", gen=0, prompt_tokens=16),  # gen not greater: ID_REUSED
    ]
    return [Entry(seq, 0, None, e) for seq, e in enumerate(events, start=1)]


def test_each_way_in_finds_what_the_ledger_finds() -> None:
    want = [(v.code, v.seq) for v in fold_all(_entries())]
    assert Code.ID_REUSED in {code for code, _ in want}
    for way in ("entries", "batch", "located"):
        folder = Folder(Ledger())
        if way == "entries":
            got = [v for _e, found in folder.entries(_entries()) for v in found]
        elif way == "batch":
            got = folder.batch(_entries())
        else:
            items = [Located(e, "x.db", e.seq, None) for e in _entries()]
            got = [v for _e, found in folder.located(items) for v in found]
        assert [(v.code, v.seq) for v in got + folder.ledger.end()] == want, way  # type: ignore[attr-defined]


def test_a_refused_record_is_named_where_it_was_read() -> None:
    other = ev.JournalOpened(version=1, block_size=32, world_size=1)  # another engine's header
    items = [Located(e, "run.jsonl", e.seq, e.seq) for e in _entries()[:2]]
    items.append(Located(Entry(3, 0, None, other), "run.jsonl", 3, 7))
    with pytest.raises(RecordError) as caught:
        for _ in Folder(Ledger()).located(items):
            pass
    assert caught.value.path == "run.jsonl" and caught.value.line == 7


def test_a_long_lived_fold_lists_its_first_findings_and_counts_the_rest() -> None:
    folder = Folder(Ledger(), listed=3)
    found = fold_all(_entries())
    folder.keep(found)
    folder.keep(found)
    assert folder.found == (found + found)[:3] and folder.omitted == 2 * len(found) - 3
    every = Folder(Ledger())
    every.keep(found)
    assert every.found == found and every.omitted == 0
