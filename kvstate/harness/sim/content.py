"""Block hashes and the KV fingerprints the simulated forward pass writes.

A full block's hash chains the previous block's hash with the block's
tokens, so it names the whole prefix, like the engine's prefix-cache hashes
and the store keys built from them. The KV a rank computes for a full block
is a pure function of that hash and the rank: any reader can tell whether a
block, a store value or a load holds the KV its key names. A partially
filled block holds a fingerprint of its partial tokens, which never equals a
full block's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = b"\x00" * 8


def block_hashes(
    tokens: Sequence[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of every full block of ``tokens`` (``known`` is a prefix of the result)."""
    hashes = list(known)
    previous = hashes[-1] if hashes else ROOT
    for i in range(len(hashes), len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        digest = hashlib.blake2b(previous, digest_size=8)
        digest.update(struct.pack(f"<{len(chunk)}q", *chunk))
        previous = digest.digest()
        hashes.append(previous)
    return hashes


def full_block_kv(block_hash: bytes, rank: int, size: int) -> bytes:
    """The KV bytes rank ``rank`` computes for the full block named by ``block_hash``."""
    return (
        hashlib.blake2b(block_hash + bytes([rank]), digest_size=min(size, 64))
        .digest()
        .ljust(size, b"\x00")
    )


def partial_block_kv(previous: bytes, tokens: Sequence[int], rank: int, size: int) -> bytes:
    """The KV of a block that is not full yet (never equal to a full block's)."""
    digest = hashlib.blake2b(b"partial" + previous + bytes([rank]), digest_size=min(size, 64))
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest().ljust(size, b"\x00")


def short(value: bytes | None) -> str | None:
    """A short hex form for journals and reports."""
    return None if value is None else value[:6].hex()
