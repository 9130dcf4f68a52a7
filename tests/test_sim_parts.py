"""The simulator's parts: the block pool, the in-memory store, fingerprints."""

from __future__ import annotations

import pytest

from kvstate.harness.sim import store as st
from kvstate.harness.sim.content import block_hashes, full_block_kv, partial_block_kv
from kvstate.harness.sim.pool import BlockPool, PoolError


def test_pool_allocates_from_the_head_and_frees_to_the_tail() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1], [2, 3]) and pool.allocate(1) is None
    pool.free_blocks(reversed(a))  # tail first: block 1 is evicted before block 0
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) == [0]


def test_freed_block_with_a_hash_is_a_cache_hit_not_a_reuse() -> None:
    pool = BlockPool(3)
    [block] = pool.allocate(1)
    pool.cache(block, b"h0")
    pool.free_blocks([block])
    assert pool.cached_prefix([b"h0", b"h1"]) == [block]
    pool.touch([block])  # the hit takes it back out of the free queue
    assert pool.refs[block] == 1 and pool.num_free == 2
    pool.free_blocks([block])
    pool.allocate(3)  # reused for new content: the hash is forgotten
    assert pool.cached_prefix([b"h0"]) == []


def test_pool_refuses_to_free_a_block_twice() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free_blocks([block])
    with pytest.raises(PoolError):
        pool.free_blocks([block])


def test_memory_store_keeps_the_first_value_and_fills_up() -> None:
    store = st.MemoryStore(capacity_bytes=8)
    assert store.batch_put_from(["a"], [memoryview(b"1111")]) == [st.OK]
    assert store.batch_put_from(["a"], [memoryview(b"2222")]) == [st.OK]
    out = bytearray(4)
    assert store.batch_get_into(["a"], [memoryview(out)]) == [4] and out == b"1111"
    codes = store.batch_put_from(["b", "c"], [memoryview(b"3333"), memoryview(b"4444")])
    assert codes == [st.OK, st.NO_AVAILABLE_HANDLE]
    assert store.batch_exist(["a", "b", "c"]) == [True, True, False]
    assert store.batch_get_into(["c"], [memoryview(bytearray(4))]) == [st.OBJECT_NOT_FOUND]
    assert store.remove("a") == st.OK and store.remove("a") == st.OBJECT_NOT_FOUND


def test_memory_store_raises_after_close() -> None:
    store = st.MemoryStore()
    store.close()
    with pytest.raises(st.StoreClosed):
        store.batch_exist(["a"])


def test_block_hashes_chain_the_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([1, 2, 3, 4, 0, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], 4, a)[:2] == a


def test_fingerprints_tell_blocks_and_ranks_apart() -> None:
    h = block_hashes([1, 2, 3, 4], 4)[0]
    assert full_block_kv(h, 0, 32) == full_block_kv(h, 0, 32)
    assert full_block_kv(h, 0, 32) != full_block_kv(h, 1, 32)
    assert partial_block_kv(b"", [1, 2, 3], 0, 32) != full_block_kv(h, 0, 32)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("store-down@٣", "not a whole number"),  # str.isdigit() takes Arabic-Indic digits
        ("put-fail=0.1,put-fail=0.2", "given twice"),  # the last one used to win silently
        ("put-fail=1e-400", "not a rate"),  # underflowed to 0: no fault, no word
        ("evict=nan", "not a rate"),
        ("no-space=1.5", "not a rate"),
    ],
)
def test_a_fault_spec_is_read_exactly_or_refused(spec: str, why: str) -> None:
    from kvstate.harness.sim.faults import Faults

    with pytest.raises(ValueError, match=why):
        Faults.parse(spec)


def test_fault_specs_as_documented_are_read() -> None:
    from kvstate.harness.sim.faults import Faults

    got = Faults.parse("put-fail=0.2, evict=.5,store-down@12,no-space=1")
    assert (got.put_fail, got.evict, got.no_space, got.store_down) == (0.2, 0.5, 1.0, 12)
