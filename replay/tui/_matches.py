"""What the inspector's ``/`` filter takes of the whole journal, cached.

A filter searches the whole journal, not only the screen around the cursor,
so a request's records and violations are found wherever they are. Each
search is kept until the filter or the journal's length changes: pressing
left and right through a filtered view costs a bisect, not a scan.
"""

from __future__ import annotations

import bisect

from journal.database import BEFORE_FIRST
from kvstate.codec import Entry
from kvstate.violations import Violation
from replay.timetravel import TimeTravel

from ._views import Filter


class Matches:
    """The records and the violations a filter takes, per filter and journal length."""

    def __init__(self, tt: TimeTravel) -> None:
        self.tt = tt
        #: (filter, last seq) -> the records it takes
        self._records: tuple[tuple[str, int], list[Entry]] | None = None
        #: (filter, violations found) -> the violations it takes, and their seqs
        self._violations: tuple[tuple[str, int], list[Violation], list[int]] | None = None

    def records(self, flt: Filter) -> list[Entry]:
        """Every record of the whole journal that ``flt`` takes."""
        key = (str(flt), self.tt.last_seq)
        if self._records is None or self._records[0] != key:
            wanted = flt.record_matcher()
            found = [e for e in self.tt.stream(BEFORE_FIRST, key[1]) if wanted(e.event)]
            self._records = (key, found)
        return self._records[1]

    def violations(self, flt: Filter) -> tuple[list[Violation], list[int]]:
        """Every violation found so far that ``flt`` takes, and their seqs."""
        key = (str(flt), len(self.tt.violations))
        if self._violations is None or self._violations[0] != key:
            found = [
                v
                for v in self.tt.violations_upto(self.tt.last_seq)
                if flt.matches(job=v.job, req=v.req, rank=v.rank, kind=v.code.value)
            ]
            self._violations = (key, found, [v.seq for v in found])
        return self._violations[1], self._violations[2]

    def violation_page(
        self, flt: Filter, cursor: int, size: int
    ) -> tuple[list[Violation], int | None]:
        """The violations shown, the latest ``size`` up to ``cursor``, and the
        row of the first violation of the latest record (None if there is none).

        Like every view, this one shows the journal as of the cursor: the
        violations of later records are not found yet.
        """
        if flt:
            matched, seqs = self.violations(flt)
            here = bisect.bisect_right(seqs, cursor)
            page = matched[max(0, here - size) : here]
        else:
            _start, page = self.tt.violations_around(cursor, size, 0)
        upto = [i for i, v in enumerate(page) if v.seq <= cursor]
        if not upto:
            return page, None
        latest = page[upto[-1]].seq
        return page, next(i for i in upto if page[i].seq == latest)
