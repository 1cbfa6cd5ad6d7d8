"""The engine: requests in, token frames out. One step is schedule -> propose -> execute ->
accept -> update.

    Generate ──add()──▶ Scheduler (waiting/running, blocks) ──schedule(k)──▶ chunks
    chunks ──SpecDecoder.propose()──▶ drafts on decode chunks (speculation on; k > 0)
    chunks ──ModelRunner.execute()──▶ logits (one row per chunk; every position of a draft chunk)
    logits ──Sampler / SpecDecoder.accept()──▶ tokens ──Scheduler.update()──▶ TokenOutput
    embedding requests ──Embeddings.step(the prompt rows left)──▶ a vector each (embedding.py)

Per-request state lives on the sequences (generator, first-scheduled time, speculation state); the
engine keeps only which sequences make up which request, and its deadline. The engine is
single-threaded and owned by the worker's main loop; it never touches a socket.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from engine_worker.block_manager import BlockManager
from engine_worker.embedding import EMBEDDING_STEP_S, Embeddings
from engine_worker.grammar import GrammarCompiler, GrammarMatcher, advance_all
from engine_worker.logprobs import logprob_entries
from engine_worker.model_runner import ModelRunner
from engine_worker.sampler import Sampler, make_generator
from engine_worker.scheduler import Scheduler
from engine_worker.sequence import Sequence
from engine_worker.speculative.decoder import SpecDecoder
from engine_worker.step import SamplerInput, ScheduledChunk, StepItem
from engine_worker.step_costs import DEFAULT_PREFILL_SHARE, DEFAULT_STEP_FLOOR_S, StepCosts
from protocol import messages as m

log = logging.getLogger("kestrel.engine")
NON_FINITE = ("the model computed a non-finite value (NaN or inf) for this request: its "
              "weights or its numerics are broken")


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    deadline: float | None
    first_frame_sent: bool = False
    matchers: dict[int, GrammarMatcher] = field(default_factory=dict)  # seq_id -> its grammar


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        spec: SpecDecoder | None = None,
        grammars: GrammarCompiler | None = None,
        prefill_share: float = DEFAULT_PREFILL_SHARE,
        step_floor_s: float = DEFAULT_STEP_FLOOR_S,
        pooling: str = "mean",
    ) -> None:
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.eos_token_ids = list(runner.config.eos_token_ids)
        self.errors: list[m.RequestError] = []  # ended by the engine itself (pop_errors)
        # Measured step costs size each step's prompt rows (0: the token budget alone); they are
        # measured, and reported to the gateway, either way.
        self.costs = StepCosts(max_num_batched_tokens, prefill_share or DEFAULT_PREFILL_SHARE,
                               step_floor_s, one_pass=runner.mixed_steps_one_pass)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=runner.max_model_len,
            eos_token_ids=self.eos_token_ids,
            prefill_rows=self.costs.prefill_rows if prefill_share > 0 else None,
        )
        self.sampler = Sampler(self.eos_token_ids)
        self.embeddings = Embeddings(runner, pooling)
        self.sized_steps = prefill_share > 0
        self.spec = spec
        self.grammars = grammars  # None: requests with a grammar are refused
        self.requests: dict[str, _Request] = {}
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.idle_check_failures = 0

    # ---- requests ---------------------------------------------------------------------------

    def add(self, gen: m.Generate, matchers: list[GrammarMatcher] | None = None) -> None:
        """Queue a request; raises ValueError (RequestTooLarge included) if it cannot be run.
        `matchers`: its grammar's, built already (engine_worker.grammar_builds), one a choice."""
        if gen.request_id in self.requests:
            raise ValueError(f"duplicate request id {gen.request_id!r}")
        if not gen.prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        vocab = self.runner.config.vocab_size
        if any(t < 0 or t >= vocab for t in gen.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if gen.embed:
            self.embeddings.add(gen)
            self.requests[gen.request_id] = _Request(gen.request_id, [], gen.deadline)
            self.prompt_tokens += len(gen.prompt_token_ids)
            return
        params = gen.params
        named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if any(t < 0 or t >= vocab for t in named):  # the gateway checked its tokenizer's size
            raise ValueError(f"logit_bias and stop_token_ids ids must be in [0, {vocab})")
        if gen.grammar is not None and self.grammars is None:
            raise ValueError("this worker does not support structured output")
        if gen.grammar is not None:
            # Drafts are not checked against the grammar, so constrained requests do not speculate.
            params = replace(params, speculative=False)
        # n > 1: one group, so siblings wait for the first one's prompt and share its blocks.
        seqs = Scheduler.make_group(gen.request_id, list(gen.prompt_token_ids), params)
        for i, seq in enumerate(seqs):
            seq.cache_salt = gen.cache_salt.encode()
            # Each choice has its own generator: seed s gives choice i the stream of seed s + i,
            # so n > 1 choices differ yet stay reproducible.
            seed = None if params.seed is None else params.seed + i
            seq.generator = make_generator(seed, self.runner.device)
        by_seq: dict[int, GrammarMatcher] = {}
        if gen.grammar is not None and self.grammars is not None:  # one matcher per choice
            built = matchers or self.grammars.matchers(gen.grammar, len(seqs))
            by_seq = {seq.seq_id: mt for seq, mt in zip(seqs, built, strict=True)}
        for seq in seqs:
            self.scheduler.add(seq)  # raises before anything else changed for seq 0
        self.requests[gen.request_id] = _Request(gen.request_id, seqs, gen.deadline,
                                                 matchers=by_seq)
        self.prompt_tokens += len(gen.prompt_token_ids)

    def abort(self, request_id: str, reason: str = "abort") -> list[m.TokenOutput]:
        """Stop a request now; frees its blocks; returns its closing frames (empty if unknown)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        if not req.seqs:  # an embedding request: its inputs not answered yet
            return self.embeddings.abort(request_id, reason)
        # Only the choices still live get a closing frame: one that ended (a stop, its length,
        # or a per-choice abort_choice) has had its last frame already.
        live = self.scheduler.abort(request_id)
        for seq in live:
            self._release(seq)
        return [
            m.TokenOutput(request_id, seq.index, [], reason, seq.num_prompt_tokens,
                          seq.num_output_tokens, cached_tokens=seq.num_cached_tokens)
            for seq in live
        ]

    def abort_choice(self, request_id: str, index: int) -> list[m.TokenOutput]:
        """Stop one choice of a request now (the gateway saw it hit a stop string); frees its
        blocks; returns its closing frame (empty if it is not live)."""
        req = self.requests.get(request_id)
        seq = None if req is None else self.scheduler.abort_seq(request_id, index)
        if req is None or seq is None:
            return []
        self._release(seq)  # its draft model's blocks, if any
        if all(s.is_finished for s in req.seqs):
            del self.requests[request_id]
        return [m.TokenOutput(request_id, seq.index, [], "abort", seq.num_prompt_tokens,
                              seq.num_output_tokens, cached_tokens=seq.num_cached_tokens)]

    def expired(self, now: float) -> list[str]:
        return [rid for rid, r in self.requests.items()
                if r.deadline is not None and now > r.deadline]

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[m.TokenOutput]:
        """One step: the scheduled chunks' tokens, then embedding inputs in the prompt rows
        the step has left; every frame of the step."""
        started = time.perf_counter()
        chunks, drafting_s = self._schedule()
        outputs = self._generate(chunks) if chunks else []
        decode_rows = sum(1 + len(c.draft_token_ids) for c in chunks if c.num_tokens == 1)
        prefill_rows = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if self.embeddings.waiting:
            allowed = (self.costs.prefill_rows(decode_rows) if self.sized_steps
                       else self.scheduler.max_num_batched_tokens - decode_rows)
            if self.sized_steps and decode_rows == 0:
                # Nobody decodes, but a request may arrive while this step runs: its turn comes
                # after the step, so a step of inputs lasts about EMBEDDING_STEP_S, not a cap.
                allowed = min(allowed, self.costs.rows_within(EMBEDDING_STEP_S))
            vectors, rows, broken = self.embeddings.step(max(0, allowed - prefill_rows),
                                                         alone=prefill_rows == 0)
            for rid in broken:
                self.abort(rid)
                self.errors.append(m.RequestError(rid, NON_FINITE, "model_numerics"))
            for out in vectors:
                if out.request_id in self.requests and out.request_id not in \
                        self.embeddings.waiting:
                    del self.requests[out.request_id]  # its last input answered
            outputs += vectors
            prefill_rows += rows
        # the draft model's passes are not the target's step: a verification step is measured
        # as its rows cost, which is what the step sizing and a draft's price weigh
        self.costs.observe(decode_rows, prefill_rows,
                           time.perf_counter() - started - drafting_s)
        return outputs

    def _schedule(self) -> tuple[list[ScheduledChunk], float]:
        """This step's chunks, with their drafts where speculation is on, and the seconds the
        drafts took (a draft model's passes: not the target's step)."""
        sched = self.scheduler
        k = 0 if self.spec is None else self.spec.lookahead(sched.num_running,
                                                            sched.max_num_batched_tokens)
        chunks = sched.schedule(k)
        if not (chunks and self.spec is not None and k):
            return chunks, 0.0
        t0 = time.perf_counter()
        self.spec.propose(chunks, self.costs.decode_s)
        return chunks, time.perf_counter() - t0

    def _generate(self, chunks: list[ScheduledChunk]) -> list[m.TokenOutput]:
        """The chunks through the model: their sampled tokens' frames."""
        sched = self.scheduler
        logits = self.runner.execute([  # (rows, V) float32: one per chunk, 1 + n per draft chunk
            StepItem(c.token_ids, c.start_pos, c.seq.block_table, bool(c.draft_token_ids))
            for c in chunks
        ])
        emitted, logprobs = self._sample(chunks, logits)
        broken = self._non_finite(chunks, logits, emitted)
        sched.update(chunks, emitted)
        outputs = self._outputs(chunks, logprobs)
        if broken:  # their frames carry no token worth sending: an error each, and they end
            for rid in broken:
                self.abort(rid)
                self.errors.append(m.RequestError(rid, NON_FINITE, "model_numerics"))
            outputs = [o for o in outputs if o.request_id not in broken]
        return outputs

    def pop_errors(self) -> list[m.RequestError]:
        """Requests the engine ended by itself since the last call, each with its error."""
        errors, self.errors = self.errors, []
        return errors

    @staticmethod
    def _non_finite(chunks: list[ScheduledChunk], logits: torch.Tensor,
                    emitted: list[list[int] | None]) -> set[str]:
        """Request ids whose sampled token's logit is NaN or inf: a model with NaN weights (or
        an overflow) samples garbage, and its logprobs cannot be written as JSON. One gather
        of a value per row, not a pass over the vocabulary."""
        rows, tokens, owners, row = [], [], [], 0
        for c, toks in zip(chunks, emitted, strict=True):
            if toks:
                rows.append(row)
                tokens.append(toks[0])
                owners.append(c.seq.request_id)
            row += 1 + len(c.draft_token_ids)
        if not rows:
            return set()
        picked = logits[torch.tensor(rows), torch.tensor(tokens)]
        finite = torch.isfinite(picked).tolist()
        return {rid for rid, ok in zip(owners, finite, strict=True) if not ok}

    @torch.inference_mode()
    def probe(self, decode_rows: tuple[int, ...] | None = None,
              prefill_rows: tuple[int, ...] = (16, 64, 256)) -> None:
        """Time a few step shapes before any request, so the first requests are sized and
        admitted by a measurement of this host and model. Runs on blocks no sequence holds (at
        start every block is free and nothing is cached); what it writes there is never read."""
        # One row, sixteen, and the full batch: a path may change with the rows (on a 2-core
        # EPYC, SmolLM2's 32-row step took 3.7x its 16-row one), so the widest is measured, not
        # extrapolated.
        most = self.scheduler.max_num_seqs
        decode_rows = tuple(sorted({min(d, most) for d in (decode_rows or (1, 16, most))}))
        bs, nblocks = self.runner.block_size, self.runner.num_blocks
        context = min(16 * bs, self.runner.max_model_len - 1)  # a decode context of a chat
        per_row = -(-(context + 1) // bs)
        shapes: list[list[StepItem]] = []
        for d in decode_rows:
            tables = [[(r * per_row + j) % nblocks for j in range(per_row)] for r in range(d)]
            if any(len(set(t)) < len(t) for t in tables):
                continue  # the cache is too small for a context this long
            shapes.append([StepItem([0], context, t) for t in tables])
        # Prompt chunks beside one decoder, as serving runs them: what a chunk adds to a step
        # (in one pass with the decode rows, or beside the stack where the plan splits them).
        beside = next((items[0] for items in shapes if len(items) == 1), None)  # 1-row decode
        for p in prefill_rows:
            p = min(p, self.runner.max_model_len, self.costs.max_rows - 1, nblocks * bs)
            start = nblocks - -(-p // bs)  # the cache's last blocks: apart from the decoder's
            if p > 1 and beside is not None and start >= per_row:
                shapes.append([beside, StepItem([0] * p, 0, list(range(start, nblocks)))])
        # The eager path: a compiled decode would compile a graph per shape here (minutes); it
        # is measured by the steps it serves.
        for items in shapes:
            self.runner.execute(items, compiled=False)  # the first run of a shape may build
            seconds = []
            one = all(len(it.token_ids) == 1 for it in items)
            sampled = [SamplerInput(m.SamplingParams(), [], None) for _ in items]
            for _ in range(2):  # the least of two: a process starting beside it is no cost
                started = time.perf_counter()
                logits = self.runner.execute(items, compiled=False)
                if one:  # a decode step samples every row
                    self.sampler(logits, sampled)
                seconds.append(time.perf_counter() - started)
            if one:
                self.costs.observe(len(items), 0, min(seconds))
            else:  # one decode row beside the chunk: decode(1) was measured just before
                self.costs.observe(1, len(items[1].token_ids), min(seconds))
        report = self.costs.report()
        log.info("step costs measured", extra={"fields": {
            "decode_ms": {int(r): round(s * 1e3, 2) for r, s in report.decode_s},
            "prefill_row_ms": {r: round(s * 1e3, 3) for r, s in report.prefill_row_s}}})

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[list[list[int] | None], dict[int, list]]:
        starts, row = [], 0
        for c in chunks:
            starts.append(row)
            row += 1 + len(c.draft_token_ids)
        emitted: list[list[int] | None] = [None] * len(chunks)
        plain = [i for i, c in enumerate(chunks) if c.sample and not c.draft_token_ids]
        spec = [i for i, c in enumerate(chunks) if c.draft_token_ids]
        logprobs: dict[int, list] = {}
        if plain:
            inputs = [SamplerInput(chunks[i].seq.params, chunks[i].seq.output_token_ids,
                                   chunks[i].seq.generator, chunks[i].seq.prompt_token_ids)
                      for i in plain]
            matchers = [self._matcher(chunks[i].seq) for i in plain]
            allowed = None  # (S, V) bool, only when some row is constrained
            if self.grammars is not None:
                allowed = self.grammars.allowed_tokens(matchers, logits.device)
            results = self.sampler(logits[[starts[i] for i in plain]], inputs, allowed)  # (S, V)
            advance_all(matchers, [r.token_id for r in results])  # each sampled token commits
            for i, res in zip(plain, results, strict=True):
                emitted[i] = [res.token_id]
                if res.logprob is not None:
                    logprobs[i] = [[res.token_id, res.logprob, [list(t) for t in
                                                                 res.top_logprobs or []]]]
        if spec:
            assert self.spec is not None  # drafts exist only when speculation is on
            rows = [r for i in spec for r in range(starts[i], starts[i] + 1 +
                                                   len(chunks[i].draft_token_ids))]
            tokens = self.spec.accept(self.sampler, [chunks[i] for i in spec], logits[rows])
            for i, toks in zip(spec, tokens, strict=True):
                emitted[i] = toks
                k = chunks[i].seq.params.logprobs
                if k is not None:  # raw logprobs at each emitted token's own position
                    logprobs[i] = logprob_entries(logits[starts[i] : starts[i] + len(toks)],
                                                  toks, k)
        return emitted, logprobs

    def _outputs(self, chunks: list[ScheduledChunk], logprobs: dict[int, list]
                 ) -> list[m.TokenOutput]:
        outputs = []
        for i, chunk in enumerate(chunks):
            if not chunk.sample or chunk.num_emitted == 0:
                continue
            seq = chunk.seq
            n = chunk.num_emitted
            tokens = seq.output_token_ids[-n:]
            self.generated_tokens += n
            req = self.requests.get(seq.request_id)
            since = None
            if req is not None and not req.first_frame_sent:
                req.first_frame_sent = True
                started = [s.first_scheduled_time for s in req.seqs
                           if s.first_scheduled_time is not None]
                since = time.monotonic() - min(started) if started else None
            lp = logprobs[i][:n] if i in logprobs else None
            outputs.append(m.TokenOutput(
                seq.request_id, seq.index, tokens, seq.finish_reason, seq.num_prompt_tokens,
                seq.num_output_tokens, lp, seq.num_cached_tokens, since,
            ))
            if seq.is_finished:
                self._release(seq)
            if req is not None and all(s.is_finished for s in req.seqs):
                del self.requests[seq.request_id]
        return outputs

    def _matcher(self, seq: Sequence) -> GrammarMatcher | None:
        req = self.requests.get(seq.request_id)
        return None if req is None else req.matchers.get(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        if self.spec is not None:
            self.spec.release(seq)

    def check_idle(self) -> list[str]:
        """With no request left, what is still held (SGLang's idle self-check): every KV block
        must be free (cached blocks count: they are evictable), no sequence queued or running.
        Each breach is logged and counted; an empty list is a clean idle."""
        if self.requests:
            return []
        bm, sched = self.block_manager, self.scheduler
        breaches = []
        if bm.num_free_blocks != bm.num_blocks:
            breaches.append(f"{bm.num_used_blocks} of {bm.num_blocks} KV blocks still in use")
        if sched.has_work:
            breaches.append(f"{sched.num_running} running and {sched.num_waiting} waiting "
                            "sequences with no request")
        if breaches:
            self.idle_check_failures += 1
            log.error("idle self-check: %s", "; ".join(breaches))
        return breaches

    def stats(self) -> m.Stats:
        bm = self.block_manager
        spec = self.spec.stats if self.spec is not None else None
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
            spec_proposed_tokens=spec.proposed if spec else 0,
            spec_accepted_tokens=spec.accepted if spec else 0,
            spec_verify_steps=spec.verify_steps if spec else 0,
            idle_check_failures=self.idle_check_failures,
            step_costs=self.costs.report(),
        )
