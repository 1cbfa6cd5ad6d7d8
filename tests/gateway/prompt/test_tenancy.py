"""Tests for gateway/prompt/tenancy.py and the router's salted prefix hashes: one prefix-cache
tenant per API key (and per request salt), the shared cache only with neither."""

from __future__ import annotations

from common.block_hash import block_hashes
from gateway.prompt.tenancy import cache_salt


def test_each_key_and_each_request_salt_is_its_own_tenant() -> None:
    assert cache_salt(None, None) == ""
    salts = {cache_salt("alice", None), cache_salt("bob", None), cache_salt("alice", "x"),
             cache_salt(None, "x"), cache_salt("bob", "x")}
    assert len(salts) == 5 and "" not in salts
    assert cache_salt("alice", None) == cache_salt("alice", None)  # stable: alice hits her own
    assert "alice" not in cache_salt("alice", None)  # a digest, never the key itself


def test_router_hashes_the_same_prompt_differently_per_tenant() -> None:
    ids = list(range(40))
    plain, alice = block_hashes(ids, 16), block_hashes(ids, 16, cache_salt("alice", None))
    assert len(plain) == len(alice) == 2 and not set(plain) & set(alice)
    assert block_hashes(ids, 16, "s") == block_hashes(ids, 16, "s")
