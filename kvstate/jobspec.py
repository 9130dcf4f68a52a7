"""What a rank knows about a job, from the scheduler's metadata: :class:`JobSpec`."""

from __future__ import annotations

from collections.abc import Iterable

import attrs


def _strings(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(keys)


@attrs.frozen(slots=True)
class JobSpec:
    """What a rank knows about a job, from the scheduler's metadata."""

    job: int
    req: str
    gen: int
    keys: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    parent: str | None = None
    #: a worker does not see the scheduler's journal; chains omit the enqueue
    enqueued_seq: None = None
