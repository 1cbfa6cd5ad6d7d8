"""BlockManager: paged block bookkeeping, ref counts, prefix cache, LRU eviction. No torch."""

from __future__ import annotations

import pytest

from common.block_hash import ROOT_HASH
from engine_worker import block_manager as bm_module
from engine_worker.block_manager import BlockManager
from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams

BS = 4  # block size used throughout: small, so block boundaries are easy to reason about


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=8))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """What the engine does after a step that computed every token of `seq`."""
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def test_allocate_then_free_returns_every_block() -> None:
    bm = BlockManager(10, BS)
    seqs = [make_seq(list(range(i * 100, i * 100 + 10))) for i in range(3)]  # 3 blocks each
    for seq in seqs:
        assert bm.can_allocate(seq)
        bm.allocate(seq)
        assert len(seq.block_table) == 3
    assert bm.num_used_blocks == 9 and bm.num_free_blocks == 1
    all_ids = [b for s in seqs for b in s.block_table]
    assert len(set(all_ids)) == 9  # no block handed out twice
    for seq in seqs:
        compute_all(bm, seq)
        bm.free(seq)
        assert seq.block_table == []
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0


def test_sequences_sharing_a_computed_prefix_share_blocks_and_ref_counts() -> None:
    bm = BlockManager(10, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 2 full blocks + 1 token
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 50, 51])
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.num_used_blocks == 4  # 3 of a + 1 of b's own
    bm.free(a)
    assert bm.num_used_blocks == 3  # b's own block and the shared prefix it still references
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_prefix_is_hit_only_after_mark_computed() -> None:
    bm = BlockManager(20, BS)
    tokens = list(range(1, 10))  # 9 tokens: blocks [1-4] [5-8] [9]
    a = make_seq(tokens)
    bm.allocate(a)
    same_step = make_seq(tokens)
    bm.allocate(same_step)  # a's blocks hold no K/V yet: must not be served
    assert same_step.num_computed_tokens == 0
    assert set(same_step.block_table).isdisjoint(a.block_table)

    a.num_computed_tokens = 4  # first chunk covered block 0 only
    bm.mark_computed(a)
    partial = make_seq(tokens)
    bm.allocate(partial)
    assert partial.num_computed_tokens == 4
    assert partial.block_table[0] == a.block_table[0]

    compute_all(bm, a)
    full = make_seq(tokens)
    bm.allocate(full)
    assert full.num_computed_tokens == 8
    assert full.block_table[:2] == a.block_table[:2]


@pytest.mark.parametrize("prompt_len, expected_hit", [(8, 4), (9, 8), (12, 8)])
def test_last_prompt_token_is_never_served_from_cache(prompt_len: int, expected_hit: int) -> None:
    bm = BlockManager(20, BS)
    donor = make_seq(list(range(1, 17)))  # 4 full blocks, all computed
    bm.allocate(donor)
    compute_all(bm, donor)
    seq = make_seq(list(range(1, prompt_len + 1)))
    bm.allocate(seq)
    assert seq.num_computed_tokens == expected_hit
    assert seq.num_computed_tokens <= seq.num_tokens - 1


def test_lru_evicts_the_least_recently_freed_cached_block_first() -> None:
    bm = BlockManager(4, BS)
    a = make_seq([1, 1, 1, 1, 9])  # one full block (cached once computed) + one partial
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    b = make_seq([2, 2, 2, 2, 9])
    bm.allocate(b)
    compute_all(bm, b)
    bm.free(b)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4

    filler = make_seq(list(range(100, 109)))  # 3 blocks: both empty ones + one cached one
    bm.allocate(filler)
    bm.free(filler)
    assert bm.num_cached_blocks == 1

    again_a, again_b = make_seq([1, 1, 1, 1, 9]), make_seq([2, 2, 2, 2, 9])
    bm.allocate(again_a)
    bm.allocate(again_b)
    assert again_a.num_computed_tokens == 0  # a was freed first: evicted
    assert again_b.num_computed_tokens == 4  # b survived


def test_recently_reused_prefix_survives_eviction() -> None:
    bm = BlockManager(4, BS)
    for fill in (1, 2):  # cache prefix 1, then prefix 2
        seq = make_seq([fill] * 4 + [9])
        bm.allocate(seq)
        compute_all(bm, seq)
        bm.free(seq)
    reuse = make_seq([1] * 4 + [9])  # touch prefix 1 again: now the most recently freed
    bm.allocate(reuse)
    assert reuse.num_computed_tokens == 4
    bm.free(reuse)

    filler = make_seq(list(range(100, 109)))  # needs 3 blocks: evicts exactly one prefix
    bm.allocate(filler)
    bm.free(filler)
    one, two = make_seq([1] * 4 + [9]), make_seq([2] * 4 + [9])
    bm.allocate(one)
    bm.allocate(two)
    assert one.num_computed_tokens == 4
    assert two.num_computed_tokens == 0


def test_a_freed_sequence_loses_its_tail_block_before_its_head() -> None:
    bm = BlockManager(3, BS)
    a = make_seq(list(range(1, 10)))  # blocks: [1-4] [5-8] cached, [9] not
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    filler = make_seq([50, 51, 52, 53, 54])  # 2 blocks: the empty one, then one cached one
    bm.allocate(filler)
    bm.free(filler)
    again = make_seq(list(range(1, 10)))
    bm.allocate(again)
    assert again.num_computed_tokens == 4  # block [1-4] survived; [5-8] was evicted


def test_usage_counts_only_referenced_blocks() -> None:
    bm = BlockManager(8, BS)
    a = make_seq(list(range(1, 10)))  # 3 blocks
    bm.allocate(a)
    assert bm.usage == pytest.approx(3 / 8)
    compute_all(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2  # still holding a's prefix...
    assert bm.usage == 0.0 and bm.num_free_blocks == 8  # ...but counted as free


def test_prefix_cache_counters_are_in_tokens() -> None:
    bm = BlockManager(20, BS)
    a = make_seq(list(range(1, 11)))  # 10 tokens
    bm.allocate(a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    compute_all(bm, a)
    b = make_seq(list(range(1, 11)))
    bm.allocate(b)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (20, 8)


def test_can_allocate_counts_a_cache_hit_on_a_free_block_as_consumed() -> None:
    bm = BlockManager(4, BS)
    holder = make_seq([7, 7])
    bm.allocate(holder)  # 1 block held throughout
    a = make_seq(list(range(1, 10)))  # 3 blocks, 2 of them full
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # 3 free, 2 of them cached
    other = make_seq([8, 8])
    bm.allocate(other)  # takes the empty block: 2 free, both cached
    again = make_seq(list(range(1, 10)))
    # 2 cached hits + 1 fresh block = 3 blocks out of the free pool, only 2 there.
    assert not bm.can_allocate(again)
    bm.free(other)
    assert bm.can_allocate(again)
    bm.allocate(again)
    assert again.num_computed_tokens == 8 and bm.num_free_blocks == 0


def test_append_slot_adds_a_block_only_when_the_last_one_is_full() -> None:
    bm = BlockManager(4, BS)
    seq = make_seq([1, 2, 3, 4])
    bm.allocate(seq)
    assert len(seq.block_table) == 1
    seq.append_token(5)  # position 4 opens block 1
    assert bm.can_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2
    seq.append_token(6)  # position 5 fits in block 1
    bm.append_slot(seq)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2


def test_can_append_is_false_when_no_block_is_free() -> None:
    bm = BlockManager(1, BS)
    seq = make_seq([1, 2, 3, 4])
    bm.allocate(seq)
    seq.append_token(5)
    assert not bm.can_append(seq)


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    a = make_seq(list(range(1, 10)))
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq(list(range(1, 10)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert set(a.block_table).isdisjoint(b.block_table)
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_hits == 0


def test_hash_collision_is_ruled_out_by_comparing_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, tokens: 42)  # every key collides
    bm = BlockManager(10, BS)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = make_seq([6, 7, 8, 9, 10])
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_num_cached_tokens_is_kept_from_the_first_allocation() -> None:
    bm = BlockManager(10, BS)
    a = make_seq(list(range(1, 10)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)  # as on a preemption: re-allocation now hits the cache
    a.num_computed_tokens = 0
    bm.allocate(a)
    assert a.num_computed_tokens == 8
    assert a.num_cached_tokens == 0  # the API reports what the first admission found


def test_block_keys_are_sha256_over_the_parent_digest_and_the_tokens() -> None:
    # Python's hash() of ints is arithmetic (hash(p) == hash(p + 2**61 - 1)), so a client could
    # craft a prompt whose chain key equals another's; SHA-256 makes that infeasible.
    import hashlib
    from array import array

    root = ROOT_HASH
    assert isinstance(root, bytes) and len(root) == 32
    key = bm_module.chain_hash(root, (1, 2, 3, 4))
    assert key == hashlib.sha256(root + array("q", (1, 2, 3, 4)).tobytes()).digest()
    assert bm_module.chain_hash(key, (5, 6, 7, 8)) != bm_module.chain_hash(root, (5, 6, 7, 8))


def test_a_cached_block_is_served_only_after_the_same_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Keys that ignore the parent (as a crafted collision would): a caches [T0, T1], c caches
    # [U0] and computes T1 after it (its block 1 key is taken by a's); d = [U0, T1] matches c's
    # block 0, then finds a's block 1 under the same key, whose K/V was computed after T0.
    monkeypatch.setattr(bm_module, "chain_hash",
                        lambda prev, tokens: bytes(str(tokens), "ascii"))
    bm = BlockManager(20, BS)
    t0, t1, u0 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    a = make_seq(t0 + t1 + [0])
    bm.allocate(a)
    compute_all(bm, a)
    c = make_seq(u0 + t1 + [0])
    bm.allocate(c)
    compute_all(bm, c)
    d = make_seq(u0 + t1 + [0])
    bm.allocate(d)
    assert d.num_computed_tokens == BS  # u0 only: a's block 1 follows another prefix


def test_a_prefix_cached_under_one_salt_is_not_found_under_another() -> None:
    bm = BlockManager(20, BS)
    alice = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "alice-1")
    alice.cache_salt = b"alice"
    bm.allocate(alice)
    compute_all(bm, alice)
    bob = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "bob-1")
    bob.cache_salt = b"bob"
    bm.allocate(bob)
    assert bob.num_cached_tokens == 0 and not set(bob.block_table) & set(alice.block_table)
    shared = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "anon")  # no salt: the shared cache, also cold
    bm.allocate(shared)
    assert shared.num_cached_tokens == 0
    again = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "alice-2")
    again.cache_salt = b"alice"
    bm.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == alice.block_table[:2]


def test_a_bare_table_grows_and_is_released_whole_or_not_at_all() -> None:
    """extend/release serve block tables that belong to no Sequence (a draft model's cache)."""
    bm = BlockManager(4, block_size=4, enable_prefix_caching=False)
    table: list[int] = []
    assert bm.extend(table, 9) and len(table) == 3 and bm.num_free_blocks == 1
    assert bm.extend(table, 12) and len(table) == 3  # already holds 12 positions
    assert not bm.extend(table, 20) and len(table) == 3 and bm.num_free_blocks == 1
    other: list[int] = []
    assert bm.extend(other, 1) and not set(other) & set(table)
    bm.release(table)
    assert bm.num_free_blocks == 3
    bm.release(other)
    assert bm.num_free_blocks == bm.num_blocks
