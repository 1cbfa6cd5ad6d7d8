// Few-row matmuls straight over Q8_0-style weights (issue 10): y = x @ W^T, W (N, K) in groups
// of 32 inputs, w = d * q with q int8 and one float32 scale d per (row, group).
//
// The GGUF's Q8_0 table is SmolLM2's token embedding and tied LM head (49152 x 576). torch has no
// group-wise INT8 kernel, so the head ran as 18 per-group `_weight_int8pack_mm` calls, each
// adding into a 49152-wide float32 row (profiled: 23 % of a batch-1 decode step). This loop
// reads each weight byte once: per output row, each group's codes are widened and scaled once and
// meet all M activation rows (a 32-lane float32 accumulator each; one horizontal sum per row).
// (The same scheme over Q4_1 nibbles was 2-3x slower than torch's packed INT4 kernel, measured,
// so INT4 layers keep torch's.)
//
// Layouts (checked): x (M, K) float32 contiguous, 1 <= M <= 8; codes (N, K) int8 row-major;
// scales (N, K/32) float32. y (M, N) float32. Work: at::parallel_for over output rows. The lane
// loops are `omp simd` with fixed trip counts, compiled -O3 -march=native for the host: AVX512
// where present, AVX2 (or SSE) elsewhere.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;

// One output row o for M activation rows: each group's 32 codes are widened and scaled once,
// then meet the M rows' inputs (M accumulators of 32 lanes; M is a template constant so the
// loops unroll and the accumulators stay in registers).
template <int M>
void q8_row(const float* xp, int64_t k, const int8_t* row, const float* ds, int64_t groups,
            float* yp, int64_t n, int64_t o) {
  float acc[M][kGroup] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* q = row + g * kGroup;
    const float d = ds[g];
    float w[kGroup];
#pragma omp simd
    for (int j = 0; j < kGroup; ++j) w[j] = d * static_cast<float>(q[j]);
    for (int r = 0; r < M; ++r) {
      const float* xg = xp + r * k + g * kGroup;
#pragma omp simd
      for (int j = 0; j < kGroup; ++j) acc[r][j] += w[j] * xg[j];
    }
  }
  for (int r = 0; r < M; ++r) {
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int j = 0; j < kGroup; ++j) total += acc[r][j];
    yp[r * n + o] = total;
  }
}

template <int M>
void q8_rows(const float* xp, int64_t k, const int8_t* cp, const float* dp, int64_t n,
             float* yp) {
  const int64_t groups = k / kGroup;
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; ++o) {
      q8_row<M>(xp, k, cp + o * k, dp + o * groups, groups, yp, n, o);
    }
  });
}

at::Tensor q8_group_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.scalar_type() == at::kChar,
              "codes must be a contiguous (N, K) int8 CPU tensor");
  const int64_t n = codes.size(0), k = codes.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "K = ", k, " is not a multiple of 32");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous() && x.size(1) == k,
              "x must be a contiguous (M, ", k, ") float32 CPU tensor");
  const int64_t rows = x.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "1..8 rows of x, got ", rows);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == groups,
              "scales must be a contiguous (N, K/32) float32 tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* dp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (rows) {
    case 1: q8_rows<1>(xp, k, cp, dp, n, yp); break;
    case 2: q8_rows<2>(xp, k, cp, dp, n, yp); break;
    case 3: q8_rows<3>(xp, k, cp, dp, n, yp); break;
    case 4: q8_rows<4>(xp, k, cp, dp, n, yp); break;
    case 5: q8_rows<5>(xp, k, cp, dp, n, yp); break;
    case 6: q8_rows<6>(xp, k, cp, dp, n, yp); break;
    case 7: q8_rows<7>(xp, k, cp, dp, n, yp); break;
    default: q8_rows<8>(xp, k, cp, dp, n, yp); break;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel, lib) {
  lib.def("q8_group_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel, CPU, lib) { lib.impl("q8_group_mm", &q8_group_mm); }
