"""Which worker gets a request: load against capacity, plus the prefix blocks it already holds.

    prompt ids ──block_hashes (chain of full blocks)──▶ for each candidate worker:
        hit  = leading blocks of the prompt found in that worker's PrefixIndex / prompt blocks
        load = sequences it holds / its max_num_seqs
        score = hit - load                      (cache_aware; least_loaded: score = -load)
    clearly unbalanced (max load - min load > imbalance) ──▶ the least-loaded one wins outright
    ties (equal best score) ──▶ a random one, so equal workers share the work
    the chosen worker's index records the prompt's blocks (it will hold them once prefilled)

The gateway cannot see the workers' caches, so each worker's PrefixIndex is an approximation the
gateway keeps itself: the block hashes of the prompts it sent there, least recently used evicted
at about the worker's KV capacity. It is wrong only in the safe direction for correctness (a
worker that evicted a block just computes it again); it only steers where work goes. Candidates
are already filtered by the registry (ready, same model, a max_model_len that fits).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from common.block_hash import block_hashes
from gateway.config import ROUTING_POLICIES
from protocol import messages as m

MAX_INDEX_BLOCKS = 1 << 16  # per worker, whatever KV capacity it claims


class Routable(Protocol):
    hello: m.Hello
    load: int
    capacity: int
    identity: bytes


class PrefixIndex:
    """An LRU set of block digests a worker is believed to hold."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, min(capacity_blocks, MAX_INDEX_BLOCKS))
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of the chain found here (a chain breaks at its first miss)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class Router:
    def __init__(self, policy: str = "cache_aware", imbalance: float = 0.5,
                 rng: random.Random | None = None) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")
        self.policy = policy
        self.imbalance = imbalance  # in fractions of capacity
        self._rng = rng or random.Random()
        self._indexes: dict[bytes, PrefixIndex] = {}

    def forget(self, identity: bytes) -> None:
        """A worker left: its cache left with it."""
        self._indexes.pop(identity, None)

    def _index(self, w: Routable) -> PrefixIndex:
        index = self._indexes.get(w.identity)
        if index is None:
            blocks = w.hello.kv_capacity_tokens // max(1, w.hello.block_size)
            index = self._indexes[w.identity] = PrefixIndex(blocks)
        return index

    def pick(self, candidates: Sequence[Routable], prompt_ids: Sequence[int],
             salt: str = "") -> Routable:
        """The worker for this prompt; `candidates` must not be empty."""
        if len(candidates) == 1 and self.policy == "least_loaded":
            return candidates[0]
        loads = [w.load / max(1, w.capacity) for w in candidates]
        hashes_by_size: dict[int, list[bytes]] = {}

        def hashes(w: Routable) -> list[bytes]:
            size = w.hello.block_size
            if size not in hashes_by_size:
                hashes_by_size[size] = block_hashes(prompt_ids, size, salt)
            return hashes_by_size[size]

        if self.policy == "least_loaded" or max(loads) - min(loads) > self.imbalance:
            scores = [-load for load in loads]  # clearly unbalanced: shortest queue wins
        else:
            scores = []
            for w, load in zip(candidates, loads, strict=True):
                hs = hashes(w)
                hit = self._index(w).matched(hs) / len(hs) if hs else 0.0
                scores.append(hit - load)
        best = max(scores)
        ties = [w for w, s in zip(candidates, scores, strict=True) if s >= best - 1e-9]
        chosen = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        if self.policy == "cache_aware":
            self._index(chosen).add(hashes(chosen))
        return chosen
