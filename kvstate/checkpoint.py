"""A checkpoint of the fold: enough for replay to go on where records were removed.

A journal that keeps a retention budget removes its oldest segments
(:mod:`journal.retention`); each segment after the first then begins with a
checkpoint, written by the journal's writer process, which folds every
batch anyway. The checkpoint is the reference ledger as it stood after the
previous segment's last record: every folded field of
:class:`~kvstate._ledger_state.LedgerState`, each rank's
:class:`~kvstate.rank.RankState`, the parked jobs and requests and the key
log (:mod:`kvstate.archive`), and the findings so far. Replay of a journal
whose head was removed restores the ledger from it (:func:`restore`) and
folds on, so every check after it sees what it would have seen, and the
verdict carries the findings of the records it no longer has.

It is stored in parts (:func:`parts`): the ledger's own state first, then
the parked entities and the key log in chunks, so neither the writer nor a
reader holds the history at once. Each part is a compressed pickle, read
back by an unpickler that builds only kvstate's state classes and plain
containers (:func:`_loads`): a journal is input, and a pickle that names
anything else is refused as a malformed checkpoint, never run.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from journal import Journal, RecordError

from . import _pickles
from . import events as ev
from ._layered import LayeredSet
from ._ledger_state import FOLDED, LedgerState
from ._parking import PARK_AFTER, SWEEP_EVERY, Parking
from .rank import RankLedger, RankState
from .violations import LISTED_FINDINGS, Violation

#: the layout of a checkpoint's parts; a reader refuses any other
FORMAT = 1
#: the history a checkpoint carries: the newest parked jobs and requests, and
#: the newest key writes. What is live is always carried whole; settled
#: history beyond these is forgotten, so a checkpoint (some megabytes at
#: most), the pause to write it, and what a journal keeps stay bounded
#: however long the engine runs. A later record naming a forgotten job is
#: judged as one naming a job never enqueued (CAUSALITY); a forgotten key
#: write leaves only the ``chain`` of a POISONED_KEY or WRONG_KV_LOADED
#: finding shorter (the key log only names which enqueues wrote a key)
NEWEST_PARKED = 100_000
NEWEST_KEY_WRITES = 100_000
#: the findings a checkpoint lists (the first ones; the rest are counted): a
#: journal whose every record is a finding (a rank's, folded alone) must not
#: grow its writer's memory or its checkpoints without end; as many as a
#: live audit lists
MAX_FINDINGS = LISTED_FINDINGS
#: the ledger fields stored as they are (the rank ledgers are stored by their state)
_FIELDS = tuple(
    f.name for f in attrs.fields(LedgerState) if f.metadata.get(FOLDED) and f.name != "ranks"
)
_RANK_FIELDS = tuple(f.name for f in attrs.fields(RankState))


def parts(
    ledger: LedgerState,
    found: Iterable[Violation],
    *,
    omitted: int = 0,
    newest_parked: int = NEWEST_PARKED,
    newest_key_writes: int = NEWEST_KEY_WRITES,
) -> Iterator[bytes]:
    """The checkpoint of ``ledger`` (and of ``found``, the findings so far,
    ``omitted`` more not listed), in parts, carrying at most the newest
    ``newest_parked`` parked entities and ``newest_key_writes`` key writes
    of its history."""
    state: dict[str, Any] = {name: getattr(ledger, name) for name in _FIELDS}
    state["reported_once"] = frozenset(ledger.reported_once)
    ranks = {
        rank: (rl.knows_all_jobs, {name: getattr(rl, name) for name in _RANK_FIELDS})
        for rank, rl in ledger.ranks.items()
    }
    parking = ledger.parking
    settled = parking.settled() if isinstance(parking, Parking) else None
    history = {"forgotten": max(0, len(ledger.archive) - newest_parked), "omitted": omitted}
    # One pickle: a job's per-rank states stay the very objects its ranks hold.
    yield _dumps(("ledger", FORMAT, state, ranks, settled, list(found), history))
    for batch in ledger.archive.items(newest_parked):
        yield _dumps(("parked", batch))
    for writes in ledger.archive.key_writes(newest_key_writes):
        yield _dumps(("keys", writes))


@attrs.frozen
class Resumed:
    """Where a journal's remaining records begin: after ``seq``, from the
    checkpoint stored with ``path`` (segment ``segment``; the records
    1..``seq`` were removed by retention). Readers hand it to the fold
    before the first record (:func:`restore`)."""

    seq: int
    path: str
    segment: int
    header: ev.JournalOpened
    #: the checkpoint's parts, read again from its segment when restored
    read_parts: Callable[[], Iterator[bytes]] = attrs.field(repr=False)
    #: settled jobs and requests the checkpoint no longer carries (see NEWEST_PARKED)
    forgotten: int = 0
    #: findings before it that it counts but does not list (see MAX_FINDINGS)
    omitted: int = 0

    @property
    def kind(self) -> str:
        return "checkpoint"

    def describe(self) -> str:
        forgot = (
            f"; it carries the newest of the settled history, {self.forgotten} older settled "
            "jobs and requests are not judged again"
            if self.forgotten
            else ""
        )
        more = (
            f"; it lists the first {MAX_FINDINGS:,} findings of those records, and "
            f"{self.omitted:,} more were found"
            if self.omitted
            else ""
        )
        return (
            f"records 1..{self.seq} were removed by retention; the fold went on from the "
            f"checkpoint stored with {self.path} (segment {self.segment}){forgot}{more}"
        )


def resumed_at(journal: Journal) -> Resumed | None:
    """Where the records of ``journal``, the first remaining segment of a
    journal, begin when retention removed the segments before it (None: it
    begins at the header). Its parts are read again, on a connection of
    their own, when restored: the segment may be closed by then (a reader
    goes on to the next one before the first record comes)."""
    row = journal.segment()
    first_parts = journal.checkpoint() if row is not None else None
    if row is None or first_parts is None:
        return None
    path, seq = journal.path, row[2]
    first = next(iter(first_parts), None)
    if first is None:
        raise RecordError("the checkpoint is empty", path=path, seq=seq)
    header, forgotten, omitted = summary_of(path, seq, first)

    def read_parts() -> Iterator[bytes]:
        with Journal(path, readonly=True) as again:
            yield from again.checkpoint() or ()

    return Resumed(seq, path, row[0], header, read_parts, forgotten, omitted)


def summary_of(path: str, seq: int, first_part: bytes) -> tuple[ev.JournalOpened, int, int]:
    """The journal's header, as the checkpoint's ledger state holds it, how
    many settled jobs and requests it no longer carries, and how many
    findings it counts but does not list."""
    value = _ledger_part(path, seq, first_part)
    header = value[2].get("header")
    if not isinstance(header, ev.JournalOpened):
        raise RecordError("the checkpoint holds no journal_opened header", path=path, seq=seq)
    history = value[6]
    return header, int(history.get("forgotten", 0)), int(history.get("omitted", 0))


def restore(ledger: LedgerState, resumed: Resumed) -> list[Violation]:
    """Make ``ledger`` (new, nothing folded) the ledger the checkpoint holds;
    returns the findings of the records before it.

    Raises :class:`journal.RecordError` naming the segment for a checkpoint
    that is not one this reader can read.
    """
    path, seq = resumed.path, resumed.seq
    parts_iter = resumed.read_parts()
    first = next(parts_iter, None)
    if first is None:
        raise RecordError("the checkpoint is empty", path=path, seq=seq)
    _tag, _format, state, ranks, settled, found, _history = _ledger_part(path, seq, first)
    for name in _FIELDS:
        if name in state and name != "reported_once":
            setattr(ledger, name, state[name])
    reported = ledger.reported_once = LayeredSet()
    for key in state.get("reported_once", ()):
        reported.add(key)
    ledger.ranks = {}
    for rank, (knows_all, fields) in ranks.items():
        rl = RankLedger(rank, ledger.jobs, knows_all_jobs=knows_all)
        for name, value in fields.items():
            setattr(rl, name, value)
        ledger.ranks[rank] = rl
    parking = ledger.parking
    # a ledger that does not park gets all of it back in memory, through a
    # parking of its own for the restore only
    temporary = not isinstance(parking, Parking)
    if not isinstance(parking, Parking):
        parking = Parking(ledger, PARK_AFTER, SWEEP_EVERY)
    elif settled is not None:
        parking.resume(settled)
    for part in parts_iter:
        tag, items = _part(path, seq, part)
        if tag == "parked":
            for key, blob in items:
                parking.put_parked(key, blob)
        elif tag == "keys":
            for key, key_seq, job in items:
                ledger.archive.key_written(key, key_seq, job)
        else:
            raise RecordError(f"the checkpoint has a part of kind {tag!r}", path=path, seq=seq)
    if temporary:
        parking.restore_all()
    return list(found)


def _ledger_part(path: str, seq: int, blob: bytes) -> tuple[Any, ...]:
    value = _loads(path, seq, blob)
    if not (isinstance(value, tuple) and len(value) == 7 and value[0] == "ledger"):
        raise RecordError("the checkpoint does not begin with the ledger", path=path, seq=seq)
    if value[1] != FORMAT:
        raise RecordError(
            f"the checkpoint is of format {value[1]!r}; this reader reads {FORMAT}",
            path=path,
            seq=seq,
        )
    if not all(type(value[i]) is dict for i in (2, 3, 6)):
        raise RecordError("the checkpoint's ledger is malformed", path=path, seq=seq)
    return value


def _part(path: str, seq: int, blob: bytes) -> tuple[str, list[Any]]:
    value = _loads(path, seq, blob)
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], list)):
        raise RecordError("a part of the checkpoint is malformed", path=path, seq=seq)
    return value[0], value[1]


# -- the pickles ------------------------------------------------------------------------

#: the modules whose classes a checkpoint may hold (state rows, events, findings)
_MODULES = frozenset(
    {
        "kvstate.state",
        "kvstate._offload",
        "kvstate._transfers",
        "kvstate.events",
        "kvstate.tier_events",
        "kvstate.transfer_events",
        "kvstate.violations",
    }
)


def _dumps(value: Any) -> bytes:
    return zlib.compress(_pickles.dumps(value), 1)


def _loads(path: str, seq: int, blob: bytes) -> Any:
    try:
        return _pickles.loads(zlib.decompress(blob), _MODULES)
    except Exception as exc:  # any malformed pickle: input, named
        raise RecordError(f"the checkpoint cannot be read: {exc}", path=path, seq=seq) from None
