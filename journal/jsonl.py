"""JSON Lines, the journal's interchange form.

One JSON object per line, UTF-8. The envelope fields (``seq``, ``kind``,
``step``, ``rank``, ``ts``) are lifted out; every other field is the payload.
``seq`` is optional on input and defaults to the 1-based line number. Blank
lines are skipped (they still count as lines).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

from . import _values
from .errors import RecordError
from .record import Record

_ENVELOPE_INTS = ("step", "rank", "ts")


def _is_int(value: Any) -> bool:
    return type(value) is int


_decode = json.JSONDecoder(
    parse_int=_values.parse_int, parse_constant=_values.parse_constant
).decode


def parse_line(text: str, *, path: str, line: int) -> Record:
    """Parse one JSON Lines record (no order check)."""
    try:
        obj = _decode(text)
    except json.JSONDecodeError as exc:
        raise RecordError(
            f"not valid JSON: {exc.msg} (column {exc.colno})", path=path, line=line
        ) from None
    except RecursionError:
        raise RecordError("not valid JSON: nested too deeply", path=path, line=line) from None
    except ValueError as exc:
        raise RecordError(f"not valid JSON: {exc}", path=path, line=line) from None
    if not isinstance(obj, dict):
        raise RecordError("a record must be a JSON object", path=path, line=line)
    # Strings may still hold lone surrogates (from \ud800 escapes), and
    # nesting may be deep but not recursion-deep: one walk settles both.
    found = _values.problem(obj)
    if found:
        raise RecordError(f"unusable value: {found}", path=path, line=line)
    kind = obj.pop("kind", None)
    if not isinstance(kind, str) or not kind:
        raise RecordError("record has no 'kind' string", path=path, line=line)
    seq = obj.pop("seq", line)
    if not _is_int(seq):
        raise RecordError(f"'seq' must be an integer, not {seq!r}", path=path, line=line)
    envelope: dict[str, int | None] = {}
    for name in _ENVELOPE_INTS:
        value = obj.pop(name, None)
        if value is not None and not _is_int(value):
            raise RecordError(
                f"'{name}' must be an integer, not {value!r}", path=path, line=line, seq=seq
            )
        envelope[name] = value
    return Record(seq, kind, obj, envelope["step"], envelope["rank"], envelope["ts"])


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Record]:
    """Stream the records of a JSON Lines file, checking that seq increases.

    Raises :class:`RecordError` naming the file and line of the first bad
    record; ``OSError`` when the file cannot be read.
    """
    for _line, record in read_jsonl_lines(path):
        yield record


def read_jsonl_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, Record]]:
    """Like :func:`read_jsonl`, also yielding each record's 1-based line number."""
    return JsonlReader(path).read(complete=True)


class JsonlReader:
    """The one JSON Lines reader: a file read from where the last call stopped.

    :func:`read_jsonl_lines` reads a whole file with it; a reader that
    follows a file another process appends to (the inspector's follow mode)
    calls :meth:`read` again and gets only the lines added since, with the
    same checks and the same errors.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._line = 0
        self._last: tuple[int, int] | None = None  # (seq, line) of the last record

    def read(self, *, complete: bool) -> Iterator[tuple[int, Record]]:
        """The records of the lines not read yet, with their line numbers.

        ``complete``: the file is whole, and a last line without its newline
        is a record; otherwise such a line is still being written and is
        left for the next call.
        """
        name = self.path
        with open(name, "rb") as f:
            f.seek(self._offset)
            for raw in f:
                if not complete and not raw.endswith(b"\n"):
                    return  # a line still being written
                self._offset += len(raw)
                self._line += 1
                lineno = self._line
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise RecordError(f"not UTF-8: {exc.reason}", path=name, line=lineno) from exc
                if not text.strip():
                    continue
                record = parse_line(text, path=name, line=lineno)
                last = self._last
                if last is not None and record.seq <= last[0]:
                    raise RecordError(
                        f"seq {record.seq} does not increase (line {last[1]} had seq {last[0]})",
                        path=name,
                        line=lineno,
                    )
                self._last = (record.seq, lineno)
                yield lineno, record


def dump_record(record: Record) -> str:
    """One record as a compact, standard JSON line (without the newline)."""
    return json.dumps(record.to_dict(), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def write_jsonl(records: Iterable[Record], out: str | os.PathLike[str] | IO[str]) -> int:
    """Write records as JSON Lines to a path or an open text file; returns the count."""
    if isinstance(out, (str, os.PathLike)):
        with open(out, "w", encoding="utf-8") as f:
            return write_jsonl(records, f)
    n = 0
    for record in records:
        out.write(dump_record(record))
        out.write("\n")
        n += 1
    return n
