"""engine_worker/grammar.py and its hooks: the sampler never draws a masked token, the engine keeps
one matcher per choice, advances it on every committed token, and ends a finished grammar with
EOS. On the tiny random Llama, whose unconstrained output is noise."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from engine_worker.engine import Engine
from engine_worker.grammar import GrammarCompiler
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.sampler import Sampler, make_generator
from engine_worker.step import SamplerInput
from gateway.prompt.structured import build_checked
from protocol import messages as m


@pytest.fixture(scope="module")
def compiler(tiny_dir: Path, tiny_runner: ModelRunner) -> GrammarCompiler:
    return GrammarCompiler((tiny_dir / "tokenizer.json").read_text(),
                           tiny_runner.config.vocab_size, list(tiny_runner.config.eos_token_ids))


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, compiler: GrammarCompiler) -> Engine:
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=16 << 20, block_size=16))
    return Engine(runner, max_num_seqs=8, max_num_batched_tokens=256, grammars=compiler)


def run(engine: Engine, gens: list[m.Generate]) -> dict[tuple[str, int], tuple[list[int], str]]:
    for g in gens:
        engine.add(g)
    out: dict[tuple[str, int], tuple[list[int], str]] = {}
    while engine.has_work:
        for o in engine.step():
            ids, _ = out.get((o.request_id, o.index), ([], ""))
            out[(o.request_id, o.index)] = (ids + o.token_ids, o.finish_reason or "")
    return out


def test_sampler_never_draws_a_forbidden_token_even_the_best_one() -> None:
    logits = torch.zeros(3, 50)  # (B, V)
    logits[:, 7] = 100.0  # by far the most likely token, and forbidden below
    allowed = torch.zeros(3, 50, dtype=torch.bool)  # (B, V)
    allowed[:, 10:13] = True
    allowed[2] = True  # an unconstrained row in the same batch keeps its argmax
    greedy = m.SamplingParams(temperature=0.0)
    hot = m.SamplingParams(temperature=2.0, seed=1)
    for step in range(20):
        inputs = [SamplerInput(greedy, [], None),
                  SamplerInput(hot, [], make_generator(step)),
                  SamplerInput(greedy, [], None)]
        out = Sampler()(logits, inputs, allowed)
        assert out[0].token_id == 10 and 10 <= out[1].token_id < 13 and out[2].token_id == 7


def test_regex_constrained_choices_match_and_end_with_stop(engine: Engine) -> None:
    grammar = build_checked("regex", r"[a-z]{2,5}-[0-9]{3}")
    params = m.SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=3)
    out = run(engine, [m.Generate("r", [1, 2, 3, 4, 5], params, grammar=grammar)])
    tok = engine.grammars.tokenizer  # type: ignore[union-attr]
    eos = set(engine.eos_token_ids)
    assert len(out) == 3
    for ids, finish in out.values():
        assert finish == "stop" and ids[-1] in eos
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", tok.decode_str(ids[:-1]))
    assert not engine.requests  # matchers went with their request


def test_free_and_constrained_requests_share_a_batch(engine: Engine) -> None:
    grammar = build_checked("choice", ["yes", "no"])
    free = m.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    bound = m.SamplingParams(max_tokens=6, temperature=0.0)
    out = run(engine, [m.Generate("free", [9, 8, 7], free),
                       m.Generate("bound", [9, 8, 7], bound, grammar=grammar)])
    tok = engine.grammars.tokenizer  # type: ignore[union-attr]
    assert len(out[("free", 0)][0]) == 6 and out[("free", 0)][1] == "length"
    ids, finish = out[("bound", 0)]
    assert tok.decode_str(ids[:-1]) in ("yes", "no") and finish == "stop"


def test_a_grammar_the_matcher_refuses_is_a_value_error(engine: Engine) -> None:
    with pytest.raises(ValueError, match="grammar"):
        engine.add(m.Generate("bad", [1, 2], m.SamplingParams(), grammar='{"grammars": 5}'))
    assert "bad" not in engine.requests


def test_rollback_undoes_exactly_the_advanced_tokens(compiler: GrammarCompiler) -> None:
    matcher = compiler.matcher(build_checked("regex", "abc"))
    ids = compiler.tokenizer.tokenize_str("abc")
    before = compiler.allowed_tokens([matcher])
    for t in ids:
        matcher.advance(t)
    assert matcher.accepting
    matcher.rollback(len(ids))
    assert torch.equal(compiler.allowed_tokens([matcher]), before)


def test_llguidance_tokenizer_is_built_by_the_first_grammar_not_at_start(
        tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    """A worker that never sees structured output does not hold llguidance's tokenizer (about
    130 MiB for a 151,936-token vocabulary); the first grammar builds it, once."""
    fresh = GrammarCompiler((tiny_dir / "tokenizer.json").read_text(),
                            tiny_runner.config.vocab_size, list(tiny_runner.config.eos_token_ids))
    assert not fresh.built
    fresh.matchers('{"grammars": [{"lark_grammar": "start: \\"a\\""}]}', 2)
    assert fresh.built
    tok = fresh.tokenizer
    fresh.matcher('{"grammars": [{"lark_grammar": "start: \\"b\\""}]}')
    assert fresh.tokenizer is tok


def test_the_link_announces_a_silence_before_the_tokenizer_build_and_only_then(
        tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    """llguidance holds the GIL while it builds its tokenizer, so the worker's heartbeats stop:
    the builder has the link say so first (a gateway dropped a worker mid-request for that
    silence). Once built, later grammars announce nothing."""
    from engine_worker.grammar_builds import TOKENIZER_BUILD_QUIET_S, GrammarBuilds

    fresh = GrammarCompiler((tiny_dir / "tokenizer.json").read_text(),
                            tiny_runner.config.vocab_size, list(tiny_runner.config.eos_token_ids))
    announced: list[tuple[float, bool]] = []
    builds = GrammarBuilds(fresh, lambda s: announced.append((s, fresh.built)))
    grammar = '{"grammars": [{"lark_grammar": "start: \\"a\\""}]}'
    for rid in ("a", "b"):
        builds.start(m.Generate(rid, [1, 2], m.SamplingParams(), grammar=grammar))
        for _ in range(500):
            if [r for r, _ in builds.ready() if r.request_id == rid]:
                break
            time.sleep(0.01)
    assert announced == [(TOKENIZER_BUILD_QUIET_S, False)]  # before the build, once
    assert fresh.built
