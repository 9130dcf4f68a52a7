"""kvstate inspect, driven headless with textual's pilot: navigation, time
travel (the view at seq N is replay --at N), filters, follow mode against a
journal written concurrently, markup safety, read-only opening, --once, and
text snapshots of the main screens."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from rich.console import Console
from textual.widgets import DataTable, Static, TabbedContent

from journal import write_jsonl
from kvstate import JobSpec, Recorder, SchedulerLedger, WorkerLedger
from kvstate.codec import to_record
from kvstate.harness.zoo import CASES, run_case
from replay.cli import main
from replay.timetravel import TimeTravel
from replay.tui.inspector import Inspector
from replay.verdict import replay

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SNAPSHOTS = Path(__file__).resolve().parent / "snapshots"


def zoo(tmp_path: Path, name: str = "poisoned-read", policy: str = "legacy") -> str:
    path = tmp_path / f"{name}.{policy}.jsonl"
    write_jsonl((to_record(e) for e in run_case(CASES[name], policy).entries or []), path)
    return str(path)


def drive(app: Inspector, script: Callable[[object], Awaitable[None]]) -> None:
    async def run() -> None:
        async with app.run_test(size=(130, 40)) as pilot:
            await pilot.pause()
            await script(pilot)

    asyncio.run(run())


def plain(renderable: object) -> str:
    """A rich renderable as plain text, 120 columns wide."""
    console = Console(width=120, record=True, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines())


def rows(app: Inspector, table_id: str) -> list[list[str]]:
    table = app.query_one(f"#{table_id}", DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def test_keys_move_the_cursor_and_n_finds_the_reused_block(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    seen: dict[str, object] = {}

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("right", "right")
        seen["right"] = app.cursor
        await pilot.press("left")
        seen["left"] = app.cursor
        await pilot.press("n")
        await pilot.pause()
        seen["n"] = (app.cursor, app.query_one(TabbedContent).active)
        seen["story"] = plain(app.query_one("#violation-story", Static).content)
        await pilot.press("p")
        seen["p"] = app.cursor
        await pilot.press("pagedown")
        seen["pagedown"] = app.cursor
        await pilot.press("g", *"20", "enter")
        seen["g"] = app.cursor

    drive(app, script)
    assert seen["right"] == 3 and seen["left"] == 2
    assert seen["n"] == (12, "violations")  # the DMA of r1's job, after r2 took its blocks
    story = " ".join(str(seen["story"]).split())
    assert "read block 2" in story and "handed to another request" in story
    assert seen["p"] == 12  # no earlier violation: stays
    assert seen["g"] == 20


@pytest.mark.parametrize("seq", [1, 6, 9, 12, 19, 27])
def test_the_view_at_seq_n_equals_replay_at_n(tmp_path: Path, seq: int) -> None:
    path = zoo(tmp_path, "req-id-aba")
    travel = TimeTravel(path, snapshot_every=4)
    travel.index()
    for target in (seq, 1, seq):  # forward, back to a snapshot, forward again
        assert travel.ledger_at(target) == replay([path], at=target).ledger
    travel.stop()


def test_time_travel_on_a_database_with_many_snapshots(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    assert main(["run", "--requests", "24", "--journal", str(db)]) == 0
    travel = TimeTravel(str(db), snapshot_every=50)
    travel.index()
    for target in (travel.last_seq, 777, 1300, 3, 1299):
        assert travel.ledger_at(target) == replay([str(db)], at=target).ledger
    travel.stop()


def test_filter_keeps_matching_rows(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    found: dict[str, list[list[str]]] = {}

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", *"27", "enter")
        await pilot.press("slash", *"req r2", "enter", "2")
        await pilot.pause()
        found["requests"] = rows(app, "requests-table")
        # the box opens empty: what is typed replaces the filter in force
        await pilot.press("slash", *"kind dma_started", "enter", "6")
        await pilot.pause()
        found["events"] = rows(app, "events-table")
        await pilot.press("slash", "escape")  # Esc keeps it
        await pilot.pause()
        found["kept"] = [[str(app.filter)]]

    drive(app, script)
    assert [r[0] for r in found["requests"]] == ["r2"]
    kinds = {r[3].split(" of job")[0] for r in found["events"] if r[0] != "27"}
    assert kinds == {"DMA"} and all("started" in r[3] for r in found["events"] if r[0] != "27")
    assert found["kept"] == [["kind dma_started"]]


def test_enter_on_a_job_opens_its_timeline(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    shown: list[str] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", *"27", "enter", "3")
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause()
        shown.append(type(app.screen).__name__)
        await pilot.press("escape")
        shown.append(type(app.screen).__name__)

    drive(app, script)
    assert shown == ["TimelineScreen", "Screen"]


def timeline_rows(app: Inspector) -> list[list[str]]:
    table = app.screen.query_one("#timeline-table", DataTable)
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


async def until(pilot, done: Callable[[], bool], what: str) -> None:  # type: ignore[no-untyped-def]
    """Let the app run until ``done()``; fails after 2,000 pauses (not a clock)."""
    for _ in range(2000):
        if done():
            return
        await pilot.pause()
    raise AssertionError(f"never happened: {what}")


def test_a_timeline_shows_what_kvstate_timeline_shows(tmp_path: Path) -> None:
    """The inspector's timeline of a job has kvstate timeline's rows: one
    definition of a row (report.lane_cells), violations marked."""
    from replay import timeline

    path = zoo(tmp_path)
    line = timeline.build([path], job=0)
    app = Inspector(path, background=False)
    seen: list[list[str]] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        app.open_timeline("job", 0)
        await until(pilot, lambda: getattr(app.screen, "shown", None) is not None, "rows shown")
        seen.extend(timeline_rows(app))

    drive(app, script)
    assert [int(r[0]) for r in seen] == [e.seq for e in line.entries]
    marked = [r for r in seen if any("<- " in cell for cell in r)]
    assert len(marked) == len(line.violations)


def test_a_long_timeline_is_read_off_the_ui_thread(tmp_path: Path) -> None:
    """Enter on a request with thousands of records froze the inspector for
    seconds (the whole journal scanned, every row laid out, on the UI
    thread). The screen now opens at once and says it is reading; keys work
    while the scan runs, and Esc leaves it."""
    path = zoo(tmp_path)
    app = Inspector(path, background=False)
    release = threading.Event()
    stream = app.tt.stream

    def slow(after: int, upto: int):  # type: ignore[no-untyped-def]
        release.wait(60)  # a scan that does not end until the test says so
        return stream(after, upto)

    app.tt.stream = slow  # type: ignore[method-assign]
    seen: dict[str, object] = {}

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        app.open_timeline("job", 0)
        await pilot.pause()
        seen["open"] = type(app.screen).__name__
        seen["heading"] = str(app.screen.query_one("#timeline-heading", Static).content)
        await pilot.press("escape")
        seen["closed"] = type(app.screen).__name__
        release.set()
        app.open_timeline("job", 0)
        await until(pilot, lambda: getattr(app.screen, "shown", None) is not None, "rows shown")
        seen["rows"] = app.screen.shown  # type: ignore[attr-defined]

    drive(app, script)
    assert seen["open"] == "TimelineScreen"
    assert "reading the journal" in str(seen["heading"])
    assert seen["closed"] == "Screen"
    assert seen["rows"]


def test_shift_arrows_scroll_a_wide_view_sideways(tmp_path: Path) -> None:
    """At 80 columns the Jobs lanes and the Events violations run off the
    right edge; left/right move the cursor record, shift+left/right scroll."""
    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.runtime import simulate

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=10, seed=2, policy="legacy", world_size=2), journal=str(path))
    app = Inspector(str(path), background=False)
    seen: dict[str, tuple[float, float, float]] = {}

    async def run() -> None:
        async with app.run_test(size=(80, 30)) as pilot:
            await pilot.pause()
            await pilot.press("end")
            for tab, key in (("jobs", "3"), ("events", "6")):
                await pilot.press(key)
                await pilot.pause()
                table = app.query_one(f"#{tab}-table", DataTable)
                assert table.virtual_size.width > 80, tab  # wider than the terminal
                before = table.scroll_x
                await pilot.press("shift+right")
                await pilot.pause()
                after = table.scroll_x
                await pilot.press("shift+left")
                await pilot.pause()
                seen[tab] = (before, after, table.scroll_x)

    asyncio.run(run())
    for tab, (before, after, back) in seen.items():
        assert before == 0 and after > 0 and back == 0, (tab, before, after, back)


@pytest.mark.parametrize("width", [80, 100, 130])
def test_the_blocks_strip_fits_the_width_without_cutting_a_cell(width: int) -> None:
    from replay.tui._views import BlockStrip

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(BlockStrip([(b, "." if b % 3 else "2", "") for b in range(1200)]))
    lines = console.export_text().splitlines()
    cells = [cell for line in lines for cell in line.split()]
    assert max(len(line) for line in lines) <= width
    assert [int(c.split(":")[0]) for c in cells] == list(range(1200))  # none cut in two
    assert len(lines) == -(-1200 // ((width + 1) // 7))  # as many to a line as fit


def test_strings_from_the_journal_are_literal(tmp_path: Path) -> None:
    path = tmp_path / "markup.jsonl"
    records = [
        {"kind": "journal_opened", "version": 1, "block_size": 4, "world_size": 1},
        {"kind": "request_admitted", "req": "[red]x[/red]", "gen": 0, "prompt_tokens": 4},
        {
            "kind": "blocks_assigned",
            "req": "[red]x[/red]",
            "gen": 0,
            "blocks": [1],
            "mode": "append",
        },
        {"kind": "engine_crashed", "error": "[bold]boom[/bold]"},
    ]
    path.write_text("".join(json.dumps({"step": 0, **r}) + "\n" for r in records))
    app = Inspector(str(path), background=False)
    found: dict[str, object] = {}

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("g", "4", "enter", "2")
        await pilot.pause()
        found["requests"] = rows(app, "requests-table")
        await pilot.press("5")
        await pilot.pause()
        found["violations"] = rows(app, "violations-table")

    drive(app, script)
    assert found["requests"][0][0] == "[red]x[/red]"  # type: ignore[index]
    assert "[bold]boom[/bold]" in found["violations"][0][3]  # type: ignore[index]


def test_the_journal_is_opened_read_only(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    assert main(["convert", zoo(tmp_path), str(db)]) == 0
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    app = Inspector(str(db), background=False)

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("n", "3", "2", "4")

    drive(app, script)
    with pytest.raises(Exception, match="read-only"):
        app.tt.records._parts[0][1].append([])  # type: ignore[union-attr]  # its first segment
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_follow_mode_tails_a_journal_being_written(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    recorder = Recorder.open(db, block_size=4, world_size=1)
    sched = SchedulerLedger(recorder)
    worker = WorkerLedger(0, recorder)
    recorder.flush()
    stop = threading.Event()

    def write() -> None:  # a writer that keeps appending while the app runs
        for i in range(40):
            if stop.is_set():
                break
            sched.begin_step()
            req = f"r{i}"
            sched.admit(req, 4)
            sched.assign_blocks(req, [i % 8], resumed=False)
            job = sched.enqueue_store_job(req, 0, 4, [f"k{i}"])
            worker.register(JobSpec(job, req, 0, (f"k{i}",)))
            with worker.run(job) as run:
                run.put_done(1, 0)
            sched.update_connector_output(worker.take_completed())
            sched.release_ready()
            sched.request_finished(req)
            recorder.flush()
            time.sleep(0.02)

    app = Inspector(str(db), follow=True)
    seen: list[int] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 15
        while writer.is_alive() and time.monotonic() < deadline:
            await pilot.pause(0.1)
        writer.join()
        await pilot.pause(0.8)  # the 4-per-second refresh picks up the tail
        seen.append(app.tt.last_seq)
        seen.append(app.tt.indexed_seq)

    try:
        drive(app, script)
    finally:
        stop.set()
        recorder.close()
    final = replay([str(db)])
    assert seen[0] == final.events and seen[1] == final.events
    assert final.verdict == "clean"


def test_once_prints_overview_and_violations(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # --once exits with replay's status: 1, the journal has violations
    assert main(["inspect", "--once", zoo(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "verdict 4 violation(s)" in out and "records by kind" in out
    assert "POISONED_READ" in out and "job 0 of r1/0 read block 2" in out
    assert main(["inspect", "--once", str(tmp_path / "missing.db")]) == 2
    capsys.readouterr()
    # a clean journal: no empty table, a plain "none"
    assert main(["inspect", "--once", str(EXAMPLES / "clean.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "violations by code: none" in out and "first seq" not in out


def test_once_shows_the_first_violations_and_says_how_many_more(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    journal = zoo(tmp_path)
    assert main(["inspect", "--once", "--limit", "1", journal]) == 1
    out = capsys.readouterr().out
    assert "... and 3 more (--limit N shows more" in out
    assert main(["inspect", "--once", "--limit", "0", journal]) == 1
    assert "more (--limit" not in capsys.readouterr().out  # 0: every one


def screen_text(app: Inspector, tab: str) -> str:
    """The main widget of a tab as plain text (a text snapshot of the screen)."""
    widget = {
        "overview": "#overview-body",
        "requests": "#requests-table",
        "jobs": "#jobs-table",
        "blocks": "#blocks-body",
        "violations": "#violations-table",
        "events": "#events-table",
    }[tab]
    if widget.endswith("table"):
        return "\n".join(" | ".join(r) for r in rows(app, widget.lstrip("#")))
    text = plain(app.query_one(widget, Static).content)
    return re.sub(r"journal \S+", "journal <path>", text)


@pytest.mark.parametrize("tab", ["overview", "requests", "jobs", "blocks", "violations", "events"])
def test_screen_snapshots(tmp_path: Path, tab: str, request: pytest.FixtureRequest) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    captured: list[str] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press(
            "g",
            *"12",
            "enter",
            str(1 + ["overview", "requests", "jobs", "blocks", "violations", "events"].index(tab)),
        )
        await pilot.pause()
        captured.append(screen_text(app, tab))

    drive(app, script)
    golden = SNAPSHOTS / f"inspector_{tab}.txt"
    if request.config.getoption("--update-snapshots", default=False):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(captured[0] + "\n")
    assert golden.exists(), f"no snapshot {golden.name}: run pytest --update-snapshots"
    assert captured[0] + "\n" == golden.read_text()


def test_keys_pressed_in_a_modal_stay_in_it(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    seen: dict[str, object] = {}

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        start = app.cursor
        await pilot.press("question_mark")
        await pilot.pause()
        await pilot.press("right", "right", "n", "end", "3")
        seen["moved"] = (app.cursor, app.query_one(TabbedContent).active) != (start, "overview")
        await pilot.press("q")  # closes the help, does not quit
        await pilot.pause()
        seen["after"] = (len(app.screen_stack), app.is_running)
        await pilot.press("right")
        seen["cursor"] = (start, app.cursor)

    drive(app, script)
    assert seen["moved"] is False
    assert seen["after"] == (1, True)
    start, cursor = seen["cursor"]  # type: ignore[misc]
    assert cursor == start + 1


def test_end_and_home_jump_to_the_last_and_first_record(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    seen: list[int] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("end")
        seen.append(app.cursor)
        await pilot.press("home")
        seen.append(app.cursor)

    drive(app, script)
    assert seen == [app.tt.last_seq, 1]


def test_the_footer_shows_the_keys_one_cannot_guess_at_80_columns(tmp_path: Path) -> None:
    app = Inspector(zoo(tmp_path), background=False)
    shown: list[str] = []

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            footer = app.query_one("Footer")
            shown.extend(
                str(child.render()) for child in footer.query("FooterKey") if child.region.width
            )

    asyncio.run(run())
    text = " ".join(shown)
    for key, what in (("n", "next viol."), ("p", "prev viol."), ("/", "filter"),
                      ("?", "help"), ("q", "quit")):  # fmt: skip
        assert key in text and what in text, text


def test_the_filter_searches_the_whole_journal_with_a_requests_job_records(
    tmp_path: Path,
) -> None:
    # A long journal: the request's records lie far from the cursor at seq 1.
    rec = Recorder.in_memory(block_size=4, world_size=1)
    sched, worker = SchedulerLedger(rec), WorkerLedger(0, rec)
    for i in range(200):
        sched.admit(f"filler{i}", 4)
    sched.admit("target", 4)
    sched.assign_blocks("target", [0], resumed=False)
    job = sched.enqueue_store_job("target", 0, 4, ["k"])
    worker.register(JobSpec(job, "target", 0, ("k",)))
    with worker.run(job) as run:
        run.put_done(stored=1, existed=0)
    path = tmp_path / "long.jsonl"
    write_jsonl((to_record(e) for e in rec.entries or []), path)
    app = Inspector(str(path), background=False)
    found: list[list[str]] = []

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("6", "slash", *"req target", "enter")
        await pilot.pause()
        found.extend(rows(app, "events-table"))

    drive(app, script)
    records = [r[3] for r in found]
    assert any("admitted target/0" in r for r in records)
    # worker records name the job, not the request: the filter still takes them
    assert any("started job 0" in r for r in records)
    assert any("reported job 0" in r for r in records)
    assert not any("filler" in r for r in records[1:])


def test_several_journals_open_merged_like_replay(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    records = [json.loads(line) for line in Path(zoo(tmp_path)).read_text().splitlines()]
    header = records[0]
    sched = [r for r in records if "rank" not in r]
    ranks = [dict(header), *(r for r in records if "rank" in r)]
    for part in (sched, ranks):
        for i, r in enumerate(part, 1):
            r["seq"] = i
    a, b = tmp_path / "sched.jsonl", tmp_path / "rank0.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in sched))
    b.write_text("".join(json.dumps(r) + "\n" for r in ranks))
    merged = replay([str(a), str(b)])
    travel = TimeTravel([str(a), str(b)])
    travel.index()
    assert travel.last_seq == merged.events
    assert [v.code for v in travel.violations] == [v.code for v in merged.violations]
    assert travel.ledger_at(merged.events) == merged.ledger
    assert main(["inspect", "--once", str(a), str(b)]) == merged.exit_status
    assert "violation(s)" in capsys.readouterr().out


def test_the_fold_thread_shows_what_the_ui_thread_would(tmp_path: Path) -> None:
    """In the background (the real UI), ledger views arrive from the fold thread;
    once settled they are the rows a fold on the UI thread gives, seq for seq."""
    db = tmp_path / "run.db"
    assert main(["run", "--requests", "24", "--journal", str(db)]) == 0
    seen: dict[bool, list[list[list[str]]]] = {}
    for background in (False, True):
        app = Inspector(str(db), background=background)
        got: list[list[list[str]]] = []

        async def script(pilot, app: Inspector = app, got: list = got) -> None:  # type: ignore[no-untyped-def]
            while not app.tt.indexed:
                await asyncio.sleep(0.02)
            for keys in (("g", *"900", "enter", "3"), ("left",) * 5, ("g", *"40", "enter", "2")):
                await pilot.press(*keys)
                await pilot.pause()
                await app.settled()
                await pilot.pause()
                tab = "jobs-table" if app._active() == "jobs" else "requests-table"
                got.append(rows(app, tab))

        drive(app, script)
        seen[background] = got
    assert seen[True] == seen[False]
    assert all(seen[True]) and seen[True][0] != seen[True][1]


def test_q_quits_and_stops_both_threads(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    assert main(["run", "--requests", "60", "--journal", str(db)]) == 0
    app = Inspector(str(db))

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("3", "n", "left")  # keys work while the index is still building
        await pilot.press("q")

    drive(app, script)
    assert not app.is_running
    assert app.folder is not None and not app.folder._thread.is_alive()
    assert app.tt._thread is not None and not app.tt._thread.is_alive()


def test_next_and_previous_violation_work_on_a_partial_index(tmp_path: Path) -> None:
    db = tmp_path / "legacy.db"
    assert main(["run", "--policy", "legacy", "--requests", "40", "--journal", str(db)]) == 1
    travel = TimeTravel(str(db))
    travel.index(limit=travel.last_seq // 2)
    assert not travel.indexed
    found = list(travel.violations)
    assert found, "the first half has violations"
    assert travel.next_violation(0) == found[0]
    assert travel.next_violation(found[-1].seq) is None  # nothing found past it yet
    assert travel.previous_violation(found[-1].seq + 1) == found[-1]
    codes = travel.codes()
    assert sum(n for _, n, _ in codes) == len(found)
    travel.index()
    assert travel.indexed and len(travel.violations) >= len(found)
    later = travel.next_violation(found[-1].seq)
    assert later is None or later.seq > found[-1].seq
    travel.stop()


def test_the_cursor_row_is_highlighted_and_in_view_on_a_long_journal(tmp_path: Path) -> None:
    """Events and Violations hold a few screens of rows: the cursor's row is the
    highlighted one and is scrolled into view, going forward and back."""
    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.runtime import simulate

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=40, seed=2, policy="legacy"), journal=str(path))
    app = Inspector(str(path), background=False)
    seen: list[tuple[str, int, int, bool]] = []

    def look(tab: str) -> None:
        table = app.query_one(f"#{tab}-table", DataTable)
        top = round(table.scroll_y)
        height = table.scrollable_content_region.height - 1
        first = str(table.get_row_at(table.cursor_row)[0])
        seen.append((tab, app.cursor, int(first), top <= table.cursor_row < top + height))

    async def script(pilot) -> None:  # type: ignore[no-untyped-def]
        app.go(app.tt.last_seq // 2)
        await pilot.press("6")
        await pilot.pause()
        for key in ("right", "pagedown", "left", "pageup"):
            await pilot.press(key)
            await pilot.pause()
            look("events")
        for key in ("p", "p", "n"):
            await pilot.press(key)
            await pilot.pause()
            look("violations")

    drive(app, script)
    assert len(seen) == 7
    for tab, cursor, highlighted, in_view in seen:
        assert in_view, (tab, cursor)
        if tab == "events":
            assert highlighted == cursor
        else:  # the latest violation up to the cursor
            assert highlighted == app.tt.violations_upto(cursor)[-1].seq == cursor


def test_a_wide_timeline_scrolls_a_lane_a_press_and_counts_only_its_own_records(
    tmp_path: Path,
) -> None:
    """At 100 columns rank 1's lane was off screen, right moved one character
    a press (about 140 of them), shift+right did nothing, the seq column went
    with the scroll, and the heading counted the violations of every record
    between the job's first and last (2039 for 39 records)."""
    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.runtime import simulate

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=10, seed=2, policy="legacy", world_size=2), journal=str(path))
    app = Inspector(str(path), background=True)
    seen: dict[str, object] = {}

    async def run() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            app.open_timeline("job", 7)
            await until(pilot, lambda: getattr(app.screen, "shown", None) is not None, "rows")
            table = app.screen.query_one("#timeline-table", DataTable)
            seen["wide"] = table.virtual_size.width > 100
            seen["fixed"] = table.fixed_columns
            xs = [table.scroll_x]
            for key in ("right", "right", "left", "left", "shift+right", "shift+left"):
                await pilot.press(key)
                await pilot.pause()
                xs.append(table.scroll_x)
            seen["xs"] = xs
            seen["heading"] = str(app.screen.query_one("#timeline-heading", Static).content)
            seen["marked"] = sum(
                any("<- " in str(c) for c in table.get_row_at(i)) for i in range(table.row_count)
            )
            seen["rows"] = table.row_count

    asyncio.run(run())
    app.tt.stop()
    assert seen["wide"] and seen["fixed"] == 1
    x0, r1, r2, l1, l2, far, back = seen["xs"]  # type: ignore[misc]
    assert x0 == 0 and 0 < r1 < r2 and l1 == r1 and l2 == 0 and far >= r2 and back == 0
    heading = str(seen["heading"])
    assert f"{seen['rows']:,} records" in heading
    if seen["marked"]:
        assert f", {seen['marked']} with violations" in heading
    else:
        assert "with violations" not in heading


def test_at_30_rows_the_first_violations_chain_is_on_screen(tmp_path: Path) -> None:
    """At 30 rows the Violations tab cut the first violation's chain to its
    header: the story pane was too short and its words came first."""
    from rich.console import Group
    from rich.text import Text

    from kvstate.harness.sim.config import SimConfig
    from kvstate.harness.sim.runtime import simulate
    from replay.report import lanes_table

    path = tmp_path / "run.db"
    simulate(SimConfig(requests=10, seed=2, policy="legacy", world_size=2), journal=str(path))
    app = Inspector(str(path), background=False)
    seen: dict[str, object] = {}

    async def run() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            first = app.tt.violations[0]
            app.go(first.seq)
            await pilot.press("5")
            await pilot.pause()
            detail = app.query_one("#violation-detail")
            records = {e.seq: e for s in first.chain for e in app.tt.entries(s - 1, s)}
            records.update({e.seq: e for e in app.tt.entries(first.seq - 1, first.seq)})
            chain = [records[s] for s in sorted({*first.chain, first.seq})]
            width = detail.scrollable_content_region.width
            console = Console(width=width, file=io.StringIO(), color_system=None)
            head = Text(f"{first.code.value} at seq {first.seq}")
            lines = console.render_lines(
                Group(head, lanes_table(chain, {first.seq: [first]}, "chain", plain=False)),
                console.options.update_width(width),
            )
            seen["needed"] = len(lines)
            seen["shown"] = detail.scrollable_content_region.height
            seen["top"] = detail.scroll_y
            seen["chain"] = len(chain)

    asyncio.run(run())
    assert seen["chain"] >= 2  # a story worth showing: the violation and what led to it
    assert seen["top"] == 0
    assert seen["needed"] <= seen["shown"], seen
