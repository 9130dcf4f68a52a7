"""The engine simulator: a vLLM-shaped scheduler and store connector that
run on the ledgers, so the journal comes from the kind of engine where the
bugs happened.

Modules: :mod:`.pool` (the device block pool), :mod:`.content` (block hashes
and KV fingerprints), :mod:`.store` (the store interface and the in-memory
store), :mod:`.device` (block memory per rank), :mod:`.engine` (requests and
continuous batching), :mod:`.connector` (the store connector, both sides),
:mod:`.runtime` (virtual-time and threaded execution, the audit, the
summary).
"""
