"""How long ``kvstate inspect`` takes to answer a key, on a journal of any size.

The inspector runs headless (textual's test pilot) on the journal given.
After the background index has read the whole journal, keys are pressed on
every tab, and for each the time from the key event until the answer is on
screen is taken: the key's action has run, the view on screen is the one
for the new cursor (for Requests, Jobs and Blocks: the fold thread has
delivered it), every widget has handled its queue, and the screen has been
repainted after that (textual's ``wait_for_refresh``). Animations are off
(see below).

The same keys are then pressed again the way a test does, with
``pilot.press`` and ``pilot.pause``, and that round trip is reported too
(``pilot_*``). It is longer by construction: the pilot decides the app is
idle by sleeping in 20 ms slices until the process's CPU time stops
advancing, three times a key, so it measures the pilot as much as the
inspector.

Run: ``python benchmarks/bench_inspector.py JOURNAL [--keys N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from textual import events

from replay.tui import inspector as _inspector
from replay.tui.inspector import TABS, Inspector

#: the keys pressed on each tab: a record forward and back, a step, the next violation
KEYS = ("right", "left", "pagedown", "pageup", "n", "p", "right", "left")


class _Timed(Inspector):
    """The inspector, telling when a key's action has run."""

    handled: asyncio.Event | None = None

    async def run_action(self, *args: Any, **kwargs: Any) -> bool:
        try:
            return await super().run_action(*args, **kwargs)
        finally:
            if self.handled is not None:
                self.handled.set()


async def _answer(app: _Timed, pilot: Any, key: str) -> float:
    """Seconds from ``key`` arriving until its answer is on screen."""
    app.handled = asyncio.Event()
    event = events.Key(key, key if len(key) == 1 else None)
    event.set_sender(app)
    start = time.perf_counter()
    app.post_message(event)
    await app.handled.wait()
    await app.settled()
    # every widget has handled what the answer sent it (a table measures its
    # new rows on its own queue), and then the screen has been repainted.
    # _wait_for_screen is what pilot.pause() runs before its idle sleeps; a
    # textual without it gets the whole pause (slower, never faster).
    wait_for_screen = getattr(pilot, "_wait_for_screen", None)
    await (wait_for_screen() if wait_for_screen is not None else pilot.pause())
    await app.wait_for_refresh()
    return time.perf_counter() - start


async def _measure(path: str, rounds: int, keys: int, index_timeout: float) -> dict[str, Any]:
    # settled() looks every 10 ms; look every millisecond so the poll does not
    # round the answer up
    _inspector.SETTLE_POLL = 0.001
    app = _Timed(path)
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
            pilot_times = []
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
                    took = await _answer(app, pilot, key)
                    times.append(took)
                    if took > slowest[1]:
                        slowest = (key, took)
                    await pilot.pause()
                    await app.settled()
                for key in KEYS[:keys]:
                    if app._active() != tab:
                        await pilot.press(str(i + 1))
                        await pilot.pause()
                        await app.settled()
                    start = time.perf_counter()
                    await pilot.press(key)
                    await pilot.pause()
                    pilot_times.append(time.perf_counter() - start)
                    await app.settled()
                    ready.append(time.perf_counter() - start)
            out["tabs"][tab] = {
                "keys": len(times),
                "max_ms": max(times) * 1000,
                "median_ms": statistics.median(times) * 1000,
                "slowest_key": slowest[0],
                "pilot_max_ms": max(pilot_times) * 1000,
                "pilot_median_ms": statistics.median(pilot_times) * 1000,
                "pilot_ready_max_ms": max(ready) * 1000,
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
