"""The connector families kvstate observes, in the order :func:`~kvstate.vllm.install` tries them.

Adding a family is one folder (its :class:`~kvstate.vllm.adapter.Adapter`
and observers) and one entry here. The specific adapters come first: the
objects of the classes they claim are theirs, and the generic adapter
(:mod:`kvstate.vllm.generic`, every ``KVConnectorBase_V1``) journals every
other connector object.
"""

from __future__ import annotations

import importlib

from kvstate.vllm.adapter import Adapter

#: name -> "module:class" of its adapter (imported only when install() runs)
ADAPTERS: dict[str, str] = {
    "mooncake_store": "kvstate.vllm.mooncake:MooncakeStoreAdapter",
    "offloading": "kvstate.vllm.offloading:OffloadingAdapter",
    "generic": "kvstate.vllm.generic:GenericAdapter",
}


def register(name: str, target: str, *, before: str | None = "generic") -> None:
    """Add (or replace) the adapter ``name`` at ``target`` ("module:class"),
    ahead of ``before`` (the generic adapter by default, so the new family's
    objects are its own)."""
    entries = [(n, t) for n, t in ADAPTERS.items() if n != name]
    at = next((i for i, (n, _) in enumerate(entries) if n == before), len(entries))
    entries.insert(at, (name, target))
    ADAPTERS.clear()
    ADAPTERS.update(entries)


def adapter_class(name: str) -> type[Adapter]:
    """The adapter class registered as ``name``."""
    module, _, cls = ADAPTERS[name].partition(":")
    found = getattr(importlib.import_module(module), cls)
    if not (isinstance(found, type) and issubclass(found, Adapter)):
        raise TypeError(f"{ADAPTERS[name]} is not a kvstate.vllm.adapter.Adapter")
    return found
