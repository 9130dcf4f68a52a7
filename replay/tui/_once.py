"""``kvstate inspect --once``: the overview and the first violations, streamed.

One pass folds the journal (settled state parked on disk, see
:mod:`kvstate.spill`) while counting records by kind and violations by
code; the violations themselves go to a spool on disk. Then the overview is
printed, and the violations one line each, so a journal of any length and
any number of violations prints in the same memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
from rich.console import Console
from rich.text import Text

from kvstate.checkpoint import Resumed
from kvstate.folder import Folder
from kvstate.ledger import Ledger
from kvstate.spill import SpillArchive
from kvstate.violations import CODE_ORDER, Code
from replay.report import emit
from replay.safe import printable
from replay.sources import open_stream

from ._spool import ViolationSpool
from ._views import overview


@attrs.define
class OnceIndex:
    """What :func:`replay.tui._views.overview` reads, counted in one pass."""

    path: str
    last_seq: int
    kinds: Counter[str]
    unfinished: bool
    violations: ViolationSpool
    counted: dict[Code, list[int]]
    indexed: bool = True
    error: Exception | None = None
    #: where retention removed the journal's head, the checkpoint's seq (else 0)
    first_seq: int = 0

    @property
    def indexed_seq(self) -> int:
        return self.last_seq

    def codes(self) -> list[tuple[Code, int, int]]:
        found = [(code, n, first) for code, (n, first) in self.counted.items()]
        return sorted(found, key=lambda c: CODE_ORDER[c[0]])


def index_once(paths: Sequence[str]) -> OnceIndex:
    """Fold ``paths`` once; raises :class:`journal.RecordError` for unusable input."""
    stream, _origin = open_stream(list(paths))
    ledger = Ledger(archive=SpillArchive())
    kinds: Counter[str] = Counter()
    spool = ViolationSpool()
    counted: dict[Code, list[int]] = {}
    last = first_seq = 0
    for entry, found in Folder(ledger).located(stream):
        last = entry.seq
        if type(entry.event) is Resumed:
            first_seq = entry.seq  # the head was removed: the records begin after it
        else:
            kinds[entry.event.kind] += 1
        for v in found:
            if v.is_warning:
                continue
            spool.add(v.seq, v.code.value, v.message)
            n = counted.setdefault(v.code, [0, v.seq])
            n[0] += 1
    return OnceIndex(
        ", ".join(paths), last, kinds, bool(ledger.end()), spool, counted, first_seq=first_seq
    )


def print_once(console: Console, paths: Sequence[str], limit: int | None = 20) -> int:
    """Print the overview, then the first ``limit`` violations (every one with
    None); returns replay's exit status (0 or 1)."""
    index = index_once(paths)
    try:
        emit(console, overview(index))
        if not len(index.violations):
            return 0
        width = len(str(index.last_seq))
        emit(console, Text("\nviolations", style="bold"))
        total = len(index.violations)
        for shown, (seq, code, message) in enumerate(index.violations):
            if limit is not None and shown >= limit:
                emit(
                    console,
                    Text(
                        f"... and {total - limit:,} more (--limit N shows more, --limit 0 "
                        "every one; kvstate replay groups them by root cause)"
                    ),
                )
                break
            line = Text(f"{seq:>{width}}  ")
            line.append(f"{code:<22}", style="red")
            line.append(printable(message))
            emit(console, line)
        return 1
    finally:
        index.violations.close()
