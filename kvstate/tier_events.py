"""Additions to journal v1 for a connector that loads as well as stores.

vLLM's OffloadingConnector keeps KV blocks in an offload tier (host memory,
a disk) and copies them back into the engine's blocks when a later request
hits the same prefix. Its protocol differs from the store connector's in
three ways these kinds describe:

- a **load job** copies tier blocks into a request's device blocks; it has
  a job id from the same counter as the store jobs, per-worker completions
  (``completions_received``, ``job_reported``) and an end (``pins_released``
  with no blocks: a load pins nothing);
- a store job pins nothing either: its device blocks are fenced by a
  **flush** instead. When a block a live store reads is handed to another
  holder, the scheduler asks every worker to finish that store first
  (``flush_requested``), and each worker waits (``flush_done``);
- the **tier** holds what a store wrote once the scheduler marks it stored
  (``tier_stored``), and loses it on eviction (``tier_evicted``).

A journal that follows this protocol says so in its header
(``journal_opened.protocol == "offloading"``); the checks that only hold under
it (a reuse without a flush, a completion of a job that ended, a load of a
key the tier does not hold) run only there, so a store-connector journal
keeps its verdict. Registered in :data:`kvstate.events.EVENT_TYPES` by
``kvstate.events`` itself, so every reader knows them.
"""

from __future__ import annotations

from ._event_base import SIDE_SCHEDULER, SIDE_WORKER, Event, Id, Ids, Strings, WorldSize, _kind

#: ``journal_opened.protocol`` of a journal written by an offloading connector
OFFLOADING = "offloading"


@_kind("load_enqueued", SIDE_SCHEDULER)
class LoadEnqueued(Event, frozen=True):
    """A load job for the current incarnation: the workers copy the tier's
    ``keys`` into the device blocks ``writes`` (one key per block, in order)."""

    job: Id
    req: str
    gen: Id
    writes: Ids
    keys: Strings
    world_size: WorldSize


@_kind("flush_requested", SIDE_SCHEDULER)
class FlushRequested(Event, frozen=True):
    """The scheduler asks every worker to finish the store jobs ``jobs`` before
    this step writes any block assigned after this record."""

    jobs: Ids


@_kind("tier_stored", SIDE_SCHEDULER)
class TierStored(Event, frozen=True):
    """The tier holds ``keys`` as store job ``job`` wrote them (vLLM's
    ``complete_store``): from now on a load may read them."""

    job: Id
    keys: Strings


@_kind("tier_promoted", SIDE_SCHEDULER)
class TierPromoted(Event, frozen=True):
    """The tier holds ``keys`` by a copy of its own from a lower tier (a
    promotion): no worker wrote them, so no flush orders that copy after a
    worker's. From now on a load may read them."""

    keys: Strings


@_kind("tier_evicted", SIDE_SCHEDULER)
class TierEvicted(Event, frozen=True):
    """The tier dropped ``keys`` to make room: a load may no longer read them."""

    keys: Strings


@_kind("flush_done", SIDE_WORKER)
class FlushDone(Event, frozen=True):
    """The rank waited until the store jobs ``jobs`` had finished reading
    their blocks (vLLM's ``wait(job_ids)``)."""

    jobs: Ids
    rank: Id
