"""Faults the simulator can inject, as ``kvstate run --faults`` spells them.

A fault spec is a comma list; each item is ``name=rate`` (a probability per
store call) or ``name@step`` (from that engine step on):

* ``put-fail=R``: a put call fails with ``TRANSFER_FAIL``;
* ``no-space=R``: a put call fails with ``NO_AVAILABLE_HANDLE`` (store full);
* ``evict=R``: after a put, the store evicts one earlier key, as a full
  Mooncake store does;
* ``store-down@S``: from step S every store call fails as a whole, like a
  killed Mooncake master (``RPC_FAIL``): the run ends with ``engine_crashed``;
* ``thread-crash@S``: the first job a sending thread runs at step S or later
  raises inside the job: the run fails loudly and ends with ``engine_crashed``.

Every fault is seeded: one seed, one journal.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable, Sequence

import attrs

from . import store as st

RATES = ("put-fail", "no-space", "evict")
STEPS = ("store-down", "thread-crash")
#: how a rate and a step are written (ASCII, no exponent: see Faults.parse)
_RATE = re.compile(r"(?:0|1)(?:\.[0-9]+)?|\.[0-9]+")
_STEP = re.compile(r"[0-9]+")


class InjectedCrash(RuntimeError):
    """The ``thread-crash`` fault: an exception inside a sending thread's job."""


@attrs.frozen
class Faults:
    """Parsed fault spec; zero rates and ``None`` steps mean no fault."""

    put_fail: float = 0.0
    no_space: float = 0.0
    evict: float = 0.0
    store_down: int | None = None
    thread_crash: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> Faults:
        """Read ``name=rate,name@step,...``; raises ValueError naming a bad item."""
        values: dict[str, float | int] = {}
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            if "=" in item:
                name, _, text = item.partition("=")
                if name not in RATES:
                    raise ValueError(f"unknown fault rate {name!r} (one of {', '.join(RATES)})")
                # A plain decimal: no exponent (1e-400 would quietly be 0), no nan or inf.
                if not _RATE.fullmatch(text) or float(text) > 1.0:
                    raise ValueError(f"fault {name}: {text!r} is not a rate from 0 to 1, like 0.2")
                value: float | int = float(text)
            elif "@" in item:
                name, _, text = item.partition("@")
                if name not in STEPS:
                    raise ValueError(f"unknown fault {name!r} (one of {', '.join(STEPS)})")
                if not _STEP.fullmatch(text):  # ASCII digits only: str.isdigit takes "٣"
                    raise ValueError(f"fault {name}: step {text!r} is not a whole number")
                value = int(text)
            else:
                raise ValueError(f"fault {item!r}: write name=rate or name@step")
            key = name.replace("-", "_")
            if key in values:
                raise ValueError(f"fault {name} is given twice")
            values[key] = value
        return cls(
            put_fail=float(values.get("put_fail", 0.0)),
            no_space=float(values.get("no_space", 0.0)),
            evict=float(values.get("evict", 0.0)),
            store_down=_step(values.get("store_down")),
            thread_crash=_step(values.get("thread_crash")),
        )

    def __bool__(self) -> bool:
        rates = self.put_fail or self.no_space or self.evict
        return bool(rates) or self.store_down is not None or self.thread_crash is not None


def _step(value: float | int | None) -> int | None:
    return None if value is None else int(value)


class FaultyStore:
    """Wraps one store client and injects the store faults of a :class:`Faults`.

    ``step`` reads the engine's current step (for ``store-down``).
    """

    def __init__(
        self, inner: st.Store, faults: Faults, rng: random.Random, step: Callable[[], int]
    ) -> None:
        self._inner = inner
        self._faults = faults
        self._rng = rng
        self._step = step
        self._lock = threading.Lock()
        self._keys: list[str] = []  # what was put, in order: eviction takes the oldest first

    def _check_up(self, call: str) -> None:
        down = self._faults.store_down
        if down is not None and self._step() >= down:
            raise st.StoreError(st.RPC_FAIL, f"{call} (injected: store down)")

    def _draw(self, rate: float) -> bool:
        if not rate:
            return False
        with self._lock:
            return self._rng.random() < rate

    def batch_exist(self, keys: Sequence[str]) -> list[bool]:
        self._check_up("batch_is_exist")
        return self._inner.batch_exist(keys)

    def batch_put_from(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        self._check_up("batch_put_from")
        if self._draw(self._faults.put_fail):
            return [st.TRANSFER_FAIL] * len(keys)
        if self._draw(self._faults.no_space):
            return [st.NO_AVAILABLE_HANDLE] * len(keys)
        codes = self._inner.batch_put_from(keys, buffers)
        with self._lock:
            self._keys.extend(k for k, c in zip(keys, codes, strict=True) if c == st.OK)
        if self._keys and self._draw(self._faults.evict):
            with self._lock:
                victim = self._keys.pop(0)
            self._inner.remove(victim)
        return codes

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int]:
        self._check_up("batch_get_into")
        return self._inner.batch_get_into(keys, buffers)

    def remove(self, key: str) -> int:
        self._check_up("remove")
        return self._inner.remove(key)

    def close(self) -> None:
        self._inner.close()
