"""Where a recorder's journal is written and where its audit runs, decided once.

:meth:`Recorder.open <kvstate.recorder.Recorder.open>` hands its settings
here, and :func:`place` turns them into a :class:`journal.writer_protocol.Writer`
and says who folds each committed batch (the audit's ``commit`` mode):

============================  ======================  ===============================
settings                      writer                  who folds a committed batch
============================  ======================  ===============================
``process=True`` (default)    a writer process        the writer process, once the
                                                      batch is durable; the
                                                      committing thread when it
                                                      cannot (ranks alone: their job
                                                      specs are not in the journal)
``process=False``             a writer thread         the writer thread, after the
(``background=True``)                                 write
``background=False``          the committing thread   the committing thread
============================  ======================  ===============================

An ``inline`` audit folds each record on the caller's thread as it is
recorded, and ``off`` folds nothing, whatever the writer.

Values the contract refuses never reach the journal: a writer process
decodes every record anyway, and writes a ``record_refused`` (an addition to
the contract, a ``RECORD_REFUSED`` finding) in place of one it refuses; with
any other writer the recorder refuses the value at the call
(:class:`~kvstate.errors.RefusedValueError`), which costs the caller one
encode and one decode per record.
"""

from __future__ import annotations

import os

import attrs

from journal import Journal, JournalWriter, ProcessWriter
from journal.rotation import Rotation
from journal.writer_protocol import Writer

from .audit import Auditor
from .codec import Entry, to_row
from .writer_codec import codec_arg, decode_report, encode_batch


@attrs.frozen
class Placement:
    """A writer, whether it folds what it writes itself, and whether it checks values."""

    writer: Writer[Entry]
    #: the writer folds every batch it writes (the committing thread need not)
    writer_folds: bool
    #: the writer checks each record's values against the contract and
    #: writes a ``record_refused`` in place of one it refuses (a writer
    #: process, which decodes every record anyway); else the recorder
    #: refuses such a value at the call
    writer_checks: bool = False


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
    """The writer of ``journal`` at ``path`` for these settings (see the table above).

    ``journal`` is open with its schema; a writer process opens its own, so
    this closes it then.
    """
    folds = auditor.mode == "commit"
    if (metrics is not None or counts is not None) and not process:
        raise ValueError("live figures come from the writer process: open it with process=True")
    retains = rotation is not None and rotation.retains
    if retains and not process:
        raise ValueError(
            "retention removes segments only after a checkpoint of the fold, which the "
            "writer process writes: open it with process=True"
        )
    if process:
        journal.close()
        writer: Writer[Entry] = ProcessWriter(
            path,
            encode_batch,
            "kvstate.writer_codec:BatchCodec",
            synchronous=synchronous,
            # read when the process starts (at the first commit), once the
            # ledgers that record here are attached
            codec_arg=lambda: codec_arg(
                auditor.hand_to_writer(),
                metrics=metrics,
                counts=counts,
                journal=os.fspath(path),
                checkpoints=retains,
                budget=rotation.keep_bytes if rotation is not None else None,
            ),
            on_report=lambda report: auditor.add_found(decode_report(report)),
            rotation=rotation,
        )
        # Whether the process folds is known when it starts: the auditor's
        # ``folded_remotely`` says so, and the recorder folds what it does not.
        return Placement(writer, writer_folds=False, writer_checks=True)
    after = auditor.fold_batch if folds else None
    return Placement(
        JournalWriter(journal, to_row, background=background, after_write=after, rotation=rotation),
        writer_folds=folds,
    )
