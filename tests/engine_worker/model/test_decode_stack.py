"""The C++ decode stack (engine_worker/model/decode_stack.py, csrc/decode_stack.cpp): a step's
decode rows through every layer in one call give bit for bit the logits and the K/V the Python
layers give them, for each family of tiny K-quant files (Qwen2's biases, Llama 3.1's RoPE
scaling, mixed block formats), and a decode row's logits no longer depend on a prefill chunk in
its step (the real SmolLM2 file, whose layers leave the integer-dot kernel from 17 rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_worker.kv_cache import as_bytes
from engine_worker.model.config import ModelConfig
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.model.test_gguf_kquants import PROMPT, family  # noqa: F401

# three sequences, block tables of 4 blocks of 16 slots each
TABLES = [list(range(4 * i, 4 * i + 4)) for i in range(3)]


def _decode_both_ways(runner: ModelRunner, items: list[StepItem]) -> list[tuple[torch.Tensor,
                                                                              list[torch.Tensor]]]:
    """The step's logits and the K cache it leaves, through the stack then the Python layers,
    each from the same cache."""
    kv = runner.kv_cache
    saved = [t.clone() for t in kv.k + kv.v]
    out = []
    for on in (True, False):
        for t, s in zip(kv.k + kv.v, saved, strict=True):
            t.copy_(s)
        runner.set_decode_stack(on)
        logits = runner.execute(items)
        out.append((logits, [t.clone() for t in kv.k + kv.v]))
    runner.set_decode_stack(True)
    return out


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_decode_rows_through_the_stack_equal_the_python_layers_bit_for_bit(
        int_dot_kernel: None, family: tuple[str, Path, Path, ModelConfig],  # noqa: F811
        kv: str) -> None:
    """Under each cache: bfloat16 by default, and the 8-bit ones, whose codes and scales the
    stack's C++ writes as kv_cache.encode does (the K/V compared byte for byte)."""
    kind, path, ref, _ = family
    runner = ModelRunner(RunnerConfig(ref, 1 << 22, gguf_path=path, kv_cache_dtype=kv))
    assert runner.decode_stack is not None, "every K-quant layer takes the integer-dot kernel"
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    for p, table in zip(prompts, TABLES, strict=True):
        runner.execute([StepItem(p, 0, table)])
    items = [StepItem([40 + i], len(p), t)
             for i, (p, t) in enumerate(zip(prompts, TABLES, strict=True))]
    (fast, fast_kv), (slow, slow_kv) = _decode_both_ways(runner, items)
    assert fast.shape == (3, runner.config.vocab_size)
    assert torch.equal(fast, slow), kind
    # the K/V it wrote, byte for byte (torch.equal of float8 tensors is not to be trusted)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(fast_kv, slow_kv, strict=True))
    # and a changed input changes the output: the stack computed, it did not pass through
    other = [StepItem([41], len(prompts[0]), TABLES[0])]
    assert not torch.equal(_decode_both_ways(runner, other)[0][0][0], fast[0])


@pytest.mark.parametrize("through_stack", [False, True])
def test_a_mixed_step_on_the_integer_dot_kernel_is_one_pass_with_the_stacks_bits(
        int_dot_kernel: None, family: tuple[str, Path, Path, ModelConfig],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, through_stack: bool) -> None:
    """Decode rows beside a prompt chunk meet it in the same matmuls (the stack would read the
    weights a second time), and their logits are still those of the decode-only step: through
    the Python layers, or (the runner's default for a short chunk) through the stack with the
    chunk's tokens as decode rows, whose last row's logits are then bit for bit those of
    decoding the chunk's tokens one at a time."""
    kind, path, ref, _ = family
    runner = ModelRunner(RunnerConfig(ref, 1 << 22, gguf_path=path))
    assert runner.plan.int_dot_all and runner.decode_stack is not None
    assert runner.prompts_through_stack  # the default
    runner.prompts_through_stack = through_stack
    calls: list[int] = []
    stack = runner.decode_stack
    monkeypatch.setattr(runner, "decode_stack", lambda x, *a: calls.append(len(x)) or stack(x, *a))
    prompts = [PROMPT, PROMPT[:7]]
    for p, table in zip(prompts, TABLES[:2], strict=True):
        runner.execute([StepItem(p, 0, table)])
    calls.clear()  # the prompts above (through the stack or not, as the switch says)
    decodes = [StepItem([40 + i], len(p), t)
               for i, (p, t) in enumerate(zip(prompts, TABLES[:2], strict=True))]
    kv = runner.kv_cache
    saved = [t.clone() for t in kv.k + kv.v]
    alone = runner.execute(decodes)
    assert calls == [2]  # a decode-only step: the stack
    for t, s in zip(kv.k + kv.v, saved, strict=True):
        t.copy_(s)
    chunk = StepItem(PROMPT[3:], 0, TABLES[2])
    mixed = runner.execute([*decodes, chunk])
    if through_stack:  # one C++ call for all rows, the chunk's tokens as decode rows
        assert calls == [2, 2 + len(chunk.token_ids)], calls
    else:
        assert calls == [2], "the mixed step ran its decode rows through the stack too"
    assert mixed.shape[0] == 3 and torch.equal(mixed[:2], alone), kind
    assert runner.mixed_steps_one_pass  # what it tells the step sizing (step_costs.one_pass)
    if through_stack:  # the chunk decoded token by token into a fourth table
        tokens, table = chunk.token_ids, [12, 13, 14, 15]
        runner.execute([StepItem(tokens[:2], 0, table)])
        for j in range(2, len(tokens)):
            last = runner.execute([StepItem([tokens[j]], j, table)])[0]
        assert torch.equal(mixed[2], last), kind


def test_the_stack_is_refused_where_it_was_not_built(tiny_runner: ModelRunner) -> None:
    assert tiny_runner.decode_stack is None  # float32 layers: nothing for the kernel
    with pytest.raises(ValueError, match="decode stack"):
        tiny_runner.set_decode_stack(True)


@pytest.mark.smollm
def test_a_decode_rows_logits_do_not_depend_on_a_prefill_chunk_in_its_step(
        int_dot_kernel: None, smollm2_dir: Path) -> None:
    runner = ModelRunner(RunnerConfig.from_settings("default", kv_cache_mb=16, max_num_seqs=4))
    if runner.decode_stack is None:
        pytest.skip("the measured paths serve no layer with the integer-dot kernel here")
    a, b = [1, 504, 3458, 282, 4649, 314, 5417, 47], list(range(300, 400))  # 100-row chunk
    runner.execute([StepItem(a, 0, TABLES[0])])
    alone = runner.execute([StepItem([2], len(a), TABLES[0])])[0]
    for on in (True, False):
        runner.set_decode_stack(on)
        both = runner.execute([StepItem([2], len(a), TABLES[0]),
                               StepItem(b, 0, list(range(4, 12)))])
        if on or runner.plan.int_dot_all:  # the stack, or one kernel for every row count
            assert torch.equal(both[0], alone)
        else:  # the Python layers run all 101 rows past the kernel's rows: other numerics
            assert not torch.equal(both[0], alone)


def test_the_stacks_rms_norm_is_the_float64_norm_within_float32_rounding(
        int_dot_kernel: None, cache_dir: Path) -> None:
    from engine_worker.model import decode_stack

    decode_stack.load(cache_dir)
    g = torch.Generator().manual_seed(0)
    for rows, c in ((1, 576), (5, 896), (130, 1536), (3, 40)):  # 40: not a multiple of 8
        x, w = torch.randn(rows, c, generator=g) * 3, torch.randn(c, generator=g)
        want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) \
            * w.double()
        got = torch.ops.kestrel.rms_norm_rows(x, w, 1e-6)
        assert got.dtype == torch.float32 and got.shape == x.shape
        # two float32 roundings of each product after an exact-enough statistic
        torch.testing.assert_close(got.double(), want, rtol=3e-7, atol=1e-6)
    # a (B, 1, C) view is normed row by row as well
    x, w = torch.randn(4, 1, 576, generator=g), torch.randn(576, generator=g)
    flat = torch.ops.kestrel.rms_norm_rows(x.view(4, 576), w, 1e-5)
    assert torch.equal(torch.ops.kestrel.rms_norm_rows(x, w, 1e-5), flat.view(4, 1, 576))


def test_only_short_prompt_chunks_run_as_decode_rows_whatever_runs_beside_them(
        int_dot_kernel: None, family: tuple[str, Path, Path, ModelConfig]) -> None:  # noqa: F811
    """A chunk runs as decode rows when its rows x its context are within
    PROMPT_AS_DECODES_READS (each row reads its whole context in place, where the chunk's SDPA
    reads it once), alone or beside decodes alike: the choice is the chunk's own, so its
    numbers do not depend on its batch."""
    from engine_worker import model_runner

    _, path, ref, _ = family
    runner = ModelRunner(RunnerConfig(ref, 1 << 22, gguf_path=path))
    dec = StepItem([40], 12, TABLES[0])
    short = StepItem(PROMPT, 0, TABLES[1])
    far = StepItem(PROMPT, model_runner.PROMPT_AS_DECODES_READS // len(PROMPT), TABLES[2])
    assert runner._prompts_as_decodes([dec, short]) == {1}
    assert runner._prompts_as_decodes([short]) == {0}  # alone: the same choice
    assert runner._prompts_as_decodes([dec]) == set()  # nothing to prefill
    assert runner._prompts_as_decodes([dec, far, short]) == {2}  # far: past the bound
    alone = runner.execute([short])[0]
    runner.execute([StepItem(PROMPT, 0, TABLES[0])])  # dec's context
    beside = runner.execute([dec, short])[1]
    assert torch.equal(alone, beside)  # the same bits, batch or no batch
    runner.prompts_through_stack = False
    assert runner._prompts_as_decodes([dec, short]) == set()
