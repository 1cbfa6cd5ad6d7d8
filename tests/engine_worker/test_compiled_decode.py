"""Compiled decode (engine_worker/compiled_step.py) against the eager forward: two runners over
the same weights, each with its own KV cache, run the same greedy decode loop for 100 steps;
tokens must be equal and every step's logits close. Tiny model in float32 and as a GGUF file
served natively (Q4_1 layers, Q8_0 embedding/head: the packed INT4/INT8 kernels). Batch 1, and
a ragged batch of 5 (padded to the batch bucket 8) whose longest context crosses the 256-token
context bucket edge mid-run. Inductor compiles each bucket here from an empty cache folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch

from engine_worker.compiled_step import MIN_CONTEXT, compiler_available  # noqa: F401 (skip string)
from engine_worker.config import WorkerConfig
from engine_worker.model.loader import load_config
from engine_worker.model_runner import ModelRunner
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.gguf_factory import write_gguf
from tests.numerics import BF16_ULPS, ULPS, assert_logits_close, rounding_bound

# A string: evaluated when a test of this module is set up, so Inductor (a second's import) is
# loaded only by the test process that runs them, not by every process that collects them.
pytestmark = pytest.mark.skipif("not compiler_available()",
                                reason="no C++ compiler: Inductor cannot build CPU kernels")

STEPS = 100
KV = 8 << 20  # bytes: 2 layers x 2 KV heads x 16 dims, float32: ~16k tokens


def _runner(folder: Path, gguf_path: Path | None, compile_mode: str, cache: Path,
            kv_cache_dtype: str) -> ModelRunner:
    # GGUF-native layers switch to a bfloat16 copy at 4 rows here, whatever this host would
    # measure (engine_worker/path_choice.py): a switch inside the compiled buckets is the case
    # these tests need.
    return ModelRunner(RunnerConfig(folder, kv_budget_bytes=KV, block_size=16, max_model_len=1024,
                                    gguf_path=gguf_path, compile_mode=compile_mode, max_num_seqs=8,
                                    cache_dir=cache, dense_min_rows=4,
                                    kv_cache_dtype=kv_cache_dtype))


@pytest.fixture(scope="module")
def cache(new_cache_dir: Callable[[], Path]) -> Path:
    return new_cache_dir()  # Inductor's folder empty; our C++ kernels the host's (conftest.py)


# The weights, then the KV cache's dtype: float32 keeps the comparison at float32's rounding; the
# default bfloat16 cache rounds each stored k/v to 8 bits, so float32-rounding differences in
# k/v between the two runners may land a bfloat16 step apart (bounded as the GGUF layers are).
@pytest.fixture(scope="module", params=["float32", "gguf-q4_1", "float32-kv-bfloat16"])
def pair(request: pytest.FixtureRequest, tiny_dir: Path, cache: Path,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRunner, ModelRunner]:
    """(eager runner, compiled runner) over the same weights."""
    path = None
    kv = "bfloat16" if request.param.endswith("kv-bfloat16") else "float32"
    if request.param.startswith("gguf"):
        cfg = load_config(tiny_dir)
        q = gguf.GGMLQuantizationType
        path = write_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", q.Q4_1,
                          q.Q8_0, cfg.num_heads, cfg.num_kv_heads)
    return (_runner(tiny_dir, path, "off", cache, kv),
            _runner(tiny_dir, path, "decode", cache, kv))


def _greedy(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]
            ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill (eager on both runners), then STEPS greedy one-token decodes: (tokens, logits)."""
    b = len(prompts)
    logits = runner.execute([StepItem(prompts[i], 0, tables[i]) for i in range(b)])
    toks = [[int(t)] for t in logits.argmax(-1)]
    seen = []
    for s in range(STEPS):
        items = [StepItem([toks[i][-1]], len(prompts[i]) + s, tables[i]) for i in range(b)]
        logits = runner.execute(items)  # (B, V)
        seen.append(logits)
        for i, t in enumerate(logits.argmax(-1).tolist()):
            toks[i].append(t)
    return toks, seen


def _tables(lengths: list[int], bs: int = 16) -> list[list[int]]:
    """Block tables in descending, interleaved block order (never one consecutive run)."""
    need = [-(-(n + STEPS + 1) // bs) for n in lengths]
    b = len(lengths)
    top = max(need) * b + b
    return [[top - b * j - i for j in range(k)] for i, k in enumerate(need)]


@pytest.mark.parametrize("lengths", [[9], [5, 70, MIN_CONTEXT - 60, 30, 120]],
                         ids=["batch1", "ragged5"])
def test_compiled_decode_gives_eager_tokens_and_logits(
    pair: tuple[ModelRunner, ModelRunner], lengths: list[int]
) -> None:
    eager, compiled = pair
    g = torch.Generator().manual_seed(len(lengths))
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]
    tables = _tables(lengths)
    want, want_logits = _greedy(eager, prompts, tables)
    got, got_logits = _greedy(compiled, prompts, tables)
    assert compiled.compiled is not None and compiled.compiled.compiled, "no graph was used"
    if len(lengths) > 1:  # the longest context crossed the first context bucket's edge
        assert {nblk for _, nblk in compiled.compiled.compiled} >= {16, 32}
    # Inductor fuses the casts around the GGUF layers' bfloat16 copies: a few bfloat16 steps
    # apart there (and through a bfloat16 KV cache), float32 rounding apart otherwise. Each row
    # is compared until the eager run's first near tie (top two within twice the bound): past it
    # either token is right.
    bf16 = eager.quant.mode == "gguf" or eager.kv_dtype == torch.bfloat16
    ulps = BF16_ULPS if bf16 else ULPS
    for i in range(len(lengths)):
        for step, (a, b) in enumerate(zip(got_logits, want_logits, strict=True)):
            try:
                assert_logits_close(a[i : i + 1], b[i : i + 1], ulps=ulps)
            except AssertionError as e:
                raise AssertionError(f"row {i} step {step}: {e}") from None
            top = b[i].topk(2).values
            if top[0] - top[1] <= 2 * rounding_bound(b[i], ulps=ulps):
                break  # a near tie: the runs may part here
            assert got[i][step + 1] == want[i][step + 1], f"row {i} step {step}"


def test_padded_rows_write_only_the_scratch_block(
    pair: tuple[ModelRunner, ModelRunner]
) -> None:
    """A batch of 5 padded to 8: the pad rows' slots, tables and contexts point at the scratch
    block, past every block id the block manager may hand out."""
    _, runner = pair
    assert runner.compiled is not None
    sc = runner.scratch_block
    assert sc == runner.num_blocks and runner.kv_cache.num_blocks == runner.num_blocks + 1
    items = [StepItem([7], p, [3, 4]) for p in (0, 17, 20, 1, 2)]
    packed, bp, nblk = runner.compiled.pack(items)
    ids, pos, slots, ctx, blocks = packed.split([bp, bp, bp, bp, bp * nblk])
    assert (bp, nblk) == (8, MIN_CONTEXT // 16)
    assert slots.tolist() == [48, 65, 68, 49, 50] + [sc * 16] * 3
    assert ctx.tolist() == [1, 18, 21, 2, 3] + [1] * 3
    assert ids[5:].tolist() == [0] * 3 and pos[5:].tolist() == [0] * 3
    table = blocks.view(bp, nblk)
    assert table[0, 0] == 3 and (table[0, 1:] == sc).all()
    assert table[1, :2].tolist() == [3, 4] and (table[1, 2:] == sc).all()
    assert (table[5:] == sc).all()


def test_batch_below_the_kernel_switch_is_not_padded_across_it(
    pair: tuple[ModelRunner, ModelRunner]
) -> None:
    """GGUF-native layers change kernels at dense_min_rows (4) rows: 3 rows padded to 4 would
    run other kernels than eager (other rounding), so 3 is a bucket of its own there."""
    eager, runner = pair
    assert runner.compiled is not None
    gguf_native = eager.quant.mode == "gguf"
    assert runner.compiled.bucket(3, 1)[0] == (3 if gguf_native else 4)
    assert runner.compiled.bucket(5, 1)[0] == 8


def test_mixed_and_verification_steps_stay_eager(pair: tuple[ModelRunner, ModelRunner]) -> None:
    _, runner = pair
    assert runner.compiled is not None
    assert runner.compiled.supports([StepItem([1], 4, [0])])
    assert not runner.compiled.supports([StepItem([1], 4, [0]), StepItem([1, 2], 0, [1])])
    assert not runner.compiled.supports([StepItem([1], 4, [0], all_logits=True)])
    assert not runner.compiled.supports([StepItem([1], 4, [0])] * 9)  # above max_num_seqs


def test_compile_flag_is_validated() -> None:
    assert WorkerConfig(compile="decode").compile == "decode"
    with pytest.raises(ValueError, match="compile must be one of"):
        WorkerConfig(compile="max-autotune")


def test_inductor_cache_is_under_the_kestrel_cache_dir(
    pair: tuple[ModelRunner, ModelRunner], cache: Path
) -> None:
    """So a second start finds the built graphs (Inductor's default is a /tmp folder)."""
    _, runner = pair
    assert runner.compiled is not None
    runner.compiled.warm([runner.compiled.bucket(1, 1)])
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((cache / "inductor").resolve())
    assert any(p.is_file() for p in (cache / "inductor").rglob("*"))


@torch.library.custom_op("kestrel_test::grouped_decode_attention", mutates_args=())
def _custom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """Opaque to the compiler (a stand-in for a C++ kernel): (B, Hkv, G, D) out."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@_custom_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def test_compiled_decode_runs_a_registered_custom_attention_op(
    tiny_dir: Path, new_cache_dir: Callable[[], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention's decode calling a registered custom op (with a fake implementation) compiles
    into the graph as an extern call, and reads the K/V the same step wrote."""
    from engine_worker.model.attention import Attention

    def grouped(self: Attention, q: torch.Tensor, kd: torch.Tensor, vd: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, h, d = q.shape
        assert mask is not None  # compiled steps always mask; eager here has ragged lengths
        out = _custom_attention(q.view(b, self.hkv, h // self.hkv, d), kd, vd, mask)
        return out.reshape(b, h, d)

    monkeypatch.setattr(Attention, "_decode_grouped", grouped)
    cache = new_cache_dir()
    eager = _runner(tiny_dir, None, "off", cache, "float32")
    compiled = _runner(tiny_dir, None, "decode", cache, "float32")
    prompts, tables = [[5, 6, 7], [8, 9, 10, 11, 12]], [[1, 2], [3, 4]]
    for r in (eager, compiled):
        r.execute([StepItem(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    for step in range(8):
        items = [StepItem([20 + step], len(p) + step, t)
                 for p, t in zip(prompts, tables, strict=True)]
        torch.testing.assert_close(compiled.execute(items), eager.execute(items),
                                   atol=1e-4, rtol=1e-4)
    assert compiled.compiled is not None and compiled.compiled.compiled
