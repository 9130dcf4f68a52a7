"""Additions to journal v1 for the lifecycle vLLM's core sees at its connector boundary.

Every vLLM connector, whatever it moves and wherever to, answers the same
calls of the scheduler (``KVConnectorBase_V1``): how many tokens it can
supply for a request and whether it loads them asynchronously
(``get_num_new_matched_tokens``), whether a finishing request's blocks must
outlive it while the connector still reads them (``request_finished``
returning delay-free), and which requests' transfers ended
(``finished_sending``, ``finished_recving``, ``failed_recving``,
``invalid_block_ids``). The contract already says a delayed free
(``request_finished`` with ``hold``, then ``held_blocks_released``); these
kinds say the rest, and the checks of :mod:`kvstate._transfers` judge them:

- ``kv_matched``: the connector's answer for a waiting request;
- ``remote_load_started``: the request waits for a remote load into ``blocks``;
- ``transfer_finished``: the connector reported a request's send or receive
  done (``failed`` for a receive it reported failed);
- ``blocks_invalid``: the connector reported blocks whose load failed;
- ``cache_reset``: vLLM reset the prefix cache (``reset_prefix_cache``, which
  RL frameworks call at every weight update) and asked the connector to
  reset too; ``jobs`` are the transfers whose end the reset discarded;
- ``transfer_params``: a request's ``kv_transfer_params``, as it arrived
  (on a decode engine, where its KV is; on a prefill engine, that a decode
  will read it: in a P/D pair both name the proxy's ``transfer_id``) or as
  the connector's ``request_finished`` returned them for the peer. Nothing
  to judge in one journal; they relate two engines' journals of one
  request (``replay.pairs``).

Registered in :data:`kvstate.events.EVENT_TYPES` by ``kvstate.events``
itself, so every reader knows them.
"""

from __future__ import annotations

from typing import Literal

from ._event_base import SIDE_SCHEDULER, Event, Id, Ids, _kind

#: the two ways a connector's transfer of a request goes
Direction = Literal["send", "recv"]


@_kind("kv_matched", SIDE_SCHEDULER)
class KvMatched(Event, frozen=True):
    """The connector can supply ``matched`` tokens beyond the ``computed`` ones
    of the waiting request ``req`` (loaded asynchronously when ``load_async``).

    vLLM's base class documents the call free of side effects: asked again
    with nothing changed for the request, it must answer the same.
    """

    req: str
    computed: Id
    matched: Id
    load_async: bool = False


@_kind("remote_load_started", SIDE_SCHEDULER)
class RemoteLoadStarted(Event, frozen=True):
    """``(req, gen)`` waits for an asynchronous load of ``tokens`` tokens into
    its ``blocks``: until ``transfer_finished`` (recv) no one else may have them."""

    req: str
    gen: Id
    blocks: Ids
    tokens: Id


@_kind("transfer_finished", SIDE_SCHEDULER)
class TransferFinished(Event, frozen=True):
    """The connector reported the ``direction`` transfer of ``(req, gen)`` done
    (``finished_sending`` / ``finished_recving``), or a receive ``failed``."""

    req: str
    gen: Id
    direction: Direction
    failed: bool = False


@_kind("blocks_invalid", SIDE_SCHEDULER)
class BlocksInvalid(Event, frozen=True):
    """The connector reported that loading ``blocks`` failed (``invalid_block_ids``)."""

    blocks: Ids


#: where a request's ``kv_transfer_params`` were met
ParamsAt = Literal["arrived", "finished"]


@_kind("transfer_params", SIDE_SCHEDULER)
class TransferParams(Event, frozen=True):
    """The ``kv_transfer_params`` of ``req``: those it ``arrived`` with (before
    its first admission, so no ``gen``), or those the connector's finish of
    ``(req, gen)`` returned for the peer engine (``finished``). ``params`` is
    the mapping as JSON, keys sorted (a value JSON cannot carry as its text)."""

    req: str
    at: ParamsAt
    params: str
    gen: Id | None = None


@_kind("cache_reset", SIDE_SCHEDULER)
class CacheReset(Event, frozen=True):
    """vLLM reset the prefix cache and the connector's (``reset_cache``);
    ``accepted`` is false where the connector refused. ``jobs``: the transfers
    the reset discarded, released at once though a worker may still run them."""

    accepted: bool = True
    jobs: Ids = ()
