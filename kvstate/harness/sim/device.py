"""Block memory: what the forward pass writes and a store job's DMA reads.

One ``[num_blocks, block_bytes]`` area per rank (that rank's shard of every
block). :class:`HostBlocks` keeps it in a bytearray; the live runtime's
:class:`kvstate.harness.live.TorchBlocks` keeps it in a torch tensor (on CUDA when
there is one) with the same methods.

``stage`` is the DMA: it copies a job's blocks into the rank's staging area
and returns one view per block, which the store reads from (zero-copy for a
store that registered the staging area). The views stay valid until the
rank's next ``stage``: one sending thread per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class BlockMemory(Protocol):
    block_bytes: int

    def write(self, rank: int, block: int, data: bytes) -> None: ...

    def stage(self, rank: int, blocks: Sequence[int]) -> list[memoryview]: ...


class HostBlocks:
    """Every rank's block shards in host memory."""

    def __init__(self, num_blocks: int, block_bytes: int, world_size: int) -> None:
        self.block_bytes = block_bytes
        self._shards = [bytearray(num_blocks * block_bytes) for _ in range(world_size)]
        self._staging = [bytearray(num_blocks * block_bytes) for _ in range(world_size)]

    def write(self, rank: int, block: int, data: bytes) -> None:
        start = block * self.block_bytes
        self._shards[rank][start : start + self.block_bytes] = data

    def stage(self, rank: int, blocks: Sequence[int]) -> list[memoryview]:
        shard, staging, size = self._shards[rank], self._staging[rank], self.block_bytes
        views = []
        for i, block in enumerate(blocks):
            staging[i * size : (i + 1) * size] = shard[block * size : (block + 1) * size]
            views.append(memoryview(staging)[i * size : (i + 1) * size])
        return views
