"""When the observer stops journaling a connector, and how it says so.

vLLM's own unit tests hand the connector objects of their own making: a
``SimpleNamespace`` where vLLM passes a ``SchedulerOutput`` or a
``NewRequestData``, a ``MagicMock`` where it passes a ``Request``, a KV
cache of several groups (a hybrid model's full and sliding-window layers)
where the contract has one block table per request. Journaling what it
read off such an object would put values in the journal that vLLM never
had, and replay would then report violations the run did not contain;
failing on it would end the journal with ``engine_crashed`` (CRASH), which
is as false. So the observer *stands down* for that connector: it writes
``observer_stood_down`` with the reason and ends the journal, and replay
reports ``UNFINISHED`` naming the reason (never clean: what followed was
not checked). vLLM's own work goes on unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvstate import build


class StandDown(Exception):
    """What vLLM handed the observer is not what it reads (see the module docstring)."""


def foreign(value: Any, expected: type, what: str) -> None:
    """Raise :class:`StandDown` unless ``value`` is an ``expected`` (vLLM's own class)."""
    if not isinstance(value, expected):
        raise StandDown(
            f"{what} is a {type(value).__name__}, not vLLM's {expected.__name__} "
            "(a test's hand-built object)"
        )


def foreign_items(values: Iterable[Any], expected: type, what: str) -> None:
    for value in values:
        foreign(value, expected, what)


def stand_down(observer: Any, reason: str) -> None:
    """End ``observer``'s journal with ``observer_stood_down``; it journals nothing more.

    ``observer`` is any of this package's observers: it has a ``recorder``,
    a ``step`` and a ``closed`` flag. A second call does nothing.
    """
    if observer.closed:
        return
    observer.closed = True
    observer.recorder.record(build.observer_stood_down(reason=reason), observer.step)
    observer.recorder.close()
