"""One connector family's observation, behind one interface: :class:`Adapter`.

vLLM loads a connector by name (``KVConnectorFactory``: seventeen
registered in 0.32.0, any other by ``kv_connector_module_path``). kvstate
observes a family of them through an adapter: it recognises the family's
classes in the installed vLLM and their shape, patches them (or stands down
with the reason, where the shape is not one it knows, leaving vLLM as it
was), and makes the scheduler-side and worker-side observers that write its
journals. :func:`kvstate.vllm.install` and the ``Journaled...`` connector
classes both go through :mod:`kvstate.vllm.registry`, in its order.

Every adapter passes one conformance suite
(``tests/vllm_conformance.py``, ``AdapterContract``): it never raises into
vLLM, stands down on a shape it does not know, ``finish()`` never raises, a
forked child takes none of its parent's journals, and its journals of
vLLM's own unit tests replay with no finding.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvstate.vllm._process import ObservedProcess


class Unrecognised(Exception):
    """The family is in this vLLM, with a shape the adapter does not know: it stands down."""


class Adapter(abc.ABC):
    """What observing one connector family takes (see the module docstring)."""

    #: the registry's name for the family
    name: ClassVar[str]
    #: the event kinds it journals beyond journal v1's (docs/events.md, "Additions")
    additions: ClassVar[tuple[str, ...]] = ()
    #: the journal header's ``protocol`` for its journals (None: journal v1's own)
    protocol: ClassVar[str | None] = None

    def __init__(self, process: ObservedProcess) -> None:
        self.process = process

    @abc.abstractmethod
    def recognise(self) -> Any:
        """The family's classes in this vLLM, or None where it has none.

        Raises :class:`Unrecognised` naming what differs where the family is
        there in a shape this adapter does not observe.
        """

    @abc.abstractmethod
    def patch(self, found: Any) -> None:
        """Hook what :meth:`recognise` found, through ``self.process.patches``."""

    def claims(self, found: Any) -> tuple[type, ...]:
        """The connector classes whose objects this adapter journals itself:
        the generic adapter leaves their objects to it (one journal each)."""
        return ()

    def flavor(self, found: Any) -> str | None:
        """The shape found, named for journal headers (``job-ids``, ...), or None."""
        return None
