"""When a journal's current segment is closed and the next begun (:class:`Rotation`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator

from .database import BEFORE_FIRST, Journal
from .errors import JournalError, SegmentError
from .segment_files import file_bytes, id_of_open, segment_path, sync_folder


class Rotation:
    """When the current segment is closed and the next begun: at ``max_bytes``
    on disk or ``max_seconds`` since it was opened, whichever comes first
    (None: never). Checked at commit boundaries only, so no commit spans two
    segments.

    ``keep_bytes`` and ``keep_seconds`` add retention (:mod:`journal.retention`):
    each new segment begins with a checkpoint, and the oldest segments are
    removed while the journal is over either budget.
    """

    def __init__(
        self,
        *,
        max_bytes: int | None = None,
        max_seconds: float | None = None,
        keep_bytes: int | None = None,
        keep_seconds: float | None = None,
    ) -> None:
        for name, value in (
            ("max_bytes", max_bytes),
            ("max_seconds", max_seconds),
            ("keep_bytes", keep_bytes),
            ("keep_seconds", keep_seconds),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"rotation's {name} must be positive, not {value!r}")
        if (keep_bytes or keep_seconds) and not (max_bytes or max_seconds):
            raise ValueError("retention removes whole segments: give a rotation size or age too")
        if keep_bytes is not None and max_bytes is not None and keep_bytes < 2 * max_bytes:
            raise ValueError(
                f"a retention budget of {keep_bytes} bytes cannot hold the segment being "
                f"written and one before it ({max_bytes} bytes each): keep at least twice "
                "the rotation size"
            )
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.keep_bytes = keep_bytes
        self.keep_seconds = keep_seconds
        self._opened = time.monotonic()
        #: what the current segment held when it was begun (its checkpoint):
        #: the size rotates on is of the records written since
        self._begun_bytes = 0
        #: the size rotated on: ``max_bytes``, grown to the bytes of the
        #: checkpoint the current segment begins with where that is larger
        self.rotate_bytes, self.checkpoint_bytes = max_bytes, 0
        #: what ``keep_bytes`` lacks to hold the current segment at its full
        #: size, and what was last said (set by journal.retention.remove_old)
        self.short_bytes = 0
        self.said = {"rotate": 0, "short": 0}

    @property
    def retains(self) -> bool:
        """Whether old segments are removed (so each new one needs a checkpoint)."""
        return self.keep_bytes is not None or self.keep_seconds is not None

    def spec(self) -> str:
        """The rotation as one argument (``BYTES,SECONDS,KEEP_BYTES,KEEP_SECONDS``,
        each may be empty) for a writer process; :meth:`from_spec` reads it back."""
        values = (self.max_bytes, self.max_seconds, self.keep_bytes, self.keep_seconds)
        return ",".join("" if v is None else str(v) for v in values)

    @classmethod
    def from_spec(cls, spec: str) -> Rotation | None:
        size, age, keep_size, keep_age = [*spec.split(","), "", "", ""][:4]
        if not size and not age:
            return None
        return cls(
            max_bytes=int(size) if size else None,
            max_seconds=float(age) if age else None,
            keep_bytes=int(keep_size) if keep_size else None,
            keep_seconds=float(keep_age) if keep_age else None,
        )

    def due(self, journal: Journal) -> bool:
        """Whether ``journal``, the current segment, is to be closed now."""
        if self.max_seconds is not None and time.monotonic() - self._opened >= self.max_seconds:
            return True
        if self.rotate_bytes is not None:
            return file_bytes(journal.path) - self._begun_bytes >= self.rotate_bytes
        return False

    def rotate(
        self,
        journal: Journal,
        first: str,
        index: int,
        *,
        synchronous: str,
        checkpoint: Iterable[bytes] | None = None,
    ) -> Journal:
        """Close ``journal`` (segment ``index`` of the journal whose first
        segment is ``first``) and return the next segment, open for appends,
        beginning with ``checkpoint`` when given (the application's state
        after the closed segment's last commit).

        The next file must not exist: a segment is never overwritten.
        """
        seq, link = journal.head()
        if seq == BEFORE_FIRST:
            raise JournalError(f"{journal.path}: an empty segment is not rotated")
        ident = _id_of(journal)
        views = journal.view_definitions()  # each segment reads with SQL as the first does
        journal.close()  # its commits are durable already; closing folds the WAL in
        path = segment_path(first, index + 1)
        if os.path.exists(path):
            raise SegmentError(f"{path}: the next segment exists already; not overwritten")
        # Made whole under a hidden name, then renamed into place: a reader
        # following the journal never sees a segment without its table, nor
        # a checkpoint cut short.
        folder, name = os.path.split(path)
        hidden = os.path.join(folder, f".{name}.tmp")
        for leftover in (hidden, hidden + "-wal", hidden + "-shm"):
            if os.path.exists(leftover):  # ours, from a rotation killed half-way
                os.unlink(leftover)
        counted = [0]  # the checkpoint's bytes, counted as its parts are stored
        with Journal(hidden, synchronous=synchronous) as nxt:
            nxt.continue_after(
                index=index + 1,
                journal_id=ident,
                previous_seq=seq,
                previous_link=link,
                previous_name=os.path.basename(journal.path),
                checkpoint=None if checkpoint is None else _counting(checkpoint, counted),
            )
            nxt.define_views(views)
        if os.path.exists(path):  # made meanwhile by someone else: theirs
            os.unlink(hidden)
            raise SegmentError(f"{path}: the next segment exists already; not overwritten")
        os.rename(hidden, path)
        sync_folder(folder)  # the new name is durable before anything is removed
        self._opened = time.monotonic()
        nxt = Journal(path, synchronous=synchronous)
        self._begun_bytes = file_bytes(path)
        self.checkpoint_bytes = counted[0]
        if self.max_bytes is not None and checkpoint is not None:
            # A segment's records are never fewer bytes than its checkpoint:
            # rotated sooner, the writer would spend its time writing
            # checkpoints (said by journal.retention.say_sizes)
            self.rotate_bytes = max(self.max_bytes, counted[0])
        return nxt


def _counting(parts: Iterable[bytes], counted: list[int]) -> Iterator[bytes]:
    for part in parts:
        counted[0] += len(part)
        yield part


def _id_of(journal: Journal) -> str:
    ident = id_of_open(journal)
    if ident is None:
        raise JournalError(f"{journal.path}: a journal with no commit has no segments")
    return ident
