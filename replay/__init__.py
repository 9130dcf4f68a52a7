"""Offline replay of kvstate journals: the engine, reports and the command line."""

from .verdict import ReplayResult, replay

__all__ = ["ReplayResult", "replay"]
