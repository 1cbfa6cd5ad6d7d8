"""The in-place paged decode attention kernel (issue 10) equals the gather path.

Per layer: the C++ kernel against the model's gather + grouped SDPA on ragged, shuffled,
non-consecutive block tables with contexts on and across block edges, float32 and bfloat16,
batch 1 and 16, G = 1 and 3 (SmolLM2's 9/3 heads of 64). Per step: the tiny model's logits both
ways through the runner; over 50 greedy steps through the engine, the same tokens. The fallback:
KESTREL_PAGED_ATTENTION=gather (or no compiler, a non-CPU device, float16) keeps the gather
path. Kernel tests skip with the reason when this host has no C++ compiler or ninja; the
fallback tests run regardless.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.settings import parse_settings
from engine_worker import kernel_build
from engine_worker.config import WorkerConfig
from engine_worker.kernel_build import compiler_missing
from engine_worker.kv_cache import decode, encode, head_major, kv_cache_bytes
from engine_worker.model.attention import Attention
from engine_worker.model_runner import ModelRunner
from engine_worker.paged_attention import (
    bf16_dot,
    load_paged_attention,
    paged_decode_attention,
)
from engine_worker.runner_config import RunnerConfig
from engine_worker.step import StepItem
from tests.engine_worker.greedy_run import greedy_tokens
from tests.engine_worker.model.test_grouped_decode import gqa_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> None:
    missing = compiler_missing()
    if missing is not None:
        pytest.skip(f"paged attention kernel not buildable here: {missing}")
    # the default cache dir: the runners below load the same library (built once per host)
    from engine_worker.config import default_cache_dir

    pa = load_paged_attention("auto", CPU, torch.float32, Path(default_cache_dir()))
    assert pa.enabled, pa.reason  # a compiler is present: a failed build is a failure


def ragged_case(b: int, h: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q (B, H, D) a strided slice like the model's; caches (Hkv, slots, D); table (B, nblk)
    of shuffled block ids; lengths on, just before and just after block edges."""
    bs, num_blocks = 4, 256
    g = torch.Generator().manual_seed(seed)
    k_cache = head_major(torch.randn(num_blocks * bs, hkv, d, generator=g)).to(dtype)
    v_cache = head_major(torch.randn(num_blocks * bs, hkv, d, generator=g)).to(dtype)
    edges = [1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 1, 17, 38]
    lens = torch.tensor([edges[i % len(edges)] + (i // len(edges)) * 5 for i in range(b)])
    nblk = -(-int(lens.max()) // bs)
    table = torch.randperm(num_blocks, generator=g)[: b * nblk].view(b, nblk)  # no runs
    qkv = torch.randn(b, h + 2 * hkv, d, generator=g).to(dtype)  # (B, H + 2Hkv, D)
    return qkv[:, :h], k_cache, v_cache, table, lens, bs


def gather_reference(attn: Attention, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                     bs: int) -> torch.Tensor:
    """The model's gather path: whole blocks copied, then the grouped SDPA, masked by length."""
    b, t_max = q.shape[0], int(lens.max())
    kd, vd = attn._context(k_cache, v_cache, table.flatten(), bs, b, t_max)  # (B, Hkv, T, D)
    mask = (torch.arange(t_max) < lens[:, None]).view(b, 1, 1, t_max)  # (B, 1, 1, T)
    return attn._decode_grouped(q, kd, vd, mask)  # (B, H, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b", [1, 16])
# G = 1; 3 with SmolLM2's 9/3 x 64; 3 with a head size on the generic (not 64/128) path; 4 x 128
@pytest.mark.parametrize("heads", [(4, 4, 16), (9, 3, 64), (6, 2, 16), (8, 2, 128)])
def test_kernel_equals_gather_path(kernel: None, dtype: torch.dtype, b: int,
                                   heads: tuple[int, int, int]) -> None:
    h, hkv, d = heads
    attn = Attention(gqa_config(h, hkv, d))
    q, k_cache, v_cache, table, lens, bs = ragged_case(b, h, hkv, d, dtype, seed=b * h)
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, bs)  # (B, H, D)
    ref = gather_reference(attn, q, k_cache, v_cache, table, lens, bs)
    assert got.dtype == dtype and got.shape == (b, h, d)
    if dtype == torch.float32:
        assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()
        return
    # bfloat16: both accumulate in float32 and round once; against float64 the kernel's error
    # must be within one rounding of the gather path's
    exact = gather_reference(attn, q.double(), k_cache.double(), v_cache.double(), table, lens, bs)
    err_got = (got.double() - exact).abs().max()
    err_ref = (ref.double() - exact).abs().max()
    assert err_got <= err_ref + 4e-3, (err_got, err_ref)
    assert torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_the_bfloat16_dot_path_follows_the_host_and_the_cap(kernel: None) -> None:
    """vdpbf16ps is built where the build's -march has AVX512-BF16: -march=native on a host
    that has it, never under KESTREL_CPU_ISA=avx2 or avx512 (x86-64-v3 / -v4 lack it), so
    `make test-avx2` runs the float32 path over a bfloat16 cache."""
    has = "avx512_bf16" in kernel_build._cpu_flags().split()
    assert bf16_dot() == (kernel_build.isa_cap() == "native" and has)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 16), (12, 2, 128)])
def test_float32_queries_read_a_16_bit_cache_in_place(kernel: None, cache_dtype: torch.dtype,
                                                      heads: tuple[int, int, int]) -> None:
    """Issue 53: the cache in its own 16-bit dtype under float32 activations, read where it
    sits: the gather path's answer over the same 16-bit values widened to float32. A float16
    cache, and a bfloat16 one on a build without AVX512-BF16, is widened and summed in float32
    (the same to 2e-6). A bfloat16 one on a build with it (bf16_dot()) is summed by vdpbf16ps,
    the query split into two bfloat16 halves and the softmax's numerators rounded to bfloat16
    (llama.cpp rounds the query to the cache's type and sums a float16 V in float16): its error
    against float64 must stay under half of what storing K and V as bfloat16 costs (measured
    0.3-0.36 of it on these short contexts, ~0.1 at 2,500 tokens; the query rounded once ~0.6)."""
    h, hkv, d = heads
    attn = Attention(gqa_config(h, hkv, d))
    q, k32, v32, table, lens, bs = ragged_case(16, h, hkv, d, torch.float32, seed=h + d)
    k_cache, v_cache = k32.to(cache_dtype), v32.to(cache_dtype)
    got = paged_decode_attention(q, k_cache, v_cache, table, lens, bs)  # (B, H, D)
    ref = gather_reference(attn, q, k_cache.float(), v_cache.float(), table, lens, bs)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    if cache_dtype == torch.float16 or not bf16_dot():
        assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()
    else:
        exact = gather_reference(attn, q.double(), k_cache.double(), v_cache.double(), table,
                                 lens, bs)
        unrounded = gather_reference(attn, q.double(), k32.double(), v32.double(), table,
                                     lens, bs)
        kernel_err = (got.double() - exact).abs().max()
        cache_err = (exact - unrounded).abs().max()
        assert kernel_err <= 0.5 * cache_err, (kernel_err, cache_err)
    # and the gather path of the model itself widens the 16-bit context the same way
    kd, vd = attn._context(k_cache, v_cache, table.flatten(), bs, 16, int(lens.max()),
                           torch.float32)
    assert kd.dtype == vd.dtype == torch.float32


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
# a scale per 32 values (64, 128), one per row (16, and 20 on the generic path)
@pytest.mark.parametrize("heads", [(9, 3, 64), (6, 2, 16), (12, 2, 128), (6, 2, 20)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_an_8_bit_cache_in_place(kernel: None, cache_dtype: torch.dtype,
                                                  heads: tuple[int, int, int],
                                                  qdtype: torch.dtype) -> None:
    """Issue 53: int8 / fp8 codes with their per-group scales in the row (kv_cache.encode),
    read where they sit: the gather path's answer over the same codes times scales."""
    h, hkv, d = heads
    attn = Attention(gqa_config(h, hkv, d))
    q, k32, v32, table, lens, bs = ragged_case(16, h, hkv, d, torch.float32, seed=h + d)
    k_cache, v_cache = encode(k32, cache_dtype), encode(v32, cache_dtype)
    assert k_cache.shape[-1] > d and k_cache.dtype == cache_dtype  # codes, then scales
    got = paged_decode_attention(q.to(qdtype), k_cache, v_cache, table, lens, bs)
    ref = gather_reference(attn, q.to(qdtype).float(), decode(k_cache, d, torch.float32),
                           decode(v_cache, d, torch.float32), table, lens, bs)
    assert got.dtype == qdtype and got.shape == ref.shape
    tol = 2e-6 if qdtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol * 5), (got - ref).abs().max()
    # the model's own gather path decodes the codes the same way
    assert torch.equal(gather_reference(attn, q.to(qdtype).float(), k_cache, v_cache, table,
                                        lens, bs), ref)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16,
                                         torch.int8])
@pytest.mark.parametrize("heads", [(9, 3, 64), (12, 2, 128), (6, 2, 20)])
@pytest.mark.parametrize("start", [1, 6, 8, 13])  # rows ending before, on and across a block edge
def test_a_sequences_consecutive_rows_in_one_call_equal_each_row_alone(
        kernel: None, cache_dtype: torch.dtype, heads: tuple[int, int, int], start: int) -> None:
    """A verification's k + 1 rows (one block table, lengths L .. L + k) in one call: each
    row's output is, bit for bit, what the kernel gives that row alone, and so is a row of
    another sequence beside them (a verified draft's numbers do not depend on its batch)."""
    h, hkv, d = heads
    bs, num_blocks, rows = 4, 64, 5
    g = torch.Generator().manual_seed(start * h + d)
    k32, v32 = (head_major(torch.randn(num_blocks * bs, hkv, d, generator=g)) for _ in "kv")
    if cache_dtype == torch.int8:
        k_cache, v_cache = encode(k32, cache_dtype), encode(v32, cache_dtype)
    else:
        k_cache, v_cache = k32.to(cache_dtype), v32.to(cache_dtype)
    seq = torch.randperm(num_blocks, generator=g)[:8]
    other = torch.randperm(num_blocks, generator=g)[:8]
    table = torch.stack([seq] * rows + [other])  # (rows + 1, 8): another sequence last
    lens = torch.tensor([start + i for i in range(rows)] + [start + 2])
    q = torch.randn(rows + 1, h, d, generator=g)
    together = paged_decode_attention(q, k_cache, v_cache, table, lens, bs)
    for i in range(rows + 1):
        alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, table[i : i + 1],
                                       lens[i : i + 1], bs)
        assert torch.equal(together[i : i + 1], alone), i


def test_kernel_zero_length_row_is_zeros_and_bad_ids_raise(kernel: None) -> None:
    q, k_cache, v_cache, table, lens, bs = ragged_case(3, 6, 2, 16, torch.float32, seed=1)
    lens[1] = 0  # a padded row (a compiled step pads its batch): zeros, never NaN
    out = paged_decode_attention(q, k_cache, v_cache, table, lens, bs)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out.isfinite().all()
    table[0, 0] = k_cache.shape[1] // bs  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention(q, k_cache, v_cache, table, lens, bs)


def test_kernel_op_traces_under_torch_compile(kernel: None) -> None:
    # the fake implementation (shapes only) is what torch.compile traces through
    q, k_cache, v_cache, table, lens, bs = ragged_case(2, 6, 2, 16, torch.float32, seed=2)
    torch.library.opcheck(torch.ops.kestrel.paged_decode_attention.default,
                          (q.contiguous(), k_cache, v_cache, table, lens, bs),
                          test_utils=("test_schema", "test_faketensor"))


def runner_items(runner: ModelRunner) -> list[StepItem]:
    """Five ragged sequences prefilled into scattered blocks; their next decode step."""
    rng = random.Random(0)
    items = []
    for i, length in enumerate([3, 40, 16, 29, 8]):
        table = [300 + i + 5 * j for j in range(4)][::-1]
        ids = [rng.randrange(3, 49152) for _ in range(length)]
        runner.execute([StepItem(ids, 0, table)])
        items.append(StepItem([rng.randrange(3, 49152)], length, table))
    return items


def test_runner_decode_logits_equal_both_paths(kernel: None, tiny_runner: ModelRunner) -> None:
    assert tiny_runner.paged_attention.enabled
    items = runner_items(tiny_runner)
    try:
        tiny_runner.set_paged_attention(False)
        ref = tiny_runner.execute(items)  # (B, V); rewriting the same k,v slots is idempotent
        tiny_runner.set_paged_attention(True)
        got = tiny_runner.execute(items)
    finally:
        tiny_runner.set_paged_attention(True)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()


def test_runner_bfloat16_decode_logits_close_both_paths(kernel: None, tiny_dir: Path) -> None:
    runner = ModelRunner(RunnerConfig(tiny_dir, dtype="bfloat16", kv_budget_bytes=16 << 20))
    assert runner.paged_attention.enabled
    items = runner_items(runner)
    runner.set_paged_attention(False)
    ref = runner.execute(items)
    runner.set_paged_attention(True)
    got = runner.execute(items)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert torch.allclose(got, ref, atol=0.1, rtol=0.05), (got - ref).abs().max()


def engine_tokens(tiny_dir: Path, paged: bool) -> dict[str, list[int]]:
    probe = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=1 << 20, paged_attention="gather"))
    budget = kv_cache_bytes(probe.config, 256 * 16, torch.float32)
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=budget, block_size=16))
    runner.set_paged_attention(paged)
    return greedy_tokens(runner, (("a", 5), ("b", 33), ("c", 70), ("d", 12), ("e", 16)), 2)


def test_engine_greedy_tokens_same_with_kernel_and_gather(kernel: None, tiny_dir: Path) -> None:
    ref, got = engine_tokens(tiny_dir, False), engine_tokens(tiny_dir, True)
    assert len(got) == 5 and all(len(t) == 50 for t in got.values())
    assert got == ref


def test_env_gather_keeps_the_gather_path(tiny_dir: Path, tiny_runner: ModelRunner) -> None:
    cfg = parse_settings(WorkerConfig, [], {"KESTREL_PAGED_ATTENTION": "gather"})
    assert cfg.paged_attention == "gather"
    runner = ModelRunner(RunnerConfig(tiny_dir, kv_budget_bytes=16 << 20,
                                      paged_attention=cfg.paged_attention,
                                      kv_cache_dtype="float32"))  # tiny_runner's
    assert not runner.paged_attention.enabled and "gather" in runner.paged_attention.reason
    assert not runner.paged_decode
    with pytest.raises(ValueError, match="unavailable"):
        runner.set_paged_attention(True)
    items = runner_items(runner)
    ref = runner.execute(items)
    # and it computes what the default runner computes on the same items (kernel or not)
    assert torch.allclose(tiny_runner.execute(runner_items(tiny_runner)), ref, atol=1e-4)
    with pytest.raises(SystemExit):  # a misspelt mode is refused at start
        parse_settings(WorkerConfig, [], {"KESTREL_PAGED_ATTENTION": "inplace"})


def test_fallback_reasons_without_building(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    cases = [
        (torch.device("cuda"), torch.float32, "CPU-only"),
        (CPU, torch.float16, "float32 and bfloat16"),
    ]
    for device, dtype, why in cases:
        pa = load_paged_attention("auto", device, dtype, tmp_path)
        assert not pa.enabled and why in pa.reason
    pa = load_paged_attention("auto", CPU, torch.float32, tmp_path, torch.float8_e5m2)
    assert not pa.enabled and "float32, 16-bit and 8-bit caches" in pa.reason
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("KESTREL_PREBUILT_KERNELS", raising=False)
    # as in a fresh process: an op an earlier test registered here would serve without a compiler
    monkeypatch.setattr(kernel_build, "registered", lambda op: False)
    pa = load_paged_attention("auto", CPU, torch.float32, tmp_path)
    assert not pa.enabled and "no C++ compiler" in pa.reason
    assert not (tmp_path / "kernels").exists()  # nothing was built
    with pytest.raises(ValueError, match="mode"):
        load_paged_attention("fast", CPU, torch.float32, tmp_path)
