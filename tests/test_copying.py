"""State declared once: each field of the fold's state says how it is copied,
and a snapshot is derived from those declarations (kvstate._copying)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvstate import _copying
from kvstate._ledger_state import LedgerState
from kvstate._offload import OffloadState
from kvstate._transfers import TransferState
from kvstate.ledger import Ledger
from replay.sources import entries
from tests.builder import legacy_run

STATES = [LedgerState, OffloadState, TransferState]


@pytest.mark.parametrize("cls", STATES, ids=lambda c: c.__name__)
def test_every_field_declares_its_copy(cls: type) -> None:
    missing = [f.name for f in attrs.fields(cls) if _copying.COPY not in f.metadata]
    assert missing == []


def test_a_field_declared_without_a_copy_is_refused_at_the_first_copy() -> None:
    @attrs.define
    class Half:
        kept: dict[int, int] = attrs.field(
            factory=dict, metadata=_copying.copied_by(_copying.PLAIN)
        )
        forgotten: dict[int, int] = attrs.field(factory=dict)

    with pytest.raises(TypeError, match=r"Half\.forgotten declares no copy"):
        _copying.copied(Half())


def _containers(value: object) -> bool:
    return isinstance(value, dict | list | set) or attrs.has(type(value))


def test_a_snapshot_shares_no_mutable_state_and_folds_on_alike(tmp_path: Path) -> None:
    """Half a journal folded, then copied: no container of the copy is the
    original's; both fold the other half to the same state, and the copy
    still equals a fresh fold of the first half after the original moved on."""
    records = list(entries([str(legacy_run(tmp_path))]))
    half = len(records) // 2
    ledger, again = Ledger(), Ledger()
    for e in records[:half]:
        ledger.apply(e.seq, e.step, e.event)
        again.apply(e.seq, e.step, e.event)
    copy = ledger.snapshot()
    assert copy == ledger
    for cls, original, copied in [
        (LedgerState, ledger, copy),
        (OffloadState, ledger.offload, copy.offload),
        (TransferState, ledger.transfers, copy.transfers),
    ]:
        for field in attrs.fields(cls):
            value = getattr(original, field.name)
            if field.metadata[_copying.COPY] is not _copying.SHARED and _containers(value):
                assert getattr(copied, field.name) is not value, field.name
    for e in records[half:]:
        ledger.apply(e.seq, e.step, e.event)
    assert copy == again and copy != ledger
    for e in records[half:]:
        copy.apply(e.seq, e.step, e.event)
    assert copy == ledger
