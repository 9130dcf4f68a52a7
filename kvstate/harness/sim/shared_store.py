"""Several simulated engines, one after another, against one store or their own.

A fleet that shares a Mooncake store is upgraded one engine at a time: an
engine on the fixed connector then loads keys that an engine still on the
legacy one poisoned, and gives wrong outputs although its own journal is
clean of its own bugs. Every engine runs the same workload (so later engines
find the earlier engines' prefixes in a shared store), journals its own run
under its own name, and the fleet check joins them (``kvstate fleet-check``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import attrs

from journal.rotation import Rotation

from . import store as st
from .config import SimConfig, Summary
from .runtime import Simulation


def engine_journal(folder: str, index: int) -> str:
    """Engine ``index``'s journal in ``folder`` (1-based, sorted by name)."""
    return os.path.join(folder, f"engine-{index:03d}.db")


def simulate_fleet(
    config: SimConfig,
    folder: str,
    *,
    engines: int,
    legacy_engines: int = 0,
    shared_store: bool = True,
    journal_path: Callable[[str, int], str] = engine_journal,
    bulk: bool = False,
    rotation: Rotation | None = None,
) -> list[tuple[str, Summary]]:
    """Run ``engines`` engines of ``config``; the first ``legacy_engines`` on
    the legacy connector. Returns each engine's journal and summary.
    ``bulk``: see :class:`Simulation` (the same journals, made faster);
    ``rotation``: each engine's journal rotated (and retained) so."""
    if engines < 1 or not 0 <= legacy_engines <= engines:
        raise ValueError(f"--engines {engines} with --legacy-engines {legacy_engines}")
    shared: st.Store | None = None
    if shared_store:
        shared = st.MemoryStore(config.store_capacity_bytes)
    # Runs named by folder and config, so two fleets checked together never
    # share a run name (and the same fleet again gets the same names).
    digest = hashlib.sha256(repr(config).encode()).hexdigest()[:6]
    base = f"{os.path.basename(os.path.abspath(folder))}-{digest}"
    done = []
    for index in range(1, engines + 1):
        policy = "legacy" if index <= legacy_engines else config.policy
        engine = attrs.evolve(config, policy=policy)
        stores = None if shared is None else [shared] * config.world_size
        path = journal_path(folder, index)
        run = f"{base}-engine-{index:03d}"
        sim = Simulation(engine, journal=path, stores=stores, run=run, bulk=bulk, rotation=rotation)
        try:
            summary = sim.run()
        finally:
            sim.close()
        done.append((path, summary))
    return done
