// The arithmetic of one decode attention task (csrc/paged_attention.cpp walks the blocks):
// float32 vectors as wide as the host's registers, dot products of a query row against a
// block's K rows, a block's V rows added under their weights, and the softmax's numerators by a
// vectorised exp; then, where the build has AVX512-BF16, the same over bfloat16 rows as stored.
// Included by paged_attention.cpp alone (engine_worker/kernel_build.py hashes csrc/*.h with
// each kernel's source, so an edit here rebuilds it).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
// DC: the head size when known at compile time (64, 128: fixed trip counts the compiler
// unrolls and keeps in registers), 0 for any other, read at run time.
// 16 floats as one value: GCC/Clang vector extensions, lowered to one AVX512 register, two AVX2
// ones, or four SSE ones, whatever -march=native offers. Locals of this type stay in registers
// (an array of floats indexed in a loop was spilled to the stack, measured).
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The working vector is the host's register: 16 floats with AVX512, 8 without. A 16-float
// value on an AVX2 build was lowered through the stack (GCC keeps a vector wider than the ISA's
// registers in memory): the accumulators of pass 2 ran 6.5x slower than on the AVX512 build of
// the same CPU (a layer of SmolLM2 at 16 sequences: 396 against 61 us, Zen 5 under the caps).
#if defined(__AVX512F__)
typedef v16 vw;
#else
typedef v8 vw;
#endif
constexpr int W = sizeof(vw) / sizeof(float);

inline vw loadw(const float* p) {
  vw v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storew(float* p, vw v) { std::memcpy(p, &v, sizeof(v)); }

// A head size not known at compile time: a plain loop.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Four dot products' lanes summed at once: [sum a0, sum a1, sum a2, sum a3]. Each step adds
// pairs of halves of two accumulators side by side: ~5 vector operations a sum where a sum of
// one accumulator by halving took ~9 (shuffles, which Intel's cores run on one port).
inline v4 hsum4(v8 a0, v8 a1, v8 a2, v8 a3) {
  const v8 s01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);  // a0 4 | a1 4
  const v8 s23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                 __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  const v8 t = __builtin_shufflevector(s01, s23, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(s01, s23, 2, 3, 6, 7, 10, 11, 14, 15);  // 2 each
  return __builtin_shufflevector(t, t, 0, 2, 4, 6) + __builtin_shufflevector(t, t, 1, 3, 5, 7);
}
inline v8 fold(v16 x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline v4 hsum4(v16 a0, v16 a1, v16 a2, v16 a3) {
  return hsum4(fold(a0), fold(a1), fold(a2), fold(a3));
}

// out[0..3] = q . k0..k3 (DC > 0, the vector path): four accumulators side by side, so
// the FMA chains overlap, and one hsum4. A row's score is the same whichever four it is
// computed with (the caller repeats rows to fill a four), so it does not depend on the step.
template <int DC>
inline void dot4(const float* __restrict q, const float* k0, const float* k1, const float* k2,
                 const float* k3, float* out) {
  vw qi = loadw(q);
  vw a0 = qi * loadw(k0), a1 = qi * loadw(k1), a2 = qi * loadw(k2), a3 = qi * loadw(k3);
#pragma GCC unroll 16
  for (int i = W; i < DC; i += W) {
    qi = loadw(q + i);
    a0 += qi * loadw(k0 + i);
    a1 += qi * loadw(k1 + i);
    a2 += qi * loadw(k2 + i);
    a3 += qi * loadw(k3 + i);
  }
  const v4 s = hsum4(a0, a1, a2, a3);
  std::memcpy(out, &s, sizeof(s));
}

// s[r] = q . k_r for a block's n rows, `stride` apart, four rows a call of four(q, k0..k3, out);
// the last rows are each the same sum it would be among four (the call repeats a row to fill
// its four), so a row's score does not depend on where the block ends.
template <typename Dot4, typename Q, typename E>
inline void in_fours(Dot4 four, const Q* q, const E* kb, int64_t n, int64_t stride, float* s) {
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    const E* k = kb + r * stride;
    four(q, k, k + stride, k + 2 * stride, k + 3 * stride, s + r);
  }
  if (r < n) {
    float tail[4];
    const E* k = kb + r * stride;
    const int64_t last = n - 1 - r;
    four(q, k, k + std::min<int64_t>(1, last) * stride, k + std::min<int64_t>(2, last) * stride,
         k + last * stride, tail);
    for (int64_t j = 0; r + j < n; ++j) s[r + j] = tail[j];
  }
}

// s[r] = q . k_r for a block's n rows, `stride` apart.
template <int DC>
inline void scores_block(const float* q, const float* kb, int64_t n, int64_t stride,
                         int64_t d, float* s) {
  if constexpr (DC > 0) {
    in_fours([](auto... a) { dot4<DC>(a...); }, q, kb, n, stride, s);
  } else {
    for (int64_t r = 0; r < n; ++r) s[r] = dot(q, kb + r * stride, d);
  }
}

// acc (D) += sum_r p[r] v_r over one block's rows; with DC known the accumulator lives in
// registers for the whole block instead of a load and store per row.
template <int DC>
inline void axpy_block(float* __restrict acc, const float* __restrict p,
                       const float* __restrict v, int64_t n, int64_t stride, int64_t d) {
  if constexpr (DC > 0) {
    constexpr int NV = DC / W;
    vw a[NV];
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) a[i] = loadw(acc + W * i);
    for (int64_t r = 0; r < n; ++r) {
      const float pr = p[r];
      const float* vr = v + r * stride;
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) a[i] += pr * loadw(vr + W * i);
    }
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) storew(acc + W * i, a[i]);
  } else {
    for (int64_t r = 0; r < n; ++r) {
      const float pr = p[r];
      const float* vr = v + r * stride;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) acc[i] += pr * vr[i];
    }
  }
}

// exp(x) for x <= 0 (scores minus their max), branch-free so the loop over T vectorises:
// x = n ln2 + r, |r| <= ln2/2; exp(r) by a degree-6 polynomial (Cephes expf coefficients,
// ~1 ulp); 2^n put into the exponent bits. Below -87 the result flushes to 0, as expf's would
// underflow.
// The steps on a float or on W lanes alike (V float or vw): n (as a float) and exp(r).
template <typename V>
inline V exp_steps(V v, V* k_out) {
  // round to nearest by the 1.5 * 2^23 trick: |v log2 e| < 2^22, and no libm call to block
  // vectorisation (the compiler may not reassociate it away without -ffast-math)
  const V k = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const V r = v - k * 0.693359375f + k * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  *k_out = k;
  return p * r * r + r + 1.f;
}

inline void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float k;
    const float p = exp_steps(x[i] < -87.f ? -87.f : x[i], &k);
    int32_t e = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, sizeof(scale));
    x[i] = x[i] < -87.f ? 0.f : p * scale;
  }
}

// exp_inplace's steps on W lanes at once (the loop above stays scalar: its float-to-int
// conversion and bit moves kept GCC from vectorising it, and the softmax took ~30 cycles a
// score, measured).
typedef int32_t vwi __attribute__((vector_size(sizeof(vw))));
inline vw exp_le0(vw x) {
  const vw m87 = vw{} - 87.f;
  vw k;
  const vw p = exp_steps<vw>(x < m87 ? m87 : x, &k);
  const vwi e = (__builtin_convertvector(k, vwi) + 127) << 23;
  vw scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return x < m87 ? vw{} : p * scale;
}

// One query row's scores to their softmax numerators in place: s - max(s), exp; the sum of
// them returned (>= 1: the max's own term is exp(0)). W lanes at a time, the tail scalar.
inline float softmax_numerators(float* s, int64_t n) {
  const int64_t body = n - n % W;
  float mx = s[0];
  if (body) {
    vw m = loadw(s);
    for (int64_t t = W; t < body; t += W) {
      const vw x = loadw(s + t);
      m = x > m ? x : m;
    }
    for (int i = 0; i < W; ++i) mx = m[i] > mx ? m[i] : mx;
  }
  for (int64_t t = body; t < n; ++t) mx = s[t] > mx ? s[t] : mx;
  vw acc = vw{};
  for (int64_t t = 0; t < body; t += W) {
    const vw e = exp_le0(loadw(s + t) - mx);
    storew(s + t, e);
    acc += e;
  }
  for (int64_t t = body; t < n; ++t) s[t] -= mx;
  exp_inplace(s + body, n - body);
  float sum = 0.f;
  for (int i = 0; i < W; ++i) sum += acc[i];
  for (int64_t t = body; t < n; ++t) sum += s[t];
  return sum;
}

#if defined(__AVX512BF16__)
// A bfloat16 cache on a host with AVX512-BF16 (Zen 4 and later, Cooper Lake, Sapphire Rapids):
// vdpbf16ps multiplies 32 bfloat16 pairs into 16 float32 sums in one instruction, so K and V are
// used as stored (no widening into a float32 buffer) at half the instructions of float32 FMAs.
// The query (scaled) and the softmax's numerators are rounded to bfloat16 for it, as llama.cpp's
// CPU flash attention rounds the query to the K cache's type; the sums stay float32, the
// softmax's denominator is summed from the float32 numerators.
#define KESTREL_BF16_DOT 1
typedef uint16_t bh;  // a bfloat16's bits

// n floats rounded to bfloat16 (nearest even, as vcvtneps2bf16 and c10::BFloat16 round)
inline void round_bf16(const float* src, bh* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(dst + i, &h, sizeof(h));
  }
  for (; i < n; ++i) {  // the tail the same way; no NaN reaches here (scores and queries)
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    dst[i] = static_cast<bh>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
  }
}

// out[0..3] = q . k0..k3 over DC bfloat16 values (DC a multiple of 32)
template <int DC>
inline void dot4_bh(const bh* q, const bh* k0, const bh* k1, const bh* k2, const bh* k3,
                    float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#pragma GCC unroll 8
  for (int i = 0; i < DC; i += 32) {
    const __m512bh qi = (__m512bh)_mm512_loadu_si512(q + i);
    const __m512bh ql = (__m512bh)_mm512_loadu_si512(q + DC + i);
    const __m512bh x0 = (__m512bh)_mm512_loadu_si512(k0 + i), x1 = (__m512bh)_mm512_loadu_si512(k1 + i);
    const __m512bh x2 = (__m512bh)_mm512_loadu_si512(k2 + i), x3 = (__m512bh)_mm512_loadu_si512(k3 + i);
    a0 = _mm512_dpbf16_ps(a0, qi, x0);
    a1 = _mm512_dpbf16_ps(a1, qi, x1);
    a2 = _mm512_dpbf16_ps(a2, qi, x2);
    a3 = _mm512_dpbf16_ps(a3, qi, x3);
    b0 = _mm512_dpbf16_ps(b0, ql, x0);
    b1 = _mm512_dpbf16_ps(b1, ql, x1);
    b2 = _mm512_dpbf16_ps(b2, ql, x2);
    b3 = _mm512_dpbf16_ps(b3, ql, x3);
  }
  const v4 s = hsum4((v16)(a0 + b0), (v16)(a1 + b1), (v16)(a2 + b2), (v16)(a3 + b3));
  std::memcpy(out, &s, sizeof(s));
}

template <int DC>
inline void scores_block_bh(const bh* q, const bh* kb, int64_t n, int64_t stride, float* s) {
  in_fours([](auto... a) { dot4_bh<DC>(a...); }, q, kb, n, stride, s);
}

// A block's n V rows as pairs of rows interleaved for vdpbf16ps: for rows (r, r + 1) and each
// 32 values, vpunpcklwd and vpunpckhwd of the two rows (in each 128-bit lane, 4 values of one
// row alternating with the other's); an odd last row pairs with zeros. Pair r/2 at buf + r * DC.
template <int DC>
inline void pair_rows(const bh* v, int64_t n, int64_t stride, bh* buf) {
  for (int64_t r = 0; r < n; r += 2) {
    const bh* x = v + r * stride;
    for (int c = 0; c < DC; c += 32) {
      const __m512i xv = _mm512_loadu_si512(x + c);
      const __m512i yv = r + 1 < n ? _mm512_loadu_si512(x + stride + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(buf + r * DC + 2 * c, _mm512_unpacklo_epi16(xv, yv));
      _mm512_storeu_si512(buf + r * DC + 2 * c + 32, _mm512_unpackhi_epi16(xv, yv));
    }
  }
}

// The value index that accumulator position e holds after pair_rows' interleave.
inline int64_t paired_index(int64_t e) {
  const int64_t i = e / 16, j = e % 16;
  return 32 * (i / 2) + 8 * (j / 4) + 4 * (i % 2) + j % 4;
}

// acc (DC, in paired_index order) += sum_r p[r] v_r over a block's n rows, two rows an
// instruction: p[r] and p[r + 1] side by side against the paired rows.
template <int DC>
inline void axpy_block_bh(float* acc, const bh* p, const bh* pairs, int64_t n) {
  constexpr int NV = DC / 16;
  __m512 a[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t r = 0; r < n; r += 2) {
    const uint32_t pr = p[r] | (r + 1 < n ? static_cast<uint32_t>(p[r + 1]) << 16 : 0u);
    const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr));
    const bh* vp = pairs + r * DC;
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i)
      a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(vp + 32 * i), pb);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

}  // namespace
