"""Speculative decoding in the engine on the tiny random Llama: lossless at temperature 0, the
target as its own draft accepts everything, only committed tokens reach the prefix cache, and
seeds, stops, logprobs, n > 1 and the per-request opt-out keep working."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from common.block_hash import ROOT_HASH as _ROOT_HASH
from common.block_hash import chain_hash
from engine_worker.block_manager import BlockManager
from engine_worker.engine import Engine
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.scheduler import Scheduler
from engine_worker.speculative.decoder import Proposer, SpecDecoder
from engine_worker.speculative.draft import DraftModelProposer
from engine_worker.speculative.ngram import NgramProposer
from protocol import messages as m


def repetitive_prompt(seed: int, n: int = 24, times: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)] * times


def run(engine: Engine, gens: list[m.Generate]) -> dict[tuple[str, int], list[int]]:
    for g in gens:
        engine.add(g)
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    steps = 0
    while engine.has_work:
        for o in engine.step():
            out[(o.request_id, o.index)] += o.token_ids
        steps += 1
        assert steps < 5000
    return dict(out)


def engine(runner: ModelRunner, proposer: Proposer | None, k: int = 4, **kw: object) -> Engine:
    spec = None if proposer is None else SpecDecoder(proposer, k, max_batch=8,
                                                      min_acceptance=0.0)
    return Engine(runner, max_num_seqs=8, max_num_batched_tokens=256, spec=spec, **kw)


def gen(rid: str, prompt: list[int], n_tokens: int = 40, **kw: object) -> m.Generate:
    params = dict(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    params.update(kw)
    return m.Generate(rid, prompt, m.SamplingParams(**params))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_runner(tiny_dir: Path) -> ModelRunner:
    return ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=16 << 20, block_size=16))


def test_ngram_greedy_equals_plain_decoding(tiny_runner: ModelRunner) -> None:
    gens = [gen(f"r{i}", repetitive_prompt(i)) for i in range(3)]
    plain = run(engine(tiny_runner, None), gens)
    spec_engine = engine(tiny_runner, NgramProposer())
    spec = run(spec_engine, gens)
    assert spec == plain
    stats = spec_engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_verify_steps > 0
    assert stats.generated_tokens == 3 * 40


@pytest.mark.parametrize("controls", [
    {"repetition_penalty": 1.3}, {"min_tokens": 30, "ignore_eos": False},
    {"min_p": 0.2, "logit_bias": [(7, 3.0), (11, -100.0)]},
], ids=["repetition", "min-tokens", "min-p-bias"])
def test_the_sampler_controls_keep_speculation_lossless(tiny_runner: ModelRunner,
                                                        controls: dict) -> None:
    """Issue 40: a control that changes the distribution is applied to the verified positions
    as to a plain step (greedy ones leave the raw-argmax fast path), so the greedy text is the
    same with and without n-gram speculation, and speculation still ran. (A sampled row's draws
    differ with speculation by design, see sampler.py; its acceptance compares Sampler.probs,
    which applies the same controls: tests/engine_worker/test_sampler_controls.py.)"""
    gens = [gen(f"r{i}", repetitive_prompt(i), **controls) for i in range(2)]
    plain = run(engine(tiny_runner, None), gens)
    spec_engine = engine(tiny_runner, NgramProposer())
    assert run(spec_engine, gens) == plain
    assert spec_engine.stats().spec_verify_steps > 0


def test_target_as_its_own_draft_accepts_everything(tiny_runner: ModelRunner,
                                                     draft_runner: ModelRunner) -> None:
    gens = [gen("g", repetitive_prompt(5), 30),
            gen("s", repetitive_prompt(6), 30, temperature=1.0, seed=4)]
    e = engine(tiny_runner, DraftModelProposer(draft_runner))
    run(e, gens)
    stats = e.stats()
    assert stats.spec_proposed_tokens > 0
    # Same weights: p == q, so every draft passes (u < p/q = 1), greedy and sampled alike.
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens
    plain = run(engine(tiny_runner, None), [gens[0]])
    again = run(engine(tiny_runner, DraftModelProposer(draft_runner)), [gens[0]])
    assert again == plain
    assert DraftModelProposer(draft_runner).num_free_blocks == draft_runner.num_blocks


def test_draft_blocks_released(tiny_runner: ModelRunner, draft_runner: ModelRunner) -> None:
    proposer = DraftModelProposer(draft_runner)
    e = engine(tiny_runner, proposer)
    e.add(gen("a", repetitive_prompt(7), 30))
    e.add(gen("b", repetitive_prompt(8), 30))
    for _ in range(4):
        e.step()
    assert proposer.num_free_blocks < draft_runner.num_blocks
    e.abort("a")
    run(e, [])
    assert proposer.num_free_blocks == draft_runner.num_blocks


def test_seeded_sampling_reproduces(tiny_runner: ModelRunner) -> None:
    g = gen("s", repetitive_prompt(9), 40, temperature=0.8, top_p=0.95, seed=123)
    first = run(engine(tiny_runner, NgramProposer()), [g])
    second = run(engine(tiny_runner, NgramProposer()), [g])
    assert first == second


def test_stop_token_inside_accepted_drafts(tiny_runner: ModelRunner) -> None:
    prompt = repetitive_prompt(10)
    plain = run(engine(tiny_runner, None), [gen("a", prompt, 40)])[("a", 0)]
    stop = plain[25]  # a token the greedy stream reaches; it ends the request there
    cut = plain.index(stop) + 1
    e = engine(tiny_runner, NgramProposer())
    out = run(e, [gen("a", prompt, 40, stop_token_ids=[stop])])
    assert out[("a", 0)] == plain[:cut]
    out = run(engine(tiny_runner, NgramProposer()), [gen("b", prompt, 7)])
    assert out[("b", 0)] == plain[:7]  # max_tokens never overshot by a draft run


def test_logprobs_and_n_with_speculation(tiny_runner: ModelRunner) -> None:
    prompt = repetitive_prompt(11)
    g = gen("lp", prompt, 20, logprobs=2)
    frames_plain: list[list] = []
    frames_spec: list[list] = []
    for proposer, sink in ((None, frames_plain), (NgramProposer(), frames_spec)):
        e = engine(tiny_runner, proposer)
        e.add(g)
        while e.has_work:
            for o in e.step():
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                sink += o.logprobs
    assert [f[0] for f in frames_spec] == [f[0] for f in frames_plain]
    for a, b in zip(frames_spec, frames_plain, strict=True):
        assert a[1] == pytest.approx(b[1], abs=1e-3)
        assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
    out = run(engine(tiny_runner, NgramProposer()),
              [gen("n", prompt, 15, n=3, temperature=0.9, seed=1)])
    assert sorted(out) == [("n", 0), ("n", 1), ("n", 2)]
    assert all(len(v) == 15 for v in out.values())


def test_opt_out_and_large_batch_turn_speculation_off(tiny_runner: ModelRunner) -> None:
    e = engine(tiny_runner, NgramProposer())
    run(e, [gen("o", repetitive_prompt(12), 20, speculative=False)])
    assert e.stats().spec_proposed_tokens == 0
    spec = SpecDecoder(NgramProposer(), 4, max_batch=2, min_acceptance=0.0)
    assert spec.lookahead(3, 256) == 0 and spec.lookahead(2, 256) == 4
    assert spec.lookahead(2, 6) == 2  # the step's token budget bounds the drafts


class _Wrong:
    """A proposer whose drafts are always wrong (never the greedy token)."""

    def propose(self, seqs: list, limits: list[int], target_step_s: object = None
                ) -> list[tuple[list[int], None]]:
        return [([0] * k, None) for k in limits]

    def release(self, seq: object) -> None:
        pass


def test_low_acceptance_backs_off(tiny_runner: ModelRunner) -> None:
    spec = SpecDecoder(_Wrong(), 4, max_batch=8, min_acceptance=0.3)
    e = Engine(tiny_runner, max_num_seqs=8, max_num_batched_tokens=256, spec=spec)
    plain = run(engine(tiny_runner, None), [gen("w", repetitive_prompt(13), 40)])
    assert run(e, [gen("w", repetitive_prompt(13), 40)]) == plain
    # Without the backoff every one of the ~40 steps would verify 4 wrong drafts.
    assert 0 < e.stats().spec_verify_steps < 15


def test_prefix_cache_registers_only_committed_tokens() -> None:
    """Drafts written past the committed tokens never become a cached block."""
    bm = BlockManager(16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                      eos_token_ids=[])
    seq = Scheduler.make_group("r", [1, 2, 3, 4, 5, 6, 7], m.SamplingParams(max_tokens=20))[0]
    sched.add(seq)
    chunks = sched.schedule()
    sched.update(chunks, [8])  # tokens 1..8, 7 computed
    chunks = sched.schedule(lookahead=3)
    assert chunks[0].max_drafts == 3
    chunks[0].draft_token_ids = [9, 99, 98]  # positions 8, 9, 10: one block (8..11)
    sched.update(chunks, [[9, 10]])  # draft 9 accepted, then 10 sampled; 99 and 98 rejected
    assert seq.token_ids == list(range(1, 11))
    assert seq.num_computed_tokens == 9  # 8 and the accepted draft 9; 10 not yet fed
    assert bm.num_cached_blocks == 2  # blocks 0..3 and 4..7; block 8..11 holds a rejected draft
    h0 = chain_hash(_ROOT_HASH, (1, 2, 3, 4))
    assert seq.block_hashes == [h0, chain_hash(h0, (5, 6, 7, 8))]
    chunks = sched.schedule(lookahead=3)
    chunks[0].draft_token_ids = [11, 12, 13]
    sched.update(chunks, [[11, 12, 13, 14]])  # all accepted plus a bonus token
    assert seq.num_computed_tokens == 13 and bm.num_cached_blocks == 3
    with pytest.raises(ValueError):  # emitted tokens must be accepted drafts plus one
        c = sched.schedule(lookahead=2)
        c[0].draft_token_ids = [1, 2]
        sched.update(c, [[2, 2]])


def test_runner_all_logits_equal_full_forward(tiny_runner: ModelRunner) -> None:
    from engine_worker.step import StepItem

    ids = repetitive_prompt(14, 10, 2)  # 20 tokens
    table = list(range(200, 202))
    tiny_runner.execute([StepItem(ids[:15], 0, table)])
    rows = tiny_runner.execute([StepItem(ids[15:], 15, table, all_logits=True)])  # (5, V)
    full = tiny_runner.forward_full(ids)[15:]  # (5, V)
    assert rows.shape == full.shape
    assert torch.allclose(rows, full, atol=1e-4, rtol=1e-4)


def test_draft_prefills_a_long_prompt_in_chunks(tiny_runner: ModelRunner,
                                                draft_runner: ModelRunner,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_worker.speculative import draft as draft_module

    monkeypatch.setattr(draft_module, "CHUNK", 16)
    passes: list[int] = []
    real = draft_runner.execute

    def counted(items: list[Any]) -> Any:
        passes.append(sum(len(it.token_ids) for it in items))
        return real(items)

    monkeypatch.setattr(draft_runner, "execute", counted)
    g = gen("g", repetitive_prompt(9, n=30), 20)  # a 90-token prompt
    e = engine(tiny_runner, DraftModelProposer(draft_runner))
    assert run(e, [g]) == run(engine(tiny_runner, None), [g])
    assert max(passes) <= 16 and passes.count(16) >= 5  # 90 tokens: 5 chunks, then the rest
    assert e.stats().spec_accepted_tokens == e.stats().spec_proposed_tokens > 0


def test_a_draft_the_model_doubts_ends_its_round_and_the_text_is_unchanged(
        tiny_runner: ModelRunner, draft_runner: ModelRunner) -> None:
    """The tiny random draft spreads its odds over 49,152 ids: with a stop at 0.5 every round
    ends after its first draft (one draft a verification), greedy and sampled, and the greedy
    text is plain decoding's; with no stop a round drafts k."""
    gens = [gen("g", repetitive_prompt(5), 24),
            gen("s", repetitive_prompt(6), 24, temperature=1.0, seed=4)]
    doubting = engine(tiny_runner, DraftModelProposer(draft_runner, min_confidence=0.5))
    out = run(doubting, gens)
    stats = doubting.stats()
    assert stats.spec_verify_steps > 0
    assert stats.spec_proposed_tokens == stats.spec_verify_steps
    assert out[("g", 0)] == run(engine(tiny_runner, None), gens[:1])[("g", 0)]
    trusting = engine(tiny_runner, DraftModelProposer(draft_runner, min_confidence=0.0))
    run(trusting, gens)
    assert trusting.stats().spec_proposed_tokens > 2 * trusting.stats().spec_verify_steps


def test_the_automatic_stop_is_the_measured_price_of_a_draft(draft_runner: ModelRunner) -> None:
    proposer = DraftModelProposer(draft_runner, min_confidence=None)
    steps = {1: 0.040, 5: 0.060}.get  # a target step by its rows, seconds
    assert proposer.threshold(4, steps) == 0.0  # the draft's pass not measured yet
    proposer.pass_s = 0.010
    assert proposer.threshold(4, None) == 0.0  # nor the target's steps
    # (the pass + a fifth row's share of a 5-row step) / a one-row step
    assert proposer.threshold(4, steps) == pytest.approx((0.010 + 0.020 / 4) / 0.040)
    assert DraftModelProposer(draft_runner, min_confidence=0.3).threshold(4, steps) == 0.3
    # a step where no sequence may draft (its draft cache full, its context at the end)
    assert proposer.threshold(0, steps) == 0.0


def test_a_greedy_drafts_confidence_is_its_softmax_probability(draft_runner: ModelRunner
                                                               ) -> None:
    """The odds a greedy draft is weighed by: its softmax at temperature 1 (now numpy's sum of
    exponentials into a kept buffer, not torch's logsumexp), for the argmax or any other id;
    a sampled request's q is read as it is."""
    proposer = DraftModelProposer(draft_runner, min_confidence=None)
    g = torch.Generator().manual_seed(3)
    greedy = type("S", (), {"params": m.SamplingParams(temperature=0.0)})()
    for scale in (0.5, 4.0, 30.0):
        row = torch.randn(49152, generator=g) * scale
        p = torch.softmax(row.double(), -1)
        for tok in (int(row.argmax()), 7):
            got = proposer._confidence(None, row, tok, greedy)
            assert got == pytest.approx(float(p[tok]), rel=1e-5, abs=1e-30), (scale, tok)
    sampled = type("S", (), {"params": m.SamplingParams(temperature=1.0)})()
    q = torch.softmax(torch.randn(49152, generator=g), -1)
    assert proposer._confidence(q, row, 11, sampled) == float(q[11])


def test_the_price_stays_measured_while_rounds_stop_at_their_first_draft(
        tiny_runner: ModelRunner, draft_runner: ModelRunner) -> None:
    """A round's first pass is timed too: were only the later passes, a stop that ends every
    round at its first draft (a slow spell of the host read as a dear draft) would freeze the
    price it was computed from, and drafting would never resume."""
    proposer = DraftModelProposer(draft_runner, min_confidence=0.99)  # one draft a round
    e = engine(tiny_runner, proposer)
    run(e, [gen("g", repetitive_prompt(5), 12)])
    assert e.stats().spec_proposed_tokens == e.stats().spec_verify_steps > 0
    assert proposer.pass_s is not None and proposer.pass_s > 0


class _Slow(_Wrong):
    """Wrong drafts that take a while to propose, as a draft model's passes do."""

    def propose(self, seqs: list, limits: list[int], target_step_s: object = None
                ) -> list[tuple[list[int], None]]:
        time.sleep(0.1)
        return super().propose(seqs, limits, target_step_s)


def test_a_verification_step_is_measured_without_the_drafting(tiny_runner: ModelRunner) -> None:
    """The engine's step costs (what step sizing and a draft's price weigh) are the target's:
    the draft model's passes before the step are not counted in it."""
    e = engine(tiny_runner, _Slow())
    run(e, [gen("w", repetitive_prompt(9), 6)])
    assert e.stats().spec_verify_steps > 0
    verify = e.costs.decode_s(5)  # 1 + 4 drafts a verification
    assert verify is not None and verify < 0.1


class _Kept(DraftModelProposer):
    """A draft model that keeps what each round proposed, by request."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.rounds: dict[str, list[tuple[list[int], Any]]] = defaultdict(list)

    def propose(self, seqs: list, limits: list[int], target_step_s: Any = None) -> list:
        out = super().propose(seqs, limits, target_step_s)
        for seq, o in zip(seqs, out, strict=True):
            self.rounds[seq.request_id].append(o)
        return out


def test_a_plain_greedy_draft_carries_no_distribution(tiny_runner: ModelRunner,
                                                      draft_runner: ModelRunner) -> None:
    """A greedy request with nothing adjusting its logits drafts the argmax and no dense one-hot
    row of the vocabulary (its verification takes the argmax); a greedy request with a penalty
    still gets its one-hot q, and both texts are plain decoding's."""
    kept = _Kept(draft_runner)
    prompt = repetitive_prompt(11)
    gens = [gen("plain", prompt, 16), gen("penalty", prompt, 16, repetition_penalty=1.2)]
    out = run(engine(tiny_runner, kept), gens)
    assert out == run(engine(tiny_runner, None), gens)
    plain, penalty = kept.rounds["plain"], kept.rounds["penalty"]
    assert plain and all(d and q is None for d, q in plain)
    assert penalty and all(q is not None and q.shape[0] == len(d) for d, q in penalty)
    assert all(bool((row.sum() == 1) & (row.max() == 1)) for _, q in penalty for row in q)
