"""Methods of vLLM's classes replaced in place, and put back.

Patching the classes (not only subclassing the connector) reaches every
scheduler and worker object, including those vLLM's own tests build with
``object.__new__``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

#: ``hook(original, self, *args, **kwargs)``: runs in place of the method
Hook = Callable[..., Any]


class Patches:
    """The methods replaced so far, in order, so that :meth:`restore` undoes them."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []

    def replace(self, owner: Any, name: str, new: Any) -> None:
        """``owner.name`` becomes ``new`` (a function, or a classmethod object; the
        class's own attribute is kept for restore)."""
        self._done.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, new)

    def around(self, owner: Any, name: str, hook: Hook) -> None:
        """``owner.name`` calls ``hook`` with the method it replaces (inherited or its own)."""
        original = getattr(owner, name)

        def method(this: Any, *args: Any, **kwargs: Any) -> Any:
            return hook(original, this, *args, **kwargs)

        self.replace(owner, name, functools.update_wrapper(method, original))

    def __iter__(self) -> Iterator[tuple[Any, str]]:
        """The (class, method name) pairs replaced, oldest first."""
        return ((owner, name) for owner, name, _ in self._done)

    def restore(self) -> None:
        """Put every replaced method back, newest first."""
        while self._done:
            owner, name, original = self._done.pop()
            if original is None:
                delattr(owner, name)  # it was inherited: the base's shows again
            else:
                setattr(owner, name, original)
