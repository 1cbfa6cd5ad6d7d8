"""A stand-in for the Engine that computes nothing: it sleeps each step by a cost model.

    add(Generate) ─▶ waiting ─(a free place among max_num_seqs)─▶ running: the first step
    prefills (cost per prompt token not found in its prefix cache), each later step decodes one
    token per sequence; step time = step_base + prefill_token x uncached + decode_seq x decoding

It meets engine_worker.engine_surface.EngineSurface, the engine as WorkerLoop drives it, so the
real link, loop and protocol run around it. Its prefix cache is an LRU of chained block
digests sized by kv_capacity_tokens: hit rates behave as a real worker's would when the router
sends related prompts to it. No torch here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from common.block_hash import chain_hash, root_hash
from engine_worker.sequence import SequenceStatus
from engine_worker.step_costs import StepCosts
from protocol import messages as m

FIRST_TOKEN = 1000  # generated ids cycle through [FIRST_TOKEN, FIRST_TOKEN + 64): plain words


@dataclass(frozen=True)
class CostModel:
    step_base_s: float = 0.02
    prefill_token_s: float = 0.0001
    decode_seq_s: float = 0.001

    def step_time(self, uncached_prefill_tokens: int, decoding: int) -> float:
        return (self.step_base_s + self.prefill_token_s * uncached_prefill_tokens
                + self.decode_seq_s * decoding)


@dataclass
class _Seq:
    index: int
    status: SequenceStatus = SequenceStatus.WAITING
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Request:
    gen: m.Generate
    seqs: list[_Seq]
    arrival: int  # FIFO order
    cached_tokens: int = 0
    prefilled: bool = False


class SimEngine:
    def __init__(self, max_num_seqs: int, kv_capacity_tokens: int, block_size: int,
                 max_model_len: int, cost: CostModel) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.cost = cost
        self.num_blocks = max(1, kv_capacity_tokens // block_size)
        self.requests: dict[str, _Request] = {}
        self.grammars = None  # no structured output: it samples nothing
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._order = 0
        self.prefix_cache_hits = self.prefix_cache_queries = 0
        self.generated_tokens = self.prompt_tokens = 0
        # What its steps cost, as the real engine reports it (the gateway's admission reads it).
        self.costs = StepCosts(max_rows=1 << 20)
        for rows in (1, max_num_seqs):
            self.costs.observe(rows, 0, cost.step_time(0, rows))
        self.costs.observe(0, 64, cost.step_time(64, 0))

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def add(self, gen: m.Generate, matchers: list[Any] | None = None) -> None:
        if gen.request_id in self.requests:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        if not gen.prompt_token_ids:
            raise ValueError("empty prompt")
        if gen.embed:  # its Hello says embedding_size 0: the gateway sends it none
            raise ValueError("a simulated worker computes no embeddings")
        if len(gen.prompt_token_ids) + gen.params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")
        self._order += 1
        self.requests[gen.request_id] = _Request(
            gen, [_Seq(i) for i in range(gen.params.n)], self._order)
        self.prompt_tokens += len(gen.prompt_token_ids)

    def abort(self, request_id: str, reason: str = "abort") -> list[m.TokenOutput]:
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        return [self._frame(req, s, [], reason) for s in req.seqs if s.finish_reason is None]

    def abort_choice(self, request_id: str, index: int) -> list[m.TokenOutput]:
        """Stop one choice (n > 1, a stop string met at the gateway); its closing frame."""
        req = self.requests.get(request_id)
        seq = next((s for s in req.seqs if s.index == index), None) if req else None
        if req is None or seq is None or seq.finish_reason is not None:
            return []
        seq.finish_reason = "abort"
        if all(s.finish_reason is not None for s in req.seqs):
            del self.requests[request_id]
        return [self._frame(req, seq, [], "abort")]

    def expired(self, now: float) -> list[str]:
        return [rid for rid, r in self.requests.items()
                if r.gen.deadline is not None and now > r.gen.deadline]

    def check_idle(self) -> list[str]:
        """Engine.check_idle's surface. Nothing here outlives its request (the prefix cache is
        evictable, so it counts as free): an idle SimEngine is always clean."""
        return []

    def stats(self) -> m.Stats:
        running = sum(1 for r in self.requests.values() for s in r.seqs
                      if s.status is SequenceStatus.RUNNING)
        waiting = sum(1 for r in self.requests.values() for s in r.seqs
                      if s.status is SequenceStatus.WAITING)
        return m.Stats(running=running, waiting=waiting, kv_blocks_used=len(self._cache),
                       kv_blocks_total=self.num_blocks, prefix_cache_hits=self.prefix_cache_hits,
                       prefix_cache_queries=self.prefix_cache_queries,
                       generated_tokens=self.generated_tokens, prompt_tokens=self.prompt_tokens,
                       step_costs=self.costs.report())

    def pop_errors(self) -> list[m.RequestError]:
        return []  # it computes nothing, so nothing can come out NaN

    def step(self) -> list[m.TokenOutput]:
        running = [r for r in self.requests.values() if r.prefilled]
        places = self.max_num_seqs - sum(len(r.seqs) for r in running)
        admitted: list[_Request] = []
        for req in sorted((r for r in self.requests.values() if not r.prefilled),
                          key=lambda r: r.arrival):
            if len(req.seqs) > places:
                break
            places -= len(req.seqs)
            admitted.append(req)
        if not running and not admitted:
            return []
        uncached = sum(self._prefill(req) for req in admitted)
        decoding = sum(len(r.seqs) for r in running)
        seconds = self.cost.step_time(uncached, decoding)
        time.sleep(seconds)
        self.costs.observe(decoding, uncached, seconds)
        outputs: list[m.TokenOutput] = []
        for req in running + admitted:  # a prefill step also yields the first token
            for seq in req.seqs:
                if seq.finish_reason is None:
                    outputs.append(self._next_token(req, seq))
            if all(s.finish_reason is not None for s in req.seqs):
                self.requests.pop(req.gen.request_id, None)
        return outputs

    def _prefill(self, req: _Request) -> int:
        """Look the prompt's full blocks up in the cache, insert them; uncached tokens."""
        ids = req.gen.prompt_token_ids
        parent, hit, chained = root_hash(req.gen.cache_salt), 0, True
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            block = ids[start:start + self.block_size]
            parent = chain_hash(parent, block)
            if chained and parent in self._cache:
                hit += self.block_size
            else:
                chained = False
            self._cache[parent] = None
            self._cache.move_to_end(parent)
        while len(self._cache) > self.num_blocks:
            self._cache.popitem(last=False)
        self.prefix_cache_hits += hit
        self.prefix_cache_queries += len(ids)
        req.cached_tokens = hit
        req.prefilled = True
        for seq in req.seqs:
            seq.status = SequenceStatus.RUNNING
        return len(ids) - hit

    def _next_token(self, req: _Request, seq: _Seq) -> m.TokenOutput:
        token = FIRST_TOKEN + (len(seq.output) + seq.index) % 64
        seq.output.append(token)
        self.generated_tokens += 1
        params = req.gen.params
        finish = None
        if token in params.stop_token_ids:
            finish = "stop"
        elif len(seq.output) >= params.max_tokens:
            finish = "length"
        seq.finish_reason = finish
        return self._frame(req, seq, [token], finish)

    def _frame(self, req: _Request, seq: _Seq, tokens: list[int],
               finish: str | None) -> m.TokenOutput:
        return m.TokenOutput(req.gen.request_id, seq.index, tokens, finish,
                             len(req.gen.prompt_token_ids), len(seq.output),
                             cached_tokens=req.cached_tokens)
