"""A set that may say yes wrongly, never no wrongly, in a few bits per member.

Parking (:mod:`kvstate._parking`) asks, for every id a record names that is
not in memory, whether it was parked: almost always it is a new id, and
the answer "certainly not" must not cost an archive lookup (for a
:class:`~kvstate.spill.SpillArchive`, a SQL query). Keeping every parked id
in a Python set would answer exactly, but costs about a hundred bytes an id:
memory would grow with history, which parking exists to prevent. This Bloom
filter costs about ten bits an id; a wrong "maybe" (about one in a hundred)
costs one lookup that finds nothing.

Members are never removed (an id taken out of the archive leaves a "maybe"
behind), and a copy may share the bits with its original: both only add, so
each sees at worst the other's ids as "maybe". The archive stays the truth.
"""

from __future__ import annotations

from collections.abc import Hashable

#: bits of the first filter; each next one is twice as large
_FIRST_BITS = 1 << 16
#: members per filter before the next: about 10 bits each, k = 4, ~1% wrong "maybe"
_BITS_PER_MEMBER = 10
_K = 4


class _Filter:
    __slots__ = ("bits", "capacity", "count", "mask")

    def __init__(self, size: int) -> None:
        self.bits = bytearray(size // 8)
        self.mask = size - 1
        self.capacity = size // _BITS_PER_MEMBER
        self.count = 0


class MaybeSet:
    """``add`` and ``in`` (True: perhaps a member; False: certainly not)."""

    __slots__ = ("_filters",)

    def __init__(self) -> None:
        self._filters = [_Filter(_FIRST_BITS)]

    @staticmethod
    def _positions(item: Hashable, mask: int) -> list[int]:
        h1 = hash(item)
        h2 = hash((item, 0x9E3779B9)) | 1
        return [(h1 + i * h2) & mask for i in range(_K)]

    def add(self, item: Hashable) -> None:
        top = self._filters[-1]
        if top.count >= top.capacity:  # grow by a larger filter; the old ones stay
            top = _Filter((top.mask + 1) * 2)
            self._filters.append(top)
        bits = top.bits
        for p in self._positions(item, top.mask):
            bits[p >> 3] |= 1 << (p & 7)
        top.count += 1

    def __contains__(self, item: object) -> bool:
        for f in self._filters:
            bits = f.bits
            if all(bits[p >> 3] & (1 << (p & 7)) for p in self._positions(item, f.mask)):
                return True
        return False

    def __bool__(self) -> bool:
        return any(f.count for f in self._filters)

    @property
    def nbytes(self) -> int:
        """Memory held by the bits."""
        return sum(len(f.bits) for f in self._filters)
