"""A prefill/decode pair's two journals, related request by request.

In a P/D pair one request lives in two engines, under two request ids:
vLLM's MooncakeConnector shares only the proxy's ``transfer_id`` between
them, in each request's ``kv_transfer_params`` (journaled as
``transfer_params``, role ``arrived``). Each engine's journal is replayed
on its own (its block ids are its own pool's); this relates them by that
id: the prefill's finish with its free delayed (``request_finished`` with
``hold``) and the end of that hold (``held_blocks_released``), against the
decode's load into its own blocks (``remote_load_started``) and the load's
end (``transfer_finished`` recv). Both engines on one host stamp records
with the same monotonic clock, so the two ends are ordered across journals.

A prefill that freed a request's held blocks before the decode's load of
them began (vLLM #45357, #52234: the next request's KV is what arrives) is
listed in :attr:`Pair.freed_before_read`; one that finished the request
without holding its blocks while the decode's load of them still succeeded,
in :attr:`Pair.not_held`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import attrs

from kvstate import events as ev
from kvstate import transfer_events as tx
from kvstate.codec import Entry
from kvstate.violations import Violation

from .sources import entries


@attrs.define
class Side:
    """One engine's part of one transfer: its request and the records that framed it."""

    req: str
    #: prefill: its finish; decode: remote_load_started (seq, ts)
    began: tuple[int, int | None] | None = None
    #: prefill: when its blocks were freed (held_blocks_released, or a finish
    #: without hold); decode: transfer_finished recv (seq, ts)
    ended: tuple[int, int | None] | None = None
    #: prefill: the finish kept the blocks for the decode (a delayed free)
    held: bool = False
    #: decode: the load was reported failed
    failed: bool = False
    #: decode: blocks the load wrote into
    blocks: int = 0
    #: the seqs of every record of the request (a finding's chain names one)
    seqs: set[int] = attrs.Factory(set)


@attrs.define
class Pair:
    """The two journals, related by transfer id."""

    #: transfer id -> the prefill's side
    prefill: dict[str, Side]
    #: transfer id -> the decode's side
    decode: dict[str, Side]

    @property
    def related(self) -> list[str]:
        """Transfers whose decode load began and whose prefill request finished."""
        return sorted(
            t for t, d in self.decode.items()
            if d.began is not None and t in self.prefill and self.prefill[t].began is not None
        )  # fmt: skip

    @property
    def unrelated(self) -> list[str]:
        """Decode loads with no finished prefill request of their transfer id."""
        return sorted(
            t for t, d in self.decode.items()
            if d.began is not None and (t not in self.prefill or self.prefill[t].began is None)
        )  # fmt: skip

    @property
    def not_held(self) -> list[str]:
        """Transfers whose prefill finished without keeping its blocks, though the
        decode's load of them was reported done, not failed: it read freed blocks
        (vLLM's MooncakeConnector frees at once only a request it will not
        send, and the decode's load then fails)."""
        return [
            t for t in self.related
            if not self.prefill[t].held and self.decode[t].ended is not None
            and not self.decode[t].failed
        ]  # fmt: skip

    @property
    def freed_before_read(self) -> list[str]:
        """Transfers whose prefill freed its held blocks before the decode's load
        began: no transfer of them can have happened before the decode asked
        (pushed by the prefill, as the MooncakeConnector does, or pulled by
        the decode), so what the decode got was read from freed blocks."""
        out = []
        for t in self.related:
            freed, began = self.prefill[t].ended, self.decode[t].began
            if not self.prefill[t].held or freed is None or began is None:
                continue
            if freed[1] is not None and began[1] is not None and freed[1] < began[1]:
                out.append(t)
        return out

    def transfer_of(self, role: str, v: Violation) -> str | None:
        """The transfer a violation found in ``role``'s journal (``prefill`` or
        ``decode``) touched: the one of the request whose record its chain
        names (a delayed free, a load: the cause, which a block reused by
        another transfer's request names), else the one of the request it names."""
        sides = self.prefill if role == "prefill" else self.decode
        for t, side in sides.items():
            if side.seqs.intersection(v.chain):
                return t
        return next((t for t, side in sides.items() if v.req == side.req), None)

    @property
    def blocks(self) -> int:
        """Blocks the decode's loads wrote, over every related transfer."""
        return sum(self.decode[t].blocks for t in self.related)


def _transfer_id(event: tx.TransferParams, want: str) -> str | None:
    try:
        params = json.loads(event.params)
    except ValueError:
        return None
    if not isinstance(params, dict) or not params.get(want):
        return None
    value = params.get("transfer_id")
    return value if isinstance(value, str) else None


def _sides(items: Iterable[Entry], prefill: bool) -> dict[str, Side]:
    """transfer id -> side, for the requests that arrived to be read by a decode
    (``prefill``) or to read from a prefill.

    A transfer id met again (a proxy's reuse) keeps its first request: the
    later one's records are not mixed into it.
    """
    want = "do_remote_decode" if prefill else "do_remote_prefill"
    by_req: dict[str, str] = {}
    sides: dict[str, Side] = {}
    for entry in items:
        e = entry.event
        if isinstance(e, tx.TransferParams):
            if e.at == "arrived":
                found = _transfer_id(e, want)
                if found is not None and found not in sides:
                    by_req[e.req] = found
                    sides[found] = Side(e.req)
            continue
        req = getattr(e, "req", None)
        if req is None or req not in by_req:
            continue
        side = sides[by_req[req]]
        side.seqs.add(entry.seq)
        at = (entry.seq, entry.ts)
        if prefill:
            if isinstance(e, ev.RequestFinished) and side.began is None:
                side.began, side.held = at, e.hold
                if not e.hold:
                    side.ended = at  # freed at the finish
            elif isinstance(e, ev.HeldBlocksReleased) and side.held and side.ended is None:
                side.ended = at
        elif isinstance(e, tx.RemoteLoadStarted) and side.began is None:
            side.began, side.blocks = at, len(e.blocks)
        elif isinstance(e, tx.TransferFinished) and e.direction == "recv" and side.ended is None:
            side.ended, side.failed = at, e.failed
    return sides


def relate(prefill: list[str], decode: list[str]) -> Pair:
    """The prefill engine's journals and the decode engine's, related by transfer id."""
    return Pair(_sides(entries(prefill), prefill=True), _sides(entries(decode), prefill=False))
