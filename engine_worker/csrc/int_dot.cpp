// Integer-dot matmuls over GGUF block-quantized weights (issues 21, 22), as llama.cpp's CPU
// backend does: y (M, N) float32 = x (M, K) float32 @ W^T for any number of activation rows, W
// in blocks of 32 inputs: Q4_0, Q4_1, Q8_0, Q5_0, the K-quants Q4_K, Q5_K and Q6_K in the
// bytes the GGUF stores (super-blocks of 256: an fp16 scale per super-block times a small integer
// scale per block), and forms that hold the other GGML types exactly in their codes
// (engine_worker/model/ggml_types.py): Q8_1 (w = d*q + m, for Q5_1), Q6_16 (6-bit codes with one
// fp16 scale per 16 inputs, Q6_K's former form) and Q8_16 (the same as 8-bit codes).
//
// Data flow of one call:
//   x rows -> quantized once to 8 bits per block of 32 (Q8_0: codes q = round(x * 127/amax),
//   ties to even, scale d = amax/127 in float32; plus the block's code sum for the weight
//   formats with an offset, Q8_1-style) -> for each tile of 8 output rows (chunks of tiles
//   taken by torch's threads as they come free: parallel_chunks), for each chunk of up to 5
//   activation rows, for each block: one integer dot of the block's 32 codes with each of the
//   tile's 8 rows (int32, exact), then in float32
//   acc[i] = fma(float(isum_i), dw_i * dx, acc[i])   (+ fma(m_i, dx * sum(q), acc[i]) for Q4_1).
// The formats and their layouts: int_dot_formats.h; the activations' quantization:
// int_dot_act.h; the inner loops: int_dot_tile.h (256-bit and scalar), int_dot_tile2.h (512-bit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "int_dot_act.h"
#include "int_dot_formats.h"
#include "int_dot_tile.h"
#include "int_dot_tile2.h"

namespace {

// body(lo, hi) over [0, n) on torch's threads, each thread taking the next chunk of items as it
// finishes one, as ggml's matmuls do, not a fixed share: a thread held off its core (the gateway
// beside the worker, a neighbour's process) then delays the call by the chunk it holds, while the
// others take the rest. The items are output tiles: who computes one changes none of its bits.
template <class Body>
void parallel_chunks(int64_t n, int64_t min_chunk, const Body& body) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                (n + min_chunk - 1) / min_chunk));
  if (threads == 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  // Chunks of 1/8 of a thread's share, shrinking to a share of what is left (1 / (2 x
  // threads) of it, at least min_chunk) as the work runs out, so the threads finish close
  // together: a fixed 1/16 of the items left one thread idle for up to a chunk at the end of
  // every call (on an AMD EPYC Zen 4, 2 threads, the 0.5B Qwen draft's one-row pass of ~97 calls
  // spent 13.1 % of its samples idle in libgomp, 9.7 % with the chunks shrinking; 10.6 / 11.6 /
  // 11.9 against 11.0 / 12.1 / 12.0 ms a pass, interleaved). Never more than 1/8 of a share: a
  // thread held off its core delays a call by the chunk it holds, no more than before.
  const int64_t most = std::max<int64_t>(min_chunk, n / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t left = n - next.load(std::memory_order_relaxed);
      const int64_t chunk = std::clamp<int64_t>(left / (2 * threads), min_chunk, most);
      const int64_t lo = next.fetch_add(chunk);
      if (lo >= n) break;
      body(lo, std::min(n, lo + chunk));
    }
  });
}

// fn.template operator()<R>() for R = rows (1..Max), each row count its own unrolled body
template <int Max, int R = 1, class Fn>
inline void with_rows(int64_t rows, const Fn& fn) {
  if constexpr (R < Max) {
    if (rows > R) return with_rows<Max, R + 1>(rows, fn);
  }
  fn.template operator()<R>();
}

template <Fmt F>
at::Tensor int_dot(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                   const c10::optional<at::Tensor>& m, int64_t n) {
  const char* name = fmt_name(F);
  TORCH_CHECK(n >= 1, "int_dot_", name, ": n = ", n, " must be >= 1");
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "int_dot_", name, ": x must be a contiguous (M, K) float32 CPU tensor, got ",
              x.scalar_type(), " of shape ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(rows >= 1, "int_dot_", name, ": x has no rows");
  TORCH_CHECK(k >= kBlock && k % kBlock == 0, "int_dot_", name, ": K = ", k,
              " is not a positive multiple of 32");
  const int64_t blocks = k / kBlock;
  const auto qtype = is_q8(F) ? at::kChar : at::kByte;
  TORCH_CHECK(qs.device().is_cpu() && qs.scalar_type() == qtype && qs.is_contiguous() &&
                  qs.dim() == 3 && qs.size(0) == tiles && qs.size(1) == blocks &&
                  qs.size(2) == packed_bytes(F),
              "int_dot_", name, ": qs must be a contiguous ", at::toString(qtype), " (", tiles,
              ", ", blocks, ", ", packed_bytes(F), ") CPU tensor for n = ", n, ", K = ", k,
              ", got ", qs.scalar_type(), " of shape ", qs.sizes());
  TORCH_CHECK(!is_k(F) || k % (kSuper * kBlock) == 0, "int_dot_", name, ": K = ", k,
              " is not a multiple of 256 (a K-quant super-block)");
  auto check_scales = [&](const at::Tensor& t, const char* what, at::ScalarType dtype,
                          int64_t per_tile, int64_t per) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() &&
                    t.dim() == 3 && t.size(0) == tiles && t.size(1) == per_tile &&
                    t.size(2) == per,
                "int_dot_", name, ": ", what, " must be a contiguous ", at::toString(dtype),
                " (", tiles, ", ", per_tile, ", ", per, ") CPU tensor, got ", t.scalar_type(),
                " of shape ", t.sizes());
  };
  // the K-quants' d: one fp16 per row (and Q4_K's dmin) per super-block of 8 blocks
  if constexpr (is_k(F)) {
    check_scales(d, "d", at::kHalf, blocks / kSuper, scales_per(F) * kSuper);
  } else {
    check_scales(d, "d", at::kHalf, blocks, scales_per(F));
  }
  const uint8_t* mp = nullptr;
  if constexpr (has_m(F)) {
    TORCH_CHECK(m.has_value(), "int_dot_", name, ": m is required");
    const auto mtype = k4_scaled(F) ? at::kByte : F == Fmt::Q6_K ? at::kChar : at::kHalf;
    check_scales(*m, "m", mtype, blocks, is_k(F) ? m_bytes(F) : kTile);
    mp = static_cast<const uint8_t*>(m->data_ptr());
  }
  constexpr int64_t sp = scales_per(F);
  QAct a;
  quantize_rows(x.data_ptr<float>(), rows, k, a);
  at::Tensor y = at::empty({rows, n}, x.options());
  const uint8_t* qp = static_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  float* yp = y.data_ptr<float>();
  constexpr int64_t pb = packed_bytes(F);
  // work items: pairs of tiles where 512-bit vectors hold two, single tiles otherwise
#if defined(KESTREL_ZMM)
  constexpr int64_t per_item = 2;
#else
  constexpr int64_t per_item = 1;
#endif
  const int64_t items = (tiles + per_item - 1) / per_item;
  // Many rows (a prefill chunk): groups of kRowGroup rows, each meeting every tile while its
  // codes stay in cache; the weights are re-read once per group.
  for (int64_t g0 = 0; g0 < rows; g0 += kRowGroup) {
  const int64_t g1 = std::min(rows, g0 + kRowGroup);
  parallel_chunks(items, 8 / per_item, [&](int64_t lo, int64_t hi) {
    for (int64_t item = lo; item < hi; ++item) {
      // the K-quants' scales of a tile, unpacked by the group's first chunk of rows and read
      // back by the others (a prefill chunk), so the unpacking is paid once a group
      auto kept = [&](int64_t width) -> float* {
        if constexpr (!is_k(F)) {
          return nullptr;
        } else {
          if (g1 - g0 <= (width == 48 ? kChunk2 : kChunk)) return nullptr;
          thread_local std::vector<float> buf;
          if (buf.size() < static_cast<size_t>(blocks * width)) buf.resize(blocks * width);
          return buf.data();
        }
      };
      const int64_t t = item * per_item;
      const uint8_t* tq = qp + t * blocks * pb;
      const uint16_t* td = dp + t * blocks * sp;
      const uint8_t* tm = mp ? mp + t * blocks * m_bytes(F) : nullptr;
#if defined(KESTREL_ZMM)
      if (t + 1 < tiles) {
        const int64_t col = t * kTile, valid = std::min(2 * kTile, n - col);
        for (int64_t r0 = g0; r0 < g1; r0 += kChunk2) {
          with_rows<kChunk2>(std::min<int64_t>(kChunk2, g1 - r0), [&]<int R>() {
            tile2_chunk<F, R>(tq, td, tm, blocks, a, r0, k, yp, n, col, valid,
                              r0 == g0 && t + 2 * kAhead + 1 < tiles ? 2 * kAhead : 0,
                              kept(48), r0 == g0);
          });
        }
        continue;
      }
#endif
      const int64_t col = t * kTile, valid = std::min(kTile, n - col);
      for (int64_t r0 = g0; r0 < g1; r0 += kChunk) {
        with_rows<kChunk>(std::min<int64_t>(kChunk, g1 - r0), [&]<int R>() {
          tile_chunk<F, R>(tq, td, tm, blocks, a, r0, k, yp, n, col, valid,
                           r0 == g0 && t + kAhead < tiles ? kAhead : 0, kept(24), r0 == g0);
        });
      }
    }
  });
  }
  return y;
}

at::Tensor int_dot_q4_0(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        int64_t n) {
  return int_dot<Fmt::Q4_0>(x, qs, d, c10::nullopt, n);
}

at::Tensor int_dot_q4_1(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  return int_dot<Fmt::Q4_1>(x, qs, d, m, n);
}

at::Tensor int_dot_q8_0(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        int64_t n) {
  return int_dot<Fmt::Q8_0>(x, qs, d, c10::nullopt, n);
}

at::Tensor int_dot_q8_1(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  return int_dot<Fmt::Q8_1>(x, qs, d, m, n);
}

at::Tensor int_dot_q5_0(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        int64_t n) {
  return int_dot<Fmt::Q5_0>(x, qs, d, c10::nullopt, n);
}

at::Tensor int_dot_q8_16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                         int64_t n) {
  return int_dot<Fmt::Q8_16>(x, qs, d, c10::nullopt, n);
}

at::Tensor int_dot_q6_16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                         int64_t n) {
  return int_dot<Fmt::Q6_16>(x, qs, d, c10::nullopt, n);
}

at::Tensor int_dot_q4_k(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  return int_dot<Fmt::Q4_K>(x, qs, d, m, n);
}

at::Tensor int_dot_q5_k(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  return int_dot<Fmt::Q5_K>(x, qs, d, m, n);
}

at::Tensor int_dot_q6_k(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  return int_dot<Fmt::Q6_K>(x, qs, d, m, n);
}

// The activation quantizer alone, for tests: (codes int8 (M, K), scales float32 (M, K/32),
// code sums int32 (M, K/32)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int_dot_quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) % kBlock == 0,
              "int_dot_quantize_q8: x must be a contiguous (M, K) float32 CPU tensor with K a "
              "multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  QAct a;
  quantize_rows(x.data_ptr<float>(), rows, k, a);
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({rows, blocks}, x.options());
  at::Tensor s = at::empty({rows, blocks}, x.options().dtype(at::kInt));
  std::memcpy(q.data_ptr(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr(), a.d.data(), a.d.size() * sizeof(float));
  std::memcpy(s.data_ptr(), a.sum.data(), a.sum.size() * sizeof(int32_t));
  return {q, d, s};
}

std::string int_dot_isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel, lib) {
  lib.def("int_dot_q4_0(Tensor x, Tensor qs, Tensor d, int n) -> Tensor");
  lib.def("int_dot_q4_1(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int_dot_q8_0(Tensor x, Tensor qs, Tensor d, int n) -> Tensor");
  lib.def("int_dot_q8_1(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int_dot_q8_16(Tensor x, Tensor qs, Tensor d, int n) -> Tensor");
  lib.def("int_dot_q5_0(Tensor x, Tensor qs, Tensor d, int n) -> Tensor");
  lib.def("int_dot_q6_16(Tensor x, Tensor qs, Tensor d, int n) -> Tensor");
  lib.def("int_dot_q4_k(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int_dot_q5_k(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int_dot_q6_k(Tensor x, Tensor qs, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int_dot_quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
  lib.def("int_dot_isa() -> str", &int_dot_isa);  // no tensors to dispatch on: catch-all
}

TORCH_LIBRARY_IMPL(kestrel, CPU, lib) {
  lib.impl("int_dot_q4_0", &int_dot_q4_0);
  lib.impl("int_dot_q4_1", &int_dot_q4_1);
  lib.impl("int_dot_q8_0", &int_dot_q8_0);
  lib.impl("int_dot_q8_1", &int_dot_q8_1);
  lib.impl("int_dot_q8_16", &int_dot_q8_16);
  lib.impl("int_dot_q5_0", &int_dot_q5_0);
  lib.impl("int_dot_q6_16", &int_dot_q6_16);
  lib.impl("int_dot_q4_k", &int_dot_q4_k);
  lib.impl("int_dot_q5_k", &int_dot_q5_k);
  lib.impl("int_dot_q6_k", &int_dot_q6_k);
  lib.impl("int_dot_quantize_q8", &int_dot_quantize_q8);
}
