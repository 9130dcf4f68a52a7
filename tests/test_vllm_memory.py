"""The fingerprint audit reads KV bytes only through the tensors vLLM registered.

On a CUDA engine, Mooncake's token database hands out device pointers; read
from the CPU they kill the worker process, past any ``try``. A tensor that
is not in host memory here is torch's ``meta`` device: its ``data_ptr()`` is
0, so a raw read of it would crash this very test process.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvstate import Recorder  # noqa: E402
from kvstate.vllm.mooncake import _fingerprint, _memory  # noqa: E402
from kvstate.vllm.mooncake._memory import KvMemory, UnreadableMemory  # noqa: E402
from kvstate.vllm.mooncake._worker import WorkerObserver  # noqa: E402

BLOCK_BYTES = 64


def _cache(device: str) -> object:
    # 8 blocks of 64 bytes, as a KV cache tensor of int8
    if device == "meta":
        return torch.empty(8, BLOCK_BYTES, dtype=torch.int8, device="meta")
    return torch.arange(8 * BLOCK_BYTES, dtype=torch.int16).to(torch.int8).reshape(8, BLOCK_BYTES)


def _block(cache: object, block: int) -> tuple[list[int], list[int]]:
    base = cache.untyped_storage().data_ptr()  # type: ignore[attr-defined]
    return [base + block * BLOCK_BYTES], [BLOCK_BYTES]


def test_host_memory_is_read_in_place_and_matches_the_bytes() -> None:
    cache = _cache("cpu")
    memory = KvMemory.of({"layer.0": cache})
    assert memory.on_host
    for block in range(8):
        expected = _fingerprint.of_bytes(cache[block].numpy().tobytes())  # type: ignore[index]
        assert _fingerprint.of_segments(memory, *_block(cache, block)) == expected


def test_bytes_outside_every_registered_tensor_are_never_read() -> None:
    cache = _cache("cpu")
    memory = KvMemory([cache])
    addrs, _ = _block(cache, 7)
    with pytest.raises(UnreadableMemory, match="lie in no KV cache tensor"):
        list(memory.segments(addrs, [BLOCK_BYTES + 1]))  # one byte past the tensor
    with pytest.raises(UnreadableMemory):
        list(memory.segments([addrs[0] + 10 * BLOCK_BYTES], [1]))


def test_memory_not_on_the_host_is_read_through_torch_never_raw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = _cache("meta")
    memory = KvMemory.of({"layer.0": [cache]})
    assert not memory.on_host and memory.devices() == ["meta"]

    class Raw:
        def __mul__(self, size: int) -> object:
            raise AssertionError("a raw read of memory not on the host")

    monkeypatch.setattr(_memory.ctypes, "c_char", Raw())
    with pytest.raises(UnreadableMemory, match="on meta: NotImplementedError"):
        _fingerprint.of_segments(memory, *_block(cache, 3))


def _rank(memory: KvMemory | None, every: int = 1) -> WorkerObserver:
    recorder = Recorder.in_memory(block_size=16, world_size=1)
    return WorkerObserver(recorder, rank=0, fingerprint=True, every=every, memory=memory)


def _received(observer: WorkerObserver, cache: object, job: int = 0) -> None:
    db = SimpleNamespace(prepare_value_for_block=lambda block: _block(cache, block))
    thread = SimpleNamespace(token_databases=[db], block_size=16)
    meta = SimpleNamespace(
        _kvstate_job=job, _kvstate_gen=0, req_id="r", token_len_chunk=48, block_ids=[[1, 2, 3]]
    )
    observer.received(thread, meta)


def test_a_rank_whose_kv_cache_is_not_on_the_host_turns_its_audit_off_and_journals_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = _cache("meta")
    observer = _rank(KvMemory([cache]))
    with caplog.at_level(logging.WARNING, logger="kvstate.vllm"):
        _received(observer, cache)
    assert not observer.fingerprint and observer.requested == {0: {}}
    assert [e.event.kind for e in observer.recorder.entries][-1] == "job_received"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "fingerprint audit off" in line and "on meta" in line


def test_a_rank_on_the_host_fingerprints_each_block_of_the_job() -> None:
    cache = _cache("cpu")
    observer = _rank(KvMemory([cache]))
    _received(observer, cache)
    assert observer.fingerprint
    assert observer.requested[0] == {
        i: _fingerprint.of_bytes(cache[b].numpy().tobytes())  # type: ignore[index]
        for i, b in enumerate([1, 2, 3])
    }


def test_a_sampled_audit_fingerprints_the_jobs_whose_id_the_sample_divides() -> None:
    # install()'s default: one store job in eight; a job outside the sample
    # reads no block at all
    cache = _cache("cpu")
    observer = _rank(KvMemory([cache]), every=8)
    for job in range(17):
        _received(observer, cache, job)
    assert sorted(observer.requested) == [0, 8, 16]
    assert observer.fingerprint  # the audit is on; the others were never read


def test_a_sample_of_zero_is_refused() -> None:
    from kvstate.vllm import _install

    with pytest.raises(ValueError, match="fingerprint_every must be 1 or more"):
        _install.install(fingerprint_every=0)


def test_a_rank_whose_tensors_were_never_seen_reads_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstate.vllm"):
        observer = _rank(None)
    assert not observer.fingerprint
    assert "were not seen registered" in caplog.records[0].getMessage()
