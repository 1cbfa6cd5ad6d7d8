"""The engine: requests in, token frames out. One step is schedule -> execute -> update.

    Generate ──add()──▶ Scheduler (waiting/running, blocks) ──schedule()──▶ chunks
    chunks ──ModelRunner.execute()──▶ logits ──Sampler──▶ tokens ──Scheduler.update()──▶ TokenOutput

The engine is single-threaded and owned by the worker's main loop; it never touches a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_worker.block_manager import BlockManager
from engine_worker.grammar import GrammarCompiler, GrammarMatcher, advance_all
from engine_worker.model_runner import ModelRunner, StepItem
from engine_worker.sampler import Sampler, SamplerInput, make_generator
from engine_worker.scheduler import ScheduledChunk, Scheduler
from engine_worker.sequence import Sequence
from protocol import messages as m


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    deadline: float | None
    generators: dict[int, torch.Generator | None] = field(default_factory=dict)
    matchers: dict[int, GrammarMatcher] = field(default_factory=dict)  # seq_id -> its grammar


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        eos_token_ids: list[int] | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.eos_token_ids = list(eos_token_ids if eos_token_ids is not None
                                  else runner.config.eos_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=runner.max_model_len,
            eos_token_ids=self.eos_token_ids,
        )
        self.sampler = Sampler()
        self.grammars = grammars  # None: requests with a grammar are refused
        self.requests: dict[str, _Request] = {}
        self.generated_tokens = 0
        self.prompt_tokens = 0

    # ---- requests ---------------------------------------------------------------------------

    def add(self, gen: m.Generate) -> None:
        """Queue a request; raises ValueError (RequestTooLarge included) if it cannot be run."""
        if gen.request_id in self.requests:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        if not gen.prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        vocab = self.runner.config.vocab_size
        if any(t < 0 or t >= vocab for t in gen.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params = gen.params
        # n > 1: one group, so siblings wait for the first one's prompt and share its blocks.
        seqs = Scheduler.make_group(gen.request_id, list(gen.prompt_token_ids), params)
        req = _Request(gen.request_id, seqs, gen.deadline)
        for i, seq in enumerate(seqs):
            # Each choice has its own generator: seed s gives choice i the stream of seed s + i,
            # so n > 1 choices differ yet stay reproducible.
            seed = None if params.seed is None else params.seed + i
            req.generators[seq.seq_id] = make_generator(seed, self.runner.device)
        if gen.grammar is not None:  # structured output: one matcher per choice
            if self.grammars is None:
                raise ValueError("this worker does not support structured output")
            matchers = self.grammars.matchers(gen.grammar, len(seqs))
            req.matchers = {seq.seq_id: mt for seq, mt in zip(seqs, matchers, strict=True)}
        for seq in seqs:
            self.scheduler.add(seq)  # raises before anything else changed for seq 0
        self.requests[gen.request_id] = req
        self.prompt_tokens += len(gen.prompt_token_ids)

    def abort(self, request_id: str, reason: str = "abort") -> list[m.TokenOutput]:
        """Stop a request now; frees its blocks; returns its closing frames (empty if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.scheduler.abort(request_id)
        return [
            m.TokenOutput(request_id, seq.index, [], reason, seq.num_prompt_tokens,
                          seq.num_output_tokens, cached_tokens=seq.num_cached_tokens)
            for seq in req.seqs
            if seq.finish_reason in (None, "abort")
        ]

    def expired(self, now: float) -> list[str]:
        return [rid for rid, r in self.requests.items()
                if r.deadline is not None and now > r.deadline]

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[m.TokenOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self.runner.execute(  # (len(chunks), V) float32
            [StepItem(c.token_ids, c.start_pos, c.seq.block_table) for c in chunks]
        )
        sampled, logprobs = self._sample(chunks, logits)
        self.scheduler.update(chunks, sampled)
        return self._outputs(chunks, sampled, logprobs)

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[list[int | None], dict[int, list]]:
        rows = [i for i, c in enumerate(chunks) if c.sample]
        sampled: list[int | None] = [None] * len(chunks)
        logprobs: dict[int, list] = {}
        if not rows:
            return sampled, logprobs
        inputs = []
        matchers: list[GrammarMatcher | None] = []
        for i in rows:
            seq = chunks[i].seq
            req = self.requests[seq.request_id]
            gen = req.generators[seq.seq_id]
            inputs.append(SamplerInput(seq.params, seq.output_token_ids, gen))
            matchers.append(req.matchers.get(seq.seq_id))
        allowed = None  # (S, V) bool, only when some row is constrained
        if self.grammars is not None:
            allowed = self.grammars.allowed_tokens(matchers, logits.device)
        results = self.sampler(logits[rows], inputs, allowed)  # rows: (S, V)
        advance_all(matchers, [r.token_id for r in results])  # every sampled token is committed
        for i, res in zip(rows, results, strict=True):
            sampled[i] = res.token_id
            if res.logprob is not None:
                top = [[t, lp] for t, lp in (res.top_logprobs or [])]
                logprobs[i] = [res.token_id, res.logprob, top]
        return sampled, logprobs

    def _outputs(self, chunks: list[ScheduledChunk], sampled: list[int | None],
                 logprobs: dict[int, list]) -> list[m.TokenOutput]:
        outputs = []
        for i, chunk in enumerate(chunks):
            token = sampled[i]
            if token is None:
                continue
            seq = chunk.seq
            self.generated_tokens += 1
            outputs.append(m.TokenOutput(
                seq.request_id, seq.index, [token], seq.finish_reason, seq.num_prompt_tokens,
                seq.num_output_tokens, [logprobs[i]] if i in logprobs else None,
                seq.num_cached_tokens,
            ))
            req = self.requests.get(seq.request_id)
            if req is not None and all(s.is_finished for s in req.seqs):
                del self.requests[seq.request_id]
        return outputs

    def stats(self) -> m.Stats:
        bm = self.block_manager
        return m.Stats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries,
            preemptions=self.scheduler.preemptions,
            generated_tokens=self.generated_tokens,
            prompt_tokens=self.prompt_tokens,
        )
