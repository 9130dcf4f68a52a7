"""Every malformed journal exits 2 with one line naming the file and line or
seq, for every reader (replay, timeline, export, convert, inspect --once);
journal strings never reach the terminal raw; declared sizes cannot make
replay work harder than the records; everything kvstate writes is standard
JSON; and fuzzing the reader and the fold lets only documented errors out."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from journal import JournalError, Record, RecordError, parse_line
from kvstate.codec import from_record
from kvstate.ledger import Ledger
from replay.cli import main

ROOT = Path(__file__).resolve().parent.parent
CLEAN = ROOT / "examples" / "clean.jsonl"
HEADER = {"seq": 1, "kind": "journal_opened", "step": 0, "version": 1, "block_size": 4,
          "world_size": 1}  # fmt: skip


def lines(*records: str) -> str:
    return json.dumps(HEADER) + "\n" + "".join(r + "\n" for r in records)


ADMIT = '{{"seq":2,"kind":"request_admitted","step":0,"req":{req},"gen":0,"prompt_tokens":{n}{x}}}'


def admit(req: str = '"r"', n: str = "8", x: str = "") -> str:
    return ADMIT.format(req=req, n=n, x=x)


def db_from(tmp: Path, name: str, mutate: str | None = None) -> Path:
    from journal import Journal
    from kvstate.codec import to_record
    from replay.sources import entries

    path = tmp / name
    with Journal(path) as journal:
        journal.append([to_record(e) for e in entries([str(CLEAN)])])
    if mutate:
        conn = sqlite3.connect(path)
        conn.executescript(mutate)
        conn.commit()
        conn.close()
    return path


def _write(name: str, text: str | bytes) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        path = tmp / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

    return make


def _truncated(tmp: Path) -> Path:
    path = db_from(tmp, "full.db")
    cut = tmp / "cut.db"
    cut.write_bytes(path.read_bytes()[:5000])
    return cut


def _foreign(tmp: Path) -> Path:
    path = tmp / "foreign.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE records(a, b); CREATE TABLE schema_version(version);"
        "INSERT INTO schema_version VALUES (1);"
    )
    conn.close()
    return path


def _schema_text(tmp: Path) -> Path:
    path = db_from(tmp, "schema.db")
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute(
        "UPDATE sqlite_master SET sql = 'CREATE TABLE records(garbage' WHERE name='records'"
    )
    conn.commit()
    conn.close()
    return path


def _binary_payload(tmp: Path) -> Path:
    from journal import Journal

    path = tmp / "bin.db"
    with Journal(path) as journal:
        payload = {"version": 1, "block_size": 4, "world_size": 1, "x": b"\x00\x01"}
        journal.append([Record(1, "journal_opened", payload, 0)])
    return path


def _not_utf8_kind(tmp: Path) -> Path:
    return db_from(
        tmp,
        "kind.db",
        "DROP TRIGGER records_refuse_update;"
        "UPDATE records SET kind = CAST(X'FF00' AS TEXT) WHERE seq = 3;",
    )


def _deep_payload(key: bytes) -> Callable[[Path], Path]:
    """A request_admitted whose msgpack payload nests 100,000 arrays deep
    under ``key`` (msgspec's decoders raised RecursionError on it)."""

    def make(tmp: Path) -> Path:
        from journal import Journal

        path = tmp / f"deep-{key.decode().replace(':', '-')}.db"
        fields = {"req": "r", "gen": 0, "prompt_tokens": 8}
        payload = msgpack.packb(fields)[1:]  # the three pairs, without their map header
        deep = b"\x84" + payload + bytes([0xA0 | len(key)]) + key + b"\x91" * 100_000 + b"\x90"
        header = {k: v for k, v in HEADER.items() if k not in ("seq", "kind", "step")}
        with Journal(path) as journal:
            journal.append(
                [Record(1, "journal_opened", header, 0), Record(2, "request_admitted", deep, 0)]
            )
        return path

    return make


BAD_INPUTS: dict[str, Callable[[Path], Path]] = {
    "msgpack nested 100000 deep": _deep_payload(b"x"),
    "msgpack extra nested 100000 deep": _deep_payload(b"kvstate:extra"),
    "broken json": _write("broken.jsonl", lines("{oops")),
    "wrong type": _write("type.jsonl", lines(admit(n='"eight"'))),
    "unknown kind": _write("kind.jsonl", lines('{"seq":2,"kind":"teleported","step":0}')),
    "unknown version": _write("version.jsonl", json.dumps({**HEADER, "version": 2}) + "\n"),
    "huge integer": _write("huge.jsonl", lines(admit(n="9" * 5000))),
    "2^63": _write("int63.jsonl", lines(admit(n=str(2**63)))),
    "NaN": _write("nan.jsonl", lines(admit(x=', "x": NaN'))),
    "Infinity": _write("inf.jsonl", lines(admit(x=', "x": -Infinity'))),
    "nested 5000 deep": _write("deep.jsonl", lines(admit(x=', "x": ' + "[" * 5000 + "]" * 5000))),
    "lone surrogate": _write("sur.jsonl", lines(admit(req='"r\\ud800"'))),
    "not UTF-8": _write("bytes.jsonl", b'{"kind": "journal_opened", "x": "\xff"}\n'),
    "empty file": _write("empty.jsonl", ""),
    "blank lines only": _write("blank.jsonl", "\n\n"),
    "no header": _write("nohead.jsonl", admit() + "\n"),
    "duplicated seq": _write("dup.jsonl", lines(admit().replace('"seq":2', '"seq":1'))),
    "reordered seq": _write(
        "order.jsonl",
        lines(admit().replace('"seq":2', '"seq":3'), admit(req='"s"')),
    ),
    "world_size 1e12": _write("world.jsonl", json.dumps({**HEADER, "world_size": 10**12}) + "\n"),
    "a directory": lambda tmp: (tmp / "adir").mkdir() or tmp / "adir",
    "missing file": lambda tmp: tmp / "nowhere.db",
    "truncated database": _truncated,
    "foreign database": _foreign,
    "corrupted schema": _schema_text,
    "tampered chain": lambda tmp: db_from(
        tmp,
        "tamper.db",
        "DROP TRIGGER records_refuse_update; UPDATE records SET step=9 WHERE seq=4;",
    ),
    "deleted middle row": lambda tmp: db_from(
        tmp, "hole.db", "DROP TRIGGER records_refuse_delete; DELETE FROM records WHERE seq=4;"
    ),
    "binary payload": _binary_payload,
    "kind not UTF-8": _not_utf8_kind,
    "not a journal at all": _write("random.db", b"SQLite format 3\x00" + b"\x07" * 3000),
}

COMMANDS: dict[str, Callable[[str, Path], list[str]]] = {
    "replay": lambda p, _t: ["replay", p],
    "replay --json": lambda p, _t: ["replay", "--json", p],
    "timeline": lambda p, _t: ["timeline", p, "--req", "r"],
    "export jsonl": lambda p, t: ["export", p, "--format", "jsonl", str(t / "o.jsonl")],
    "export perfetto": lambda p, t: ["export", p, "--format", "perfetto", str(t / "o.json")],
    "convert": lambda p, t: ["convert", p, str(t / "o.db")],
    "inspect --once": lambda p, _t: ["inspect", "--once", p],
}


@pytest.mark.parametrize("bad", sorted(BAD_INPUTS))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_reader_exits_2_with_one_line(tmp_path: Path, bad: str, command: str, capsys) -> None:  # type: ignore[no-untyped-def]
    path = BAD_INPUTS[bad](tmp_path)
    status = main(COMMANDS[command](str(path), tmp_path))
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert "Traceback" not in err
    message = [line for line in err.splitlines() if line.startswith("kvstate: error:")]
    assert len(message) == 1 and path.name in message[0], err
    if command == "replay --json":
        report = json.loads(out)
        assert report["verdict"] == "unusable"
    for name in ("o.jsonl", "o.json", "o.db"):
        assert not (tmp_path / name).exists()  # nothing written from unusable input


def test_no_traceback_from_a_real_process(tmp_path: Path) -> None:
    path = BAD_INPUTS["lone surrogate"](tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "replay", "replay", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["verdict"] == "unusable"


ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


def escape_journal(tmp: Path) -> Path:
    req = json.dumps(ESCAPES)
    return _write("esc.jsonl", lines(admit(req=req), admit(req=req).replace('"seq":2', '"seq":3')))(
        tmp
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "{p}"],
        ["replay", "--all", "{p}"],
        ["replay", "--json", "{p}"],
        ["timeline", "{p}", "--req", ESCAPES],
        ["timeline", "--json", "{p}", "--req", ESCAPES],
        ["inspect", "--once", "{p}"],
    ],
)
def test_control_characters_are_shown_escaped(tmp_path: Path, argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    path = escape_journal(tmp_path)
    main([a.replace("{p}", str(path)) for a in argv])
    out, err = capsys.readouterr()
    for raw in ("\x1b", "\x07", "\x9b"):
        assert raw not in out and raw not in err
    assert "pwned" in out


def test_declared_world_size_does_not_drive_replay_work(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    records = [
        {**HEADER, "world_size": 60000},
        {"seq": 2, "kind": "request_admitted", "step": 0, "req": "r", "gen": 0, "prompt_tokens": 4},
        {"seq": 3, "kind": "blocks_assigned", "step": 0, "req": "r", "gen": 0, "blocks": [0],
         "mode": "append"},
        {"seq": 4, "kind": "job_enqueued", "step": 0, "job": 0, "req": "r", "gen": 0,
         "token_start": 0, "token_end": 4, "reads": [0], "pins": [0], "keys": ["k"],
         "world_size": 60000},
        {"seq": 5, "kind": "engine_idle", "step": 1},
    ]  # fmt: skip
    path = tmp_path / "wide.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["replay", "--json", str(path)]) == 1
    report = json.loads(capsys.readouterr().out)
    missing = [v for v in report["violations"] if v["code"] == "MISSING_REPORT"]
    assert len(missing) == 1 and "60000 ranks" in missing[0]["message"]


def test_written_json_is_standard(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # A float descriptive field round-trips; nothing kvstate writes says NaN.
    path = _write("float.jsonl", json.dumps({**HEADER, "created": 1.5}) + "\n")(tmp_path)
    for argv in (
        ["export", str(path), "--format", "jsonl", str(tmp_path / "o.jsonl")],
        ["export", str(path), "--format", "perfetto", str(tmp_path / "o.json")],
        ["convert", str(path), str(tmp_path / "c.jsonl")],
    ):
        assert main(argv) == 0
    strict = json.JSONDecoder(parse_constant=lambda c: pytest.fail(f"non-standard {c}"))
    for name in ("o.jsonl", "c.jsonl"):
        for line in (tmp_path / name).read_text().splitlines():
            strict.decode(line)
    strict.decode((tmp_path / "o.json").read_text())


# -- fuzzing: only the documented errors escape --------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
KINDS = ["journal_opened", "request_admitted", "blocks_assigned", "job_enqueued", "job_received",
         "job_reported", "pins_released", "engine_idle", "offset_saved", "nonsense"]  # fmt: skip
FIELDS = ["req", "gen", "job", "blocks", "mode", "reads", "pins", "keys", "token_start",
          "token_end", "world_size", "block_size", "version", "prompt_tokens", "offset", "rank",
          "step", "seq", "count", "cached", "hold"]  # fmt: skip


@st.composite
def record_lines(draw: st.DrawFn) -> str:
    obj = {"kind": draw(st.sampled_from(KINDS))}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8)):
        obj[name] = draw(
            st.integers(-3, 5) | st.sampled_from(["r", "append", "replace"]) | json_values
            | st.lists(st.integers(-1, 5), max_size=3)
        )  # fmt: skip
    text = json.dumps(obj, allow_nan=True)
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=3)) + text[cut:]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(record_lines(), max_size=12))
def test_fuzzed_lines_raise_only_record_errors_and_the_fold_only_findings(texts: list[str]) -> None:
    ledger = Ledger()
    header = from_record(parse_line(json.dumps(HEADER), path="f", line=1))
    ledger.apply(header.seq, header.step, header.event)
    for i, text in enumerate(texts, 2):
        try:
            entry = from_record(parse_line(text, path="f", line=i), path="f", line=i)
        except RecordError:
            continue
        try:
            ledger.apply(entry.seq, entry.step, entry.event)
        except RecordError:
            continue  # a second header that disagrees: unusable input, documented
    ledger.end()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.sampled_from(KINDS))
def test_fuzzed_database_payloads_raise_only_record_errors(
    tmp_path_factory, payload: bytes, kind: str
) -> None:  # type: ignore[no-untyped-def]
    from journal import Journal
    from journal._chain import GENESIS, link

    folder = tmp_path_factory.mktemp("fz")
    path = folder / "f.db"
    Journal(path).close()
    conn = sqlite3.connect(path)
    header = msgpack.packb({"version": 1, "block_size": 4, "world_size": 1})
    d1 = link(GENESIS, [(1, "journal_opened", 0, None, None, header)])
    d2 = link(d1, [(2, kind, 0, 0, None, payload)])
    conn.executemany(
        "INSERT INTO records VALUES (?,?,?,?,?,?,?)",
        [(1, "journal_opened", 0, None, None, header, d1), (2, kind, 0, 0, None, payload, d2)],
    )
    conn.commit()
    conn.close()
    try:
        with Journal(path, readonly=True) as journal:
            ledger = Ledger()
            for record in journal.records():
                entry = from_record(record, path=str(path))
                ledger.apply(entry.seq, entry.step, entry.event)
    except (RecordError, JournalError):
        pass
    shutil.rmtree(folder)


def _flips(size: int) -> list[int]:
    """Offsets to flip: densely in the first page (the schema: sqlite_master),
    sparsely over the rest (records, the chain, free space)."""
    return sorted({*range(0, min(size, 4096), 5), *range(4096, size, 89)})


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_single_byte_flips_never_give_a_traceback_or_a_false_verdict(
    tmp_path: Path, command: str, capsys
) -> None:  # type: ignore[no-untyped-def]
    """A damaged clean journal is read as clean (the flip hit unused space) or
    refused with exit 2 naming the file: never a traceback, never exit 1."""
    original = db_from(tmp_path, "clean.db").read_bytes()
    flipped = tmp_path / "flipped.db"
    seen = set()
    for offset in _flips(len(original)):
        damaged = bytearray(original)
        damaged[offset] = 0xFF if damaged[offset] != 0xFF else 0x00
        flipped.write_bytes(bytes(damaged))
        for leftover in ("o.jsonl", "o.json", "o.db"):
            (tmp_path / leftover).unlink(missing_ok=True)
        status = main(COMMANDS[command](str(flipped), tmp_path))
        _out, err = capsys.readouterr()
        assert "Traceback" not in err, (offset, err)
        assert status in (0, 2), (offset, status, err[-500:])
        if status == 2:
            message = [line for line in err.splitlines() if line.startswith("kvstate: error:")]
            assert len(message) == 1 and "flipped.db" in message[0], (offset, err)
        seen.add(status)
    assert 2 in seen  # the flips were read, and refused


def test_a_huge_value_is_cut_on_the_terminal_and_whole_in_json(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A 3 MB request id: the human report shows its start and says how much is
    left out (the report's layout work once grew with the square of its
    length); ``--json`` carries it whole."""
    huge = "r" * 3_000_000
    path = tmp_path / "huge.jsonl"
    preempt = {"seq": 3, "kind": "request_preempted", "step": 0, "req": huge, "gen": 1}
    path.write_text(lines(admit(req=json.dumps(huge)), json.dumps(preempt)))
    status = main(["replay", str(path)])
    out, err = capsys.readouterr()
    assert status == 1, err  # CAUSALITY: generation 1 was never admitted
    assert "more characters; --json has them all" in out
    assert max(len(line) for line in out.splitlines()) < 2_000
    status = main(["replay", "--json", str(path)])
    out, _ = capsys.readouterr()
    report = json.loads(out)
    assert any(v.get("req") == huge for v in report["violations"])


@pytest.mark.parametrize("bad", ["reordered seq", "not UTF-8", "broken json", "duplicated seq"])
def test_replay_and_the_inspector_read_jsonl_with_one_reader(tmp_path: Path, bad: str) -> None:
    """The inspector had a JSON Lines parser of its own, with other words for
    the same bad file; both now read through journal.jsonl.JsonlReader."""
    from replay.sources import read_path
    from replay.timetravel import TimeTravel

    path = BAD_INPUTS[bad](tmp_path)
    with pytest.raises(RecordError) as by_replay:
        list(read_path(path))
    with pytest.raises(RecordError) as by_inspector:
        TimeTravel(str(path))
    assert str(by_inspector.value) == str(by_replay.value)
