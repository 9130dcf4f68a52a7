"""What a record's payload may hold: the values JSON and msgpack share.

A journal is read by tools that print JSON, pack msgpack and write SQLite
integers. A value any of them cannot carry faithfully (a byte string, a NaN,
an integer beyond 64 bits, a string with a lone surrogate, nesting deeper
than any record means) is refused where it is read, with the record's
location, instead of failing later in a writer with a traceback.
"""

from __future__ import annotations

from typing import Any

#: the integer range every reader and writer shares (SQLite is signed 64-bit)
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
#: nesting deeper than this means nothing in a journal record
MAX_DEPTH = 32
#: digits of the longest integer literal that can be in range
_MAX_DIGITS = len(str(INT_MIN))


def problem(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` cannot be part of a record, or None when it can."""
    kind = type(value)
    if kind is str:
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "a string holds a lone surrogate (not valid UTF-8)"
        return None
    if kind is int:
        if INT_MIN <= value <= INT_MAX:
            return None
        return f"integer {_abbreviate(value)} is outside the signed 64-bit range"
    if kind is bool or value is None:
        return None
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            return f"{value} is not a JSON number"
        return None
    if depth >= MAX_DEPTH:
        return f"values nested deeper than {MAX_DEPTH} levels"
    if kind is list or kind is tuple:
        for item in value:
            found = problem(item, depth + 1)
            if found:
                return found
        return None
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return f"a map key is {type(key).__name__}, not a string"
            found = problem(key, depth + 1) or problem(item, depth + 1)
            if found:
                return found
        return None
    if kind in (bytes, bytearray):
        return "binary data, which JSON cannot carry"
    return f"a value of type {kind.__name__}"


def payload_problem(fields: dict[str, Any]) -> str | None:
    """:func:`problem` for a decoded payload map, fast on the shapes records have.

    Replay runs this for every record. Most values are short strings, small
    integers, booleans and flat lists of them; those are checked inline, and
    anything else goes through :func:`problem` as before.
    """
    for key, value in fields.items():
        kind = type(key)
        if kind is not str:
            return f"a map key is {kind.__name__}, not a string"
        if not key.isascii():
            found = problem(key, 1)
            if found:
                return found
        kind = type(value)
        if kind is int:
            if INT_MIN <= value <= INT_MAX:
                continue
        elif kind is str:
            if value.isascii():
                continue
        elif kind is bool or value is None:
            continue
        elif kind is list:
            for item in value:
                if type(item) is int and INT_MIN <= item <= INT_MAX:
                    continue
                if type(item) is str and item.isascii():
                    continue
                break
            else:
                continue
        found = problem(value, 1)
        if found:
            return found
    return None


def parse_int(text: str) -> int:
    """``json.loads``' integer hook: refuses literals outside the 64-bit range
    before converting them (Python refuses more than 4300 digits anyway)."""
    if len(text) > _MAX_DIGITS:
        raise ValueError(f"integer {text[:12]}... is outside the signed 64-bit range")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"integer {text} is outside the signed 64-bit range")
    return value


def parse_constant(name: str) -> Any:
    """``json.loads``' hook for NaN and Infinity, which standard JSON has not."""
    raise ValueError(f"{name} is not standard JSON")


def _abbreviate(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
