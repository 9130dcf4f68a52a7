"""The fold's part for the lifecycle at vLLM's connector boundary (:mod:`kvstate.transfer_events`).

:class:`TransferState` holds what these checks need and nothing else; the
ledger calls it from the records that change it. It knows incarnations only
as :class:`~kvstate.state.Incarnation` rows, so it is a leaf.

- ``DELAYED_FREE_REUSED`` (vLLM #45357, #52234): a finish whose free was
  delayed (``request_finished`` with ``hold``) keeps its blocks for the
  connector, which still reads them (a prefill engine's blocks, until the
  decode engine pulled them). A block of it handed to another request, not
  as a prefix-cache hit, before ``held_blocks_released`` is overwritten
  while it is read: the decode gets the next prompt's KV.
- ``LOAD_TARGET_RELEASED`` (vLLM #56104, #41269): an asynchronous load
  writes into its request's blocks until the connector reports the receive
  (``transfer_finished`` recv). A preemption or a finish that frees them
  before, or another request handed one of them, lets the in-flight write
  corrupt whichever request owns them next.
- ``UNEXPECTED_TRANSFER`` (vLLM #25067, LMCache #5248): a send reported for
  an incarnation with no delayed free outstanding, or a receive for one with
  no load outstanding (a second report included): vLLM frees blocks it does
  not hold for that request, or twice.
- ``FAILED_LOAD_USED``: blocks reported invalid after their load was
  reported done and the request was scheduled on them: the failure reached
  a running request before it was reported.
- ``MATCH_NOT_PURE``: vLLM documents ``get_num_new_matched_tokens`` free of
  side effects and may ask it again; a second answer for the same request
  and computed tokens, with nothing of the request changed in between, that
  differs (LMCache #4955).
- ``RESUME_APPENDED`` (vLLM #46595): a resumed incarnation's table starts
  empty; its first assignment is the whole table, a replace.

``DOUBLE_FINISH`` (vLLM #50297) is the ledger's own: one finish per incarnation.
"""

from __future__ import annotations

import attrs

from . import transfer_events as tx
from ._copying import EVOLVED, PLAIN, copied, copied_by
from .state import Incarnation
from .violations import Code, Violation, finding

Out = list[Violation]


@attrs.define(slots=True)
class _Load:
    """One asynchronous load: its incarnation, blocks and the records that framed it."""

    gen: int
    blocks: tuple[int, ...]
    started_seq: int
    #: the receive was reported done (not failed) at this seq
    done_seq: int | None = None
    #: the request was scheduled on the loaded blocks at this seq
    ran_seq: int | None = None
    #: a target of it was handed to another request (LOAD_TARGET_RELEASED, said
    #: once); the load still writes, and its receive is still to be reported
    handed_on: bool = False


@attrs.define(slots=True)
class TransferState:
    """The connector-boundary lifecycle's folded state (see the module docstring)."""

    #: req -> (computed, matched, load_async, seq) of its last answer, until the request changes
    matches: dict[str, tuple[int, int, bool, int]] = attrs.field(
        factory=dict, metadata=copied_by(PLAIN)
    )
    #: req -> its outstanding asynchronous load
    loading: dict[str, _Load] = attrs.field(factory=dict, metadata=copied_by(EVOLVED))
    #: block -> the request whose outstanding load writes it
    targets: dict[int, str] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: req -> its last load reported done, until the request ends
    loaded: dict[str, _Load] = attrs.field(factory=dict, metadata=copied_by(EVOLVED))
    #: block -> (req, gen, finish seq) of the delayed free that keeps it
    held: dict[int, tuple[str, int, int]] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: (req, gen) -> finish seq of each delayed free not yet released
    delayed: dict[tuple[str, int], int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))
    #: req -> gen of an incarnation begun by request_resumed with no table yet
    resumed: dict[str, int] = attrs.field(factory=dict, metadata=copied_by(PLAIN))

    def copy(self) -> TransferState:
        return copied(self)

    # -- a waiting request's match ------------------------------------------------------

    def matched(self, seq: int, event: tx.KvMatched, out: Out) -> None:
        last = self.matches.get(event.req)
        answer = (event.matched, event.load_async)
        if last is not None and last[0] == event.computed and last[1:3] != answer:
            why = (
                f"get_num_new_matched_tokens for {event.req!r} at {event.computed} computed "
                f"tokens answered {event.matched} (async {event.load_async}), and "
                f"{last[1]} (async {last[2]}) before with nothing of the request changed: "
                f"vLLM documents the call free of side effects"
            )
            out.append(finding(Code.MATCH_NOT_PURE, seq, why, last[3], req=event.req))
        self.matches[event.req] = (event.computed, event.matched, event.load_async, seq)

    # -- loads -------------------------------------------------------------------------

    def load_started(self, seq: int, event: tx.RemoteLoadStarted) -> None:
        self.matches.pop(event.req, None)
        self.loaded.pop(event.req, None)
        self.loading[event.req] = _Load(event.gen, event.blocks, seq)
        for block in event.blocks:
            self.targets[block] = event.req

    def finished_transfer(self, seq: int, event: tx.TransferFinished, out: Out) -> None:
        req, gen = event.req, event.gen
        if event.direction == "send":
            if (req, gen) not in self.delayed:
                why = (
                    f"the connector reported {req}/{gen}'s send done, but no finish of it "
                    f"delays its free now: vLLM frees blocks the request does not hold"
                )
                out.append(finding(Code.UNEXPECTED_TRANSFER, seq, why, req=req, gen=gen))
            return
        load = self.loading.get(req)
        if load is None or load.gen != gen:
            last = self.loaded.get(req)
            why = (
                f"the connector reported {req}/{gen}'s receive "
                f"{'failed' if event.failed else 'done'}, but it has no load outstanding"
            )
            prior = last.done_seq if last is not None else None
            out.append(finding(Code.UNEXPECTED_TRANSFER, seq, why, prior, req=req, gen=gen))
            return
        self._end_load(req, load)
        if not event.failed:
            load.done_seq = seq
            self.loaded[req] = load

    def _end_load(self, req: str, load: _Load) -> None:
        del self.loading[req]
        for block in load.blocks:
            if self.targets.get(block) == req:
                del self.targets[block]

    def invalid(self, seq: int, event: tx.BlocksInvalid, out: Out) -> None:
        bad = set(event.blocks)
        for req, load in list(self.loaded.items()):
            if load.ran_seq is None or not bad.intersection(load.blocks):
                continue
            why = (
                f"blocks {sorted(bad.intersection(load.blocks))} of {req}/{load.gen} reported "
                f"invalid after their load was reported done and the request ran on them"
            )
            chain = (load.started_seq, load.done_seq, load.ran_seq)
            out.append(finding(Code.FAILED_LOAD_USED, seq, why, *chain, req=req, gen=load.gen))
            del self.loaded[req]

    # -- tables ------------------------------------------------------------------------

    def resumed_at(self, req: str, gen: int) -> None:
        self.resumed[req] = gen

    def assigned(self, seq: int, inc: Incarnation, blocks: tuple[int, ...],
                 cached: tuple[int, ...], mode: str, out: Out) -> None:  # fmt: skip
        """Checks before ``blocks`` join ``inc``'s table (refs not yet taken)."""
        req = inc.req
        self.matches.pop(req, None)
        if self.resumed.get(req) == inc.gen:
            del self.resumed[req]
            if mode == "append" and inc.table_seq is None:
                why = (
                    f"the first blocks of {inc.name}, a resumed incarnation, were appended: "
                    f"its table starts empty, so they must replace it"
                )
                out.append(finding(Code.RESUME_APPENDED, seq, why, inc.started_seq,
                                   req=req, gen=inc.gen))  # fmt: skip
        load = self.loaded.get(req)
        if load is not None and load.gen == inc.gen and load.ran_seq is None:
            load.ran_seq = seq
        if not (self.held or self.targets):
            return
        keep = set(cached)
        for block in blocks:
            if block in keep:
                continue
            holder = self.held.get(block)
            if holder is not None and holder[:2] != (req, inc.gen):
                why = (
                    f"block {block} given to {inc.name} while {holder[0]}/{holder[1]}'s "
                    f"delayed free still keeps it for the connector"
                )
                out.append(finding(Code.DELAYED_FREE_REUSED, seq, why, holder[2],
                                   req=req, gen=inc.gen, block=block))  # fmt: skip
            loader = self.targets.get(block)
            if loader is not None and loader != req and not self.loading[loader].handed_on:
                load = self.loading[loader]
                load.handed_on = True  # reported once per load
                why = (
                    f"block {block} given to {inc.name} while {loader}/{load.gen}'s "
                    f"asynchronous load still writes into it"
                )
                out.append(finding(Code.LOAD_TARGET_RELEASED, seq, why, load.started_seq,
                                   req=req, gen=inc.gen, block=block))  # fmt: skip

    def dropped(self, seq: int, inc: Incarnation, how: str, out: Out) -> None:
        """``inc``'s table refs drop now (preempted, or finished without hold)."""
        load = self.loading.get(inc.req)
        if load is not None and load.gen == inc.gen:
            why = (
                f"{inc.name} {how} while its asynchronous load still writes into its "
                f"blocks {list(load.blocks)}: the next holder's KV is overwritten"
            )
            out.append(finding(Code.LOAD_TARGET_RELEASED, seq, why, load.started_seq,
                               req=inc.req, gen=inc.gen))  # fmt: skip
            self._end_load(inc.req, load)
        self._forget(inc)

    def held_by(self, seq: int, inc: Incarnation) -> None:
        """``inc`` finished with its free delayed: its table stays the connector's."""
        self.delayed[(inc.req, inc.gen)] = seq
        for block in inc.table:
            self.held[block] = (inc.req, inc.gen, seq)
        self.matches.pop(inc.req, None)

    def released(self, inc: Incarnation) -> None:
        """The delayed free of ``inc`` ended: its blocks are the allocator's again."""
        self.delayed.pop((inc.req, inc.gen), None)
        for block in inc.table:
            if self.held.get(block, ("",))[:2] == (inc.req, inc.gen):
                del self.held[block]
        load = self.loading.get(inc.req)
        if load is not None and load.gen == inc.gen:
            self._end_load(inc.req, load)  # freed once its load ended (vLLM's own rule)
        self._forget(inc)

    def _forget(self, inc: Incarnation) -> None:
        self.matches.pop(inc.req, None)
        load = self.loaded.get(inc.req)
        if load is not None and load.gen == inc.gen:
            del self.loaded[inc.req]
        if self.resumed.get(inc.req) == inc.gen:
            del self.resumed[inc.req]
