"""``kvstate demo``: one seeded, preemption-heavy workload under the legacy
connector and under the ledgers, against a real Mooncake store.

Each policy gets a fresh local master (so the legacy run's poisoned keys
cannot leak into the fixed run), one Mooncake client per rank, block memory
in torch tensors, and its own journal. Where Mooncake cannot run (no
package, no ``libibverbs1``, no master), the demo says so and uses the
in-memory store instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import attrs

from kvstate.harness.sim import store as st
from kvstate.harness.sim.config import SimConfig, Summary
from kvstate.harness.sim.device import BlockMemory, HostBlocks
from kvstate.harness.sim.runtime import Simulation

from .master import MasterAddress


@attrs.frozen
class DemoRun:
    summary: Summary
    journal: str


@contextlib.contextmanager
def native_logs_to(path: str) -> Iterator[None]:
    """Send what native code writes to stderr (Mooncake's glog lines) to ``path``.

    The client logs every setup, transfer-engine detail and teardown on file
    descriptor 2; the demo's table belongs on the terminal, the log in a file.
    """
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def mooncake_problem() -> str | None:
    """Why Mooncake cannot run here, or None when it can."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"cannot import mooncake.store ({exc})"
    from .master import find_executable

    if find_executable() is None:
        return "mooncake_master is not installed"
    return None


def _memory(config: SimConfig) -> BlockMemory:
    try:
        from .torch_blocks import TorchBlocks
    except ImportError:
        return HostBlocks(config.blocks, config.block_bytes, config.world_size)
    try:
        return TorchBlocks(config.blocks, config.block_bytes, config.world_size)
    except ImportError:
        return HostBlocks(config.blocks, config.block_bytes, config.world_size)


def default_segment_bytes(config: SimConfig) -> int:
    """A segment per rank large enough that the demo's keys are rarely evicted,
    within what a small machine can lend (64 MiB to 1 GiB)."""
    wanted = 4 * config.blocks * config.block_bytes * config.requests // 8
    return min(max(64 << 20, wanted), 1 << 30)


@contextlib.contextmanager
def _mooncake_stores(
    config: SimConfig, memory: BlockMemory, master: MasterAddress | None, segment: int
) -> Iterator[list[st.Store]]:
    from .master import MooncakeMaster
    from .mooncake import MooncakeStore

    with contextlib.ExitStack() as stack:
        address = master or stack.enter_context(MooncakeMaster())
        stores = [MooncakeStore(address, segment_bytes=segment) for _ in range(config.world_size)]
        try:
            staging = getattr(memory, "staging_area", None)
            if staging is not None:
                for rank, client in enumerate(stores):
                    client.register(staging(rank))
            yield list(stores)
        finally:
            for client in stores:
                client.close()


def run_policy(
    config: SimConfig,
    journal: str,
    *,
    use_mooncake: bool,
    master: MasterAddress | None = None,
    progress: Callable[[Summary], None] | None = None,
    segment_bytes: int | None = None,
) -> DemoRun:
    """Run the workload under ``config.policy`` and write its journal.

    With ``master`` the run uses that master instead of starting its own.
    Keys carry the policy in their model name, so two runs against one
    store never read each other's values.
    """
    config = attrs.evolve(config, model=f"demo-{config.policy}")
    memory = _memory(config)
    if use_mooncake:
        log = os.path.join(os.path.dirname(journal) or ".", "mooncake.log")
        segment = segment_bytes or default_segment_bytes(config)
        with native_logs_to(log), _mooncake_stores(config, memory, master, segment) as stores:
            summary = _run(
                Simulation(config, journal=journal, stores=stores, memory=memory), progress
            )
    else:
        summary = _run(Simulation(config, journal=journal, memory=memory), progress)
    return DemoRun(summary, journal)


def _run(sim: Simulation, progress: Callable[[Summary], None] | None) -> Summary:
    # The journal is closed on every way out, an interrupt included, before
    # the store clients and the master go: its records are all on disk.
    try:
        return sim.run(progress)
    finally:
        sim.close()


def journal_path(out: str, policy: str) -> str:
    return os.path.join(out, f"{policy}.db")
