"""The writer conformance suite: every :class:`kvstate.writer_protocol.Writer` keeps one promise.

:class:`WriterContract` is the suite (the way eventsourcing's recorder tests
are one class each recorder subclasses): durable on commit, even when the
process is killed the moment ``commit()`` returned; batches in commit
order; the hash chain intact; ``close()`` idempotent and final; and, with
``settle=True``, the writer's audit of the batch answered before the
commit returns. Each writer kvstate uses subclasses it with its factory.

A writer that acknowledges a batch before it is durable must fail the
suite: :class:`AcknowledgesFirst` does exactly that, and the last test shows
the suite catching it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from journal import Journal, JournalError
from kvstate import events as ev
from kvstate.codec import Entry, to_row
from kvstate.process_writer import ProcessWriter
from kvstate.thread_writer import JournalWriter
from kvstate.writer_codec import CodecSettings
from kvstate.writer_protocol import Writer

ROOT = Path(__file__).resolve().parent.parent
HEADER = ev.JournalOpened(version=1, block_size=4, world_size=1)


def entries(first: int, n: int) -> list[Entry]:
    """``n`` entries from seq ``first`` (a header at seq 1)."""
    out = []
    for seq in range(first, first + n):
        event: ev.Event = (
            HEADER if seq == 1 else ev.RequestAdmitted(req=f"r{seq}", gen=0, prompt_tokens=4)
        )
        out.append(Entry(seq, 1, seq, event))
    return out


def stored_seqs(path: Path) -> list[int]:
    """What a second reader finds on disk, the chain checked."""
    with Journal(path, readonly=True) as journal:
        return [r.seq for r in journal.records(verify=True)]


# -- the writers, as factories a child process can name too -------------------------

#: what each writer's audit found, per writer (the after-write / report hook)
FOUND: dict[str, list[Any]] = {}


def thread_writer(path: Path) -> Writer[Entry]:
    found = FOUND.setdefault(str(path), [])
    return JournalWriter(Journal(path), to_row, after_write=found.append)


def committing_thread_writer(path: Path) -> Writer[Entry]:
    found = FOUND.setdefault(str(path), [])
    return JournalWriter(Journal(path), to_row, background=False, after_write=found.append)


def process_writer(path: Path) -> Writer[Entry]:
    Journal(path).close()  # the schema; the process opens its own
    found = FOUND.setdefault(str(path), [])
    return ProcessWriter(path, settings=CodecSettings(fold="scheduler"), on_found=found.extend)


class _Gated(JournalWriter[Entry]):
    """Writes only once :meth:`open_gate` ran (close opens it)."""

    def __init__(self, path: Path) -> None:
        self.gate = threading.Event()
        super().__init__(Journal(path), self._held)

    def _held(self, entry: Entry) -> Any:
        self.gate.wait()
        return to_row(entry)

    def commit(self, *, wait: bool = True, settle: bool = False) -> None:
        # The defect under test: the caller is told "durable" at once.
        super().commit(wait=False)

    def _close(self) -> None:
        self.gate.set()
        super()._close()


def acknowledges_first(path: Path) -> Writer[Entry]:
    return _Gated(path)


FACTORIES: dict[str, Callable[[Path], Writer[Entry]]] = {
    "thread": thread_writer,
    "committing_thread": committing_thread_writer,
    "process": process_writer,
    "acknowledges_first": acknowledges_first,
}


# -- the suite --------------------------------------------------------------------------


class WriterContract:
    """Subclass with ``factory`` naming one of :data:`FACTORIES`."""

    factory: ClassVar[str]

    def make(self, path: Path) -> Writer[Entry]:
        return FACTORIES[self.factory](path)

    def test_a_commit_is_durable_when_it_returns(self, tmp_path: Path) -> None:
        path = tmp_path / "j.db"
        writer = self.make(path)
        for entry in entries(1, 5):
            writer.append(entry)
        writer.commit()
        assert stored_seqs(path) == [1, 2, 3, 4, 5], "commit returned before the batch was durable"
        writer.close()

    def test_batches_are_written_whole_in_commit_order(self, tmp_path: Path) -> None:
        path = tmp_path / "j.db"
        writer = self.make(path)
        for first, n in ((1, 3), (4, 1), (5, 40)):
            for entry in entries(first, n):
                writer.append(entry)
            writer.commit(wait=False)
        writer.flush()
        assert stored_seqs(path) == list(range(1, 45))
        writer.close()

    def test_close_is_final_and_idempotent(self, tmp_path: Path) -> None:
        path = tmp_path / "j.db"
        writer = self.make(path)
        for entry in entries(1, 2):
            writer.append(entry)
        writer.close()  # flushes
        writer.close()
        assert stored_seqs(path) == [1, 2]
        assert writer.path == str(path)
        with pytest.raises(JournalError, match="closed"):
            writer.append(entries(3, 1)[0])
        with pytest.raises(JournalError, match="closed"):
            writer.commit()

    def test_a_process_killed_right_after_commit_keeps_the_batch(self, tmp_path: Path) -> None:
        path = tmp_path / "j.db"
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.factory, str(path)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert child.stdout is not None
        line = child.stdout.readline()  # printed the moment commit() returned
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert line.strip() == "committed"
        seqs = stored_seqs(path)
        assert seqs[:10] == list(range(1, 11)), "a batch acknowledged was lost with the process"

    def test_settle_answers_with_the_audit_of_the_batch(self, tmp_path: Path) -> None:
        path = tmp_path / "j.db"
        writer = self.make(path)
        for entry in entries(1, 1):
            writer.append(entry)
        writer.commit()
        poisoned = Entry(2, 1, 2, ev.KeyVerified(key="k", ok=False))
        writer.append(poisoned)
        writer.commit(settle=True)
        found = FOUND[str(path)]
        batches = [item for item in found if isinstance(item, list)]  # after_write's batches
        codes = [item.code.value for item in found if not isinstance(item, list)]  # reports
        assert poisoned in [e for batch in batches for e in batch] or codes == ["POISONED_KEY"]
        writer.close()


_CHILD = """
import sys
from pathlib import Path
from tests.test_writers import FACTORIES, entries
writer = FACTORIES[sys.argv[1]](Path(sys.argv[2]))
for entry in entries(1, 10):
    writer.append(entry)
writer.commit()
print("committed", flush=True)
import time
while True:
    time.sleep(1)  # killed here, never closed
"""


class TestThreadWriter(WriterContract):
    factory = "thread"


class TestCommittingThreadWriter(WriterContract):
    factory = "committing_thread"


class TestProcessWriter(WriterContract):
    factory = "process"


class AcknowledgesFirst(WriterContract):
    """Not collected (no ``Test`` prefix): the broken writer the suite must catch."""

    factory = "acknowledges_first"


@pytest.mark.parametrize(
    "check",
    [
        "test_a_commit_is_durable_when_it_returns",
        "test_a_process_killed_right_after_commit_keeps_the_batch",
    ],
)
def test_the_suite_fails_a_writer_that_acknowledges_before_durable(
    tmp_path: Path, check: str
) -> None:
    with pytest.raises(AssertionError, match=r"durable|lost"):
        getattr(AcknowledgesFirst(), check)(tmp_path)
