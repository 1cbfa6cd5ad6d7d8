"""The prefix-cache key of a full KV block, shared by the worker's block manager, the gateway's
router and the simulated engine, so "the same prefix" means one thing everywhere.

    h_0 = root(salt)            one root per prefix-cache tenant (gateway/prompt/tenancy.py)
    h_i = SHA-256(h_{i-1} || tokens of block i as signed 64-bit ints)

A key names the whole prefix up to and including its block, not just the block's own tokens.
The hash is cryptographic on purpose: a lookup can only compare what the block itself holds (its
tokens and its parent's key), so a collision a client could craft (Python's `hash()` of ints is
plain arithmetic) would hand it the K/V of another client's prefix. Tokens are fixed-width, so no
two token tuples of one block size share an encoding.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Chain value "before block 0" for the default tenant: a digest of nothing in particular.
ROOT_HASH = hashlib.sha256(b"kestrel prefix cache root").digest()


def root_hash(salt: bytes | str = b"") -> bytes:
    """Where a sequence's chain starts: one root per tenant, so a block cached for one salt is
    never found by another (nor its hit reported to it)."""
    if isinstance(salt, str):
        salt = salt.encode()
    return ROOT_HASH if not salt else hashlib.sha256(ROOT_HASH + salt).digest()


def chain_hash(prev_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of a full block given the key of the block before it."""
    return hashlib.sha256(prev_hash + array("q", token_ids).tobytes()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes | str = b"") -> list[bytes]:
    """The keys of every full block of `token_ids`, in order (a trailing partial block has none)."""
    full = len(token_ids) // block_size * block_size
    raw = array("q", token_ids[:full]).tobytes()  # one conversion, not one per block
    step = 8 * block_size
    out: list[bytes] = []
    parent = root_hash(salt)
    for start in range(0, len(raw), step):
        parent = hashlib.sha256(parent + raw[start:start + step]).digest()
        out.append(parent)
    return out
