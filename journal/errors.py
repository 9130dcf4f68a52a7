"""Errors raised by the journal layer.

Every error about a record names where the record came from: the file and
either its line (JSON Lines) or its ``seq`` (a journal database), so a user
can open the input at the right place.
"""

from __future__ import annotations


class JournalError(Exception):
    """The journal cannot be opened, read or written as asked."""


class RecordError(JournalError):
    """One record is unusable: malformed, out of order, or failing its digest.

    ``path`` is the file, ``line`` the 1-based line of a JSON Lines file and
    ``seq`` the record's sequence number; either may be ``None`` when it is
    not known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        seq: int | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.seq = seq
        super().__init__(self.__str__())

    def located(
        self, *, path: str | None = None, line: int | None = None, seq: int | None = None
    ) -> RecordError:
        """Return a copy that also carries the location fields given here."""
        return type(self)(
            self.message,
            path=self.path or path,
            line=self.line if self.line is not None else line,
            seq=self.seq if self.seq is not None else seq,
        )

    def __str__(self) -> str:
        where = self.path or "<journal>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        if self.seq is not None:
            where = f"{where} (seq {self.seq})"
        return f"{where}: {self.message}"


class TamperedError(RecordError):
    """A record's stored digest does not match the hash chain."""


class SegmentError(JournalError):
    """The segments of a journal do not follow each other (the message names the file)."""
