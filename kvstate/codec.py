"""Between journal records and events: the two codecs of journal v1.

A :class:`journal.Record` holds the kind-specific fields in its payload;
on disk that payload is msgpack (the storage form), in JSON Lines it is the
rest of the line (the interchange form). This module turns records into
validated events and back. Every failure is one error type,
:class:`journal.RecordError`, carrying the file and line or seq.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from journal import Record, RecordError
from journal.database import Row

from .events import EVENT_TYPES, SIDE_WORKER, Event, rank_of


class Entry(NamedTuple):
    """One journal position: the envelope and the event it holds."""

    seq: int
    step: int
    ts: int | None
    event: Event


def event_payload(event: Event) -> dict[str, Any]:
    """The payload of an event: its fields (tuples as lists) plus kept extras.

    Optional fields at their default are left out: absent and default mean
    the same in journal v1, and the stored form stays small. Each kind's
    encoder is compiled once (see :func:`_compile`): this runs for every
    record a connector writes, on the writer thread that shares the GIL
    with the engine.
    """
    cls = type(event)
    encode = _ENCODERS.get(cls)
    if encode is None:
        encode = _ENCODERS[cls] = _compile(cls)
    return encode(event)


_ENCODERS: dict[type[Event], Any] = {}


def _compile(cls: type[Event]) -> Any:
    """A payload function for one kind, written out field by field (as attrs does).

    The generated code is what the generic loop did, without the loop:
    required fields copied, optional ones copied unless at their default
    (same value and type), tuples turned into lists, extras added last
    without overriding a field.
    """
    lines = ["def encode(e):", "    out = {}"]
    namespace: dict[str, Any] = {"_tuple": tuple, "_list": list, "_type": type}
    for i, name in enumerate(cls.payload_fields):
        lines.append(f"    v = e.{name}")
        if name in cls.optional_fields:
            namespace[f"_d{i}"] = cls.optional_fields[name]
            namespace[f"_t{i}"] = type(cls.optional_fields[name])
            lines.append(f"    if not (v == _d{i} and _type(v) is _t{i}):")
            lines.append(f"        out[{name!r}] = _list(v) if _type(v) is _tuple else v")
        else:
            lines.append(f"    out[{name!r}] = _list(v) if _type(v) is _tuple else v")
    lines += [
        "    extra = e.extra",
        "    if extra:",
        "        for k, x in extra.items():",
        "            out.setdefault(k, x)",
        "    return out",
    ]
    exec("\n".join(lines), namespace)  # our own field names, never input
    return namespace["encode"]


def to_record(entry: Entry) -> Record:
    """The journal record of an entry (worker events put their rank in the envelope)."""
    event = entry.event
    rank = rank_of(event)
    return Record(entry.seq, event.kind, event_payload(event), entry.step, rank, entry.ts)


def to_row(entry: Entry) -> Row:
    """:func:`to_record` as a plain row, what the journal writer appends (no Record built)."""
    event = entry.event
    rank = event.rank if event.side == SIDE_WORKER else None  # type: ignore[attr-defined]
    return (entry.seq, event.kind, entry.step, rank, entry.ts, event_payload(event))


def to_dict(entry: Entry) -> dict[str, Any]:
    """The JSON Lines object of an entry."""
    return to_record(entry).to_dict()


def from_record(record: Record, *, path: str | None = None, line: int | None = None) -> Entry:
    """Decode and validate one record.

    Raises :class:`RecordError` for an unknown kind, a missing or ill-typed
    field, or a missing ``step`` / ``rank``; the error names ``path`` and
    ``line`` when given, else the record's ``seq``.
    """
    return from_row(
        record.seq, record.kind, record.step, record.rank, record.ts, record.payload, path, line
    )


#: kind -> (event class, payload field names, required field names, worker side)
_SHAPES: dict[str, tuple[Any, frozenset[str], frozenset[str], bool]] = {
    kind: (cls, frozenset(cls.payload_fields), frozenset(cls.required_fields),
           cls.side == SIDE_WORKER)
    for kind, cls in EVENT_TYPES.items()
}  # fmt: skip


def from_row(
    seq: int,
    kind: str,
    step: int | None,
    rank: int | None,
    ts: int | None,
    payload: Mapping[str, Any],
    path: str | None = None,
    line: int | None = None,
) -> Entry:
    """:func:`from_record` for the parts of a record (what replay reads per row).

    A payload that holds exactly the kind's fields (all required ones, no
    extras, ``rank`` only on worker kinds) goes straight to the event class,
    whose validators check every value; anything else takes the general
    path below, which keeps extras and names what is missing.
    """
    shape = _SHAPES.get(kind)
    if shape is not None and step is not None and step >= 0:
        cls, known, required, worker = shape
        keys = payload.keys()
        if keys <= known and required <= keys and (rank is not None) is worker:
            try:
                event = cls(**payload, rank=rank) if worker else cls(**payload)
            except (TypeError, ValueError) as exc:
                raise RecordError(f"{kind}: {exc}", path=path, line=line, seq=seq) from exc
            return Entry(seq, step, ts, event)
    return _from_parts(seq, kind, step, rank, ts, payload, path, line)


def _from_parts(
    seq: int,
    kind: str,
    step: int | None,
    rank: int | None,
    ts: int | None,
    payload: Mapping[str, Any],
    path: str | None,
    line: int | None,
) -> Entry:
    def bad(message: str) -> RecordError:
        return RecordError(message, path=path, line=line, seq=seq)

    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise bad(f"unknown kind {kind!r}")
    if step is None:
        raise bad(f"{kind} record has no 'step'")
    if step < 0:
        raise bad(f"'step' must be non-negative, not {step}")
    missing = [name for name in cls.required_fields if name not in payload]
    if missing:
        raise bad(f"{kind} record lacks {', '.join(map(repr, missing))}")
    known = cls.payload_fields
    kwargs = {name: payload[name] for name in known if name in payload}
    extra = {name: value for name, value in payload.items() if name not in known}
    if cls.side == SIDE_WORKER:
        if rank is None:
            raise bad(f"{kind} is a worker record and needs 'rank'")
        kwargs["rank"] = rank
        extra.pop("rank", None)
    elif rank is not None:
        # Only worker events carry a rank; keep it so a round trip loses nothing.
        extra["rank"] = rank
    try:
        event = cls(**kwargs, extra=extra) if extra else cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise bad(f"{kind}: {exc}") from exc
    return Entry(seq, step, ts, event)
