"""A pytest plugin: run any test session of vLLM's connector under the observer.

    pytest -p kvstate.harness.vllm_engine.pytest_plugin --kvstate-journals DIR [--kvstate-per-test]

With ``--kvstate-journals`` alone, :func:`kvstate.vllm.install` runs once for
the whole session and :func:`kvstate.vllm.finish` once at its end: every
connector the tests build in this process gets a journal of its own in DIR.
With ``--kvstate-per-test`` each test gets its own folder ``DIR/<test name>``,
installed before the test and finished after it, so each test's journals
replay on their own.

This is how kvstate checks that observing never changes vLLM's behaviour:
vLLM's own scheduler tests must pass and fail exactly as without the plugin
(see :mod:`kvstate.harness.vllm_engine.upstream`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstate.vllm

#: characters a test id may hold that a folder name should not
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\[\]-]+")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvstate")
    group.addoption(
        "--kvstate-journals",
        metavar="DIR",
        default=None,
        help="journal every connector the tests build (Mooncake store, offloading) into DIR",
    )
    group.addoption(
        "--kvstate-per-test",
        action="store_true",
        default=False,
        help="a folder of journals per test (install before it, finish after it)",
    )


def _folder(config: pytest.Config) -> Path | None:
    value = config.getoption("--kvstate-journals")
    return None if value is None else Path(value)


def pytest_configure(config: pytest.Config) -> None:
    folder = _folder(config)
    if folder is not None and not config.getoption("--kvstate-per-test"):
        kvstate.vllm.install(folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _folder(config) is not None and not config.getoption("--kvstate-per-test"):
        kvstate.vllm.finish()


@pytest.fixture(autouse=True)
def _kvstate_journal_per_test(request: pytest.FixtureRequest) -> Iterator[None]:
    folder = _folder(request.config)
    if folder is None or not request.config.getoption("--kvstate-per-test"):
        yield
        return
    # the module in the name too: two files of a suite may name a test alike
    name = f"{request.node.path.stem}.{request.node.name}"
    kvstate.vllm.install(folder / _UNSAFE.sub("_", name))
    try:
        yield
    finally:
        # Every exit of a test ends its journals, so the next test's
        # connectors never write into this one's folder.
        kvstate.vllm.finish()
