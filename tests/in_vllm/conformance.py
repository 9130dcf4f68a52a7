"""The conformance suite every connector adapter passes: :class:`AdapterContract`.

Runs inside a vLLM venv (``tests/test_vllm_adapters.py`` starts it there),
driving a real V1 ``Scheduler`` built by vLLM's own test helpers
(``tests/v1/kv_connector/unit/utils.py`` of the release's source tree, on
``$KVSTATE_VLLM_TREE``). A subclass names its adapter (:attr:`adapter`, a
:mod:`kvstate.vllm.registry` name), drives a short lifecycle of one of the
family's connectors (:meth:`drive`, returning what vLLM decided) and says
how to give the family a shape the adapter does not know
(:meth:`break_shape`). Each test runs with that adapter alone registered, in
a fresh :class:`~kvstate.vllm._process.ObservedProcess`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

import kvstate.vllm as kv
from kvstate.vllm import _install, _journals, registry
from kvstate.vllm._lifecycle import LifecycleObserver
from kvstate.vllm._process import ObservedProcess
from kvstate.vllm.adapter import Unrecognised
from replay.runs import group
from replay.verdict import replay

TREE = os.environ.get("KVSTATE_VLLM_TREE", "")


def vllm_test_utils() -> Any:
    """vLLM's ``tests/v1/kv_connector/unit/utils.py``, loaded by its path (the
    name ``tests`` is this repository's package)."""
    name = "vllm_kv_connector_unit_utils"
    if name not in sys.modules:
        path = Path(TREE) / "tests" / "v1" / "kv_connector" / "unit" / "utils.py"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not path.is_file():
            pytest.fail(f"vLLM's connector test helpers are not at {path} ($KVSTATE_VLLM_TREE)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def lifecycle(scheduler: Any, steps: int = 6, tokens: tuple[int, int] = (40, 32)) -> list[Any]:
    """Three requests (two sharing a prefix of ``tokens[1]``) through
    ``scheduler`` until they finish: what vLLM decided at each step (tokens
    scheduled, finished ids)."""
    utils = vllm_test_utils()
    create_request = utils.create_request

    block = scheduler.block_size if hasattr(scheduler, "block_size") else 16
    requests = [
        create_request(1, tokens[0], tokens[1], block_size=block, max_tokens=3),
        create_request(2, tokens[0], tokens[1], block_size=block, max_tokens=2),
        create_request(3, tokens[0] // 2, block_size=block, max_tokens=4),
    ]
    for request in requests:
        scheduler.add_request(request)
    decided: list[Any] = []
    for _ in range(steps):
        out = scheduler.schedule()
        running = [r for r in requests if r.request_id in out.num_scheduled_tokens]
        runner = utils.create_model_runner_output(running)
        finished = scheduler.update_from_output(out, runner)
        ends = sorted(
            (o.request_id, str(o.finish_reason))
            for engine in finished.values()
            for o in engine.outputs
            if o.finished
        )
        decided.append((sorted(out.num_scheduled_tokens.items()), ends))
    return decided


class AdapterContract:
    """What every adapter must do (see the module docstring)."""

    #: the adapter's name in kvstate.vllm.registry
    adapter: ClassVar[str]

    def drive(self) -> Any:
        """One short lifecycle of one of the family's connectors; what vLLM decided."""
        raise NotImplementedError

    def break_shape(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Give the family, in this vLLM, a shape the adapter does not know."""
        raise NotImplementedError

    @pytest.fixture
    def journals(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
        folder = tmp_path / "journals"
        monkeypatch.setattr(_install, "process", ObservedProcess())
        monkeypatch.setattr(_journals, "chosen_dir", folder)
        only = {self.adapter: registry.ADAPTERS[self.adapter]}
        monkeypatch.setattr(registry, "ADAPTERS", only)
        yield folder
        kv.finish()
        kv.uninstall()

    def _replayed(self, folder: Path) -> list[Any]:
        runs = group([str(folder)])
        assert runs, f"no journal in {folder}"
        return [replay(paths) for paths in runs.values()]

    # -- the contract ------------------------------------------------------------------

    def test_what_it_journals_beyond_journal_v1_is_in_the_contract(self) -> None:
        from kvstate.events import EVENT_TYPES

        adapter = registry.adapter_class(self.adapter)
        docs = (Path(__file__).resolve().parents[2] / "docs" / "events.md").read_text()
        for kind in adapter.additions:
            assert kind in EVENT_TYPES, kind
            assert f"`{kind}`" in docs, f"{kind} is not in docs/events.md"
        if adapter.protocol is not None:
            assert f'"{adapter.protocol}"' in docs

    def test_observed_vllm_decides_as_plain_and_its_journals_replay_clean(
        self, journals: Path
    ) -> None:
        plain = self.drive()
        kv.install()
        assert self.drive() == plain
        kv.finish()
        for result in self._replayed(journals):
            assert result.violations == [], [v.message for v in result.violations]
        assert _install.process.failures == []

    def test_uninstall_restores_every_method(self, journals: Path) -> None:
        kv.install()
        replaced = [(owner, name, getattr(owner, name)) for owner, name in kv.patched()]
        assert replaced, "the adapter patched nothing"
        kv.uninstall()
        for owner, name, patched in replaced:
            assert getattr(owner, name) is not patched, f"{owner.__name__}.{name} stays patched"

    def test_a_shape_it_does_not_know_is_left_alone_with_the_reason(
        self, journals: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self.break_shape(monkeypatch)
        adapter = registry.adapter_class(self.adapter)(_install.process)
        with pytest.raises(Unrecognised) as refused:
            adapter.recognise()
        assert str(refused.value)
        with pytest.raises(kv.UnsupportedVLLMError) as said:
            kv.install()
        assert str(refused.value) in str(said.value)
        assert list(kv.patched()) == []  # vLLM left as it was

    def test_a_failing_observer_ends_only_its_journal_and_never_reaches_vllm(
        self, journals: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        plain = self.drive()
        kv.install()

        def broken(self: Any) -> None:
            raise RuntimeError("a deliberately broken observer")

        monkeypatch.setattr(LifecycleObserver, "commit", broken)
        assert self.drive() == plain  # vLLM went on unchanged
        kv.finish()
        codes = {v.code.value for result in self._replayed(journals) for v in result.violations}
        assert codes == {"CRASH"}

    def test_finish_never_raises(self, journals: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        kv.install()
        self.drive()

        def broken(self: Any, **kw: Any) -> None:
            raise OSError("the disk is gone")

        monkeypatch.setattr(LifecycleObserver, "close", broken)
        assert set(kv.finish()) == {"verified", "poisoned", "missing"}
        assert _install.process.observers == []

    def test_a_forked_child_takes_none_of_its_parents_journals(self, journals: Path) -> None:
        kv.install()
        self.drive()
        assert _install.process.observers
        before = sorted(p.name for p in journals.rglob("*.db"))
        pid = os.fork()
        if pid == 0:  # the child: no observer of the parent's, and its finish() ends none
            held = bool(_install.process.observers)
            kv.finish()
            os._exit(1 if held else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sorted(p.name for p in journals.rglob("*.db")) == before
        kv.finish()  # the parent's journals were still its own to end
        for result in self._replayed(journals):
            assert result.violations == [], [v.message for v in result.violations]
