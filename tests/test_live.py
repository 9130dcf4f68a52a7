"""Live transfers against a real Mooncake master (started by the fixture):
block data through torch staging buffers, the store's semantics, and the
simulator's verdicts read back from Mooncake."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from kvstate.harness.live.master import MasterError, MooncakeMaster, existing_master
from kvstate.harness.live.mooncake import MooncakeStore
from kvstate.harness.live.torch_blocks import TorchBlocks
from kvstate.harness.sim import store as st
from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.content import block_hashes, full_block_kv
from kvstate.harness.sim.runtime import Simulation

BLOCK = 4096


@pytest.fixture(scope="module")
def client(mooncake_master):  # type: ignore[no-untyped-def]
    store = MooncakeStore(mooncake_master, segment_bytes=32 << 20)
    yield store
    store.close()


def test_real_block_data_round_trips_through_staging(client: MooncakeStore) -> None:
    memory = TorchBlocks(num_blocks=8, block_bytes=BLOCK, world_size=1)
    client.register(memory.staging_area(0))
    hashes = block_hashes(list(range(32)), 8)
    for block, h in zip((5, 2, 7), hashes, strict=False):
        memory.write(0, block, full_block_kv(h, 0, BLOCK))
    views = memory.stage(0, [5, 2, 7])  # the DMA: gather into the registered staging area
    keys = [f"rt@{h.hex()}" for h in hashes[:3]]
    assert client.batch_put_from(keys, views) == [0, 0, 0]
    buffers = [bytearray(BLOCK) for _ in keys]
    assert client.batch_get_into(keys, [memoryview(b) for b in buffers]) == [BLOCK] * 3
    assert [bytes(b) for b in buffers] == [full_block_kv(h, 0, BLOCK) for h in hashes[:3]]


def test_a_put_of_an_existing_key_keeps_the_first_value(client: MooncakeStore) -> None:
    first, second = bytearray(b"A" * 64), bytearray(b"B" * 64)
    assert client.batch_put_from(["dedup"], [memoryview(first)]) == [0]
    assert client.batch_put_from(["dedup"], [memoryview(second)]) == [0]
    out = bytearray(64)
    client.batch_get_into(["dedup"], [memoryview(out)])
    assert out == first
    assert client.batch_exist(["dedup", "absent"]) == [True, False]
    assert client.batch_get_into(["absent"], [memoryview(bytearray(64))]) == [st.OBJECT_NOT_FOUND]


def test_a_tiny_segment_fills_up_with_out_of_space_codes(mooncake_master) -> None:  # type: ignore[no-untyped-def]
    # a separate master, so no other client's segment can take the overflow
    with MooncakeMaster() as address:
        small = MooncakeStore(address, segment_bytes=16 << 20)  # the smallest it accepts
        try:
            data = bytearray(1 << 20)
            keys = [f"big{i}" for i in range(24)]
            codes = small.batch_put_from(keys, [memoryview(data)] * len(keys))
            assert st.NO_AVAILABLE_HANDLE in codes and codes[0] == 0
        finally:
            small.close()


def test_closed_client_refuses_instead_of_crashing(mooncake_master) -> None:  # type: ignore[no-untyped-def]
    store = MooncakeStore(mooncake_master, segment_bytes=16 << 20)
    store.close()
    store.close()  # idempotent
    with pytest.raises(st.StoreClosed):
        store.batch_exist(["x"])


def test_master_is_started_on_free_ports_and_stopped() -> None:
    master = MooncakeMaster()
    address = master.start()
    port = urlparse(address.metadata_url).port
    assert port is not None and master.process is not None
    process = master.process
    master.stop()
    assert process.poll() is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the metadata port still answers after stop()")
    with pytest.raises(MasterError, match="no metadata server"):
        existing_master(address.metadata_url, address.rpc_address)


def test_legacy_poisons_mooncake_and_kvstate_does_not(mooncake_master) -> None:  # type: ignore[no-untyped-def]
    results = {}
    for policy in ("legacy", "kvstate"):
        with MooncakeMaster() as address:  # a fresh store per policy
            config = SimConfig(policy=policy, requests=64, block_bytes=1024, seed=1)
            memory = TorchBlocks(config.blocks, config.block_bytes, config.world_size)
            stores = [MooncakeStore(address, segment_bytes=32 << 20) for _ in range(2)]
            try:
                for rank, store in enumerate(stores):
                    store.register(memory.staging_area(rank))
                sim = Simulation(config, stores=stores, memory=memory)
                results[policy] = sim.run()
            finally:
                for store in stores:
                    store.close()
    legacy, fixed = results["legacy"], results["kvstate"]
    # every stored key was read back from Mooncake by the audit
    assert legacy.keys_stored > 0 and fixed.keys_stored > 0
    assert legacy.poisoned_keys > 0 and "POISONED_KEY" in legacy.violations
    assert (fixed.poisoned_keys, fixed.wrong_kv_requests, fixed.violations) == (0, 0, {})


@pytest.mark.parametrize("store", ["mooncake", "memory"])
def test_demo_command(tmp_path, capsys, store: str) -> None:  # type: ignore[no-untyped-def]
    from replay.cli import main

    out = tmp_path / "demo"
    argv = [
        "demo",
        "--out",
        str(out),
        "--requests",
        "96",
        "--block-bytes",
        "1024",
        "--store",
        store,
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for text in ("legacy policy", "kvstate policy", "poisoned keys", "requests that read wrong KV"):
        assert text in printed
    assert ("local Mooncake master" in printed) == (store == "mooncake")
    assert main(["replay", "--json", str(out / "kvstate.db")]) == 0
    capsys.readouterr()
    assert main(["replay", "--json", str(out / "legacy.db")]) == 1
    found = json.loads(capsys.readouterr().out)["violations"]
    first_req = next(v["req"] for v in found if "req" in v)
    # the suggested timeline is of the request the first violation names
    suggested = f"kvstate timeline {out / 'legacy.db'} --req {first_req}"
    assert suggested in " ".join(printed.split()), printed[-600:]
    assert main(argv) == 2  # refuses to overwrite the journals


def test_demo_against_an_existing_master(tmp_path, capsys, mooncake_master) -> None:  # type: ignore[no-untyped-def]
    from replay.cli import main

    argv = [
        "demo", "--out", str(tmp_path / "d"), "--requests", "96", "--block-bytes", "1024",
        "--master-url", mooncake_master.metadata_url, "--master-rpc", mooncake_master.rpc_address,
    ]  # fmt: skip
    assert main(argv) == 0
    assert f"the Mooncake master at {mooncake_master.rpc_address}" in capsys.readouterr().out
    bad = ["demo", "--out", str(tmp_path / "e"), "--master-url", "http://127.0.0.1:1/metadata",
           "--master-rpc", "127.0.0.1:1"]  # fmt: skip
    assert main(bad) == 2
    assert "no metadata server answers" in capsys.readouterr().err
