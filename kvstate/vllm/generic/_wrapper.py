"""The wrapping way in: ``kv_connector="JournaledConnector"``, any connector inside.

::

    KVTransferConfig(
        kv_connector="JournaledConnector",
        kv_connector_module_path="kvstate.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={
            "kvstate_connector": "NixlConnector",      # the connector to observe
            # "kvstate_connector_module_path": "...",  # where it is not registered
            # "kvstate_connector_extra_config": {...}, # its own extra config
            "kvstate_journal_dir": "journals",
        },
    )

The wrapper builds the inner connector as vLLM's factory would and hands
every call to it; :func:`kvstate.vllm.install` (run when the wrapper is
made) observes the inner object, so the journal is the one the other way in
writes. The wrapper changes nothing vLLM decides:

- vLLM decides hybrid-KV (HMA) support from the connector *class* it loads
  by name (``supports_hma``: ``issubclass(cls, SupportsHMA)``), before any
  object exists, and from the children only for the literal name
  ``MultiConnector``. A wrapper that did not declare ``SupportsHMA`` where
  its inner connector does would turn HMA off and change which finish
  method vLLM calls; one that did where it does not would turn it on. The
  class cannot know its inner connector when vLLM asks, so there are two:
  :class:`JournaledConnector` for a connector without HMA support and
  :class:`JournaledHMAConnector` for one with it, and each refuses to start
  around the other kind (vLLM would have decided from the wrong class),
  naming the one to use;
- every method and property of ``KVConnectorBase_V1`` is the inner object's.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvstate.vllm._install import install

#: kv_connector_extra_config keys naming the inner connector
INNER = "kvstate_connector"
INNER_PATH = "kvstate_connector_module_path"
INNER_EXTRA = "kvstate_connector_extra_config"


def inner_transfer_config(transfer: Any) -> Any:
    """The inner connector's ``KVTransferConfig``: the wrapper's, naming the inner connector."""
    extra = dict(transfer.kv_connector_extra_config or {})
    name = extra.get(INNER)
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"JournaledConnector needs kv_connector_extra_config[{INNER!r}]: the name of "
            "the connector to observe (a registered one, or a class in "
            f"kv_connector_extra_config[{INNER_PATH!r}])"
        )
    inner_extra = extra.get(INNER_EXTRA)
    if not isinstance(inner_extra, dict):  # the wrapper's own, less the inner's naming
        inner_extra = {k: v for k, v in extra.items() if k not in (INNER, INNER_PATH, INNER_EXTRA)}
    return dataclasses.replace(
        transfer,
        kv_connector=name,
        kv_connector_module_path=extra.get(INNER_PATH),
        kv_connector_extra_config=inner_extra,
    )


def _inner(vllm_config: Any) -> tuple[Any, Any]:
    transfer = inner_transfer_config(vllm_config.kv_transfer_config)
    config = copy.copy(vllm_config)  # as MultiConnector builds its children's
    config.kv_transfer_config = transfer
    return KVConnectorFactory.get_connector_class(transfer), config


class JournaledConnector(KVConnectorBase_V1):
    """Any vLLM connector without HMA support, unchanged, with the lifecycle
    vLLM's core sees journaled."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        inner_cls, config = _inner(vllm_config)
        hma = issubclass(inner_cls, SupportsHMA)
        if hma != isinstance(self, SupportsHMA):
            right = "JournaledHMAConnector" if hma else "JournaledConnector"
            raise ValueError(
                f"kv_connector={type(self).__name__!r} around {inner_cls.__name__}: vLLM "
                f"decides hybrid-KV support from the wrapper's class, and "
                f"{inner_cls.__name__} {'supports' if hma else 'does not support'} it; "
                f"use kv_connector={right!r}"
            )
        install()  # observes the inner object as it is made (idempotent)
        self._kvstate_inner = inner_cls(config, role, kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)

    def __getattr__(self, name: str) -> Any:
        # What the base class does not declare (a connector's own methods,
        # which vLLM's tests reach for) is the inner object's too.
        if name == "_kvstate_inner":
            raise AttributeError(name)
        return getattr(self._kvstate_inner, name)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        inner_cls, config = _inner(vllm_config)
        layout: str | None = inner_cls.get_required_kvcache_layout(config)
        return layout

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        name = (extra_config or {}).get(INNER)
        if not isinstance(name, str) or name not in KVConnectorFactory._registry:
            return False
        inner_cls = KVConnectorFactory.get_connector_class_by_name(name)
        inner_extra = (extra_config or {}).get(INNER_EXTRA, extra_config)
        return bool(inner_cls.requires_piecewise_for_cudagraph(inner_extra))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kw: Any) -> Any:
        inner_cls, config = _inner(vllm_config)
        return inner_cls.build_prom_metrics(config, *args, **kw)


class JournaledHMAConnector(JournaledConnector, SupportsHMA):
    """A :class:`JournaledConnector` whose inner connector supports HMA."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> Any:
        return self._kvstate_inner.request_finished_all_groups(request, block_ids)


def _forward(name: str) -> Any:
    def method(self: Any, *args: Any, **kw: Any) -> Any:
        return getattr(self._kvstate_inner, name)(*args, **kw)

    method.__name__ = name
    return method


def _forward_property(name: str) -> property:
    return property(lambda self: getattr(self._kvstate_inner, name))


# Every instance method and property of the base is the inner object's.
for _name, _value in list(vars(KVConnectorBase_V1).items()):
    if _name.startswith("__") or _name in vars(JournaledConnector):
        continue
    if isinstance(_value, property):
        setattr(JournaledConnector, _name, _forward_property(_name))
    elif inspect.isfunction(_value):
        setattr(JournaledConnector, _name, _forward(_name))
JournaledConnector.__abstractmethods__ = frozenset()
JournaledHMAConnector.__abstractmethods__ = frozenset()
