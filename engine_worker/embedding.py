"""Embedding requests in the engine: each input pooled into one vector, in the same steps as
generation.

    Generate(embed=True) ──Embeddings.add──▶ its inputs, queued in arrival order
    Engine.step ──take(the prompt rows the step has left)──▶ a batch of inputs, one of each
        waiting request in turn (a second tenant's input rides in the next step, not after
        another's 2,048 inputs)
        ──ModelRunner.embed (one forward, --pooling)──▶ (k, C) normalised vectors
        ──▶ one TokenOutput per input: its vector as float32 bytes, finish "stop"

An input is computed whole in one step, as a prefill span from position 0 that reads and
writes no cache: embedding requests hold no KV block and never enter the prefix index. A step
takes the requests' next inputs in turn, oldest request first, while they fit in the prompt
rows its measured time allows beside its decoders (engine_worker/step_costs.py), so decoding
streams keep their pace; when none fits, the oldest input runs alone in a step that prefills
nothing else (or after two steps passed it by), so a long input is delayed, never starved.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine_worker.config import POOLINGS
from engine_worker.model_runner import ModelRunner
from protocol import messages as m

# A step's vectors travel in one StepOutputs (at most 2 MiB): the bytes they may take there.
VECTOR_BYTES_PER_STEP = 1 << 20
STEPS_PASSED_BY = 2  # after this many steps without room, the oldest input runs anyway
# With nobody decoding, a step of inputs lasts about this long (by the measured cost of a prompt
# row), not the whole row cap: a request that arrives while it runs gets its turn in the next
# step. Beside a 2,048-input batch on SmolLM2 (2 cores) a single input waited 1.3 s behind steps
# of the cap; issue 58 asks for 2 s on a loaded host. A step's fixed cost is a few ms.
EMBEDDING_STEP_S = 0.25


@dataclass
class _Inputs:
    request_id: str
    inputs: list[list[int]]
    done: int = 0  # inputs answered, in order
    started: float | None = None  # monotonic, when its first input was computed


class Embeddings:
    def __init__(self, runner: ModelRunner, pooling: str = "mean") -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r} (one of {', '.join(POOLINGS)})")
        self.runner = runner
        self.pooling = pooling
        self.size = runner.config.hidden_size
        self.max_vectors = max(1, VECTOR_BYTES_PER_STEP // (4 * self.size))
        self.waiting: OrderedDict[str, _Inputs] = OrderedDict()
        self.passed_by = 0  # steps with inputs waiting that ran none

    def add(self, gen: m.Generate) -> None:
        """Queue the inputs of `gen`; ValueError if they cannot be run here."""
        lengths, n = list(gen.input_lengths), gen.params.n
        if len(lengths) != n or any(k < 1 for k in lengths) \
                or sum(lengths) != len(gen.prompt_token_ids):
            raise ValueError("an embedding request needs params.n inputs of at least one token, "
                             "laid end to end in the prompt (input_lengths)")
        longest = self.runner.max_model_len
        if max(lengths) > longest:
            raise ValueError(f"an input of {max(lengths)} tokens exceeds the model's context of "
                             f"{longest}")
        if gen.grammar is not None:
            raise ValueError("an embedding request has no grammar")
        ids, inputs, at = gen.prompt_token_ids, [], 0
        for k in lengths:
            inputs.append(list(ids[at : at + k]))
            at += k
        self.waiting[gen.request_id] = _Inputs(gen.request_id, inputs)

    def abort(self, request_id: str, reason: str) -> list[m.TokenOutput]:
        """Drop a request's inputs not answered yet: a closing frame each (none if unknown)."""
        req = self.waiting.pop(request_id, None)
        if req is None:
            return []
        return [m.TokenOutput(request_id, i, [], reason, len(req.inputs[i]))  # type: ignore[arg-type]
                for i in range(req.done, len(req.inputs))]

    def step(self, rows: int, alone: bool) -> tuple[list[m.TokenOutput], int, set[str]]:
        """Embed the oldest inputs that fit in `rows` prompt rows (at most max_vectors); with
        none fitting, the oldest alone when `alone` (nothing else prefills in this step) or
        when it has been passed by long enough. Its frames, the rows it computed, and the
        requests whose vector came out NaN or inf (no frame: the engine ends them)."""
        if not self.waiting:
            return [], 0, set()
        batch: list[tuple[_Inputs, int]] = []
        used = 0
        # One input of each waiting request in turn, oldest first, round after round, until
        # one does not fit: a small request is not held behind another's 2,048 inputs.
        nexts = {req.request_id: req.done for req in self.waiting.values()}
        left = sum(len(req.inputs) - req.done for req in self.waiting.values())
        full = False
        while not full and len(batch) < left:
            for req in self.waiting.values():
                i = nexts[req.request_id]
                if i == len(req.inputs):
                    continue
                k = len(req.inputs[i])
                if used + k > rows or len(batch) == self.max_vectors:
                    full = True
                    break
                batch.append((req, i))
                nexts[req.request_id], used = i + 1, used + k
        if not batch:
            if not alone and self.passed_by < STEPS_PASSED_BY:
                self.passed_by += 1
                return [], 0, set()
            req = next(iter(self.waiting.values()))
            batch, used = [(req, req.done)], len(req.inputs[req.done])
        self.passed_by = 0
        now = time.monotonic()
        vectors = self.runner.embed([req.inputs[i] for req, i in batch], self.pooling)
        finite = torch.isfinite(vectors).all(dim=1).tolist()
        raw = vectors.cpu().contiguous().numpy().astype("<f4")
        broken = {req.request_id for (req, _), ok in zip(batch, finite, strict=True) if not ok}
        outputs = []
        for row, (req, i) in enumerate(batch):
            if req.request_id in broken:
                continue
            since = None
            if req.started is None:
                req.started = now
                since = time.monotonic() - now
            req.done = i + 1
            outputs.append(m.TokenOutput(req.request_id, i, [], "stop", len(req.inputs[i]), 0,
                                         since_scheduled_s=since, embedding=raw[row].tobytes()))
            if req.done == len(req.inputs):
                del self.waiting[req.request_id]
        return outputs, used, broken
