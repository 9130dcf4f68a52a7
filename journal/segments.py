"""A journal as a run of segments: rotated at a commit boundary, one chain across them.

A writer that runs for weeks rotates its journal: once the current segment
has reached a size or an age, its last commit is durable and it is closed,
and the next segment is created beside it. ``engine.db`` is the first
segment; the later ones are ``engine.000002.db``, ``engine.000003.db``, ...
Each later segment holds, in a one-row ``segment`` table, its index, the
journal's id (the same in every segment), and the seq and link of the
previous segment's last commit: its first commit follows that seq and links
to that link. So the hash chain runs across segments as it runs across
commits, and :func:`segments` hands a reader the files of one journal in
order, after checking that each follows the one before: a missing segment,
one out of order, one of another journal, or one whose predecessor was
replaced is named, with the file.

The first segment is an ordinary journal (no ``segment`` table), so a
journal that never rotated reads as it always did. Its id, for its later
segments, is the digest of its first commit.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator

from .database import BEFORE_FIRST, Journal
from .errors import JournalError

#: the index of a later segment in its file name: ``NAME.000002.db``
_LATER = re.compile(r"^(?P<stem>.+)\.(?P<index>\d{6})(?P<suffix>\.[^.]+)?$")


class SegmentError(JournalError):
    """The segments of a journal do not follow each other (the message names the file)."""


def segment_path(first: str | os.PathLike[str], index: int) -> str:
    """The file of segment ``index`` (1: the first segment itself)."""
    path = os.fspath(first)
    if index == 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{index:06d}{suffix}"


def journal_id(first: Journal) -> str:
    """The id every later segment of ``first``'s journal carries: the digest
    of its first commit, in hex (a journal with no commit cannot rotate)."""
    link = first.first_link()
    if link is None:
        raise JournalError(f"{first.path}: a journal with no commit has no segments")
    return link.hex()


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
        _sync_folder(folder)  # the new name is durable before anything is removed
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


def file_bytes(path: str) -> int:
    """A journal file's size on disk, its write-ahead log and shared index included."""
    total = 0
    for name in (path, path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            total += os.path.getsize(name)
    return total


def _sync_folder(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _id_of(journal: Journal) -> str:
    ident = id_of_open(journal)
    if ident is None:
        raise JournalError(f"{journal.path}: a journal with no commit has no segments")
    return ident


def segments(first: str | os.PathLike[str]) -> Iterator[Journal]:
    """The segments of the journal whose first segment is ``first``, each
    open read-only, in order, each checked to follow the one before (see the
    module docstring). Each is closed when the next is taken (a ``with``
    block around each closes it as well).

    Raises :class:`SegmentError` naming the file that does not follow.
    """
    oldest = open_first(os.fspath(first))
    path = head_name(oldest.path)
    row = oldest.segment()
    journal: Journal | None = oldest
    # the journal's id, read now: retention may remove the first segment
    # while it is read
    index, ident = (1, id_of_open(oldest)) if row is None else (row[0], row[1])
    while journal is not None:
        head = journal.head()  # what the next segment must follow
        name = journal.path
        yield journal
        journal.close()
        index += 1
        journal = open_next(path, index, head, name, ident)


def open_first(first: str) -> Journal:
    """The first segment there is of the journal whose first segment is
    named ``first``, open read-only.

    That is ``first`` itself, or, once retention removed the journal's head
    (:mod:`journal.retention`), its oldest remaining segment, which must
    begin with a checkpoint (given by name, or found from ``first``'s). A
    later segment named while an older one is there is refused.
    """
    head = first_of(first)
    if head is not None:
        oldest = _oldest(head)
        if os.path.exists(head) or oldest is None or not _same(oldest, first):
            raise SegmentError(
                f"{first}: a later segment of a journal; give its first segment"
                + ("" if oldest is None or os.path.exists(head) else f" ({oldest})")
            )
        return _open_head(first)
    if not os.path.exists(first):
        oldest = _oldest(first)
        if oldest is not None:
            return _open_head(oldest)
    journal = Journal(first, readonly=True)
    if journal.segment() is not None:
        journal.close()
        raise SegmentError(f"{first}: a later segment of a journal; give its first segment")
    return journal


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _oldest(first: str) -> str | None:
    """The oldest later segment of the journal named ``first`` (None: none)."""
    later = _later_indexes(first)
    return segment_path(first, later[0]) if later else None


def _open_head(path: str) -> Journal:
    """A later segment that begins what is left of a journal whose head was removed."""
    journal = Journal(path, readonly=True)
    if journal.segment() is None or journal.checkpoint() is None:
        journal.close()
        raise SegmentError(
            f"{path}: the segments before it are gone, and it begins with no "
            "checkpoint to go on from"
        )
    return journal


def is_start(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is where a journal begins: a first segment, or the
    oldest remaining segment of one whose head retention removed (a folder's
    listing shows each journal once, by this file)."""
    name = os.fspath(path)
    head = first_of(name)
    if head is None:
        return True
    oldest = _oldest(head)
    return not os.path.exists(head) and oldest is not None and _same(oldest, name)


def id_of_open(journal: Journal) -> str | None:
    """The id of the journal whose segment ``journal`` is (None: a first
    segment with no commit yet, which has no later segment either)."""
    row = journal.segment()
    if row is not None:
        return row[1]
    link = journal.first_link()
    return None if link is None else link.hex()


def is_removed_head(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names the first segment of a journal that retention
    removed, later segments of which remain (a reader starts at the oldest)."""
    name = os.fspath(path)
    return not os.path.exists(name) and first_of(name) is None and _oldest(name) is not None


def head_name(path: str) -> str:
    """The name of segment 1 of the journal ``path`` is a segment of."""
    return first_of(path) or path


def base_seq(journal: Journal) -> int:
    """The seq after which ``journal``'s records begin (its segment's predecessor's last)."""
    row = journal.segment()
    return BEFORE_FIRST if row is None else row[2]


def open_next(
    first: str,
    index: int,
    after: tuple[int, bytes],
    previous: str,
    ident: str | None = None,
) -> Journal | None:
    """Segment ``index`` (2 or more) of the journal whose first segment is
    ``first``, open read-only and checked to follow ``after`` (the seq and
    link that ``previous``, segment ``index - 1``, ends with); None while
    there is no such file and no later one. ``ident``: the journal's id
    (read from ``first`` when not given; given where the head was removed).
    """
    path = segment_path(first, index)
    if not os.path.exists(path):
        beyond = [i for i in _later_indexes(first) if i > index]
        if beyond:
            if not os.path.exists(first) and not os.path.exists(previous):
                # the writer's retention went past this reader (a journal still written)
                raise SegmentError(
                    f"{path}: removed by retention while the journal was read (it now "
                    f"begins at segment {beyond[0]}): read it again"
                )
            raise SegmentError(
                f"{path}: segment {index} is missing, and segment {beyond[0]} exists"
            )
        return None
    if ident is None:
        with Journal(first, readonly=True) as head:
            ident = journal_id(head)
    journal = Journal(path, readonly=True)
    row = journal.segment()
    name = os.path.basename(previous)
    problem = None
    if row is None:
        problem = "has no segment table: not a later segment of this journal"
    elif row[1] != ident:
        problem = f"belongs to another journal (id {row[1]}, not {ident})"
    elif row[0] != index:
        problem = f"says it is segment {row[0]}, not {index}: out of order"
    elif (row[2], row[3]) != after:
        problem = (
            f"does not follow {name} (it continues after seq {row[2]}; {name} ends at "
            f"seq {after[0]}, or its last link differs): a segment was replaced"
        )
    if problem is not None:
        journal.close()
        raise SegmentError(f"{path}: {problem}")
    return journal


def present(first: str) -> list[tuple[int, str]]:
    """The segments of the journal whose first segment is named ``first``
    that are on disk now, oldest first: (index, file)."""
    head = [(1, first)] if os.path.exists(first) else []
    return head + [(i, segment_path(first, i)) for i in _later_indexes(first)]


def later_segments(first: str) -> list[str]:
    """The later segments of the journal whose first segment is named ``first``."""
    return [segment_path(first, i) for i in _later_indexes(first)]


def _later_indexes(first: str) -> list[int]:
    folder = os.path.dirname(first) or "."
    stem, suffix = os.path.splitext(os.path.basename(first))
    found = []
    for name in os.listdir(folder):
        match = _LATER.match(name)
        if match and match["stem"] == stem and (match["suffix"] or "") == suffix:
            found.append(int(match["index"]))
    return sorted(found)


def last_seq(first: Journal) -> int:
    """The last seq the journal whose first segment is open as ``first``
    holds, in its last segment (a count, for a progress bar: seqs run 1..N
    across segments). A journal that never rotated is not opened again."""
    name = head_name(first.path)
    later = _later_indexes(name)
    if not later or _same(segment_path(name, later[-1]), first.path):
        return first.head()[0]
    with Journal(segment_path(name, later[-1]), readonly=True) as journal:
        return journal.head()[0]


def first_of(path: str | os.PathLike[str]) -> str | None:
    """The first segment of the journal ``path`` is a later segment of, by
    name (None: ``path`` is not named as a later segment)."""
    name = os.fspath(path)
    match = _LATER.match(os.path.basename(name))
    if match is None or int(match["index"]) <= 1:
        return None
    return os.path.join(os.path.dirname(name), match["stem"] + (match["suffix"] or ""))


class Rotating:
    """The segment a writer appends to now, rotated after a commit when due.

    ``checkpoint`` gives the application's state after the last commit, in
    parts; with retention (:attr:`Rotation.retains`) each new segment begins
    with it, and then the oldest segments over the budget are removed.
    """

    def __init__(
        self,
        journal: Journal,
        rotation: Rotation | None,
        *,
        synchronous: str,
        checkpoint: Callable[[], Iterable[bytes]] | None = None,
        on_rotate: Callable[[int, str, list[str]], None] | None = None,
    ) -> None:
        if rotation is not None and rotation.retains and checkpoint is None:
            raise JournalError(
                f"{journal.path}: retention removes old segments only after a checkpoint "
                "of the state they folded into; this writer has none to write"
            )
        self.journal = journal
        self.first = head_name(journal.path)
        self.rotation = rotation
        self.synchronous = synchronous
        self.checkpoint = checkpoint
        #: told after each rotation: the new segment's index and file, and what
        #: retention removed then
        self.on_rotate = on_rotate
        row = journal.segment()
        self.index = 1 if row is None else row[0]
        #: the files retention removed, oldest first (for the figures and tests)
        self.removed: list[str] = []

    def committed(self) -> None:
        """After a commit: close the segment and begin the next, if due."""
        rotation = self.rotation
        if rotation is None or not rotation.due(self.journal):
            return
        # with retention, the constructor made sure there is a checkpoint to write
        retains = rotation.retains and self.checkpoint is not None
        self.journal = rotation.rotate(
            self.journal,
            self.first,
            self.index,
            synchronous=self.synchronous,
            checkpoint=self.checkpoint() if retains and self.checkpoint is not None else None,
        )
        self.index += 1
        removed: list[str] = []
        if retains:
            from .retention import remove_old

            removed = remove_old(self.first, self.index, rotation)
            self.removed += removed
        if self.on_rotate is not None:
            self.on_rotate(self.index, self.journal.path, removed)
