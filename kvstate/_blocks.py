"""Physical blocks in the fold: holders (``refs``) and content epochs.

A block's epoch changes exactly when a free block is handed to a table and
not offered as a cache hit: whatever it held before may be overwritten from
then on. A job records the epochs of the blocks it reads at enqueue; a
transfer that sees another epoch read someone else's KV (POISONED_READ).
Dropping a block nobody holds is REFCOUNT_UNDERFLOW.
"""

from __future__ import annotations

from .state import BlockState
from .violations import Code, Violation, finding

Blocks = dict[int, BlockState]


def block(blocks: Blocks, number: int) -> BlockState:
    """The state of block ``number``, created free at epoch 0 when first named."""
    state = blocks.get(number)
    if state is None:
        state = blocks[number] = BlockState(number)
    return state


def assign(blocks: Blocks, number: int, seq: int, cached: bool, holder: str) -> None:
    """A table takes a block; a free block not offered as a cache hit gets a new epoch."""
    state = block(blocks, number)
    if state.refs == 0 and not cached:
        state.epoch += 1
        state.epoch_seq = seq
        state.epoch_holder = holder
        state.prior_free_seq = state.freed_seq
    state.refs += 1


def drop(blocks: Blocks, number: int, seq: int, out: list[Violation], why: str) -> None:
    """A holder lets go of a block; the last one frees it."""
    state = block(blocks, number)
    if state.refs == 0:
        why = f"{why} drops block {number}, which has no holder left"
        out.append(finding(Code.REFCOUNT_UNDERFLOW, seq, why, state.freed_seq, block=number))
        return
    state.refs -= 1
    if state.refs == 0:
        state.freed_seq = seq
