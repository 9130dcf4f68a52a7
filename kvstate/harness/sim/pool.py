"""The device block pool, shaped like vLLM's ``BlockPool``.

Blocks have reference counts. A block whose count drops to zero goes to the
*tail* of the free queue and keeps its content and hash, so a later request
with the same prefix can take it back as a cache hit; allocation takes from
the *head*, evicting the least recently freed block first. Callers free a
table tail first (``reversed(table)``) so the shared prefix, freed last,
stays cached longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PoolError(RuntimeError):
    """A block was freed more often than it was held, or the pool is misused."""


class BlockPool:
    """``num_blocks`` blocks with ref counts, a free queue and a prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("a pool needs at least one block")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest prefix of ``hashes`` (a prefix-cache hit)."""
        hit = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def touch(self, blocks: Iterable[int]) -> None:
        """One more holder for each block; a free block leaves the free queue."""
        for block in blocks:
            if self.refs[block] == 0:
                self._free.pop(block, None)
            self.refs[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks from the head of the free queue, or None if too few are free.

        An allocated block loses its cached hash: its content is about to be
        overwritten.
        """
        if n > len(self._free):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None and self._cached.get(old) == block:
                del self._cached[old]
            self.block_hash[block] = None
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[int]) -> None:
        """Drop one holder of each block, in eviction order (pass tables tail first)."""
        for block in blocks:
            if self.refs[block] <= 0:
                raise PoolError(f"block {block} freed with no holder")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: bytes) -> None:
        """Mark a full block as holding the KV of ``block_hash`` (for later hits)."""
        self.block_hash[block] = block_hash
        self._cached.setdefault(block_hash, block)
