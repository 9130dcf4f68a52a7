"""Fingerprints of KV bytes, read where the store reads them.

A store job's value for one key is the concatenation of the address/size
segments that vLLM's token database hands to the put (one per layer and
K/V). Hashing those segments in place, without copying, gives a digest that
equals the hash of the bytes the store keeps under the key, so the same
function checks a put against the save request, and the store against both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from kvstate.vllm.mooncake._memory import KvMemory

DIGEST_SIZE = 8
#: the fingerprint audit's default sample: the store jobs whose id this divides
#: (every job with 1). Each sampled job's blocks are hashed twice on the rank's
#: sending thread, on cores the forward pass uses; one in eight keeps the
#: default audit within 1.05 of the engine's wall time (docs/vllm.md), and a
#: poisoned read that recurs is still caught.
SAMPLE_EVERY = 8


def of_segments(memory: KvMemory, addrs: Sequence[int], sizes: Sequence[int]) -> str:
    """The digest of the bytes at ``addrs`` (``sizes`` long each), in order,
    read through ``memory`` (never from a raw address it does not know:
    :class:`kvstate.vllm.mooncake._memory.UnreadableMemory`)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for segment in memory.segments(addrs, sizes):
        h.update(segment)
    return h.hexdigest()


def of_bytes(value: bytes | memoryview) -> str:
    """The digest of a value read back from the store."""
    return hashlib.blake2b(value, digest_size=DIGEST_SIZE).hexdigest()


def combine(digests: Iterable[str]) -> str:
    """One digest for several keys' digests (a job's whole transfer)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for digest in digests:
        h.update(digest.encode())
    return h.hexdigest()
