"""Embedding requests in the engine (engine_worker/embedding.py) on the tiny random Llama: the
vectors are transformers' final hidden states pooled and normalised, batching changes none of
them, they share steps with generation without changing its tokens, and they hold no KV block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.model_runner import ModelRunner
from protocol import messages as m
from tests.engine_worker.test_engine import greedy, make_engine, prompt, run


def embed_request(rid: str, inputs: list[list[int]], deadline: float | None = None
                  ) -> m.Generate:
    ids = [t for x in inputs for t in x]
    return m.Generate(rid, ids, m.SamplingParams(max_tokens=1, n=len(inputs)), embed=True,
                      input_lengths=[len(x) for x in inputs], deadline=deadline)


def vector(out: m.TokenOutput) -> np.ndarray:
    assert out.embedding is not None
    return np.frombuffer(out.embedding, dtype="<f4")


@pytest.fixture(scope="module")
def hf_states(tiny_dir: Path):  # noqa: ANN201
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_dir, dtype=torch.float32, local_files_only=True)
    model.eval()

    def states(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]  # (T, C), after the norm

    return states


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_a_vector_is_transformers_last_hidden_states_pooled_and_normalised(
        tiny_runner: ModelRunner, hf_states, pooling: str) -> None:  # noqa: ANN001
    ids = prompt(23, 5)
    states = hf_states(ids)
    pooled = states.mean(0) if pooling == "mean" else states[-1]
    want = torch.nn.functional.normalize(pooled, dim=0)
    got = tiny_runner.embed([ids], pooling)[0]
    assert got.shape == (tiny_runner.config.hidden_size,)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert abs(float(got.norm()) - 1.0) < 1e-5


def test_inputs_embedded_together_equal_each_alone(tiny_runner: ModelRunner) -> None:
    inputs = [prompt(n, 10 + n) for n in (1, 7, 30, 64)]
    together = tiny_runner.embed(inputs, "mean")
    for i, ids in enumerate(inputs):
        torch.testing.assert_close(together[i], tiny_runner.embed([ids], "mean")[0],
                                   atol=1e-5, rtol=1e-5)


def test_an_embedding_request_holds_no_kv_block_and_answers_each_input(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, blocks=64)
    inputs = [prompt(n, 20 + n) for n in (3, 40, 17)]
    engine.add(embed_request("e", inputs))
    frames: list[m.TokenOutput] = []
    while engine.has_work:
        frames += engine.step()
        assert engine.block_manager.num_used_blocks == 0
    assert [f.index for f in frames] == [0, 1, 2]
    assert all(f.finish_reason == "stop" and f.token_ids == [] for f in frames)
    assert [f.prompt_tokens for f in frames] == [3, 40, 17]
    want = engine.runner.embed(inputs, "mean")
    for f in frames:
        np.testing.assert_allclose(vector(f), want[f.index].numpy(), atol=1e-5)
    assert engine.check_idle() == [] and "e" not in engine.requests
    assert engine.stats().prompt_tokens == 60


def test_embeddings_beside_generation_leave_its_tokens_unchanged(tiny_dir: Path) -> None:
    gens = [greedy("a", prompt(9, 1)), greedy("b", prompt(33, 2))]
    alone = run(make_engine(tiny_dir), gens)
    engine = make_engine(tiny_dir)
    inputs = [prompt(20, 7), prompt(50, 8)]
    joined = run(engine, [*gens, embed_request("e", inputs)])
    assert {k: v for k, v in joined.items() if k[0] != "e"} == alone
    assert engine.check_idle() == []


def test_inputs_beyond_a_step_s_rows_spread_over_steps_and_a_long_one_runs_alone(
        tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_tokens_per_step=32, max_num_seqs=4)
    inputs = [prompt(20, 1), prompt(20, 2), prompt(100, 3), prompt(5, 4)]
    engine.add(embed_request("e", inputs))
    per_step = []
    while engine.has_work:
        per_step.append([f.index for f in engine.step()])
    # 20 + 20 > 32: one a step; 100 alone although over the step's rows; then the last
    assert per_step == [[0], [1], [2], [3]]


def test_an_aborted_or_expired_embedding_request_closes_its_unanswered_inputs(
        tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, max_tokens_per_step=32, max_num_seqs=4)
    engine.add(embed_request("e", [prompt(20, 1), prompt(20, 2), prompt(20, 3)], deadline=5.0))
    first = engine.step()
    assert [f.index for f in first] == [0]
    assert engine.expired(now=6.0) == ["e"]
    closing = engine.abort("e", "timeout")
    assert [(f.index, f.finish_reason, f.embedding) for f in closing] == [
        (1, "timeout", None), (2, "timeout", None)]
    assert not engine.has_work and engine.step() == [] and engine.abort("e") == []


@pytest.mark.parametrize("lengths, why", [([3, 3], "laid end to end"),
                                          ([0, 7], "at least one token"),
                                          ([7], "params.n inputs")])
def test_an_embedding_request_whose_inputs_do_not_add_up_is_refused(
        tiny_dir: Path, lengths: list[int], why: str) -> None:
    engine = make_engine(tiny_dir, blocks=8)
    n = 2 if why == "params.n inputs" else len(lengths)
    gen = m.Generate("e", prompt(7, 1), m.SamplingParams(max_tokens=1, n=n), embed=True,
                     input_lengths=lengths)
    with pytest.raises(ValueError, match="laid end to end"):
        engine.add(gen)
    assert not engine.has_work


def test_an_input_longer_than_the_context_is_refused(tiny_dir: Path) -> None:
    engine: Engine = make_engine(tiny_dir, blocks=8)  # 128 tokens of context
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.add(embed_request("e", [prompt(129, 1)]))
    assert not engine.has_work


def test_a_small_request_is_not_held_behind_another_requests_large_batch(tiny_dir: Path) -> None:
    """Issue 58: one tenant's 2,048-input batch held another's single input until it had run
    whole; the requests' inputs now take turns within each step."""
    engine = make_engine(tiny_dir, max_tokens_per_step=32, max_num_seqs=4)
    engine.add(embed_request("big", [prompt(4, k) for k in range(40)]))
    engine.add(embed_request("small", [prompt(4, 99)]))
    steps_to_small = 0
    while engine.has_work:
        steps_to_small += 1
        frames = engine.step()
        if any(f.request_id == "small" for f in frames):
            break
    assert steps_to_small == 1  # beside big's first inputs, not after its 40
    rest: list[m.TokenOutput] = []
    while engine.has_work:
        rest += engine.step()
    assert sorted(f.index for f in rest if f.request_id == "big")[-1] == 39
    assert engine.check_idle() == []
