"""Harness code: everything that drives or imitates an engine around the core.

The embeddable core (:mod:`kvstate`) never imports this package. Here live
the legacy policy that re-enacts the connector before the upstream fixes
(:mod:`.legacy`), the bug zoo (:mod:`.zoo`), the engine simulator
(:mod:`.sim`) and the live runtime on torch and Mooncake (:mod:`.live`).
"""
