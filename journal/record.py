"""The journal's unit of storage: one immutable record.

The journal is generic: a record is a ``kind`` name and a ``payload`` mapping
of kind-specific fields, plus the envelope every record has (``seq``, ``step``,
``rank``, ``ts``). What the kinds mean is the application's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


@attrs.frozen(slots=True)
class Record:
    """One journal record.

    ``seq`` is the record's position, strictly increasing within a journal.
    ``step`` is the engine step it belongs to, ``rank`` the worker that wrote
    it (``None`` for records of the scheduler side) and ``ts`` an optional
    monotonic clock reading in nanoseconds, used to merge journals.
    """

    seq: int
    kind: str
    payload: Mapping[str, Any] = attrs.field(factory=dict)
    step: int | None = None
    rank: int | None = None
    ts: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON Lines form: envelope fields first, then the payload."""
        out: dict[str, Any] = {"seq": self.seq, "kind": self.kind}
        if self.step is not None:
            out["step"] = self.step
        if self.rank is not None:
            out["rank"] = self.rank
        if self.ts is not None:
            out["ts"] = self.ts
        for name, value in self.payload.items():
            if name not in out:
                out[name] = value
        return out
