"""Regenerate the inspector screenshots in docs/img/ (SVG, from the app itself).

    python docs/screenshots.py

Runs the demo's workload under the legacy policy (in-memory store, so no
Mooncake is needed), opens its journal headless, and saves one screenshot
per screen.
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from kvstate.harness.sim.config import SimConfig
from kvstate.harness.sim.runtime import simulate
from replay.tui.inspector import Inspector

HERE = os.path.dirname(os.path.abspath(__file__))
SHOTS = [
    ("inspector-overview.svg", []),
    ("inspector-violation.svg", ["n"]),
    ("inspector-jobs.svg", ["n", "3"]),
    ("inspector-blocks.svg", ["n", "4"]),
    ("inspector-events.svg", ["n", "6"]),
]


async def shoot(journal: str) -> None:
    for name, keys in SHOTS:
        app = Inspector(journal, background=False)
        async with app.run_test(size=(140, 42)) as pilot:
            await pilot.pause()
            for key in keys:
                await pilot.press(key)
                await pilot.pause()
            app.save_screenshot(name, os.path.join(HERE, "img"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        journal = os.path.join(tmp, "legacy.db")
        simulate(SimConfig(policy="legacy", requests=480, block_bytes=1024), journal=journal)
        asyncio.run(shoot(journal))


if __name__ == "__main__":
    main()
