"""The vLLM observer never breaks vLLM: how observers are made, in this
process, without vLLM (a stub stands for the installed connector).

vLLM's own scheduler tests build many connectors in one process; an engine
restarted in-process builds a second; a watchdog may end the journals while
the engine goes on. None of these may raise into vLLM or start a journal in
the middle of a request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstate.vllm import _install, _journals
from kvstate.vllm._compat import Connector
from kvstate.vllm._process import ObservedProcess
from kvstate.vllm.adapter import Adapter
from kvstate.vllm.mooncake._hooks import SchedulerHooks, WorkerHooks
from replay.runs import run_of


@pytest.fixture
def observed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """kvstate.vllm as if installed (journals in a fresh folder), reset afterwards."""
    folder = tmp_path / "journals"
    process = ObservedProcess()
    process.connector = Connector("0.32.0", "store-jobs", {})
    monkeypatch.setattr(_install, "process", process)
    monkeypatch.setattr(_journals, "chosen_dir", folder)
    yield folder
    _install.finish()


def _scheduler_of(sched: object) -> object:
    """The Mooncake store adapter's observer of ``sched`` (made on first use)."""
    process = _install.process
    assert process.connector is not None
    return SchedulerHooks(process, process.connector).observer(sched)


def _worker_of(thread: object) -> object:
    """The Mooncake store adapter's observer of ``thread``'s rank."""
    process = _install.process
    assert process.connector is not None
    return WorkerHooks(process, process.connector).observer(thread)


def scheduler() -> SimpleNamespace:
    """What the observer reads of a MooncakeStoreScheduler built by object.__new__."""
    return SimpleNamespace(_block_size=16, _num_workers=1)


def test_every_connector_of_a_process_gets_a_journal_of_its_own(observed: Path) -> None:
    first, second = scheduler(), scheduler()
    one = _scheduler_of(first)
    two = _scheduler_of(second)
    assert one is not None and two is not None and one is not two
    assert _scheduler_of(first) is one  # made once per connector
    _install.finish()
    names = sorted(p.name for p in observed.glob("*.db"))
    assert len(names) == 2 and all(n.startswith("scheduler-") for n in names)
    assert sum(n.endswith("-2.db") for n in names) == 1
    runs = {run_of(str(observed / n)) for n in names}
    assert len(runs) == 2  # two connectors: two runs, never merged as copies
    assert _install.process.failures == []


def test_a_journal_that_cannot_be_opened_never_reaches_vllm(
    observed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    observed.parent.mkdir(exist_ok=True)
    observed.write_text("a file where the journal folder should be")
    sched = scheduler()
    assert _scheduler_of(sched) is None  # no exception
    assert _scheduler_of(sched) is None  # and not tried on every call
    assert len(_install.process.failures) == 1 and "journals" in _install.process.failures[0]
    thread = SimpleNamespace(tp_rank=0, block_size=16)
    assert _worker_of(thread) is None
    assert _worker_of(thread) is None
    assert len(_install.process.failures) == 2


def test_after_finish_a_running_engine_is_not_observed_until_installed_again(
    observed: Path,
) -> None:
    """A watchdog's finish() ended the journals while vLLM goes on: the next
    call of a rank made a second journal of the process and role, which
    raised FileExistsError into vLLM and killed the engine (its Mooncake
    segment, and the keys in it, with it). Now nothing is observed after
    finish(), and no journal starts mid-request."""
    sched = scheduler()
    thread = SimpleNamespace(tp_rank=0, block_size=16)
    assert _scheduler_of(sched) is not None
    assert _worker_of(thread) is not None
    _install.finish(error="watchdog: no progress")
    assert _scheduler_of(sched) is None
    assert _worker_of(thread) is None
    assert _scheduler_of(scheduler()) is None
    assert len(list(observed.glob("*.db"))) == 2 and _install.process.failures == []
    _install.process.ended = False  # what install() does
    assert _worker_of(thread) is not None  # a new journal, for a new run
    assert len(list(observed.glob("worker-*.db"))) == 2


def _output(**fields: object) -> SimpleNamespace:
    """A SchedulerOutput with nothing scheduled, as vLLM's unit tests build one."""
    base: dict[str, object] = {
        "preempted_req_ids": set(),
        "scheduled_new_reqs": [],
        "scheduled_cached_reqs": SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
    }
    return SimpleNamespace(**{**base, **fields})


def test_a_journal_that_meets_lifecycles_in_flight_says_so_and_claims_nothing() -> None:
    """vLLM's scheduler tests build a connector and call single methods with
    requests and jobs that began before it existed; an observer installed
    in a running engine meets the same. The journal records none of what it
    cannot place (no CAUSALITY, no LEAKED_PIN about a lifecycle it never saw
    begin) and ends without engine_idle, so replay says UNFINISHED."""
    from kvstate import Recorder
    from kvstate.vllm._store_jobs import SchedulerObserver
    from replay.sources import Located
    from replay.verdict import fold_located

    rec = Recorder.in_memory(block_size=16, world_size=1)
    observer = SchedulerObserver(rec, block_size=16, world_size=1, numbering=False)
    running = _output(
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["req-0"],
            new_block_ids=[([7],)],
            num_computed_tokens=[48],
            resumed_req_ids=set(),
        ),
        preempted_req_ids={"req-1"},
    )
    observer.after_build(
        SimpleNamespace(), running, SimpleNamespace(requests=[]), {"saved": {}, "local": {}}
    )
    observer.completions({5: 1}, {5: [3, 4]})  # a job enqueued before the observer
    observer.close()
    entries = rec.entries or []
    assert [e.event.kind for e in entries] == ["journal_opened"]  # nothing it cannot place
    items = (Located(e, "j", e.seq, None) for e in entries)
    _ledger, _n, violations, warnings = fold_located(items)
    assert violations == [] and [w.code.value for w in warnings] == ["UNFINISHED"]


def test_a_journal_that_saw_every_lifecycle_begin_ends_idle() -> None:
    from kvstate import Recorder
    from kvstate.vllm._store_jobs import SchedulerObserver

    rec = Recorder.in_memory(block_size=16, world_size=1)
    observer = SchedulerObserver(rec, block_size=16, world_size=1, numbering=False)
    observer.after_build(
        SimpleNamespace(), _output(), SimpleNamespace(requests=[]), {"saved": {}, "local": {}}
    )
    observer.close()
    assert [e.event.kind for e in rec.entries or []][-1] == "engine_idle"


def _admitting(req: str, blocks: list[int]) -> SimpleNamespace:
    new = SimpleNamespace(
        req_id=req, block_ids=(blocks,), num_computed_tokens=0, prompt_token_ids=[1] * 32
    )
    return _output(scheduled_new_reqs=[new])


def _save(req: str, job: int, blocks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=req,
        load_spec=None,
        can_save=True,
        store_job_id=job,
        token_len_chunk=16 * len(blocks),
        block_ids=(blocks,),
        block_hashes=[bytes([i]) * 4 for i in range(len(blocks))],
    )


def _ends(observer_steps: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Run a scheduler observer through ``observer_steps``, close it, replay the journal:
    its kinds, its violation codes, its warning codes."""
    from kvstate import Recorder
    from kvstate.vllm._store_jobs import SchedulerObserver
    from replay.sources import Located
    from replay.verdict import fold_located

    rec = Recorder.in_memory(block_size=16, world_size=1)
    observer = SchedulerObserver(rec, block_size=16, world_size=1, numbering=False)
    empty = {"saved": {}, "local": {}}
    for step in observer_steps:
        if step == "admit and save":
            meta = SimpleNamespace(requests=[_save("req-0", 0, [3, 4])])
            sched = SimpleNamespace(_pinned_saves={0: ([3, 4],)})
            observer.after_build(sched, _admitting("req-0", [3, 4]), meta, empty)
        elif step == "finish":
            observer.request_finished(SimpleNamespace(request_id="req-0", status=""), False)
        elif step == "complete":
            observer.completions({0: 1}, {0: [3, 4]})
    observer.close()
    entries = rec.entries or []
    items = (Located(e, "j", e.seq, None) for e in entries)
    _ledger, _n, violations, warnings = fold_located(items)
    return (
        [e.event.kind for e in entries],
        [v.code.value for v in violations],
        [w.code.value for w in warnings],
    )


def test_engine_idle_is_claimed_only_when_every_admitted_request_finished() -> None:
    """A unit test (or an engine stopped with work queued) ends while a request
    runs: engine_idle would make replay judge its pins and reports as leaked.
    The journal ends without it, UNFINISHED. A finished request whose pins
    are still held at the end is the real leak, and is reported."""
    kinds, violations, warnings = _ends(["admit and save"])
    assert "job_enqueued" in kinds and kinds[-1] != "engine_idle"
    assert violations == [] and warnings == ["UNFINISHED"]
    kinds, violations, warnings = _ends(["admit and save", "finish"])
    assert kinds[-1] == "engine_idle" and "LEAKED_PIN" in violations
    kinds, violations, warnings = _ends(["admit and save", "finish", "complete"])
    assert kinds[-1] == "engine_idle" and "LEAKED_PIN" not in violations


def test_journals_after_finish_belong_to_a_new_run(observed: Path) -> None:
    """A journal folder per test: the first journal of each folder has the same
    file name, and must not share its run with the last folder's."""
    assert _scheduler_of(scheduler()) is not None
    _install.finish()
    _install.process.ended = False  # install() with a new folder
    second = observed.parent / "second"
    _journals.chosen_dir = second
    assert _scheduler_of(scheduler()) is not None
    _install.finish()
    (one,), (two,) = observed.glob("*.db"), second.glob("*.db")
    assert one.name == two.name
    assert run_of(str(one)) != run_of(str(two))


def test_a_mock_geometry_stands_the_observer_down_and_finish_never_raises(observed: Path) -> None:
    """Connector unit tests build schedulers whose block_size is a MagicMock:
    journaled as is, finish() raised TypeError out of the encoder."""
    from unittest import mock

    sched = SimpleNamespace(_block_size=mock.MagicMock(), _num_workers=1)
    assert _scheduler_of(sched) is None  # stood down, nothing raised
    thread = SimpleNamespace(tp_rank=0, block_size=mock.MagicMock())
    assert _worker_of(thread) is None
    # each reason kept; not a failure that would end other journals with CRASH
    assert len(_install.process.stood_down) == 2 and _install.process.failures == []
    assert all("block_size" in f for f in _install.process.stood_down)
    assert list(observed.glob("*.db")) == []  # no journal no reader could read
    _install.finish()  # never raises


def test_a_value_vllm_hands_over_that_the_contract_refuses_keeps_the_journal_readable(
    observed: Path,
) -> None:
    from unittest import mock

    from kvstate import events as ev
    from replay import replay

    observer = _scheduler_of(scheduler())
    assert observer is not None
    observer._record(ev.RequestAdmitted(req="r", gen=0, prompt_tokens=mock.MagicMock()))
    _install.finish()
    (path,) = observed.glob("scheduler-*.db")
    result = replay([str(path)])
    assert [v.code.value for v in result.violations] == ["RECORD_REFUSED"]


class _Stub(Adapter):
    name = "stub"

    def recognise(self) -> object:
        return None

    def patch(self, found: object) -> None:
        pass


def test_a_release_kvstate_was_not_tested_with_is_named_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """install() checks shapes, not versions: on a newer release with the
    shapes it knows it observes, and says once which release it was not
    tested on; a tested one says nothing."""
    from kvstate.vllm._compat import TESTED

    monkeypatch.setattr(_install, "_untested", set())
    for version, said in (("0.33.0", 1), ("0.33.0", 0), (TESTED[-1], 0), (f"{TESTED[-1]}+cpu", 0)):
        monkeypatch.setattr(_install, "process", _install.ObservedProcess())
        monkeypatch.setattr(_install, "vllm_version", lambda v=version: v)
        # one family recognised, its hooks not needed: install() names the release
        found = [(_Stub(_install.process), Connector(version, "job-ids", {}))]
        monkeypatch.setattr(_install, "_recognised", lambda f=found: (f, []))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstate.vllm"):
            assert _install.install().version == version
        lines = [r.getMessage() for r in caplog.records if "not a release" in r.getMessage()]
        assert len(lines) == said, (version, lines)
        if said:
            assert lines[0].startswith(f"vLLM {version} is not a release kvstate was tested with")


def test_a_registered_family_is_tried_before_the_generic_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One registry entry adds a family, ahead of the generic adapter (whose
    objects would otherwise be journaled twice)."""
    from kvstate.vllm import registry

    monkeypatch.setattr(registry, "ADAPTERS", dict(registry.ADAPTERS))
    registry.register("stub", f"{__name__}:_Stub")
    assert list(registry.ADAPTERS)[-2:] == ["stub", "generic"]
    assert registry.adapter_class("stub") is _Stub
    registry.register("stub", "kvstate.vllm.registry:ADAPTERS")
    with pytest.raises(TypeError, match=r"not a kvstate\.vllm\.adapter\.Adapter"):
        registry.adapter_class("stub")
