"""The engine on the tiny random Llama: batching, chunked prefill, prefix caching, preemption and
sampling give the same tokens as the simple cases they must agree with."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.kv_cache import kv_cache_bytes
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from protocol import messages as m

ATOL = RTOL = 1e-4


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def make_engine(model_dir: Path, *, blocks: int = 512, max_num_seqs: int = 16,
                max_tokens_per_step: int = 512, prefix_caching: bool = True,
                kv_cache_dtype: str = "auto") -> Engine:
    probe = ModelRunner(RunnerConfig(model_dir, kv_budget_bytes=1 << 20,
                                     kv_cache_dtype=kv_cache_dtype))  # to read the config
    budget = kv_cache_bytes(probe.config, blocks * 16, probe.kv_dtype)
    runner = ModelRunner(RunnerConfig(model_dir, kv_budget_bytes=budget, block_size=16,
                                      kv_cache_dtype=kv_cache_dtype))
    assert runner.num_blocks == blocks
    return Engine(runner, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step,
                  enable_prefix_caching=prefix_caching)


def greedy(rid: str, ids: list[int], max_tokens: int = 20, **kw: object) -> m.Generate:
    params = m.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)
    return m.Generate(rid, ids, params)


def run(engine: Engine, gens: list[m.Generate], join_at: dict[str, int] | None = None,
        ) -> dict[tuple[str, int], list[int]]:
    """Step until every request finished; request r joins at step join_at[r] (default 0)."""
    join_at = join_at or {}
    tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
    pending = list(gens)
    step = 0
    while pending or engine.has_work:
        for gen in [g for g in pending if join_at.get(g.request_id, 0) <= step]:
            engine.add(gen)
            pending.remove(gen)
        for out in engine.step():
            tokens[(out.request_id, out.index)].extend(out.token_ids)
        step += 1
        assert step < 10_000
    return dict(tokens)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return {"a": prompt(5, 1), "b": prompt(17, 2), "c": prompt(40, 3), "d": prompt(70, 4)}


@pytest.fixture(scope="module")
def alone(tiny_dir: Path, prompts: dict[str, list[int]]) -> dict[tuple[str, int], list[int]]:
    engine = make_engine(tiny_dir)
    result = {}
    for rid, ids in prompts.items():
        result.update(run(engine, [greedy(rid, ids)]))
    return result


def test_batched_greedy_equals_each_alone(tiny_dir: Path, prompts, alone) -> None:  # noqa: ANN001
    engine = make_engine(tiny_dir)
    assert run(engine, [greedy(r, ids) for r, ids in prompts.items()]) == alone


def test_joining_at_different_steps_with_chunked_prefill_equals_alone(
        tiny_dir: Path, prompts, alone) -> None:  # noqa: ANN001
    # A 24-token step budget: the 70-token prompt is prefilled in chunks while others decode.
    engine = make_engine(tiny_dir, max_tokens_per_step=24)
    join = {"a": 0, "b": 3, "c": 4, "d": 9}
    assert run(engine, [greedy(r, ids) for r, ids in prompts.items()], join) == alone


def test_shared_prefix_prefills_only_the_uncached_tail(tiny_dir: Path) -> None:
    system = prompt(200, 7)
    first, second = system + prompt(9, 8), system + prompt(13, 9)
    logits_seen: list[torch.Tensor] = []

    def spy(engine: Engine) -> None:
        real = engine.runner.execute

        def execute(items):  # noqa: ANN001, ANN202
            out = real(items)
            logits_seen.append(out.clone())
            return out
        engine.runner.execute = execute  # type: ignore[method-assign]

    cached = make_engine(tiny_dir)
    run(cached, [greedy("first", first, max_tokens=2)])
    spy(cached)
    cached.add(greedy("second", second, max_tokens=1))
    seq = cached.requests["second"].seqs[0]
    while cached.has_work:
        cached.step()
    hit = (200 // 16) * 16
    assert seq.num_cached_tokens == hit
    assert seq.num_prefilled_tokens_total == len(second) - hit
    assert cached.block_manager.prefix_cache_hits >= hit
    with_cache = logits_seen[-1][0]

    logits_seen.clear()
    plain = make_engine(tiny_dir, prefix_caching=False)
    spy(plain)
    plain.add(greedy("second", second, max_tokens=1))
    seq = plain.requests["second"].seqs[0]
    while plain.has_work:
        plain.step()
    assert seq.num_prefilled_tokens_total == len(second)
    assert torch.allclose(with_cache, logits_seen[-1][0], atol=ATOL, rtol=RTOL)


def test_tiny_kv_budget_preempts_but_gives_the_same_tokens_and_frees_every_block(
        tiny_dir: Path) -> None:
    gens = [greedy(f"r{i}", prompt(20 + 7 * i, 20 + i), max_tokens=40) for i in range(6)]
    big = run(make_engine(tiny_dir), gens)
    small_engine = make_engine(tiny_dir, blocks=12)  # 192 tokens for ~6 x 80 tokens of work
    small = run(small_engine, gens)
    assert small == big
    assert small_engine.scheduler.preemptions > 0
    bm = small_engine.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks


def sampled(rid: str, ids: list[int], seed: int | None, **kw: object) -> m.Generate:
    params = m.SamplingParams(max_tokens=15, temperature=1.0, top_p=0.95, seed=seed,
                              ignore_eos=True, **kw)
    return m.Generate(rid, ids, params)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_dir: Path) -> None:
    # The tiny random model's distribution is nearly flat over 49152 tokens, so a batch's
    # different matmul shapes (last-bit differences in the logits) could move a cumulative
    # boundary under the draw; top_k=50 makes the draw as robust as a real model's peaked one.
    target = sampled("t", prompt(12, 30), seed=1234, top_k=50)
    alone = run(make_engine(tiny_dir), [target])[("t", 0)]
    others = [sampled(f"o{i}", prompt(8 + i, 40 + i), seed=None, top_k=5) for i in range(4)]
    mixed = run(make_engine(tiny_dir), [others[0], others[1], target, others[2], others[3]],
                join_at={"o2": 2, "o3": 5})
    assert mixed[("t", 0)] == alone
    other_seed = run(make_engine(tiny_dir), [sampled("t", prompt(12, 30), seed=99, top_k=50)])
    assert other_seed[("t", 0)] != alone


def test_n3_returns_three_choices_sharing_the_prompt_blocks(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    ids = prompt(40, 50)
    engine.add(sampled("n", ids, seed=5, n=3))
    seqs = engine.requests["n"].seqs
    tokens = run(engine, [])
    assert sorted(k[1] for k in tokens if k[0] == "n") == [0, 1, 2]
    assert all(len(tokens[("n", i)]) == 15 for i in range(3))
    assert len({tuple(tokens[("n", i)]) for i in range(3)}) > 1  # different streams
    # The siblings reused the leader's full prompt blocks: only the tail was computed again.
    assert [s.num_prefilled_tokens_total for s in seqs[1:]] == [40 - 32, 40 - 32]


def test_logprobs_match_an_independent_log_softmax(tiny_dir: Path) -> None:
    # float32 K/V: the reference recomputes the whole sequence without a cache, so a 16-bit
    # cache's rounding (~2e-3 here) would be measured instead of the logprobs
    engine = make_engine(tiny_dir, kv_cache_dtype="float32")
    ids = prompt(10, 60)
    engine.add(greedy("lp", ids, max_tokens=5, logprobs=3))
    outs = []
    while engine.has_work:
        outs += engine.step()
    generated = [o.token_ids[0] for o in outs]
    logits = engine.runner.forward_full(ids + generated).double()  # (T, V)
    for k, out in enumerate(outs):
        token, logprob, top = out.logprobs[0]
        ref = torch.log_softmax(logits[len(ids) - 1 + k], dim=-1)
        assert token == generated[k]
        assert logprob == pytest.approx(ref[token].item(), abs=1e-4)
        best = torch.topk(ref, 3)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_request_that_can_never_fit_is_refused(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, blocks=4)
    with pytest.raises(ValueError, match="(?i)context|fit|block|len"):
        engine.add(greedy("big", prompt(60, 70), max_tokens=30))
    assert not engine.has_work


@pytest.mark.parametrize("kw", [{"logit_bias": [(10**6, 1.0)]}, {"stop_token_ids": [10**6]},
                                {"min_tokens": 2, "stop_token_ids": [-1]}])
def test_ids_past_the_models_vocabulary_are_refused_not_a_failed_step(
        tiny_dir: Path, kw: dict) -> None:
    """The gateway checks them against its tokenizer's size; a model's logits may be fewer
    (added tokens): an id past them would fail the whole step's index_put, every sequence in it."""
    engine = make_engine(tiny_dir)
    with pytest.raises(ValueError, match="logit_bias and stop_token_ids"):
        engine.add(greedy("x", prompt(5, 9), **kw))
    assert not engine.has_work


def test_abort_frees_blocks_and_reports_the_reason(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.add(greedy("x", prompt(30, 80), max_tokens=100))
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    outs = engine.abort("x", "timeout")
    assert [o.finish_reason for o in outs] == ["timeout"]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work


def test_a_choice_aborted_alone_gets_no_second_closing_frame(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir)
    engine.add(greedy("n2", prompt(30, 81), max_tokens=100, n=2))
    for _ in range(3):
        engine.step()
    assert [o.index for o in engine.abort_choice("n2", 1)] == [1]
    outs = engine.abort("n2", "timeout")  # the whole request ends later
    assert [(o.index, o.finish_reason) for o in outs] == [(0, "timeout")]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work


def test_idle_self_check_is_clean_after_requests_and_names_a_leak(tiny_dir: Path) -> None:
    from engine_worker.sequence import Sequence

    engine = make_engine(tiny_dir, blocks=64)
    run(engine, [greedy("a", prompt(40, 1), 8), greedy("b", prompt(20, 2), 8)])
    assert not engine.has_work and engine.check_idle() == []
    assert engine.stats().idle_check_failures == 0
    leaked = Sequence("ghost", prompt(33, 3), m.SamplingParams(max_tokens=4))
    engine.block_manager.allocate(leaked)  # blocks held by a sequence no request owns
    breaches = engine.check_idle()
    assert breaches and "KV blocks still in use" in breaches[0]
    assert engine.stats().idle_check_failures == 1
