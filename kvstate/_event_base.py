"""The base of every event kind: the field types, :class:`Event` and the registry.

:mod:`kvstate.events` declares journal v1's kinds on this base and
:mod:`kvstate.tier_events` the additions for connectors that load; both
register into :data:`EVENT_TYPES`, which every reader builds its tables from.
Kept apart so that neither kinds module imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import msgspec

JOURNAL_VERSION = 1

SIDE_JOURNAL = "journal"
SIDE_SCHEDULER = "scheduler"
SIDE_WORKER = "worker"
SIDE_AUDIT = "audit"


#: ids and counts are signed 64-bit integers on disk
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
#: the largest ``world_size`` a journal can mean: replay never loops over
#: declared ranks, but a bound keeps reports and tools honest
MAX_WORLD_SIZE = 1 << 16
#: the largest ``block_size`` (tokens per block) a journal can mean
MAX_BLOCK_SIZE = 1 << 24

# -- the field types: each is the one definition of what a field may hold ----------

Id = Annotated[int, msgspec.Meta(ge=0, le=INT_MAX)]
Ids = tuple[Id, ...]
Strings = tuple[str, ...]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)]
BlockSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
Mode = Literal["append", "replace"]
SkipReason = Literal["stale", "pressure", "empty", "error"]
#: a descriptive value (a digest, an engine name): any JSON scalar, finite
Scalar = Union[str, int, float, bool, None]  # noqa: UP007 (evaluated at run time on 3.10)
#: a prompt's block hash: vLLM's are 64-bit integers or hex strings
Hashes = tuple[str | Annotated[int, msgspec.Meta(ge=INT_MIN, le=INT_MAX)], ...]


def _finite(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if type(value) is float and not math.isfinite(value):
            raise ValueError(f"'{name}' must be a finite number, not {value!r}")


# -- the base class and the registry -------------------------------------------------

EVENT_TYPES: dict[str, type[Event]] = {}


class Event(
    msgspec.Struct,
    frozen=True,
    gc=False,
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=True,
):
    """Base of every event kind. ``kind`` and ``side`` are class constants."""

    kind: ClassVar[str] = ""
    side: ClassVar[str] = ""
    #: payload fields in declaration order (everything but ``rank`` and ``extra``)
    payload_fields: ClassVar[tuple[str, ...]] = ()
    #: payload fields that must be present in an input record
    required_fields: ClassVar[tuple[str, ...]] = ()
    #: optional payload fields and their defaults (omitted from output when default)
    optional_fields: ClassVar[dict[str, Any]] = {}

    # Stored under a name no record field can take ("kvstate:extra"), so an
    # input field called "extra" is an extra like any other.
    extra: dict[str, Any] | None = msgspec.field(default=None, name="kvstate:extra")

    def __copy__(self) -> Event:
        return self  # immutable: a copy would be the same value

    def __deepcopy__(self, memo: dict[int, Any]) -> Event:
        return self


E = TypeVar("E", bound="Event")


def _kind(name: str, side: str) -> Callable[[type[E]], type[E]]:
    """Register an event class under its journal kind name."""

    def register(cls: type[E]) -> type[E]:
        cls.kind = name
        cls.side = side
        fields = [f for f in msgspec.structs.fields(cls) if f.name not in ("extra", "rank")]
        nodefault = msgspec.NODEFAULT
        cls.payload_fields = tuple(f.name for f in fields)
        cls.required_fields = tuple(f.name for f in fields if f.default is nodefault)
        cls.optional_fields = {f.name: f.default for f in fields if f.default is not nodefault}
        EVENT_TYPES[name] = cls
        return cls

    return register
