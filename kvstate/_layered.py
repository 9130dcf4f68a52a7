"""A set that only grows, copied in constant time.

The ledger remembers which findings it has reported once (a set that grows
with every violation of a journal). Time travel copies the ledger dozens of
times; copying that set each time would cost memory in proportion to the
history, per snapshot. Here a copy freezes the current layer, shared by
original and copy, and both add to new layers of their own. Layers are
merged every few copies so lookups stay short.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

#: frozen layers kept before they are merged into one
_MAX_LAYERS = 8


class LayeredSet:
    """``add`` and ``in``, like a set; :meth:`copy` shares what is already in it."""

    __slots__ = ("_frozen", "_own")

    def __init__(self) -> None:
        self._own: set[Hashable] = set()
        self._frozen: tuple[frozenset[Hashable], ...] = ()

    def add(self, item: Hashable) -> None:
        self._own.add(item)

    def __contains__(self, item: object) -> bool:
        if item in self._own:
            return True
        return any(item in layer for layer in self._frozen)

    def __iter__(self) -> Iterator[Hashable]:
        seen: set[Hashable] = set(self._own)
        for layer in self._frozen:
            seen.update(layer)
        return iter(seen)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayeredSet):
            return NotImplemented
        return set(self) == set(other)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def copy(self) -> LayeredSet:
        if self._own:
            frozen = (*self._frozen, frozenset(self._own))
            if len(frozen) > _MAX_LAYERS:
                frozen = (frozenset().union(*frozen),)
            self._frozen, self._own = frozen, set()
        new = LayeredSet()
        new._frozen = self._frozen
        return new
