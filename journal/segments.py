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

import os
from collections.abc import Callable, Iterable, Iterator

from .database import BEFORE_FIRST, Journal
from .errors import JournalError, SegmentError
from .retention import remove_old
from .rotation import Rotation
from .segment_files import file_bytes as file_bytes
from .segment_files import first_of as first_of
from .segment_files import id_of_open as id_of_open
from .segment_files import later_indexes, segment_path
from .segment_files import later_segments as later_segments
from .segment_files import present as present


def journal_id(first: Journal) -> str:
    """The id every later segment of ``first``'s journal carries: the digest
    of its first commit, in hex (a journal with no commit cannot rotate)."""
    link = first.first_link()
    if link is None:
        raise JournalError(f"{first.path}: a journal with no commit has no segments")
    return link.hex()


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
    later = later_indexes(first)
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
        beyond = [i for i in later_indexes(first) if i > index]
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


def last_seq(first: Journal) -> int:
    """The last seq the journal whose first segment is open as ``first``
    holds, in its last segment (a count, for a progress bar: seqs run 1..N
    across segments). A journal that never rotated is not opened again."""
    name = head_name(first.path)
    later = later_indexes(name)
    if not later or _same(segment_path(name, later[-1]), first.path):
        return first.head()[0]
    with Journal(segment_path(name, later[-1]), readonly=True) as journal:
        return journal.head()[0]


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
            removed = remove_old(self.first, self.index, rotation)
            self.removed += removed
        if self.on_rotate is not None:
            self.on_rotate(self.index, self.journal.path, removed)
