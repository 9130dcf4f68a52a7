"""install(), uninstall() and finish(): this process's observation, begun and ended.

:func:`install` detects the connector and patches its classes in place
(:mod:`kvstate.vllm._mooncake`, one hook class per half of the connector);
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

from kvstate.vllm import _journals, _offloading, _per_request
from kvstate.vllm._compat import (
    OFFLOADING_ONLY,
    TESTED,
    Connector,
    UnsupportedVLLMError,
    detect,
    vllm_version,
)
from kvstate.vllm._mooncake import SchedulerHooks, WorkerHooks
from kvstate.vllm._process import ObservedProcess

#: this process's observation (a test replaces it with a fresh one)
process = ObservedProcess()
_log = logging.getLogger("kvstate.vllm")


def installed() -> Connector | None:
    """The observed connector, or None when :func:`install` has not run."""
    return process.connector


def install(
    journal_dir: str | os.PathLike[str] | None = None, *, fingerprint: bool | None = None
) -> Connector:
    """Journal every MooncakeStoreConnector and OffloadingConnector of this process from now on.

    ``fingerprint`` (default on) hashes each saved block when the save is
    requested and again when the put reads it. Idempotent: a later call
    changes only what it names. Each connector is patched where the
    installed vLLM has the shape observed here; one that has not is left
    alone, with a warning naming what it lacks (it writes no journal, never
    an incomplete one). Raises :class:`UnsupportedVLLMError` (and patches
    nothing) when neither has.
    """
    with process.lock:
        if journal_dir is not None:
            _journals.chosen_dir = Path(journal_dir)
        if fingerprint is not None:  # a later bare install() keeps the choice
            process.fingerprint = fingerprint
        process.ended = False  # observe again (after a finish(), new journals)
        process.unobservable.clear()
        if process.connector is not None:
            return process.connector
        offloading = _offloading.classes()
        # Before per-job completion (vLLM #39186, 0.21.0) the connector names
        # its transfers by request: observed through a per-job view.
        per_request = None if offloading else _per_request.classes()
        try:
            connector = detect()
        except UnsupportedVLLMError as exc:
            if offloading is None and per_request is None:
                raise
            # An older vLLM whose MooncakeStoreConnector has another shape:
            # its OffloadingConnector is observed alone.
            _log.warning("the MooncakeStoreConnector is not observed: %s", exc)
            connector = Connector(vllm_version(), OFFLOADING_ONLY, {})
        else:
            SchedulerHooks(process, connector).patch()
            WorkerHooks(process, connector).patch()
        if offloading is not None:  # vLLM's OffloadingConnector, where this vLLM has it
            _offloading.OffloadingHooks(process, *offloading).patch()
        elif per_request is not None:
            _per_request.PerRequestHooks(process, *per_request).patch()
        process.connector = connector
        _say_untested(connector.version)
        atexit.register(_close_at_exit)
        return connector


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
