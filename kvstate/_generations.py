"""The newest generation of every request id, with finished ones parked.

A guard must remember a request id's newest generation for as long as the
id may come back: a re-admitted id must get a greater generation (the
req_id ABA of vLLM #51637 is exactly a stale effect landing on a reused id).
A finished request needs nothing else, so its generation is parked in an
:class:`~kvstate.archive.Archive` (in memory, packed, or on disk with a
:class:`~kvstate.spill.SpillArchive`) and brought back when the id is named
again: memory follows the requests in flight, not every id ever seen.
"""

from __future__ import annotations

from .archive import Archive


class Generations:
    """``req -> newest gen``: in memory while in flight, parked once finished."""

    __slots__ = ("_archive", "_live")

    def __init__(self, archive: Archive | None = None) -> None:
        self._live: dict[str, int] = {}
        self._archive = archive if archive is not None else Archive()

    def get(self, req: str) -> int | None:
        """The newest generation of ``req``; None if never seen.

        Reading a parked generation leaves it parked: a finished request
        asked about (is it holding blocks? which generation?) stays out of
        memory until a new generation is :meth:`set`.
        """
        gen = self._live.get(req)
        if gen is None:
            key = ("gen", req)
            blob = self._archive.take(key)
            if blob is not None:
                self._archive.put(key, blob)
                gen = int.from_bytes(blob, "little")
        return gen

    def set(self, req: str, gen: int) -> None:
        """``req`` runs as ``gen`` (in memory until :meth:`park`; this shadows a parked one)."""
        self._live[req] = gen

    def park(self, req: str) -> None:
        """``req`` has nothing in flight: keep its generation out of memory."""
        gen = self._live.pop(req, None)
        if gen is not None:
            self._archive.put(("gen", req), gen.to_bytes(8, "little"))

    def __len__(self) -> int:
        """Requests in memory (in flight, or named since they were parked)."""
        return len(self._live)
