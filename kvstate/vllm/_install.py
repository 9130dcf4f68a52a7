"""install(), uninstall() and finish(): this process's observation, begun and ended.

:func:`install` asks each adapter of :mod:`kvstate.vllm.registry` to
recognise its connector family and patch its classes in place;
the observers, made on first use, and the errors they meet belong to the
one :class:`~kvstate.vllm._process.ObservedProcess` of this process.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstate.vllm import _journals, registry
from kvstate.vllm._compat import (
    TESTED,
    Connector,
    UnsupportedVLLMError,
    vllm_version,
)
from kvstate.vllm._process import ObservedProcess
from kvstate.vllm.adapter import Adapter, Unrecognised

#: this process's observation (a test replaces it with a fresh one)
process = ObservedProcess()
_log = logging.getLogger("kvstate.vllm")


def installed() -> Connector | None:
    """The observed connector, or None when :func:`install` has not run."""
    return process.connector


def install(
    journal_dir: str | os.PathLike[str] | None = None,
    *,
    fingerprint: bool | None = None,
    fingerprint_every: int | None = None,
) -> Connector:
    """Journal every vLLM connector of this process from now on.

    Each adapter of :mod:`kvstate.vllm.registry` in turn: the Mooncake store
    and the OffloadingConnector in depth, and every other connector object
    at vLLM's connector boundary (:mod:`kvstate.vllm.generic`).
    ``fingerprint`` (default on) hashes each saved block when the save is
    requested and again when the put reads it, for one store job in
    ``fingerprint_every`` (default 8; 1 audits every job). Idempotent: a later call
    changes only what it names. A family whose classes have a shape its
    adapter does not know is left alone, with a warning naming what it lacks
    (it writes no journal, never an incomplete one). Raises
    :class:`UnsupportedVLLMError` (and patches nothing) when no adapter
    recognises anything in this vLLM.
    """
    with process.lock:
        if journal_dir is not None:
            _journals.chosen_dir = Path(journal_dir)
        if fingerprint is not None:  # a later bare install() keeps the choice
            process.fingerprint = fingerprint
        if fingerprint_every is not None:
            if isinstance(fingerprint_every, bool) or fingerprint_every < 1:
                raise ValueError(f"fingerprint_every must be 1 or more, not {fingerprint_every!r}")
            process.fingerprint_every = fingerprint_every
        process.ended = False  # observe again (after a finish(), new journals)
        for key in [k for k, made in process.by_key.items() if made is False]:
            del process.by_key[key]  # what could not be made is tried again
        if process.connector is not None:
            return process.connector
        version = vllm_version()
        found, refused = _recognised()
        if not found:
            raise UnsupportedVLLMError("; ".join(refused) or f"vLLM {version}: no connector known")
        for reason in refused:
            _log.warning("a connector is not observed: %s", reason)
        # the first shape an adapter names (the Mooncake store's) names the journals
        named = [adapter.flavor(shape) for adapter, shape in found]
        flavor = next((n for n in named if n is not None), "generic")
        process.claimed = tuple(cls for adapter, shape in found for cls in adapter.claims(shape))
        for adapter, shape in found:
            adapter.patch(shape)
            process.adapters.append(adapter)
        connector = process.connector = Connector(version, flavor, {})
        _say_untested(version)
        atexit.register(_close_at_exit)
        return connector


def _recognised() -> tuple[list[tuple[Adapter, Any]], list[str]]:
    """The registry's adapters that recognise their family here, with what they
    found, and why each of the others that found its family refused it."""
    found: list[tuple[Adapter, Any]] = []
    refused: list[str] = []
    for name in registry.ADAPTERS:
        adapter = registry.adapter_class(name)(process)
        try:
            shape = adapter.recognise()
        except Unrecognised as exc:
            refused.append(str(exc))
            continue
        if shape is not None:
            found.append((adapter, shape))
    return found, refused


#: the untested releases already named in this process's log
_untested: set[str] = set()


def _say_untested(version: str) -> None:
    """Name, once per process, a vLLM release kvstate was not tested with.

    install() checks shapes, not versions: on a newer release whose classes
    have the shapes observed here, it observes them. An operator still needs
    to know that the release was not among those tested.
    """
    if version.split("+")[0] in TESTED or version in _untested:  # 0.32.0+cpu is 0.32.0
        return
    _untested.add(version)
    _log.warning(
        "vLLM %s is not a release kvstate was tested with (tested: %s); its connectors "
        "are observed where their classes have the shapes kvstate knows",
        version, ", ".join(TESTED),
    )  # fmt: skip


def patched() -> Iterator[tuple[Any, str]]:
    """The (vLLM class, method name) pairs :func:`install` replaced."""
    return iter(process.patches)


def uninstall() -> None:
    """Restore vLLM's methods (journals already open stay open until :func:`finish`)."""
    with process.lock:
        process.patches.restore()
        process.adapters.clear()
        process.claimed = ()
        process.connector = None


def outstanding() -> int:
    """Store jobs this process's ranks received and have not reported yet.

    A sending thread still owes their records, and their puts: a caller
    about to :func:`finish` a drained engine steps it until this is 0, so
    the audit reads back every key the engine wrote and no record comes
    after its journal closed (the engine's own watchdog ends a run whose
    sending thread stops making progress).
    """
    return process.outstanding()


def finish(*, audit: bool | None = None, error: str | None = None) -> dict[str, int]:
    """End this process's journals: audit the store, then ``engine_idle`` (or a crash).

    Workers close first and the scheduler last, so the merged journal ends
    with the scheduler's ``engine_idle``. Returns the audit's counts.
    ``audit`` defaults to "unless ``error``": after a crash the store may be
    gone. A caller that knows it is reachable (a watchdog ending a stalled
    engine) passes ``audit=True`` and the stored keys are still read back.
    """
    return process.finish(audit=audit, error=error)


def _close_at_exit() -> None:
    process.close_at_exit()


def _forked() -> None:
    process.forked()


os.register_at_fork(after_in_child=_forked)
