"""A set that may say yes wrongly, never no wrongly, in a few bits per member.

Parking (:mod:`kvstate._parking`) asks, for every id a record names that is
not in memory, whether it was parked: almost always it is a new id, and
the answer "certainly not" must not cost an archive lookup (for a
:class:`~kvstate.spill.SpillArchive`, a SQL query). Keeping every parked id
in a Python set would answer exactly, but costs about a hundred bytes an id:
memory would grow with history, which parking exists to prevent. This Bloom
filter costs about ten bits an id (128 KiB up to 100k ids, then doubling);
a wrong "maybe" (one or two in a hundred) costs one lookup that finds
nothing.

Members are never removed (an id taken out of the archive leaves a "maybe"
behind), and a copy may share the bits with its original: both only add, so
each sees at worst the other's ids as "maybe". The archive stays the truth.
"""

from __future__ import annotations

from collections.abc import Hashable

#: bits of the first filter (128 KiB); each next one is twice as large
_FIRST_BITS = 1 << 20
#: members per filter before the next: about 10 bits each, k = 4, ~1% wrong "maybe"
_BITS_PER_MEMBER = 10
_SALT = 0x9E3779B9


class _Filter:
    __slots__ = ("bits", "capacity", "count", "mask")

    def __init__(self, size: int) -> None:
        self.bits = bytearray(size // 8)
        self.mask = size - 1
        self.capacity = size // _BITS_PER_MEMBER
        self.count = 0

    def has(self, h1: int, h2: int) -> bool:
        bits, mask = self.bits, self.mask
        # k = 4 positions by double hashing, written out: this runs for every
        # id a record names that is not in memory
        p = h1 & mask
        if not bits[p >> 3] & (1 << (p & 7)):
            return False
        p = (h1 + h2) & mask
        if not bits[p >> 3] & (1 << (p & 7)):
            return False
        p = (h1 + 2 * h2) & mask
        if not bits[p >> 3] & (1 << (p & 7)):
            return False
        p = (h1 + 3 * h2) & mask
        return bool(bits[p >> 3] & (1 << (p & 7)))

    def set(self, h1: int, h2: int) -> None:
        bits, mask = self.bits, self.mask
        for i in range(4):
            p = (h1 + i * h2) & mask
            bits[p >> 3] |= 1 << (p & 7)
        self.count += 1


class MaybeSet:
    """``add`` and ``in`` (True: perhaps a member; False: certainly not)."""

    __slots__ = ("_filters",)

    def __init__(self) -> None:
        self._filters = [_Filter(_FIRST_BITS)]

    def add(self, item: Hashable) -> None:
        top = self._filters[-1]
        if top.count >= top.capacity:  # grow by a larger filter; the old ones stay
            top = _Filter((top.mask + 1) * 2)
            self._filters.append(top)
        top.set(hash(item), hash((item, _SALT)) | 1)

    def __contains__(self, item: object) -> bool:
        h1, h2 = hash(item), hash((item, _SALT)) | 1
        return any(f.has(h1, h2) for f in self._filters)
