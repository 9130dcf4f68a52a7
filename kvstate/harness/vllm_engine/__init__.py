"""The real-vLLM demo: one venv per vLLM release, a local checkpoint, a driver
that runs the engine inside that venv, and the side-by-side comparison.

The observer connector itself lives in :mod:`kvstate.vllm` (it runs inside
vLLM's process); this package runs in kvstate's own environment and never
imports vLLM, but for the two modules that run inside the venv's engine:
``in_venv`` (the engine driver) and ``host_tier`` (a host-memory offload tier
for vLLM's OffloadingConnector on a machine without CUDA, which the tests and
the demo select by its module path).
"""
