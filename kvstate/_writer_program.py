"""The journal writer process: the program behind :class:`kvstate.process_writer.ProcessWriter`.

Run as ``python -m kvstate._writer_program PATH SYNCHRONOUS SETTINGS
PARENT_PID [ROTATION]``, ``SETTINGS`` a :class:`kvstate.writer_codec.CodecSettings`
as JSON. It reads frames from standard input, each one encoded batch handed
over by the engine process, turns a batch into rows with
:class:`kvstate.writer_codec.BatchCodec` (the typed decode that refuses what
the contract refuses), appends them to the journal as one commit (the one
place a record passes into :mod:`journal`), tells the codec, and answers on
standard output when the engine asked to wait, with the codec's report
(what its audit of the committed records found). The codec's work on a
batch runs after the answer, so the engine goes on meanwhile; a frame
flagged ``SETTLE`` (or ``CLOSE``) is answered after it instead. The codec is
told of each rotation, and of the sizes in force at the start and after
each rotation: the rotation size, the checkpoint's bytes and what the byte
budget lacks (see :mod:`journal.retention`).

It never outlives its parent: when standard input ends without the close
frame (the engine was killed, or crashed in C), or the parent process is
gone, it writes every batch it was given, appends ``engine_crashed`` for an
orphaned journal and exits. It ignores SIGINT, which a terminal sends to the
whole process group: the engine decides when the writer stops, by closing
it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from typing import Any

from journal.database import Journal
from journal.rotation import Rotation
from journal.segments import Rotating

from ._frames import ANSWER, CLOSE, FRAME, SETTLE, WAIT
from .writer_codec import BatchCodec, CodecSettings

#: how often (seconds) an idle writer checks that its parent is still alive;
#: this decides nothing about progress, only when a dead parent is noticed
PARENT_CHECK_S = 1.0


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at end of input (a partial frame included)."""
    parts = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def _answer(fd: int, ticket: int, error: str | None, report: bytes) -> None:
    message = (error or "").encode("utf-8", "replace")
    data = memoryview(ANSWER.pack(ticket, len(message), len(report)) + message + report)
    while data:
        data = data[os.write(fd, data) :]


def _on_rotate(codec: BatchCodec, rotation: Rotation | None) -> Any:
    """What the writer calls after each rotation: the codec's ``rotated``,
    then its ``sized``; the sizes as they stand at the start are told now."""
    if rotation is None:
        return codec.rotated

    def told(index: int, path: str, removed: list[str]) -> None:
        codec.rotated(index, path, removed)
        codec.sized(rotation.rotate_bytes, rotation.checkpoint_bytes, rotation.short_bytes)

    codec.sized(rotation.rotate_bytes, rotation.checkpoint_bytes, rotation.short_bytes)
    return told


def serve(
    path: str,
    synchronous: str,
    settings: CodecSettings,
    parent: int,
    fd_in: int,
    fd_out: int,
    rotation: Rotation | None = None,
) -> int:
    """The writer's loop; returns the exit status."""
    codec = BatchCodec(settings)
    # with retention, each new segment begins with the codec's checkpoint
    checkpoint = codec.checkpoint if rotation is not None and rotation.retains else None
    segment = Rotating(
        Journal(path, synchronous=synchronous),
        rotation,
        synchronous=synchronous,
        checkpoint=checkpoint,
        on_rotate=_on_rotate(codec, rotation),
    )
    written = 0
    error: str | None = None
    try:
        while True:
            ready, _, _ = select.select([fd_in], [], [], PARENT_CHECK_S)
            if not ready:
                if os.getppid() != parent:
                    break  # orphaned: nothing more can arrive
                continue
            header = _read_exact(fd_in, FRAME.size)
            if header is None:
                break
            ticket, length, flags = FRAME.unpack(header)
            blob = _read_exact(fd_in, length) if length else b""
            if blob is None:
                break  # a frame cut short: its batch never arrived whole
            committed = False
            if blob and error is None:
                try:
                    segment.journal.append_rows(codec.rows(blob))
                    committed = True
                except Exception as exc:  # reported to the engine on its next wait
                    error = f"{type(exc).__name__}: {exc}"
            written = ticket
            closed = bool(flags & CLOSE)
            if committed and flags & (CLOSE | SETTLE):
                # the last findings go with the last answer; a settling
                # engine waits for this batch's own
                codec.committed()
                committed = False
            if flags & (WAIT | CLOSE):
                # The batch is durable: the engine goes on while the codec
                # works on it (its findings come with the next answer). The
                # engine may be gone: what it handed over is written all the same.
                with contextlib.suppress(OSError):
                    _answer(fd_out, written, error, codec.report())
            if committed:
                codec.committed()
            if closed:
                return 0
            if blob and error is None:
                # Between two commits, the engine not waiting: the segment is
                # closed whole before the next takes a record.
                try:
                    segment.committed()
                except Exception as exc:
                    error = f"rotating the journal: {type(exc).__name__}: {exc}"
        if error is None:
            last_seq, _ = segment.journal.head()
            segment.journal.append_rows(codec.orphaned(last_seq))
        return 0
    finally:
        segment.journal.close()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    path, synchronous, settings, parent, *rest = argv
    rotation = Rotation.from_spec(rest[0]) if rest else None
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    given = CodecSettings.decode(settings)
    return serve(path, synchronous, given, int(parent), stdin, stdout, rotation)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
