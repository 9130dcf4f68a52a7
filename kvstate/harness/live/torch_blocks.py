"""Block memory in torch tensors: the device pool and the DMA into staging.

Each rank's shard of the pool is a ``uint8`` tensor ``[num_blocks,
block_bytes]`` on CUDA when available, else on the CPU. A store job's DMA
(:meth:`TorchBlocks.stage`) gathers its blocks into the rank's host staging
tensor, which is registered with the store so the put reads it without a
copy. On CUDA the staging tensor is pinned and the gather runs on a separate
stream that first waits on the event recorded after the step's writes, as
the connector waits on ``current_event`` before reading KV the forward pass
may still be writing; on the CPU the same code path copies synchronously.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any


class TorchBlocks:
    """Every rank's block shards as torch tensors, with a staging area per rank."""

    def __init__(
        self, num_blocks: int, block_bytes: int, world_size: int, device: str | None = None
    ) -> None:
        import torch

        self.torch = torch
        self.block_bytes = block_bytes
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        cuda = self.device.startswith("cuda")
        self.shards = [
            torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(world_size)
        ]
        self.staging = [
            torch.zeros(num_blocks, block_bytes, dtype=torch.uint8, pin_memory=cuda)
            for _ in range(world_size)
        ]
        self._streams: list[Any] = [torch.cuda.Stream() for _ in range(world_size)] if cuda else []
        self._written: list[Any] = [None] * world_size  # the event after the last write
        # Buffer-protocol views of each staging row, over the tensor's own memory.
        self._views = [self._row_views(t, num_blocks) for t in self.staging]

    def _row_views(self, tensor: Any, rows: int) -> list[memoryview]:
        size = self.block_bytes
        area = (ctypes.c_char * (rows * size)).from_address(tensor.data_ptr())
        whole = memoryview(area).cast("B")
        return [whole[i * size : (i + 1) * size] for i in range(rows)]

    def staging_area(self, rank: int) -> memoryview:
        """The whole staging area of a rank, to register with its store client."""
        rows = self._views[rank]
        return memoryview(
            (ctypes.c_char * (len(rows) * self.block_bytes)).from_address(
                self.staging[rank].data_ptr()
            )
        ).cast("B")

    def write(self, rank: int, block: int, data: bytes) -> None:
        """The forward pass writes one block's KV."""
        torch = self.torch
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.shards[rank][block].copy_(src, non_blocking=False)
        if self._streams:
            event = torch.cuda.Event()
            event.record()  # on the compute stream, after the write
            self._written[rank] = event

    def stage(self, rank: int, blocks: Sequence[int]) -> list[memoryview]:
        """The DMA: gather ``blocks`` into the staging area; one view per block."""
        torch = self.torch
        n = len(blocks)
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        target = self.staging[rank][:n]
        if self._streams:
            stream = self._streams[rank]
            if self._written[rank] is not None:
                stream.wait_event(self._written[rank])
            with torch.cuda.stream(stream):
                gathered = self.shards[rank].index_select(0, index)
                target.copy_(gathered, non_blocking=True)
            stream.synchronize()  # dma_done is recorded once the bytes are on the host
        else:
            torch.index_select(self.shards[rank], 0, index, out=target)
        return self._views[rank][:n]
