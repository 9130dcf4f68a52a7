"""Between journal records and events: the two codecs of journal v1.

A :class:`journal.Record` holds the kind-specific fields in its payload; on
disk that payload is msgpack (the storage form), in JSON Lines it is the rest
of the line (the interchange form). The event classes of
:mod:`kvstate.events` are the schema of both: msgspec encodes an event's
fields straight to its stored payload, and one typed decoder per kind turns
stored bytes back into a validated event, checking every type and range in C.

Every failure is one error type, :class:`journal.RecordError`, carrying the
file and line or seq, with a message that says what the field must hold.

The stored payload of a worker event holds its ``rank`` as well as the
record's envelope (the event is decoded in one call); payloads written
before that (no ``rank``), payloads with unknown extra fields and JSON Lines
take the general path, which gives the same events.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, get_args, get_origin

import msgspec
import msgspec.inspect as mi

from journal import Record, RecordError
from journal import _values as values

from . import build
from .events import EVENT_TYPES, SIDE_WORKER, Event, rank_of


class Entry(NamedTuple):
    """One journal position: the envelope and the event it holds."""

    seq: int
    step: int
    ts: int | None
    event: Event


class Located(NamedTuple):
    """An entry and where it was read: file, own seq, and line for JSON Lines.

    A named tuple rather than an attrs class: one is made per record read.
    """

    entry: Entry
    path: str
    seq: int
    line: int | None


#: the one encoder of the storage form
_encode = msgspec.msgpack.Encoder().encode
#: the one decoder of each kind's storage form, and what the general path needs
_DECODERS: dict[str, Any] = {k: msgspec.msgpack.Decoder(c).decode for k, c in EVENT_TYPES.items()}
_EXTRA = "kvstate:extra"


# -- encoding ------------------------------------------------------------------------


def payload_bytes(event: Event) -> bytes:
    """The stored payload of an event: a msgpack map of its fields.

    Optional fields at their default are left out (absent and default mean
    the same in journal v1); kept extras are merged in without overriding a
    field. This is the writer's encoder, one msgspec call per record.
    """
    if event.extra is None:
        return _encode(event)
    fields = msgspec.to_builtins(event)
    extra = fields.pop(_EXTRA)
    for name, value in extra.items():
        fields.setdefault(name, value)
    return _encode(fields)


def refusal(event: Event) -> str | None:
    """Why the contract refuses ``event``'s values, or None when it takes them.

    Building an event checks nothing (see :mod:`kvstate.events`); this is
    the reader's own check, run where a record is made: the one encoder,
    then the kind's one typed decoder. Naming the field, as a reader would.
    """
    try:
        payload = payload_bytes(event)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"{event.kind}: {_unencodable(event, exc)}"
    try:
        _DECODERS[event.kind](payload)
    except msgspec.ValidationError as exc:
        fields = msgspec.msgpack.decode(payload)
        return f"{event.kind}: {_explain(type(event), fields, exc)}"
    except (msgspec.DecodeError, RecursionError) as exc:
        return f"{event.kind}: {exc}"
    return None


def refused(seq: int, step: int, ts: int | None, kind: str, error: str) -> Entry:
    """The record written in place of a refused one of ``kind``: same seq, step and ts."""
    return Entry(seq, step, ts, build.record_refused(refused=kind, error=error))


def event_payload(event: Event) -> dict[str, Any]:
    """The payload of an event as a record holds it: the stored payload
    decoded (tuples as lists, extras merged), without ``rank``, which lives
    in the record's envelope."""
    fields: dict[str, Any] = msgspec.msgpack.decode(payload_bytes(event))
    if event.side == SIDE_WORKER:
        del fields["rank"]
    return fields


def to_record(entry: Entry) -> Record:
    """The journal record of an entry (worker events put their rank in the envelope)."""
    event = entry.event
    return Record(entry.seq, event.kind, event_payload(event), entry.step, rank_of(event), entry.ts)


def to_row(entry: Entry) -> tuple[int, str, int, int | None, int | None, bytes]:
    """The row the journal writer appends: envelope and stored payload bytes."""
    event = entry.event
    rank = event.rank if event.side == SIDE_WORKER else None  # type: ignore[attr-defined]
    return (entry.seq, event.kind, entry.step, rank, entry.ts, payload_bytes(event))


def to_dict(entry: Entry) -> dict[str, Any]:
    """The JSON Lines object of an entry."""
    return to_record(entry).to_dict()


# -- decoding ------------------------------------------------------------------------


def from_stored(
    seq: int,
    kind: str,
    step: int | None,
    rank: int | None,
    ts: int | None,
    payload: bytes,
    path: str | None = None,
) -> Entry:
    """Decode one stored row (what replay reads per record).

    The fast path is one typed msgspec decode; a payload it does not take
    as it is (no ``rank`` inside, extra fields, a bad value) goes through the
    general path, which keeps extras and explains what is wrong.
    """
    decode = _DECODERS.get(kind)
    if decode is not None and step is not None and step >= 0:
        try:
            event = decode(payload)
        except (msgspec.DecodeError, RecursionError):
            # RecursionError: nesting deeper than msgspec recurses (an
            # ``extra`` value is Any); the general path below names the seq.
            pass
        else:
            if event.extra is None and (
                rank is None if event.side != SIDE_WORKER else event.rank == rank
            ):
                return Entry(seq, step, ts, event)
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise RecordError(f"payload is not msgpack: {exc}", path=path, seq=seq) from exc
    except RecursionError:
        raise RecordError(
            f"unusable value in the payload: values nested deeper than {values.MAX_DEPTH} levels",
            path=path,
            seq=seq,
        ) from None
    if type(fields) is not dict:
        raise RecordError("payload is not a map", path=path, seq=seq)
    found = values.payload_problem(fields)
    if found:
        raise RecordError(f"unusable value in the payload: {found}", path=path, seq=seq)
    cls = EVENT_TYPES.get(kind)
    if cls is not None and cls.side == SIDE_WORKER and fields.pop("rank", rank) != rank:
        raise RecordError("the payload's rank differs from the record's", path=path, seq=seq)
    return from_row(seq, kind, step, rank, ts, fields, path)


def from_record(record: Record, *, path: str | None = None, line: int | None = None) -> Entry:
    """Decode and validate one record.

    Raises :class:`RecordError` for an unknown kind, a missing or ill-typed
    field, or a missing ``step`` / ``rank``; the error names ``path`` and
    ``line`` when given, else the record's ``seq``.
    """
    return from_row(
        record.seq, record.kind, record.step, record.rank, record.ts, record.payload, path, line
    )


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
    """:func:`from_record` for the parts of a record whose payload is a mapping
    without ``rank`` (JSON Lines, a :class:`journal.Record`)."""

    def bad(message: str) -> RecordError:
        return RecordError(message, path=path, line=line, seq=seq)

    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise bad(f"unknown kind {_short(kind)}")
    if step is None:
        raise bad(f"{kind} record has no 'step'")
    if step < 0:
        raise bad(f"'step' must be non-negative, not {step}")
    missing = [name for name in cls.required_fields if name not in payload]
    if missing:
        raise bad(f"{kind} record lacks {', '.join(map(repr, missing))}")
    known = cls.payload_fields
    fields = {name: payload[name] for name in known if name in payload}
    extra = {name: value for name, value in payload.items() if name not in known}
    if cls.side == SIDE_WORKER:
        if rank is None:
            raise bad(f"{kind} is a worker record and needs 'rank'")
        fields["rank"] = rank
        extra.pop("rank", None)
    elif rank is not None:
        # Only worker events carry a rank; keep it so a round trip loses nothing.
        extra["rank"] = rank
    if extra:
        fields[_EXTRA] = extra
    try:
        event = msgspec.convert(fields, cls)
    except msgspec.ValidationError as exc:
        raise bad(f"{kind}: {_explain(cls, fields, exc)}") from exc
    return Entry(seq, step, ts, event)


# -- messages --------------------------------------------------------------------------


def _explain(cls: type[Event], fields: Mapping[str, Any], exc: msgspec.ValidationError) -> str:
    """msgspec's error in the journal's words: which field, what it must hold, what it held."""
    message = str(exc)
    marker = " - at `$."
    if marker not in message:
        return message  # a rule of __post_init__, already in our words
    name = message.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    must = _MUST.get(cls, {}).get(name)
    if must is None or name not in fields:
        return message
    return f"'{name}' must be {must}, not {_short(fields[name])}"


def _unencodable(event: Event, exc: Exception) -> str:
    """Which field of ``event`` the encoder could not write, in the journal's words."""
    for field in msgspec.structs.fields(event):
        value = getattr(event, field.name)
        try:
            _encode(value)
        except (TypeError, ValueError, OverflowError):
            must = _MUST.get(type(event), {}).get(field.name)
            if must is not None:
                return f"'{field.name}' must be {must}, not {_short(value)}"
            return f"'{field.name}': {exc}"
    return str(exc)


def _short(value: Any, limit: int = 60) -> str:
    """A value's repr, cut to ``limit`` characters (a bad field may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _must(info: mi.Type, plural: bool = False) -> str:
    """What a field of this msgspec type may hold, in words."""
    if isinstance(info, mi.IntType):
        lo = info.ge if info.ge is not None else None
        if lo == 0:
            words = "non-negative integers" if plural else "a non-negative integer"
        elif lo == 1:
            words = "positive integers" if plural else "a positive integer"
        else:
            words = "integers" if plural else "an integer"
        if info.le is not None and info.le < 2**32:
            words += f" (at most {info.le}, larger than any engine)"
        return words
    if isinstance(info, mi.StrType):
        return "strings" if plural else "a string"
    if isinstance(info, mi.BoolType):
        return "true or false"
    if isinstance(info, mi.LiteralType):
        return "one of " + ", ".join(map(str, info.values))
    if isinstance(info, (mi.VarTupleType, mi.ListType)):
        return f"a list of {_must(info.item_type, plural=True)}"
    if isinstance(info, mi.UnionType):
        parts = [t for t in info.types if not isinstance(t, mi.NoneType)]
        nullable = len(parts) < len(info.types)
        if all(isinstance(t, (mi.IntType, mi.FloatType, mi.StrType, mi.BoolType)) for t in parts):
            if len(parts) > 1:
                words = "a string or number" if not plural else "strings or numbers"
            else:
                words = _must(parts[0], plural)
        else:
            words = " or ".join(_must(t, plural) for t in parts)
        return f"{words} or null" if nullable else words
    return f"a {type(info).__name__.removesuffix('Type').lower()}"


def _field_must(field: msgspec.structs.FieldInfo, info: mi.Type) -> str:
    if get_origin(field.type) is Literal:  # in declared order (msgspec sorts them)
        return "one of " + ", ".join(map(str, get_args(field.type)))
    return _must(info)


_MUST: dict[type[Event], dict[str, str]] = {
    cls: {
        f.name: _field_must(f, i.type)
        for f, i in zip(msgspec.structs.fields(cls), mi.type_info(cls).fields, strict=True)  # type: ignore[attr-defined]
    }
    for cls in EVENT_TYPES.values()
}
