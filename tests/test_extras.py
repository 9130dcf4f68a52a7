"""A feature whose optional extra is not installed says which to install.

``prometheus_client`` (the ``metrics`` extra) is made unimportable, as in
an install without the extra: ``kvstate watch --metrics`` is one line naming
``pip install 'kvstate[metrics]'`` and exit 2, as ``--ray`` says its own,
never a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from kvstate.extras import MissingExtra, missing_extra, require_metrics_extra
from replay.cli import main

INSTALL = "pip install 'kvstate[metrics]' (it is an optional extra)"


@pytest.fixture
def no_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    monkeypatch.delitem(sys.modules, "kvstate.prometheus", raising=False)  # imported again


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.usefixtures("no_prometheus_client")
def test_watch_metrics_without_the_extra_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["watch", str(tmp_path), "--metrics", f"127.0.0.1:{_port()}", "--once"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstate: error: ") and INSTALL in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.usefixtures("no_prometheus_client")
def test_the_check_names_the_option_that_needs_it() -> None:
    with pytest.raises(MissingExtra) as caught:
        require_metrics_extra("--metrics")
    assert str(caught.value) == f"--metrics needs prometheus_client: {INSTALL}"
    assert isinstance(caught.value, ImportError)


def test_with_the_extra_nothing_is_said() -> None:
    pytest.importorskip("prometheus_client")
    require_metrics_extra("--metrics")


def test_only_an_extras_module_is_taken_for_a_missing_extra() -> None:
    found = missing_extra(ModuleNotFoundError("no", name="prometheus_client.core"))
    assert found is not None and INSTALL in str(found)
    assert missing_extra(ModuleNotFoundError("no", name="numpy")) is None
