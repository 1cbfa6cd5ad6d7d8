"""Speculative decoding on the real SmolLM2: greedy output with n-gram speculation equals plain
decoding over 120 tokens, except where the top two logits are within 1e-3 (a near-tie that the
verify chunk's different float summation order may break the other way); the target used as its
own draft accepts every draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.speculative.decoder import SpecDecoder
from engine_worker.speculative.draft import DraftModelProposer
from engine_worker.speculative.ngram import NgramProposer
from protocol import messages as m
from tests.engine_worker.model.test_llama import chat_ids

TIE = 1e-3
TEXT = (
    "Rewrite the following paragraph in plain words, keeping every fact.\n\n"
    "The kestrel is a small falcon that hunts over open country. It hovers in place, facing "
    "into the wind, while it scans the ground for voles, mice and large insects. When it spots "
    "prey it drops steeply, and it can repeat this many times an hour. Kestrels nest in tree "
    "holes, on cliff ledges and on buildings, and they do not build nests of their own. In "
    "towns they often use church towers and the ledges of tall office blocks."
)


def generate(runner: ModelRunner, spec: SpecDecoder | None, prompt: list[int], n: int
             ) -> tuple[list[int], m.Stats]:
    e = Engine(runner, max_num_seqs=4, max_num_batched_tokens=512, spec=spec)
    e.add(m.Generate("x", prompt, m.SamplingParams(max_tokens=n, temperature=0.0,
                                                   ignore_eos=True)))
    out: list[int] = []
    while e.has_work:
        for o in e.step():
            out += o.token_ids
    return out, e.stats()


@pytest.mark.smollm
def test_greedy_ngram_equals_plain_except_near_ties(smollm2_runner: ModelRunner,
                                                     smollm2_dir: Path) -> None:
    prompt = chat_ids(smollm2_dir, TEXT)
    n = 120  # 200 until the suite neared its 10 minutes (30 s; 120 take ~9)
    plain, _ = generate(smollm2_runner, None, prompt, n)
    full = smollm2_runner.forward_full(prompt + plain)  # (T, V) cache-free reference
    top2 = full[len(prompt) - 1 : len(prompt) - 1 + n].topk(2, dim=-1).values  # (n, 2)
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    near_ties = sum(g < TIE for g in gaps)
    got: list[int] = []
    diverged = 0
    proposed = accepted = 0
    while len(got) < n:
        spec = SpecDecoder(NgramProposer(), 4, max_batch=4, min_acceptance=0.0)
        rest, stats = generate(smollm2_runner, spec, prompt + got, n - len(got))
        proposed += stats.spec_proposed_tokens
        accepted += stats.spec_accepted_tokens
        expected = plain[len(got) :]
        mismatch = next((i for i, (a, b) in enumerate(zip(rest, expected, strict=True))
                         if a != b), None)
        if mismatch is None:
            got += rest
            break
        pos = len(got) + mismatch
        assert gaps[pos] < TIE, f"diverged at token {pos} with a top-2 gap of {gaps[pos]}"
        diverged += 1
        got += plain[len(got) : pos + 1]  # continue from the plain run's choice
    print(f"\nSmolLM2 greedy {n} tokens: {near_ties} near-ties (top-2 gap < {TIE}), "
          f"{diverged} divergences at them; n-gram accepted {accepted}/{proposed} drafts")
    assert got == plain or diverged > 0
    assert accepted > 0


@pytest.mark.smollm
def test_smollm_as_its_own_draft_accepts_everything(smollm2_runner: ModelRunner,
                                                     smollm2_dir: Path) -> None:
    draft = ModelRunner(RunnerConfig(smollm2_dir, kv_budget_bytes=32 << 20, block_size=16))
    prompt = chat_ids(smollm2_dir, "Name three colours.")
    spec = SpecDecoder(DraftModelProposer(draft), 4, max_batch=4, min_acceptance=0.0)
    out, stats = generate(smollm2_runner, spec, prompt, 32)
    plain, _ = generate(smollm2_runner, None, prompt, 32)
    assert out == plain
    assert stats.spec_proposed_tokens > 0
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
    del draft
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
