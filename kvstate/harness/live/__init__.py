"""Live transfers: block memory in torch tensors, a real Mooncake store, and
the demo that runs the simulator's workload against them.

Everything here is optional: ``torch`` and ``mooncake-transfer-engine`` come
with the ``mooncake`` extra (``mooncake-cuda`` on CUDA machines), and each
module imports them only when used.
"""
