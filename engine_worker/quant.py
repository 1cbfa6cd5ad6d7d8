"""Weight-only quantization as module swaps: INT8 per-output-channel and INT4 group-wise packed.

Data flow of `quantize_model(model, "int8" | "int4", group_size)`, run once after loading:

    each nn.Linear of the decoder layers (fused qkv_proj, o_proj, gate_up_proj, down_proj)
      -> Int8Linear.from_float / Int4GroupLinear.from_float -> setattr on its parent
    LM head (optional): an untied head is swapped the same way; a tied one (SmolLM2) gets its
      own quantized head, and the embedding becomes an Int8Embedding (shared with an INT8 head)
      so the float matrix is freed
    -> QuantReport (weight bytes before and after, group size used per layer)

A quantized layer's forward is `x (M, K) -> (M, N)` like nn.Linear, so llama.py calls it
unchanged. Two paths compute it:
  - kernel: torch's packed weight-only matmuls (`_weight_int8pack_mm`,
    `_weight_int4pack_mm_for_cpu`) on CPU. Their float32 paths measured ~10x slower than a float
    matmul here, their bfloat16 paths 2-7x faster (avx512_bf16), so on CPU activations enter
    them in bfloat16 (`compute_dtype`) and leave in the caller's dtype.
  - fallback: dequantize to the activations' dtype, then F.linear. Every other device (CUDA
    included, for now), and shapes the kernel refuses (INT4 needs N % 16 == 0).
Tests hold the two against each other. Scales (and zeros) are stored in the compute dtype and
weights are rounded against the stored values, so rounding a scale adds no error of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine_worker.quant_group import GROUP, Int8GroupEmbedding, Int8GroupLinear

log = logging.getLogger("kestrel.quant")

MODES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)

_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)
_INT4_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
_INT4_MM = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)


def _kernel_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """Dtype the CPU kernels compute in: bfloat16 (the fast one measured), whatever the model's."""
    return torch.bfloat16 if device.type == "cpu" else dtype


class Int8Linear(nn.Module):
    """Symmetric per-output-channel INT8: w[n, :] ~= qweight[n, :] * scales[n],
    scales[n] = max|w[n, :]| / 127. 1 byte a weight plus one float per row."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
        use_kernel: bool,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)  # (N, K) int8
        self.register_buffer("scales", scales)  # (N,) compute dtype
        self.register_buffer("bias", bias)  # (N,) model dtype or None
        self.use_kernel = use_kernel

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
        compute_dtype: torch.dtype | None = None, use_kernel: bool | None = None,
    ) -> Int8Linear:
        if use_kernel is None:
            use_kernel = _INT8_MM is not None and weight.device.type == "cpu"
        if compute_dtype is None:
            compute_dtype = _kernel_dtype(weight.device, weight.dtype) if use_kernel \
                else weight.dtype
        w = weight.detach().float()  # (N, K)
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(compute_dtype)  # (N,)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales, None if bias is None else bias.detach().clone(),
                   use_kernel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.to(dtype) * self.scales.to(dtype)[:, None])  # (N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            y = _INT8_MM(x.to(self.scales.dtype), self.qweight, self.scales).to(x.dtype)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.use_kernel}"


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) ints in 0..15 -> (N, K/2) uint8: column 2j in the low nibble, 2j+1 in the high."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K/2) uint8 -> (N, K) uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


class Int4GroupLinear(nn.Module):
    """Asymmetric INT4 per group of `group_size` inputs: w ~= (q - 8) * scale + zero, q in
    0..15, with scale = (max - min) / 15 and zero = min + 8 * scale per (row, group): the
    layout torch's int4 kernels read. Two weights a byte plus a scale and a zero per group.

    `qweight` is (N, K/2) uint8 either way; with `use_kernel` its bytes are in the CPU kernel's
    own tiled order (made by `_convert_weight_to_int4pack_for_cpu`, CPU-specific), otherwise in
    `pack_int4` order. `scales_zeros` is (K/G, N, 2), the kernel's layout."""

    def __init__(
        self, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
        bias: torch.Tensor | None, use_kernel: bool,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # (N, K/2) uint8
        self.register_buffer("scales_zeros", scales_zeros)  # (K/G, N, 2) compute dtype
        self.register_buffer("bias", bias)
        self.use_kernel = use_kernel
        self.dense_min_rows = 0
        self.register_buffer("dense", None)  # (N, K) float copy for many rows, if kept

    def keep_dense(self, min_rows: int, weight: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> None:
        """From `min_rows` rows up, compute with a `dtype` copy of the weights through oneDNN
        (2 or 4 bytes a weight on top of the packed half byte): where it wins is the host's
        to say (engine_worker/path_choice.py measures it)."""
        if self.use_kernel and min_rows > 0:
            self.dense_min_rows = min_rows
            # `weight` (N, K), when the caller has it, spares reading the tiled bytes back
            # through the float32 kernel (seconds per layer)
            w = self.dequantize(torch.float32) if weight is None else weight
            self.dense = w.to(dtype)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int = 32,
        compute_dtype: torch.dtype | None = None, use_kernel: bool | None = None,
        clip_search: bool = False,
    ) -> Int4GroupLinear:
        """Round-to-nearest over each group's [min, max]; with clip_search, each group also
        tries ranges shrunk by CLIP_SHRINKS and keeps the one with the least squared error
        (an outlier then costs one clipped weight instead of a coarse step for all 32)."""
        n, k = weight.shape
        if k % group_size or k % 2:
            raise ValueError(f"in_features {k} is not a multiple of group size {group_size}")
        fits = n % 16 == 0 and group_size in (32, 64, 128, 256)
        if use_kernel is None:
            use_kernel = _INT4_MM is not None and weight.device.type == "cpu" and fits
        if compute_dtype is None:
            compute_dtype = _kernel_dtype(weight.device, weight.dtype) if use_kernel \
                else weight.dtype
        w = weight.detach().float().view(n, k // group_size, group_size)  # (N, K/G, G)
        q, scale, zero = _round_groups(w, w.amin(-1), w.amax(-1), compute_dtype)
        if clip_search:  # per group, the clipped range with the least squared error
            best = ((_dequant_groups(q, scale, zero) - w) ** 2).sum(-1)  # (N, K/G)
            lo, hi = w.amin(-1), w.amax(-1)
            # both ends shrunk, or only one (an outlier is usually on one side)
            ranges = [(lo * a, hi * b) for c in CLIP_SHRINKS for a, b in ((c, c), (c, 1), (1, c))]
            for lo2, hi2 in ranges:
                q2, s2, z2 = _round_groups(w, lo2, hi2, compute_dtype)
                err = ((_dequant_groups(q2, s2, z2) - w) ** 2).sum(-1)
                better = err < best
                best = torch.where(better, err, best)
                q = torch.where(better[..., None], q2, q)
                scale, zero = torch.where(better, s2, scale), torch.where(better, z2, zero)
        return cls.from_codes(q.view(n, k), scale, zero, group_size, bias, use_kernel=use_kernel)

    @classmethod
    def from_codes(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
        bias: torch.Tensor | None = None, *, use_kernel: bool,
    ) -> Int4GroupLinear:
        """Adopt ready codes: q (N, K) in 0..15, scale and zero (N, K/G) in the compute dtype,
        meaning w = (q - 8) * scale + zero. GGUF Q4_0/Q4_1 blocks map here with no rounding."""
        if use_kernel:
            packed = _INT4_PACK(q.to(torch.int32), 1)  # (N, K/2) uint8, tiled
        else:
            packed = pack_int4(q)
        sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
        return cls(packed, sz, group_size, None if bias is None else bias.detach().clone(),
                   use_kernel)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weights in `dtype`."""
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.use_kernel:  # tiled bytes: read them back through the kernel, x = identity
            eye = torch.eye(k, dtype=torch.float32, device=self.qweight.device)
            sz = self.scales_zeros.float()
            return _INT4_MM(eye, self.qweight, g, sz).t().to(dtype)  # (K, N) -> (N, K)
        q = unpack_int4(self.qweight).to(dtype).view(n, k // g, g)  # (N, K/G, G)
        sz = self.scales_zeros.transpose(0, 1).to(dtype)  # (N, K/G, 2)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_min_rows:
            y = F.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
        elif self.use_kernel:
            xc = x.to(self.scales_zeros.dtype)
            y = _INT4_MM(xc, self.qweight, self.group_size, self.scales_zeros).to(x.dtype)
        else:
            y = F.linear(x, self.dequantize(x.dtype))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"kernel={self.use_kernel}")


CLIP_SHRINKS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def _round_groups(
    w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K/G, G) on the range [lo, hi] (N, K/G) -> codes (N, K/G, G) in 0..15, scale and
    zero (N, K/G) in compute_dtype; codes are rounded against the stored (rounded) values."""
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(compute_dtype)
    zero = (lo + 8 * scale.float()).to(compute_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    return torch.round((w - z) / s + 8).clamp(0, 15), scale, zero


def _dequant_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q - 8) * scale.float()[..., None] + zero.float()[..., None]  # (N, K/G, G)


class Int8Embedding(nn.Module):
    """Row-wise INT8 embedding table; may share qweight/scales with a tied Int8Linear head.
    No `weight` attribute on purpose: code that reads `embed_tokens.weight` must fail loudly."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # (V, C) int8
        self.register_buffer("scales", scales)  # (V,)
        self.dtype = dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Embedding:
        q = Int8Linear.from_float(weight, compute_dtype=torch.float32, use_kernel=False)
        return cls(q.qweight, q.scales, weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(self.dtype)  # (N, C)
        return rows * self.scales.index_select(0, ids).to(self.dtype)[:, None]


def pick_group_size(in_features: int, requested: int) -> int | None:
    """`requested` if it divides in_features, else the largest smaller allowed size that does."""
    fits = [g for g in GROUP_SIZES if g <= requested and in_features % g == 0]
    return max(fits) if fits else None


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights held: parameters and persistent buffers, shared storage once."""
    seen: dict[tuple[int, int], int] = {}  # (address, bytes) -> bytes: a tied tensor once
    for t in model.state_dict(keep_vars=True).values():
        if t is not None:
            seen[(t.data_ptr(), t.nbytes)] = t.nbytes
    return sum(seen.values())


@dataclass
class QuantReport:
    mode: str
    bytes_before: int
    bytes_after: int
    # quantized layer -> INT4 group size used (0 for INT8: one scale per output channel)
    group_sizes: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # layers left in float
    # (in_features, group used) -> layers whose in_features the requested group does not divide
    fallbacks: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        return (f"{self.mode}: weights {self.bytes_before / 2**20:.1f} MiB -> "
                f"{self.bytes_after / 2**20:.1f} MiB ({len(self.group_sizes)} layers quantized, "
                f"{len(self.skipped)} left in float)")


@dataclass(frozen=True)
class _Options:
    """How layers are made: the kernels' dtype and use, and the options of one kind only."""

    compute_dtype: torch.dtype | None = None
    use_kernel: bool | None = None
    clip_search: bool = False  # INT4 layers
    native_q8: bool = False  # group-wise INT8 head: our C++ kernel at few rows
    head_dense_rows: int = 0  # group-wise INT8 head: a bfloat16 copy from this many rows


def _quantize(
    w: torch.Tensor, b: torch.Tensor | None, name: str, mode: str, group_size: int,
    report: QuantReport, opt: _Options,
) -> nn.Module | None:
    if mode == "int8g32" and b is None and w.shape[1] % GROUP == 0:
        report.group_sizes[name] = GROUP
        return Int8GroupLinear.from_float(w, use_kernel=opt.use_kernel, native=opt.native_q8,
                                          dense_min_rows=opt.head_dense_rows)
    if mode in ("int8", "int8g32"):
        report.group_sizes[name] = 0
        return Int8Linear.from_float(w, b, compute_dtype=opt.compute_dtype,
                                     use_kernel=opt.use_kernel)
    g = pick_group_size(w.shape[1], group_size)
    if g is None:
        log.warning("%s: in_features %d has no group size <= %d; left in float",
                    name, w.shape[1], group_size)
        report.skipped.append(name)
        return None
    if g != group_size:
        report.fallbacks.setdefault((w.shape[1], g), []).append(name)
    report.group_sizes[name] = g
    return Int4GroupLinear.from_float(w, b, group_size=g, compute_dtype=opt.compute_dtype,
                                      use_kernel=opt.use_kernel, clip_search=opt.clip_search)


@torch.no_grad()
def quantize_model(
    model: nn.Module, mode: str, group_size: int = 32, *, lm_head: bool = True,
    head_mode: str | None = None, compute_dtype: torch.dtype | None = None,
    use_kernel: bool | None = None, clip_search: bool = False, native_q8: bool = False,
    head_dense_rows: int = 0,
) -> QuantReport:
    """Swap the model's projections for quantized ones in place (after loading; init_rope
    already done). mode: none | int8 | int4. lm_head: quantize the head too (and, if tied, the
    embedding to INT8), in head_mode (default: mode). Returns what changed; logs it."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, not {mode!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, not {group_size}")
    report = QuantReport(mode, weight_bytes(model), 0)
    if mode == "none":
        report.bytes_after = report.bytes_before
        return report
    # clip_search is off by default: 19 passes over the weights made a loaded 2-core host's INT4
    # worker start exceed 3 minutes. native_q8: load_group_gemv first.
    opt = _Options(compute_dtype, use_kernel, clip_search, native_q8, head_dense_rows)
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and (lm_head or n != "lm_head")]
    # INT4 mode's head: group-wise INT8. A per-row INT8 (and an INT4) head turned SmolLM2's
    # "The capital of France is Paris." into "L'Étoile, ..."; a float32 head cost 4.5 ms/step.
    head_mode = head_mode or ("int8g32" if mode == "int4" else mode)
    for name, mod in targets:
        m = head_mode if name == "lm_head" else mode
        new = _quantize(mod.weight, mod.bias, name, m, group_size, report, opt)
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, new)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if lm_head and getattr(model, "lm_head", "absent") is None and isinstance(embed, nn.Embedding):
        head = _quantize(embed.weight, None, "lm_head", head_mode, group_size, report, opt)
        if head is not None:  # tied: the head gets its own quantized copy, the embedding INT8
            model.lm_head = head
            if isinstance(head, Int8Linear):  # same per-row quantization: share it
                inner.embed_tokens = Int8Embedding(head.qweight, head.scales, embed.weight.dtype)
            elif isinstance(head, Int8GroupLinear):  # same groups: the GGUF path's sharing
                inner.embed_tokens = Int8GroupEmbedding(head, embed.weight.dtype)
            else:
                inner.embed_tokens = Int8Embedding.from_float(embed.weight)
    report.bytes_after = weight_bytes(model)
    for (k, g), names in report.fallbacks.items():  # one line per shape, not per layer
        log.warning("int4 group %d does not divide in_features %d: %d layers (%s%s) use group %d",
                    group_size, k, len(names), ", ".join(names[:3]),
                    ", ..." if len(names) > 3 else "", g)
    log.info("quantized: %s", report)
    return report
