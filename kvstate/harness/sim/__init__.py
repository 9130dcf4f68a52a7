"""The engine simulator: a vLLM-shaped scheduler and store connector that
run on the ledgers, so the journal comes from the kind of engine where the
bugs happened.

Modules: :mod:`.pool` (the device block pool), :mod:`.content` (block hashes
and KV fingerprints), :mod:`.store` (the store interface and the in-memory
store), :mod:`.device` (block memory per rank), :mod:`.batching` (requests
and continuous batching), :mod:`.connector` (the store connector, both
sides), :mod:`.faults` (injected faults), :mod:`.config` (a run's knobs,
its workload and its summary), :mod:`.runtime` (virtual-time and threaded
execution), :mod:`.readback` (the audit that reads every stored key back),
:mod:`.fleet` (many engines at once).
"""
