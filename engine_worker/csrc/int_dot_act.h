// The activation rows of an integer-dot call (csrc/int_dot.cpp) quantized once to 8 bits per
// block of 32 (Q8_0: q = round(x * 127/amax), ties to even, d = amax/127), with the sums the
// weight formats with an offset or a zero code need. The same bits on every build.

#pragma once

#include "int_dot_formats.h"

namespace {

// The activation rows quantized to Q8 blocks: codes (M, K), scales (M, B), code sums (M, B), the
// sums per half block (M, 2B) and for the offset formats scale * code sum (M, B).
struct QAct {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  std::vector<int32_t> half;
  std::vector<float> s;
};

// One block of 32 activations to Q8 codes: its scale d, code sum and sums per half, or NaN
// scales and zero codes for a block holding NaN or inf (the row's outputs are then NaN, as a
// float matmul's would be). A block below 1e-30 (zero, or so small that 127/amax would overflow)
// quantizes to zeros.
struct QBlock {
  float d;
  int32_t half[2];
  bool finite;
};

#if defined(KESTREL_SIMD)
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The same codes, scale and sums as the scalar build's quantize_block (below), 8 lanes at a
// time: the maximum is exact in any order, x * (127/amax) is the same float product, and the
// conversion rounds to nearest even as nearbyint does under the default rounding mode.
inline QBlock quantize_block(const float* xb, int8_t* qb) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  __m256 v[4], amax8 = _mm256_setzero_ps();
  int finite = 0xFF;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 ab = _mm256_andnot_ps(sign, v[i]);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(ab, inf, _CMP_LT_OQ));  // NaN compares false
    amax8 = _mm256_max_ps(amax8, ab);
  }
  if (finite != 0xFF) return {0.f, {0, 0}, false};
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const bool live = amax >= 1e-30f;
  const float id = live ? 127.f / amax : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
  QBlock out{live ? amax / 127.f : 0.f,
             {hsum8(_mm256_add_epi32(q[0], q[1])), hsum8(_mm256_add_epi32(q[2], q[3]))}, true};
  // int32 -> int8 (|code| <= 127: no saturation); the packs interleave 128-bit lanes, the
  // permutation puts the 32 codes back in order
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                       _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return out;
}
#else
inline QBlock quantize_block(const float* xb, int8_t* qb) {
  float amax = 0.f;
  bool finite = true;
  for (int j = 0; j < kBlock; ++j) {
    amax = std::max(amax, std::fabs(xb[j]));
    finite = finite && std::isfinite(xb[j]);
  }
  if (!finite) return {0.f, {0, 0}, false};
  const bool live = amax >= 1e-30f;
  const float id = live ? 127.f / amax : 0.f;
  QBlock out{live ? amax / 127.f : 0.f, {0, 0}, true};
  for (int j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * id));  // ties to even
    qb[j] = static_cast<int8_t>(v);
    out.half[j / 16] += v;
  }
  return out;
}
#endif

// Blocks quantized per thread: a 16-row step of the 1.5B Qwen quantized ~6 M activations one
// block at a time on one core, 7 % of its time, while the other core waited.
constexpr int64_t kQuantGrain = 256;

void quantize_rows(const float* x, int64_t m, int64_t k, QAct& a) {
  const int64_t blocks = k / kBlock;
  a.q.resize(m * k);
  a.d.resize(m * blocks);
  a.sum.resize(m * blocks);
  a.half.resize(2 * m * blocks);
  a.s.resize(m * blocks);
  at::parallel_for(0, m * blocks, kQuantGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t rb = lo; rb < hi; ++rb) {
      int8_t* qb = a.q.data() + rb * kBlock;
      const QBlock b = quantize_block(x + rb * kBlock, qb);  // rows contiguous, K % 32 == 0
      if (!b.finite) {
        std::memset(qb, 0, kBlock);
        a.d[rb] = a.s[rb] = std::numeric_limits<float>::quiet_NaN();
        a.sum[rb] = a.half[2 * rb] = a.half[2 * rb + 1] = 0;
        continue;
      }
      const int32_t sum = b.half[0] + b.half[1];
      a.d[rb] = b.d;
      a.sum[rb] = sum;
      a.half[2 * rb] = b.half[0];
      a.half[2 * rb + 1] = b.half[1];
      a.s[rb] = b.d * static_cast<float>(sum);
    }
  });
}

}  // namespace
