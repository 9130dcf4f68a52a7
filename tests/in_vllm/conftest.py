"""The in-venv suite's marker: ``broken`` classes run only when asked (``-m broken``)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "broken: a deliberately broken adapter the contract fails")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "broken" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a deliberately broken adapter: run with -m broken")
    for item in items:
        if item.get_closest_marker("broken"):
            item.add_marker(skip)
