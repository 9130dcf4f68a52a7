"""Where the fold parks settled state, so memory follows live state, not history.

A journal of millions of records names hundreds of thousands of requests and
jobs, nearly all of them long finished. The fold needs a finished job again
only if a later record names it (a late report, a second release: exactly
the records that are violations). :class:`~kvstate.ledger.Ledger` therefore
moves a job or request that has settled, and has not been named for a
while, out of its dicts into an :class:`Archive`, packed, and brings it back
whole, identical, the moment a record names it. Verdicts are the same with
or without an archive; only the memory differs.

The archive also keeps the key log: which enqueues wrote each store key, read
back only when an audit record (``key_verified``, ``load_verified``) names the
key. Keys are history by nature (the store holds them), so they are written
to the log and never held by the fold.

:class:`Archive` keeps both in this process (packed, a few hundred bytes
per job); :class:`replay.spill.SpillArchive` keeps them in a temporary SQLite
file, for journals of any length.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

#: what an archived entity is filed under: ("job", id) or ("request", req)
Key = tuple[str, Hashable]


class Archive:
    """Packed settled entities and the key log (in memory).

    Subclasses store elsewhere; the fold only calls these methods. An entity
    is put once and taken (removed) when a record names it again.
    """

    def __init__(self) -> None:
        self._entities: dict[Key, bytes] = {}
        #: key -> seqs of the enqueues that wrote it (tuples: copies share them)
        self._writers: dict[str, tuple[int, ...]] = {}
        #: key -> the first job that wrote it
        self._first_job: dict[str, int] = {}

    # -- entities --------------------------------------------------------------------

    def put(self, key: Key, blob: bytes) -> None:
        """Park a packed entity under ``key``."""
        self._entities[key] = blob

    def take(self, key: Key) -> bytes | None:
        """The entity parked under ``key``, removed from the archive; None if none."""
        return self._entities.pop(key, None)

    def keys(self) -> Iterator[Key]:
        """What is parked (for views and equality, which bring it all back)."""
        return iter(list(self._entities))

    def __len__(self) -> int:
        return len(self._entities)

    # -- the key log -----------------------------------------------------------------

    def key_written(self, key: str, seq: int, job: int) -> None:
        """Record that the enqueue at ``seq`` (job ``job``) writes ``key``."""
        self._writers[key] = (*self._writers.get(key, ()), seq)
        # The first put of a key wins (Mooncake keeps the first value): its job
        # is the one a wrong value under the key comes from.
        self._first_job.setdefault(key, job)

    def key_writers(self, key: str) -> tuple[tuple[int, ...], int | None]:
        """The seqs of the enqueues that wrote ``key``, and the first writer's job."""
        return self._writers.get(key, ()), self._first_job.get(key)

    # -- copies and comparison ---------------------------------------------------------

    def copy(self) -> Archive:
        """An independent copy (packed blobs and tuples are immutable and shared)."""
        new = type(self).__new__(type(self))
        Archive.__init__(new)
        new._entities = dict(self._entities)
        new._writers = dict(self._writers)
        new._first_job = dict(self._first_job)
        return new

    def key_log(self) -> dict[str, tuple[tuple[int, ...], int | None]]:
        """The whole key log (for equality and views)."""
        return {key: self.key_writers(key) for key in self._writers}

    def close(self) -> None:
        """Release what the archive holds outside this process (nothing here)."""
