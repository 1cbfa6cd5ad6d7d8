"""Paged KV-cache bookkeeping with prefix caching. No tensors: block ids and counts only.

Data flow: the scheduler asks `can_allocate` / `allocate` when it admits a sequence (the prefix
cache may serve its leading full blocks), `can_append` / `append_slot` before each decode step,
`mark_computed` after each step (full blocks whose K/V now exist become findable), and `free`
when a sequence finishes or is preempted. The model runner only reads `seq.block_table`.

Prefix cache: a full block is keyed by the hash chain of common/block_hash.py (the key names
the whole prefix up to and including the block; it is cryptographic on purpose).
A block's key is registered only once its K/V has been computed, so a block allocated but not
yet written is never served to another sequence.

Free pool: a block no sequence references is free, even if it still holds a cached prefix. The
pool is ordered least-recently-freed first; allocation takes from the front and evicts that
block's cache entry. Blocks with no cached content are put at the front, so cached prefixes are
evicted (LRU) only when no empty block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from common.block_hash import chain_hash, root_hash
from engine_worker.sequence import Sequence


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    # Set only while this block is the cache entry for `hash`; `parent` (the previous block's
    # key) and `token_ids` are kept so a lookup checks all the key was made from.
    hash: bytes | None = None
    parent: bytes = b""
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Invariant: a block is in the free pool iff its ref_count is 0.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Invariant: _cached[h] == b iff self._blocks[b].hash == h.
        self._cached: dict[bytes, int] = {}
        self.prefix_cache_queries = 0  # tokens offered to the cache at allocation (cumulative)
        self.prefix_cache_hits = 0  # of those, tokens served from cached blocks (cumulative)

    # -- figures -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self._num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a findable prefix, referenced or not."""
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    # -- admission -----------------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], list[bytes]]:
        """Cached blocks (and their chain hashes) covering the longest cached prefix of `seq`.

        Only full blocks inside tokens [0, num_tokens - 1) are looked up: the last token is
        always computed, since its forward pass yields the logits for the next token.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self._block_size
        tokens = seq.token_ids
        blocks: list[int] = []
        hashes: list[bytes] = []
        h = root_hash(seq.cache_salt)
        for i in range((seq.num_tokens - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent, h = h, chain_hash(h, block_tokens)
            block_id = self._cached.get(h)
            if block_id is None or self._blocks[block_id].token_ids != block_tokens \
                    or self._blocks[block_id].parent != parent:
                break
            blocks.append(block_id)
            hashes.append(h)
        return blocks, hashes

    def _fits(self, seq: Sequence, matched: list[int]) -> bool:
        fresh = self.blocks_needed(seq.num_tokens) - len(matched)
        # A hit on an unreferenced cached block takes that block out of the free pool too.
        revived = sum(1 for b in matched if self._blocks[b].ref_count == 0)
        return fresh + revived <= len(self._free)

    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._match_prefix(seq)[0])

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all of its tokens, reusing cached prefix blocks.

        Sets `seq.num_computed_tokens` to the tokens served from the cache. The caller checks
        `can_allocate` first.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq!r} already has blocks")
        matched, hashes = self._match_prefix(seq)
        if not self._fits(seq, matched):
            raise RuntimeError(f"not enough free blocks for {seq!r}")
        for block_id in matched:
            self._take(block_id)
        num_matched = len(matched) * self._block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_matched
        seq.block_table = list(matched)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = num_matched
        if seq.num_allocations == 0:
            seq.num_cached_tokens = num_matched
        seq.num_allocations += 1
        for _ in range(self.blocks_needed(seq.num_tokens) - len(matched)):
            seq.block_table.append(self._take_fresh())

    # -- decoding ------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        missing = self.blocks_needed(seq.num_tokens + lookahead) - len(seq.block_table)
        return missing <= len(self._free)

    def append_slot(self, seq: Sequence, lookahead: int = 0) -> None:
        """Make sure `seq` has blocks for positions up to num_tokens - 1 + lookahead (the token
        fed next and `lookahead` speculative drafts after it)."""
        if not self.extend(seq.block_table, seq.num_tokens + lookahead):
            raise RuntimeError(f"no free block for {seq!r}")

    def extend(self, table: list[int], num_tokens: int) -> bool:
        """Append fresh blocks to `table` until it holds `num_tokens` positions; False, taking
        nothing, when the pool has too few. Also the draft model's own cache's allocator
        (engine_worker/speculative/draft.py), whose tables belong to no Sequence."""
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > len(self._free):
            return False
        for _ in range(missing):
            table.append(self._take_fresh())
        return True

    def mark_computed(self, seq: Sequence) -> None:
        """Register the full blocks that `seq.num_computed_tokens` now covers in the cache.

        Invariant relied on: every position below `num_computed_tokens` holds the K/V of a
        committed token. Speculative drafts written past it (rejected, or dropped after a stop)
        are never hashed, and are overwritten when the sequence reaches those positions."""
        if not self.enable_prefix_caching:
            return
        bs = self._block_size
        tokens = seq.token_ids
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            prev = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq.cache_salt)
            h = chain_hash(prev, block_tokens)
            seq.block_hashes.append(h)
            block = self._blocks[seq.block_table[i]]
            # Two sequences may compute the same content at once: the first registration wins
            # and the other block stays an ordinary (uncached) block.
            if block.hash is None and h not in self._cached:
                block.hash = h
                block.parent = prev
                block.token_ids = block_tokens
                self._cached[h] = block.block_id

    # -- release -------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Its computed full blocks stay cached until evicted."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` (the caller forgets the table)."""
        # Reverse order: a prefix is only useful from its start, so the tail should go first;
        # freed earlier means closer to the front of the pool, i.e. evicted sooner.
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:
                    # Nothing worth keeping: reuse it before any cached block.
                    self._free.move_to_end(block_id, last=False)

    # -- internals -----------------------------------------------------------------------------

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        """Pop the least recently freed block, evicting whatever prefix it cached."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None:
            del self._cached[block.hash]
            block.hash = None
            block.parent = b""
            block.token_ids = ()
        block.ref_count = 1
        return block_id
