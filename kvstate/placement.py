"""Where a recorder's journal is written and where its fold runs: one value.

:meth:`Recorder.open <kvstate.recorder.Recorder.open>` hands its settings
to :func:`place`, which fixes, before the first record, a :class:`Placement`:
the writer, and the :class:`Site` where the audit's fold runs. The recorder
carries it; nothing else decides or repeats where the fold runs:

============================  ======================  ===============================
settings                      writer                  where the fold runs (``commit``)
============================  ======================  ===============================
``process=True`` (default)    a writer process        the writer process, once the
                                                      batch is durable
``process=False``             a writer thread         the writer thread, after the
(``background=True``)                                 write
``background=False``          the committing thread   the committing thread
============================  ======================  ===============================

An ``inline`` audit folds each record on the caller's thread as it is
recorded (:attr:`Site.CALLER`), and ``off`` folds nothing
(:attr:`Site.NOWHERE`), whatever the writer.

One case is settled here too, when the writer process starts: ranks that
record without their scheduler are judged against the job specs they
registered, which are not in the journal, so the writer process cannot
fold their records; the committing thread folds them instead.

Values the contract refuses never reach the journal: a writer process
decodes every record anyway, and writes a ``record_refused`` (an addition to
the contract, a ``RECORD_REFUSED`` finding) in place of one it refuses; with
any other writer the recorder refuses the value at the call
(:class:`~kvstate.errors.RefusedValueError`), which costs the caller one
encode and one decode per record.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

from journal import Journal
from journal.rotation import Rotation

from . import events as ev
from .audit import Auditor
from .codec import Entry, refusal, refused, to_row
from .process_writer import ProcessWriter
from .thread_writer import JournalWriter
from .violations import Violation
from .writer_codec import CodecSettings
from .writer_protocol import Writer


class Site(enum.Enum):
    """Where the audit's fold runs."""

    #: each record as it is recorded, on the caller's thread (``audit="inline"``)
    CALLER = "the caller's thread"
    #: each committed batch, on the thread that committed it
    COMMITTING_THREAD = "the committing thread"
    #: each batch, on the writer thread, after the write
    WRITER_THREAD = "the writer thread"
    #: each batch, in the writer process, once it is durable
    WRITER_PROCESS = "the writer process"
    #: nowhere live (``audit="off"``): ``kvstate replay`` judges the journal
    NOWHERE = "nowhere"


def _as_written(entry: Entry) -> Entry:
    """An entry as a writer process writes it: a ``record_refused`` in place
    of a record whose values the contract refuses."""
    problem = refusal(entry.event)
    if problem is None:
        return entry
    return refused(entry.seq, entry.step, entry.ts, entry.event.kind, problem)


class Placement:
    """A recorder's writer and the site of its fold, fixed when it opens.

    The recorder asks it only what to do, never where: whether to check a
    value at the call (:attr:`check`), to fold a record as it is recorded
    (:attr:`fold_now`), to keep committed batches (:attr:`keeps_batches`)
    and fold them (:meth:`committed`), and whether an audit follows a
    commit (:attr:`settles`).
    """

    def __init__(
        self,
        site: Site,
        auditor: Auditor,
        writer: Writer[Entry] | None = None,
        *,
        folds_after_write: bool = False,
    ) -> None:
        self.site = site
        self.auditor = auditor
        self.writer = writer
        #: the journal writer folds each batch after its write (``after_write``,
        #: installed by :func:`place`); a writer given as it is folds nothing
        self._folds_after_write = folds_after_write
        #: under a writer process: whether it folds (known once it starts:
        #: not for ranks recording without their scheduler, see the module)
        self._process_folds = False

    @property
    def check(self) -> Callable[[ev.Event], str | None] | None:
        """The contract's value check on the caller's thread; None where the
        writer process checks each record (and writes ``record_refused``)."""
        return None if self.site is Site.WRITER_PROCESS else refusal

    @property
    def fold_now(self) -> Callable[[int, int, ev.Event], list[Violation]] | None:
        """The fold of one record on the caller's thread, where it runs there."""
        return self.auditor.fold if self.site is Site.CALLER else None

    @property
    def keeps_batches(self) -> bool:
        """Whether the recorder keeps each batch for :meth:`committed` (a
        journal writer that folds after its write needs none)."""
        if self.site is Site.COMMITTING_THREAD:
            return not self._folds_after_write
        return self.site is Site.WRITER_PROCESS

    @property
    def settles(self) -> bool:
        """Whether an audit follows each commit (what :meth:`Recorder.settle` waits for)."""
        return self.site not in (Site.CALLER, Site.NOWHERE)

    @property
    def writer_process_folds(self) -> bool:
        """Whether a writer process folds the batches (known once it started)."""
        return self._process_folds

    def committed(self, batch: list[Entry]) -> None:
        """A batch is committed: fold it on this thread, unless it is folded elsewhere."""
        if self.site is Site.COMMITTING_THREAD and not self._folds_after_write:
            self.auditor.fold_batch(batch)
        elif self.site is Site.WRITER_PROCESS and not self._process_folds:
            # ranks alone: fold what the writer process wrote, a record_refused
            # in place of a refused record
            self.auditor.fold_batch([_as_written(entry) for entry in batch])

    def _codec_settings(self, settings: CodecSettings) -> CodecSettings:
        """What the writer process's codec is built with, as it starts (the
        ledgers that record here are attached by then)."""
        fold = self.auditor.remote_config() if self.site is Site.WRITER_PROCESS else None
        self._process_folds = fold is not None
        return settings.with_fold(fold)


def site_of(audit: str, *, process: bool, background: bool) -> Site:
    """Where an audit of mode ``audit`` folds with this writer (the table above)."""
    if audit == "inline":
        return Site.CALLER
    if audit == "off":
        return Site.NOWHERE
    if process:
        return Site.WRITER_PROCESS
    if background:
        return Site.WRITER_THREAD
    return Site.COMMITTING_THREAD


def given(auditor: Auditor, writer: Writer[Entry] | None = None) -> Placement:
    """The placement of a recorder built with a writer of the caller's (or
    none: entries in memory): the committing thread folds each batch, and
    values are checked at the call."""
    return Placement(site_of(auditor.mode, process=False, background=False), auditor, writer)


def place(
    path: str | os.PathLike[str],
    journal: Journal,
    auditor: Auditor,
    *,
    process: bool,
    background: bool,
    synchronous: str,
    metrics: str | None = None,
    counts: str | None = None,
    rotation: Rotation | None = None,
) -> Placement:
    """The placement of ``journal`` at ``path`` for these settings (see the table above).

    ``journal`` is open with its schema; a writer process opens its own, so
    this closes it then.
    """
    if (metrics is not None or counts is not None) and not process:
        raise ValueError("live figures come from the writer process: open it with process=True")
    retains = rotation is not None and rotation.retains
    if retains and not process:
        raise ValueError(
            "retention removes segments only after a checkpoint of the fold, which the "
            "writer process writes: open it with process=True"
        )
    site = site_of(auditor.mode, process=process, background=background)
    if process:
        journal.close()
        settings = CodecSettings(
            metrics=metrics,
            counts=counts,
            journal=os.fspath(path),
            checkpoints=retains,
            budget=rotation.keep_bytes if rotation is not None else None,
        )
        placement = Placement(site, auditor)
        placement.writer = ProcessWriter(
            path,
            synchronous=synchronous,
            settings=lambda: placement._codec_settings(settings),
            on_found=auditor.add_found,
            rotation=rotation,
        )
        return placement
    # the journal writer folds each batch after its write, on its thread or
    # on the committing thread
    after = auditor.fold_batch if site in (Site.WRITER_THREAD, Site.COMMITTING_THREAD) else None
    writer = JournalWriter(
        journal, to_row, background=background, after_write=after, rotation=rotation
    )
    return Placement(site, auditor, writer, folds_after_write=after is not None)
