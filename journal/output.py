"""Writing output files without ever destroying one.

Every command that writes a file goes through :func:`atomic_output`: it
writes a temporary file in the destination's directory and renames it into
place only when the whole output is written. An existing destination is
refused unless ``force`` is given, and even then it is replaced only by a
complete new file, in one rename. A failure leaves the old file byte for
byte and removes only the temporary file this function created.

A journal a run writes as it goes is different: it is the run's evidence, so
:func:`journal_output` writes a new journal under its own name from the
first record (a killed run leaves it where the user looks), and only a
``force`` replacement of an existing journal goes through a file beside it,
``NAME.new``, renamed over ``NAME`` when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from .errors import JournalError

#: SQLite's companions of a database file, which a rename must not leave behind
_COMPANIONS = ("-wal", "-shm", "-journal")


class OutputExists(JournalError):
    """The destination exists and ``force`` was not given."""


def refuse_existing(path: str | os.PathLike[str], *, force: bool = False) -> None:
    """Raise :class:`OutputExists` unless ``path`` is free (or ``force``)."""
    name = os.fspath(path)
    if os.path.isdir(name):
        raise OutputExists(f"{name}: is a directory")
    if not force and os.path.lexists(name):
        raise OutputExists(f"{name}: already exists; refusing to overwrite (use --force)")


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike[str], *, force: bool = False, keep_on_interrupt: bool = False
) -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it to ``path`` on success.

    The caller writes (and closes) the temporary file inside the block. On
    an exception the temporary file is removed and ``path`` is untouched.
    With ``keep_on_interrupt`` a KeyboardInterrupt (Ctrl-C, or a signal
    turned into one) publishes what was written so far instead: a journal
    cut short by the user is still the user's record of the run.
    """
    name = os.fspath(path)
    refuse_existing(name, force=force)
    directory = os.path.dirname(os.path.abspath(name))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(name)}.", suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)  # the writer creates it (SQLite wants a new file, not an empty one)
    committed = False
    try:
        yield tmp
        publish(tmp, name, force=force)
        committed = True
    except KeyboardInterrupt:
        if keep_on_interrupt and os.path.exists(tmp):
            publish(tmp, name, force=force)
            committed = True
        raise
    finally:
        if not committed:
            discard(tmp)


def publish(tmp: str, path: str, *, force: bool = False) -> None:
    """Rename a finished temporary file to ``path``.

    Without ``force`` the rename must not replace a file that appeared in
    the meantime: a hard link fails if the name is taken, where a plain
    rename would silently overwrite it.
    """
    for suffix in _COMPANIONS:
        if os.path.exists(tmp + suffix):
            raise JournalError(f"{tmp}{suffix} still exists: close the database before publishing")
    if force:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise OutputExists(f"{path}: appeared while the output was written; not replaced") from None
    except OSError:
        # A file system without hard links: check, then rename.
        refuse_existing(path)
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def discard(tmp: str) -> None:
    """Remove a temporary output (and its SQLite companions) this module created."""
    for name in (tmp, *(tmp + s for s in _COMPANIONS)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


#: the suffix of a replacement journal while its run is going (documented)
NEW = ".new"


@contextlib.contextmanager
def journal_output(path: str | os.PathLike[str], *, force: bool = False) -> Iterator[str]:
    """Yield where a run writes its journal ``path`` as it goes.

    A new ``path`` is written in place: a run killed at any moment leaves
    its journal under its own name (replay says UNFINISHED, or CRASH). An
    existing one is refused unless ``force``; then the run writes
    ``path + ".new"`` and, however the run ends (success, error, Ctrl-C),
    renames it over ``path``: the journal of the run that replaced it. A
    SIGKILL before that leaves the old ``path`` intact and the new one
    beside it. A ``.new`` file already there was left by another run and is
    never overwritten.
    """
    name = os.fspath(path)
    refuse_existing(name, force=force)
    if not os.path.lexists(name):
        yield name
        return
    tmp = name + NEW
    if os.path.lexists(tmp):
        raise OutputExists(
            f"{tmp}: already exists (left by a run that was killed?); move it away first"
        )
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            publish(tmp, name, force=True)
