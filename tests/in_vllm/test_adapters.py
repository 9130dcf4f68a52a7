"""Every adapter of kvstate.vllm.registry against :class:`AdapterContract`, in vLLM's venv."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

import kvstate.vllm as kv
from kvstate.vllm import _install, registry
from kvstate.vllm.adapter import Adapter
from kvstate.vllm.generic import GenericAdapter
from tests.in_vllm.conformance import AdapterContract, lifecycle, vllm_test_utils

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def scheduler_with(
    connector: str, extra: dict[str, Any] | None = None, role: str = "kv_both"
) -> Any:
    """A real V1 Scheduler whose connector is ``connector``, built by vLLM's test helpers."""
    utils = vllm_test_utils()
    vllm_config = utils.create_vllm_config(
        kv_connector=connector, kv_role=role, kv_connector_extra_config=extra or {}
    )
    return utils.create_scheduler(vllm_config, num_blocks=64)


class TestGenericAdapter(AdapterContract):
    adapter = "generic"

    def drive(self) -> Any:
        with tempfile.TemporaryDirectory() as shared:
            return lifecycle(scheduler_with("ExampleConnector", {"shared_storage_path": shared}))

    def break_shape(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        monkeypatch.delattr(KVConnectorBase_V1, "update_connector_output")

    def test_the_wrapper_decides_as_its_inner_connector_and_is_journaled(
        self, journals: Any
    ) -> None:
        """kv_connector="JournaledConnector" around ExampleConnector: vLLM decides
        the same, the inner object is journaled (its class names the journal)."""
        plain = self.drive()
        with tempfile.TemporaryDirectory() as shared:
            extra = {"kvstate_connector": "ExampleConnector", "shared_storage_path": shared}
            utils = vllm_test_utils()
            config = utils.create_vllm_config(
                kv_connector="JournaledConnector", kv_connector_module_path="kvstate.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra,
            )  # fmt: skip
            wrapped = utils.create_scheduler(config, num_blocks=64)
            assert type(wrapped.connector).__name__ == "JournaledConnector"
            assert lifecycle(wrapped) == plain
        kv.finish()
        names = sorted(p.name for p in journals.glob("*.db"))
        assert names and all(n.startswith("ExampleConnector-scheduler-") for n in names)
        assert all(r.violations == [] for r in self._replayed(journals))

    @pytest.mark.parametrize("inner", ["ExampleConnector", "DecodeBenchConnector"])
    def test_the_wrapper_changes_no_hma_decision(self, journals: Any, inner: str) -> None:
        """vLLM decides HMA support from the class it loads by name: the wrapper
        of each kind answers as its inner connector, and the other refuses to start."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        plain = KVTransferConfig(kv_connector=inner, kv_role="kv_both")
        expected = KVConnectorFactory.supports_hma_config(plain)
        utils = vllm_test_utils()
        kinds: list[bool] = []
        for name in ("JournaledConnector", "JournaledHMAConnector"):
            wrapped = KVTransferConfig(
                kv_connector=name, kv_connector_module_path="kvstate.vllm", kv_role="kv_both",
                kv_connector_extra_config={"kvstate_connector": inner},
            )  # fmt: skip
            decided = KVConnectorFactory.supports_hma_config(wrapped)
            config = utils.create_vllm_config(
                kv_connector=name, kv_connector_module_path="kvstate.vllm", kv_role="kv_both",
                kv_connector_extra_config={"kvstate_connector": inner},
                disable_hybrid_kv_cache_manager=True,
            )  # fmt: skip
            if decided != expected:  # the other kind refuses to start, naming the right one
                with pytest.raises(ValueError, match="use kv_connector="):
                    KVConnectorFactory.get_connector_class(wrapped)(
                        config, KVConnectorRole.SCHEDULER, None
                    )
            kinds.append(decided == expected)
        assert kinds.count(True) == 1  # exactly one kind decides as the inner connector


class TestOffloadingAdapter(AdapterContract):
    adapter = "offloading"

    def drive(self) -> Any:
        # No block fills, so no store: a scheduler without workers leaves no job unreported.
        extra = {"cpu_bytes_to_use": 1 << 22}
        return lifecycle(scheduler_with("OffloadingConnector", extra), tokens=(12, 8))

    def break_shape(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler

        monkeypatch.delattr(scheduler.OffloadingConnectorScheduler, "build_connector_meta")


class _NoLookup:
    """The Mooncake store scheduler's lookup client, with no lookup server to ask."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        pass

    def lookup(self, *args: Any, **kw: Any) -> Any:
        return 0

    def discard(self, *args: Any) -> None:
        pass

    def reset(self) -> bool:
        return True


class TestMooncakeStoreAdapter(AdapterContract):
    adapter = "mooncake_store"

    @pytest.fixture(autouse=True)
    def no_lookup_server(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import scheduler

        monkeypatch.setattr(scheduler, "LookupKeyClient", _NoLookup)

    def drive(self) -> Any:
        extra = {"enable_lookup": False}
        return lifecycle(scheduler_with("MooncakeStoreConnector", extra, role="kv_consumer"))

    def break_shape(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker

        monkeypatch.delattr(worker.MooncakeStoreWorker, "get_finished")


# -- the contract fails a broken adapter ---------------------------------------------------


class LeakyAdapter(GenericAdapter):
    """Deliberately broken: its hook calls its observer outside the process's
    ``observe``, so an observer error reaches vLLM."""

    name = "leaky"

    def patch(self, found: Any) -> None:
        base, _ = found
        hooks = self.process.patches

        def init(original: Any, conn: Any, *args: Any, **kw: Any) -> None:
            original(conn, *args, **kw)
            role = kw.get("role", args[1] if len(args) > 1 else None)
            if getattr(role, "name", "") == "SCHEDULER":
                build = conn.build_connector_meta

                def build_connector_meta(scheduler_output: Any) -> Any:
                    meta = build(scheduler_output)
                    from kvstate.vllm._lifecycle import LifecycleObserver

                    LifecycleObserver.commit(None)  # type: ignore[arg-type]
                    return meta

                conn.__dict__["build_connector_meta"] = build_connector_meta

        hooks.around(base, "__init__", init)


@pytest.mark.broken
class TestLeakyAdapterFails(TestGenericAdapter):
    """Selected only with ``-m broken``: the contract must fail here."""

    adapter = "leaky"

    @pytest.fixture(autouse=True)
    def registered(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(registry.ADAPTERS, "leaky", f"{__name__}:LeakyAdapter")


def test_every_registered_adapter_has_a_contract_class() -> None:
    tested = {cls.adapter for cls in AdapterContract.__subclasses__()}
    assert set(registry.ADAPTERS) <= tested
    for name in registry.ADAPTERS:
        assert issubclass(registry.adapter_class(name), Adapter)
    assert _install.process is not None


class TestUnderMultiConnector:
    """vLLM's MultiConnector: each child observed as itself, a journal of its own."""

    def test_each_child_gets_a_journal_and_vllm_decides_the_same(
        self, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from kvstate.vllm import _journals
        from kvstate.vllm._process import ObservedProcess
        from replay.runs import group
        from replay.verdict import replay

        folder = tmp_path / "journals"
        monkeypatch.setattr(_install, "process", ObservedProcess())
        monkeypatch.setattr(_journals, "chosen_dir", folder)
        children = [
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "a")}},
            {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"},
        ]  # fmt: skip

        def drive() -> Any:
            return lifecycle(scheduler_with("MultiConnector", {"connectors": children}))

        plain = drive()
        kv.install()
        try:
            assert drive() == plain
        finally:
            kv.finish()
            kv.uninstall()
        names = sorted(p.name.split("-scheduler-")[0] for p in folder.glob("*.db"))
        assert names == ["DecodeBenchConnector", "ExampleConnector"]  # no MultiConnector journal
        runs = group([str(folder)])
        assert len(runs) == 2  # judged apart
        assert all(replay(paths).violations == [] for paths in runs.values())
