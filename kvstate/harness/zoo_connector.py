"""The bug zoo's cases for vLLM's connector boundary: one interleaving per public bug.

Each script runs on a :class:`ConnectorStage`, a tiny engine that speaks to
its connector the way vLLM's core does (``KVConnectorBase_V1``): a block
pool, requests and their tables, finishes whose free the connector delays
until it reports the send done, asynchronous loads into a waiting request's
blocks, and the connector's reports (``finished_sending``,
``finished_recving``, ``invalid_block_ids``). It journals what the generic
adapter journals (:mod:`kvstate.transfer_events`). Where the upstream fix
changed a decision, the script asks :attr:`ConnectorStage.legacy`; the
legacy journal must be flagged with the case's code at the right kind of
record and the fixed one replay clean (``tests/test_zoo.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from kvstate import build
from kvstate import events as ev
from kvstate.recorder import Recorder

BLOCK_SIZE = 4
Mode = Literal["append", "replace"]


class ConnectorStage:
    """A scripted engine and connector at vLLM's connector boundary (see the module)."""

    def __init__(self, policy: str, recorder: Recorder, *, world_size: int, pool: int) -> None:
        #: the release before the case's fix (the script takes its path)
        self.legacy = policy == "legacy"
        self.recorder = recorder
        self.step_no = 0
        self.free: list[int] = list(range(pool))
        self.gens: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        #: requests whose finish the connector delayed, or whose load is outstanding
        self.held: set[str] = set()
        self.loading: set[str] = set()
        self.done: set[str] = set()

    def play(self, script: Callable[[ConnectorStage], None]) -> None:
        """Run ``script``, finish what still runs, end every transfer, go idle."""
        script(self)
        for req in sorted(set(self.tables) - self.done):
            self.finish(req)
        for req in sorted(self.held):
            self.sent(req)
        self._record(build.engine_idle())

    def _record(self, event: ev.Event) -> None:
        self.recorder.record(event, self.step_no)

    def step(self) -> None:
        self.step_no += 1

    def _alloc(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken

    def _release(self, req: str) -> None:
        self.free.extend(self.tables.get(req, []))
        self.tables[req] = []

    # -- what the core decides ---------------------------------------------------------

    def admit(self, req: str, n: int) -> None:
        self.gens[req] = self.gens[req] + 1 if req in self.gens else 0
        self.done.discard(req)
        self._record(
            build.request_admitted(req=req, gen=self.gens[req], prompt_tokens=n * BLOCK_SIZE)
        )
        self.tables[req] = self._alloc(n)
        self._assign(req, self.tables[req], "replace")

    def _assign(self, req: str, blocks: list[int], mode: Mode) -> None:
        gen = self.gens[req]
        self._record(build.blocks_assigned(req=req, gen=gen, blocks=blocks, mode=mode))

    def match(self, req: str, computed: int, matched: int, *, load_async: bool = True) -> None:
        kind = build.kv_matched(req=req, computed=computed, matched=matched, load_async=load_async)
        self._record(kind)

    def load(self, req: str, n: int) -> None:
        """``req`` is admitted waiting for an asynchronous load into ``n`` blocks."""
        self.admit(req, n)
        blocks = tuple(self.tables[req])
        self._record(build.remote_load_started(req=req, gen=self.gens[req], blocks=blocks,
                                          tokens=n * BLOCK_SIZE))  # fmt: skip
        self.loading.add(req)

    def received(self, req: str, *, failed: bool = False) -> None:
        """The connector reports ``req``'s load done (``finished_recving``)."""
        gen = self.gens[req]
        self._record(build.transfer_finished(req=req, gen=gen, direction="recv", failed=failed))
        self.loading.discard(req)
        if req in self.held:  # finished while loading: vLLM frees it now
            self.held.discard(req)
            self._record(build.held_blocks_released(req=req, gen=gen))
            self._release(req)

    def schedule(self, req: str) -> None:
        """A request whose load ended runs: its whole table, as vLLM schedules it."""
        self._assign(req, self.tables[req], "replace")

    def invalid(self, blocks: list[int]) -> None:
        self._record(build.blocks_invalid(blocks=blocks))

    def finish(self, req: str, *, hold: bool = False) -> None:
        """``req`` finishes; ``hold``: the connector delays the free until it sent it."""
        hold = hold or req in self.loading  # vLLM's own rule while a load is outstanding
        self._record(build.request_finished(req=req, gen=self.gens[req], hold=hold))
        self.done.add(req)
        if hold:
            self.held.add(req)
        else:
            self._release(req)

    def sent(self, req: str) -> None:
        """The connector reports ``req``'s send done; vLLM frees the held blocks."""
        gen = self.gens[req]
        self._record(build.transfer_finished(req=req, gen=gen, direction="send"))
        if req in self.held:
            self.held.discard(req)
            self._record(build.held_blocks_released(req=req, gen=gen))
            self._release(req)

    def preempt(self, req: str) -> None:
        self._record(build.request_preempted(req=req, gen=self.gens[req]))
        self._release(req)

    def resume(self, req: str, n: int, *, mode: Mode = "replace") -> None:
        self.gens[req] += 1
        self._record(build.request_resumed(req=req, gen=self.gens[req]))
        self.tables[req] = self._alloc(n)
        self._assign(req, self.tables[req], mode)


# -- the cases ---------------------------------------------------------------------------


def delayed_free_reused(s: ConnectorStage) -> None:
    """vLLM #45357, #52234: a prefill's finished request keeps its blocks for
    the decode engine's read; the blocks go to the next request first."""
    s.admit("r1", 2)
    s.step()
    s.finish("r1", hold=True)
    if s.legacy:
        s.free = s.tables["r1"] + s.free  # freed before the send ended
    s.step()
    s.admit("r2", 2)
    s.step()
    s.sent("r1")


def load_target_released(s: ConnectorStage) -> None:
    """vLLM #56104, #41269: a request waiting for a remote write is aborted and
    its blocks handed on while the write is still landing."""
    s.load("r1", 2)
    s.step()
    if s.legacy:
        s._record(build.request_finished(req="r1", gen=0, hold=False, aborted=True))
        s.done.add("r1")
        s.loading.discard("r1")
        s._release("r1")
    else:
        s.finish("r1")  # held while the load is outstanding
    s.step()
    s.admit("r2", 2)
    if not s.legacy:
        s.received("r1")


def unexpected_transfer(s: ConnectorStage) -> None:
    """vLLM #25067: a send reported for a request vLLM already freed
    (``KeyError`` in ``_update_from_kv_xfer_finished``)."""
    s.admit("r1", 2)
    s.step()
    s.finish("r1", hold=True)
    s.step()
    s.sent("r1")
    if s.legacy:
        s.step()
        s.sent("r1")  # the worker's report, again


def double_finish(s: ConnectorStage) -> None:
    """vLLM #50297: a request preempted during its final step is finished twice."""
    s.admit("r1", 2)
    s.step()
    s.preempt("r1")
    s.finish("r1")
    if s.legacy:
        s._record(build.request_finished(req="r1", gen=0))


def failed_load_used(s: ConnectorStage) -> None:
    """A load whose blocks failed is reported done, the request runs on them,
    and the failure is reported only afterwards."""
    s.load("r1", 2)
    s.step()
    if s.legacy:
        s.received("r1")
        s.schedule("r1")
        s.step()
        s.invalid(s.tables["r1"][1:])
    else:
        s.invalid(s.tables["r1"][1:])
        s.received("r1", failed=True)
        s.schedule("r1")  # recomputed from the valid prefix


def match_not_pure(s: ConnectorStage) -> None:
    """LMCache #4955: ``get_num_new_matched_tokens`` asked again, with nothing
    changed, answers differently (its lookup had a side effect)."""
    s.match("r1", 0, 8)
    s.step()
    s.match("r1", 0, 4 if s.legacy else 8)
    s.admit("r1", 3)


def resume_appended(s: ConnectorStage) -> None:
    """vLLM #46595: a resumed request's table applied as an append."""
    s.admit("r1", 2)
    s.step()
    s.preempt("r1")
    s.step()
    s.resume("r1", 2, mode="append" if s.legacy else "replace")


#: the cases (kvstate.harness.zoo.Case's fields before ``stage``), in the zoo's order
CASES = (
    (
        "delayed-free-reused",
        "vLLM PR #45357, issue #52234",
        "a delayed free's blocks handed on before the send ended",
        "r1 finishes and the connector keeps its blocks for the decode engine's "
        "read; they go to r2 before the connector reports the send done.",
        delayed_free_reused,
        "DELAYED_FREE_REUSED",
        "blocks_assigned",
    ),
    (
        "load-target-released",
        "vLLM PR #56104, issue #41269",
        "a request's blocks freed while a remote write into them lands",
        "r1 waits for an asynchronous load into its blocks and is aborted; its "
        "blocks are freed at once and go to r2 while the write is in flight.",
        load_target_released,
        "LOAD_TARGET_RELEASED",
        "request_finished",
    ),
    (
        "send-reported-twice",
        "vLLM issue #25067",
        "a send reported for a request vLLM already freed",
        "r1's send is reported done and its blocks freed; the worker reports it again.",
        unexpected_transfer,
        "UNEXPECTED_TRANSFER",
        "transfer_finished",
    ),
    (
        "double-finish",
        "vLLM PR #50297",
        "a request preempted in its final step finished twice",
        "r1 is preempted during its last step, finished, and finished again.",
        double_finish,
        "DOUBLE_FINISH",
        "request_finished",
    ),
    (
        "failed-load-used",
        "vLLM's invalid_block_ids (load-failure recovery)",
        "a failed load reported after the request ran on it",
        "r1's load is reported done, r1 runs, and only then are two of its "
        "blocks reported invalid.",
        failed_load_used,
        "FAILED_LOAD_USED",
        "blocks_invalid",
    ),
    (
        "match-not-pure",
        "LMCache issue #4955",
        "get_num_new_matched_tokens with a side effect",
        "r1 waits; the connector answers 8 tokens, and 4 when asked again with nothing changed.",
        match_not_pure,
        "MATCH_NOT_PURE",
        "kv_matched",
    ),
    (
        "resume-appended",
        "vLLM PR #46595",
        "a resumed request's table appended, not replaced",
        "r1 is preempted and resumed; its new blocks are applied as an append.",
        resume_appended,
        "RESUME_APPENDED",
        "blocks_assigned",
    ),
)
