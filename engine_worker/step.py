"""The types one engine step passes between its parts. No torch (annotations only).

    Scheduler.schedule() --ScheduledChunk--> Engine --StepItem--> ModelRunner.execute() -> logits
    Engine --SamplerInput--> Sampler --SampleResult--> Engine -> Scheduler.update()

They live apart from the modules that make and read them so that those import this one and never
each other (the runner and its compiled step, the sampler and its logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_worker.sequence import Sequence
from protocol.messages import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledChunk:
    """Compute K/V for `seq.token_ids[start_pos : start_pos + num_tokens]` this step.

    `start_pos == seq.num_computed_tokens` when scheduled. `sample`: the chunk ends at the
    sequence's last token, so its last logits give the next token.
    """

    seq: Sequence
    start_pos: int
    num_tokens: int
    sample: bool
    # Speculation (decode chunks only): how many drafts the blocks reserved this step allow, the
    # drafts the proposer filled in (fed after the last token, scored at every position), and
    # their draft distribution (a (len(drafts), V) tensor; None: one-hot, e.g. n-gram lookup).
    max_drafts: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None
    num_emitted: int = 0  # set by update: tokens committed from this chunk

    @property
    def token_ids(self) -> list[int]:
        """The committed tokens to compute, then the drafts to verify."""
        end = self.start_pos + self.num_tokens
        return self.seq.token_ids[self.start_pos : end] + self.draft_token_ids


@dataclass
class StepItem:
    """Tokens at absolute positions start_pos..start_pos+len-1 of one sequence. Their K/V go to
    the slots their block table gives; attention sees positions 0..start_pos+len-1."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # Logits for every token of the item, not only the last (speculative verification).
    all_logits: bool = False

    def check(self, max_model_len: int, block_size: int, num_blocks: int) -> None:
        """Raise ValueError unless the item fits the context and its table the cache."""
        n, end = len(self.token_ids), self.start_pos + len(self.token_ids)
        if n == 0 or self.start_pos < 0:
            raise ValueError(f"bad step item: {n} tokens at start_pos {self.start_pos}")
        if end > max_model_len:
            raise ValueError(f"positions up to {end} exceed max_model_len {max_model_len}")
        used = self.block_table[: -(-end // block_size)]
        if len(used) * block_size < end:
            raise ValueError(f"block table of {len(self.block_table)} blocks too short for {end}")
        if min(used) < 0 or max(used) >= num_blocks:
            raise ValueError(f"block id out of range 0..{num_blocks - 1}")


@dataclass
class SamplerInput:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    output_token_ids: list[int]  # this sequence's generated tokens so far (for penalties)
    generator: torch.Generator | None  # per-sequence RNG from make_generator, kept by the engine
    prompt_token_ids: list[int] | tuple[int, ...] = ()  # repetition_penalty counts it too


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None  # set when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # k best (token_id, logprob), best first
