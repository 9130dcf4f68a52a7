"""How a field of folded state is copied, declared with the field.

Time travel, the inspector and ledger equality copy the fold's state many
times over a long journal, so each field is copied by what it holds, not by
``copy.deepcopy``: immutable values are shared, containers copied one level,
state rows with their own ``copy()``. A state class declares each field's
copy in its metadata (``attrs.field(metadata=copied_by(ROWS))``) and
:func:`copied` walks the declaration: a new field is one line where it is
declared, and a field declared without one fails at the first copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

#: metadata: how the field is copied, a function of (value, the copy being made)
COPY = "kvstate.copy"

Copier = Callable[[Any, Any], Any]
T = TypeVar("T")


def SHARED(value: Any, _new: Any) -> Any:
    """Immutable (a number, a string, a tuple, an event): the copy shares it."""
    return value


def PLAIN(value: Any, _new: Any) -> Any:
    """A dict, list or set of immutable values: copied one level."""
    return type(value)(value)


def NESTED(value: dict[Any, Any], _new: Any) -> dict[Any, Any]:
    """A dict of dicts, lists or sets of immutable values: copied two levels."""
    return {key: type(inner)(inner) for key, inner in value.items()}


def ROWS(value: dict[Any, Any], _new: Any) -> dict[Any, Any]:
    """A dict of state rows: each row's own ``copy()``."""
    return {key: row.copy() for key, row in value.items()}


def EVOLVED(value: dict[Any, Any], _new: Any) -> dict[Any, Any]:
    """A dict of attrs rows of immutable fields: each a shallow attrs copy."""
    return {key: attrs.evolve(row) for key, row in value.items()}


def OWN(value: Any, _new: Any) -> Any:
    """A value with a ``copy()`` of its own."""
    return value.copy()


def copied_by(how: Copier) -> dict[str, Copier]:
    """The field metadata that declares how the field is copied."""
    return {COPY: how}


def copy_fields(source: Any, new: T, cls: type) -> T:
    """Set each field of ``cls`` on ``new`` to its declared copy from
    ``source``, in declaration order (a copier may read fields set before it)."""
    for field in attrs.fields(cls):
        how = field.metadata.get(COPY)
        if how is None:
            raise TypeError(f"{cls.__name__}.{field.name} declares no copy (kvstate._copying)")
        setattr(new, field.name, how(getattr(source, field.name), new))
    return new


def copied(source: T) -> T:
    """A copy of an attrs state value, each field as declared."""
    cls = type(source)
    return copy_fields(source, attrs.evolve(source), cls)  # type: ignore[misc]
