"""Shared fixtures. The Mooncake master is a real subprocess, started once per
test session on free loopback ports and stopped at the end."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

#: the adapters' conformance suite runs inside a vLLM venv (tests/test_vllm_adapters.py)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["in_vllm"]


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[object]:
    from kvstate.harness.live.master import MooncakeMaster
    from kvstate.harness.live.mooncake_demo import mooncake_problem

    problem = mooncake_problem()
    if problem is not None:
        # Not a skip: `make test` installs Mooncake, so this is a broken setup.
        pytest.fail(f"Mooncake cannot run: {problem}")
    with MooncakeMaster() as address:
        yield address


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-snapshots",
        action="store_true",
        help="rewrite tests/snapshots/ from the current screens",
    )


@pytest.fixture(autouse=True)
def _wide_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reports written to a pipe take ``COLUMNS`` (80 without it). The tests
    read what a report says, so they give it room for whole lines; the
    width itself is tested in test_report.py, without ``COLUMNS``."""
    monkeypatch.setenv("COLUMNS", "160")


@pytest.fixture(autouse=True)
def _private_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fleet-check's default facts folder is the user's cache: a test's own here."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
