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
per job); :class:`kvstate.spill.SpillArchive` keeps them in a temporary SQLite
file, for journals of any length and engines that run for weeks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

#: what an archived entity is filed under: ("job", id) or ("request", req)
Key = tuple[str, Hashable]
#: entities or key writes handed out together (:meth:`Archive.items`)
_BATCH = 4096


class _Layer:
    """Entities parked since the layer began, and those it took from below."""

    __slots__ = ("below", "gone", "own")

    def __init__(self, below: _Layer | None) -> None:
        self.own: dict[Key, bytes] = {}
        self.gone: set[Key] = set()
        self.below = below


class _KeyLog:
    """Which enqueues wrote each key. Append-only, so copies share one log and
    read only the writes before their own position (see :meth:`Archive.copy`)."""

    def __init__(self) -> None:
        #: key -> seqs of the enqueues that wrote it, in the order folded
        self.writers: dict[str, tuple[int, ...]] = {}
        #: key -> the job of the first of them
        self.first_job: dict[str, int] = {}
        #: read and written by copies folding from different positions
        self.shared = False

    def written(self, key: str, seq: int, job: int) -> None:
        seqs = self.writers.get(key)
        if seqs is None:
            self.writers[key] = (seq,)
            # The first put of a key wins (Mooncake keeps the first value): its
            # job is the one a wrong value under the key comes from.
            self.first_job[key] = job
        elif seq > seqs[-1] or not self.shared:
            self.writers[key] = (*seqs, seq)
        # else: a copy folding again from an earlier snapshot logged it already


class Archive:
    """Packed settled entities and the key log, in memory.

    Subclasses store elsewhere; the fold only calls these methods. An entity
    is put once and taken (removed) when a record names it again.

    :meth:`copy` is cheap whatever the archive holds: the copy and the
    original each get a new empty layer over the shared, now frozen, one
    below (a tombstone in a layer hides what it took from below), and the
    append-only key log is shared, each ledger reading only the writes before
    the record it is at. Time travel keeps dozens of snapshots this way.
    """

    def __init__(self) -> None:
        self._top = _Layer(None)
        self._count = 0
        self._log = _KeyLog()

    # -- entities --------------------------------------------------------------------

    def put(self, key: Key, blob: bytes) -> None:
        """Park a packed entity under ``key``."""
        top = self._top
        if key not in top.own:
            self._count += 1
        top.own[key] = blob  # own is looked at before gone: this shadows a tombstone

    def take(self, key: Key) -> bytes | None:
        """The entity parked under ``key``, removed from the archive; None if none."""
        top = self._top
        blob = top.own.pop(key, None)
        if blob is not None:
            self._count -= 1
            if top.below is not None:
                top.gone.add(key)  # an older version may lie below: hide it too
            return blob
        if key in top.gone:
            return None
        layer = top.below
        while layer is not None:
            blob = layer.own.get(key)
            if blob is not None:
                top.gone.add(key)
                self._count -= 1
                return blob
            if key in layer.gone:
                return None
            layer = layer.below
        return None

    def keys(self) -> Iterator[Key]:
        """What is parked (for views and equality, which bring it all back)."""
        seen: set[Key] = set()
        found = []
        layer: _Layer | None = self._top
        while layer is not None:
            for key in layer.own:
                if key not in seen:
                    found.append(key)
            seen.update(layer.own)
            seen.update(layer.gone)
            layer = layer.below
        return iter(found)

    def __len__(self) -> int:
        return self._count

    def items(self, newest: int | None = None) -> Iterator[list[tuple[Key, bytes]]]:
        """The parked entities and their blobs, left in place, in batches (for a
        checkpoint): every one, or the ``newest`` parked last."""
        seen: set[Key] = set()
        layer: _Layer | None = self._top
        batch: list[tuple[Key, bytes]] = []
        given = 0
        while layer is not None and (newest is None or given < newest):
            for key, blob in reversed(layer.own.items()):
                if key in seen:
                    continue
                if newest is not None and given >= newest:
                    break
                given += 1
                batch.append((key, blob))
                if len(batch) >= _BATCH:
                    yield batch
                    batch = []
            seen.update(layer.own)
            seen.update(layer.gone)
            layer = layer.below
        if batch:
            yield batch

    # -- the key log -----------------------------------------------------------------

    def key_written(self, key: str, seq: int, job: int) -> None:
        """Record that the enqueue at ``seq`` (job ``job``) writes ``key``."""
        self._log.written(key, seq, job)

    def key_writers(self, key: str, before: int) -> tuple[tuple[int, ...], int | None]:
        """The seqs of the enqueues before seq ``before`` that wrote ``key``, and
        the first writer's job (None when there is none)."""
        seqs = self._log.writers.get(key)
        if not seqs or seqs[0] >= before:
            return (), None
        if seqs[-1] >= before:
            seqs = tuple(s for s in seqs if s < before)
        return seqs, self._log.first_job[key]

    def key_writes(self, newest: int | None = None) -> Iterator[list[tuple[str, int, int]]]:
        """The key log as written, in batches: ``(key, seq, job)`` in the order
        folded, each key's first write first (only the first writer's job is
        kept: a later write's ``job`` is the first's; for a checkpoint). This
        in-memory log is given whole (``newest`` bounds what a spilled one
        gives: the newest writes)."""
        log = self._log
        batch: list[tuple[str, int, int]] = []
        for key, seqs in log.writers.items():
            job = log.first_job[key]
            batch += [(key, seq, job) for seq in seqs]
            if len(batch) >= _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def key_log(self, upto: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
        """The key log as of seq ``upto`` (for equality and views)."""
        found = {key: self.key_writers(key, upto + 1) for key in self._log.writers}
        return {key: w for key, w in found.items() if w[0]}

    # -- copies ----------------------------------------------------------------------

    def copy(self) -> Archive:
        """An independent copy, in constant time (see the class docstring)."""
        frozen = self._top
        self._top = _Layer(frozen)
        new = Archive()
        new._top = _Layer(frozen)
        new._count = self._count
        new._log = self._log
        self._log.shared = True
        return new

    def close(self) -> None:
        """Release what the archive holds outside this process (nothing here)."""
