"""How long ``kvstate inspect`` takes to answer a key, on a journal of any size.

The inspector runs headless (textual's test pilot) on the journal given.
After the background index has read the whole journal, keys are pressed on
every tab, and for each the time from the press until the screen has
processed it (the pilot's pause: every message handled, the views
refreshed; animations off, see below) is taken. The ledger views
(Requests, Jobs, Blocks) fold in the background; their time until the
fold is on screen is reported apart.

Run: ``python benchmarks/bench_inspector.py JOURNAL [--keys N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from replay.tui.inspector import TABS, Inspector

#: the keys pressed on each tab: a record forward and back, a step, the next violation
KEYS = ("right", "left", "pagedown", "pageup", "n", "p", "right", "left")


async def _measure(path: str, rounds: int, keys: int, index_timeout: float) -> dict[str, Any]:
    app = Inspector(path)
    # The tab underline slides for a few hundred ms after a tab switch (n/p
    # switch to Violations); the pilot would wait for it. It is decoration,
    # not the inspector answering: measure without it.
    app.animation_level = "none"
    out: dict[str, Any] = {"tabs": {}}
    async with app.run_test(size=(130, 40)) as pilot:
        t0 = time.perf_counter()
        while not app.tt.indexed and time.perf_counter() - t0 < index_timeout:
            await asyncio.sleep(0.2)
        out["index_s"] = time.perf_counter() - t0
        out["records"] = app.tt.last_seq
        out["violations"] = len(app.tt.violations)
        middle = max(1, app.tt.last_seq // 2)
        app.go(middle)
        await pilot.pause()
        for i, tab in enumerate(TABS):
            await pilot.press(str(i + 1))
            await pilot.pause()
            times = []
            ready = []
            slowest = ("", 0.0)
            for _ in range(rounds):
                for key in KEYS[:keys]:
                    # n/p jump to the Violations tab: come back, so every key
                    # is measured on the tab it is listed under
                    if app._active() != tab:
                        await pilot.press(str(i + 1))
                        await pilot.pause()
                        await app.settled()
                    start = time.perf_counter()
                    await pilot.press(key)
                    await pilot.pause()
                    took = time.perf_counter() - start
                    times.append(took)
                    if took > slowest[1]:
                        slowest = (key, took)
                    await app.settled()
                    ready.append(time.perf_counter() - start)
            out["tabs"][tab] = {
                "keys": len(times),
                "max_ms": max(times) * 1000,
                "median_ms": statistics.median(times) * 1000,
                "ready_max_ms": max(ready) * 1000,
                "slowest_key": slowest[0],
            }
        start = time.perf_counter()
        await pilot.press("q")
        out["quit_ms"] = (time.perf_counter() - start) * 1000
    with open("/proc/self/status") as status:  # this process's own peak (see runner._child)
        hwm = next(line for line in status if line.startswith("VmHWM:"))
    out["peak_mb"] = int(hwm.split()[1]) / 1024
    return out


def measure(
    path: str, *, rounds: int = 1, keys: int = len(KEYS), index_timeout: float = 600
) -> dict[str, Any]:
    """Per-key latencies (ms) on every tab of ``path`` (the first ``keys`` of
    :data:`KEYS` on each), and the process's peak memory."""
    return asyncio.run(_measure(path, rounds, keys, index_timeout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("journal")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.journal, rounds=args.rounds), indent=1))


if __name__ == "__main__":
    main()
