"""Pickles read back from what may be input: only the classes allowed are built.

The fold parks settled state as pickled tuples of plain values
(:mod:`kvstate._parking`) and a checkpoint stores the ledger as pickles
(:mod:`kvstate.checkpoint`). A checkpoint is read from a journal file, and
what it parks comes back through the parking's own unpacking, so both read
with :func:`loads`: an unpickler whose ``find_class`` builds only plain
containers and the public classes of the modules it is given (Python's
"Restricting Globals"). A pickle naming anything else raises
:class:`pickle.UnpicklingError`; nothing it names is ever called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

_BUILTINS = frozenset({"set", "frozenset", "dict", "list", "tuple", "int", "str", "bytes"})
#: how msgspec pickles a Struct with keyword-only fields: ``rebuild(cls, kwargs)``
#: calls ``cls(**kwargs)``, and ``cls`` comes through :meth:`_Unpickler.find_class`
_FUNCTIONS = frozenset({("msgspec._utils", "rebuild")})


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, modules: frozenset[str]) -> None:
        super().__init__(io.BytesIO(data))
        self._modules = modules

    def find_class(self, module: str, name: str) -> Any:
        if (module == "builtins" and name in _BUILTINS) or (module, name) in _FUNCTIONS:
            return super().find_class(module, name)
        if module in self._modules and not name.startswith("_"):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"a stored pickle may not name {module}.{name}")


def loads(data: bytes, modules: frozenset[str] = frozenset()) -> Any:
    """``pickle.loads`` building only plain containers and the classes of ``modules``."""
    return _Unpickler(data, modules).load()


def dumps(value: Any) -> bytes:
    return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
