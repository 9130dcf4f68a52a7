"""--minimize: a large journal with one injected bug shrinks to a few dozen
records that still fail the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from replay.minimize import ddmin

WORLD = 2


def healthy_request(i: int, blocks: list[int], out: list[dict]) -> None:
    req, job = f"r{i}", i
    out.append({"kind": "request_admitted", "req": req, "gen": 0, "prompt_tokens": 8})
    out.append(
        {"kind": "blocks_assigned", "req": req, "gen": 0, "blocks": blocks, "mode": "append"}
    )
    out.append(
        {"kind": "job_enqueued", "job": job, "req": req, "gen": 0, "token_start": 0,
         "token_end": 8, "reads": blocks, "pins": blocks, "keys": [f"k{i}a", f"k{i}b"],
         "world_size": WORLD}
    )  # fmt: skip
    for rank in range(WORLD):
        out.append({"kind": "job_received", "job": job, "rank": rank})
    for rank in range(WORLD):
        for kind in ("job_started", "dma_started", "dma_done"):
            out.append({"kind": kind, "job": job, "rank": rank})
        out.append({"kind": "put_done", "job": job, "rank": rank, "stored": 2, "existed": 0})
        out.append({"kind": "offset_saved", "job": job, "rank": rank, "req": req, "offset": 8})
        out.append({"kind": "job_reported", "job": job, "rank": rank})
    out.append({"kind": "completions_received", "job": job, "count": WORLD})
    out.append({"kind": "pins_released", "job": job, "blocks": blocks[::-1]})
    out.append({"kind": "request_finished", "req": req, "gen": 0})


def poisoned_request(i: int, blocks: list[int], out: list[dict]) -> None:
    """The #52360 shape: no pins, preempted, blocks handed to a thief, then the DMA."""
    req, job = f"r{i}", i
    out.append({"kind": "request_admitted", "req": req, "gen": 0, "prompt_tokens": 8})
    out.append(
        {"kind": "blocks_assigned", "req": req, "gen": 0, "blocks": blocks, "mode": "append"}
    )
    out.append(
        {"kind": "job_enqueued", "job": job, "req": req, "gen": 0, "token_start": 0,
         "token_end": 8, "reads": blocks, "pins": [], "keys": [f"k{i}a", f"k{i}b"],
         "world_size": WORLD}
    )  # fmt: skip
    for rank in range(WORLD):
        out.append({"kind": "job_received", "job": job, "rank": rank})
    out.append({"kind": "request_preempted", "req": req, "gen": 0})
    out.append({"kind": "request_admitted", "req": "thief", "gen": 0, "prompt_tokens": 8})
    out.append(
        {"kind": "blocks_assigned", "req": "thief", "gen": 0, "blocks": blocks, "mode": "append"}
    )
    for rank in range(WORLD):
        for kind in ("job_started", "dma_started", "dma_done"):
            out.append({"kind": kind, "job": job, "rank": rank})
        out.append({"kind": "put_done", "job": job, "rank": rank, "stored": 2, "existed": 0})
        out.append({"kind": "job_reported", "job": job, "rank": rank})
    out.append({"kind": "completions_received", "job": job, "count": WORLD})
    out.append({"kind": "request_finished", "req": req, "gen": 0})
    out.append({"kind": "request_finished", "req": "thief", "gen": 0})


def big_journal(path: Path, requests: int, bad: int) -> int:
    records: list[dict] = [
        {"kind": "journal_opened", "version": 1, "block_size": 4, "world_size": WORLD}
    ]
    for i in range(requests):
        blocks = [(2 * i) % 64, (2 * i + 1) % 64]
        (poisoned_request if i == bad else healthy_request)(i, blocks, records)
    records.append({"kind": "engine_idle"})
    with path.open("w") as f:
        for seq, record in enumerate(records, 1):
            f.write(json.dumps({"seq": seq, "step": seq // 20, **record}) + "\n")
    return len(records)


def test_a_100k_record_journal_shrinks_to_a_few_dozen_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = tmp_path / "big.jsonl", tmp_path / "min.jsonl"
    total = big_journal(path, 5_000, bad=2_500)
    assert total >= 100_000
    assert main(["replay", "--json", "--minimize", str(out), str(path)]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["code"] == "POISONED_READ" and summary["records"] == total
    assert summary["minimized"] <= 36
    assert main(["replay", "--json", str(out)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["violations"][0]["code"] == "POISONED_READ"
    assert report["violations"][0]["seq"] == summary["seq"]  # original seqs are kept
    kinds = [json.loads(line)["kind"] for line in out.read_text().splitlines()]
    assert kinds[0] == "journal_opened" and "request_preempted" in kinds


def test_clean_journal_has_nothing_to_minimize(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.jsonl"
    big_journal(path, 10, bad=-1)
    assert main(["replay", "--minimize", str(tmp_path / "m.jsonl"), str(path)]) == 0
    assert "nothing to minimize" in capsys.readouterr().out
    assert not (tmp_path / "m.jsonl").exists()


def test_ddmin_finds_a_one_minimal_subsequence() -> None:
    needed = {3, 17, 42}
    result = ddmin(list(range(100)), lambda xs: needed <= set(xs))
    assert result == [3, 17, 42]
