"""Optional extras: a feature that needs one says which to install.

kvstate itself needs none of them. A feature that does (``/metrics`` needs
``prometheus_client``, the ``metrics`` extra) checks before it starts, so a
missing one is one line naming the ``pip install`` that brings it, as
``--ray`` says it, never a traceback from an import deep inside.
"""

from __future__ import annotations

import importlib.util

from .errors import KvstateError

#: the module each optional extra brings, by the extra's name (pyproject.toml)
EXTRAS = {"prometheus_client": "metrics", "ray": "ray"}


class MissingExtra(KvstateError, ImportError):
    """An optional extra a feature needs is not installed (the message says
    which, and how to install it); nothing was started."""


def require_extra(module: str, feature: str) -> None:
    """Raise :class:`MissingExtra` unless ``module`` (one of :data:`EXTRAS`)
    can be imported; ``feature`` names what needs it (``--metrics``).

    Looked up, not imported: the process that checks (an engine's, for
    ``Recorder.open(metrics=...)``) may not be the one that uses it.
    """
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install of it
        found = False
    if not found:
        raise MissingExtra(needs(feature, module))


def require_metrics_extra(feature: str = "--metrics") -> None:
    """:func:`require_extra` for ``/metrics`` (``prometheus_client``)."""
    require_extra("prometheus_client", feature)


def missing_extra(exc: ImportError) -> MissingExtra | None:
    """What an import error of an optional extra's module means (None: the
    module is not one of an extra's)."""
    module = (exc.name or "").partition(".")[0]
    if module not in EXTRAS:
        return None
    return MissingExtra(needs("this command", module))


def needs(feature: str, module: str) -> str:
    extra = EXTRAS[module]
    return f"{feature} needs {module}: pip install 'kvstate[{extra}]' (it is an optional extra)"
