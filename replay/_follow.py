"""Follow mode of the one reader (:class:`replay.sources.Follower`).

A journal database read as another process writes it: each read gives
what was committed since the last one, chain-verified, across the segments
the writer rotates into (:mod:`journal.segments`), from the checkpoint of
the oldest segment left where retention removed records before they were
read. Left on for months beside an engine, the follower must never change
what it reads, nor keep it from becoming what its writer makes of it: it
holds no file open between two reads. A writer can take its file out of
WAL mode only while no other connection has it open
(:func:`journal.database._leave_wal`), so that a finished journal is one
file; and a file removed (by retention, by an operator) frees its disk.
"""

from __future__ import annotations

import os
from collections.abc import Generator

from journal import Journal, JournalError, RecordError, segments
from kvstate.codec import Located

from ._stored import resumed, rows

#: how often the oldest segment is opened again where retention removed it
#: as it was opened (each time, retention went on: progress, not a clock)
OPEN_TRIES = 100


class Gone(Exception):
    """Every file of a followed journal is gone (deleted or moved away)."""


class Follower:
    """One journal database followed as its writer appends to it.

    :meth:`read` yields the records committed since the last read, in
    order. Where the journal's head was removed before the first read, or
    retention removed records this follower had not read yet, the read
    begins with an item whose event is a :class:`kvstate.checkpoint.Resumed`
    (the oldest segment left's checkpoint), as :func:`replay.sources.read_path`
    begins at a removed head: the fold restores its ledger from it.

    Opening checks the journal can be read (raises :class:`JournalError`
    or :class:`RecordError` where it cannot); reads raise :class:`Gone`
    once every file of it is gone.
    """

    def __init__(self, path: str) -> None:
        #: the first segment's name, even once retention removed it
        self.path = segments.head_name(path)
        #: the last seq read (or resumed from)
        self.last = 0
        #: the last seq the journal held at the last read (at least :attr:`last`)
        self.written = 0
        #: the segment read now, and its index
        self.index = 1
        self.segment = path
        self._ident: str | None = None
        #: a checkpoint to hand out first: what came before it was removed unread
        self._pending: Located | None = None
        self._open_oldest().close()

    def last_written(self) -> int:
        """The last seq the journal holds now."""
        with segments.open_first(self.path) as journal:
            return segments.last_seq(journal)

    def read(self, limit: int) -> Generator[Located, None, None]:
        """What was committed since the last read, ``limit`` records at most
        (and a checkpoint before them, where retention overtook this reader).

        The file is open only while the items are read; close the iterator
        (``contextlib.closing``) where it is not read to its end.
        """
        journal = self._open_current()
        try:
            if self.last >= journal.head()[0]:
                journal = self._next_segment(journal)
            self.written = max(self.written, journal.head()[0])
            if self._pending is not None:
                item, self._pending = self._pending, None
                yield item
            for item in rows(journal, journal.path, self.last, self.last + limit):
                self.last = item.seq
                yield item
        finally:
            # The writer may have committed after the head was read above: what
            # was read is written too (else a journal read to its closing record
            # would look behind its own fold forever).
            self.written = max(self.written, self.last)
            journal.close()  # held by no read: the writer can make it one file

    # -- where to read ---------------------------------------------------------

    def _open_oldest(self) -> Journal:
        """The oldest segment left, open: the journal's start, or its checkpoint
        (handed out first where it is past what this follower read).

        Retention may remove that very segment between the listing and the
        open, or before its checkpoint is read: the listing is taken again,
        as long as it keeps changing (:data:`OPEN_TRIES` times at most).
        """
        for _ in range(OPEN_TRIES):
            before = segments.present(self.path)
            if not before:
                raise Gone
            journal = None
            try:
                journal = segments.open_first(self.path)
                row = journal.segment()
                index = 1 if row is None else row[0]
                ident = segments.id_of_open(journal)
                item = resumed(journal)
            except (JournalError, RecordError):
                if journal is not None:
                    journal.close()
                if segments.present(self.path) == before:
                    raise  # not retention's doing
                continue
            if item is not None and item.seq > self.last:
                # the records up to the checkpoint are gone: go on after it
                self._pending, self.last = item, item.seq
                self.written = max(self.written, item.seq)
            self.index, self.segment, self._ident = index, journal.path, ident
            return journal
        raise JournalError(
            f"{self.path}: its oldest segment was removed {OPEN_TRIES} times as it was "
            "opened: retention outruns this reader"
        )

    def _open_current(self) -> Journal:
        """The segment to read from now (raises :class:`Gone`)."""
        if os.path.exists(self.segment):
            try:
                return Journal(self.segment, readonly=True)
            except JournalError:
                if os.path.exists(self.segment):
                    raise  # there, and cannot be opened: said on its line
        # removed since the last read: by retention (later segments remain), or
        # the whole journal deleted or moved away
        if not os.path.exists(self.path) and not segments.later_segments(self.path):
            raise Gone
        return self._open_oldest()

    def _next_segment(self, journal: Journal) -> Journal:
        """The next segment once the writer began it (the current one is whole);
        ``journal`` itself while there is none."""
        # the journal's id, from the segment read now: a first segment found
        # before its first commit had none, and the head may be gone by now
        self._ident = self._ident or segments.id_of_open(journal)
        try:
            nxt = segments.open_next(
                self.path, self.index + 1, journal.head(), journal.path, self._ident
            )
        except JournalError:  # a SegmentError, or the file gone as it was opened
            if os.path.exists(segments.segment_path(self.path, self.index + 1)):
                raise  # there, and not this journal's next: said on its line
            # removed before this reader reached it: from the oldest segment left
            journal.close()
            return self._open_oldest()
        if nxt is None:
            return journal
        journal.close()
        self.index, self.segment = self.index + 1, nxt.path
        return nxt
