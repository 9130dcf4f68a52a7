"""A disk that fills up: an error naming the journal's folder, and every committed record kept.

A small tmpfs (mounted here; the test needs root, as CI runs) is filled by
a recorder's writer process. The commit that finds no room is an error
that names the folder; what was committed before it is all there, its
chain verified.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from journal import Journal, JournalError
from kvstate import Recorder, SchedulerLedger


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_full_disk_names_the_folder_and_loses_no_committed_record(small_disk: Path) -> None:
    path = small_disk / "engine.db"
    rec = Recorder.open(path, block_size=16, world_size=1)
    s = SchedulerLedger(rec, strict=False)
    committed = 0
    with pytest.raises(JournalError) as info:
        for i in range(1_000_000):  # until the disk is full; it is 2 MB
            s.begin_step()
            s.admit(f"r{i}", 16)
            s.assign_blocks(f"r{i}", [i % 50 + 1], resumed=False)
            rec.commit()
            committed = rec.recorded
    assert f"the disk holding {small_disk} is full" in str(info.value)
    with pytest.raises(JournalError):
        rec.close(raise_found=False)  # the writer's failure is said again, never hidden
    with Journal(path, readonly=True) as journal:
        seqs = [row[0] for row in journal.stored_rows()]  # the chain verified on read
    assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) >= committed
