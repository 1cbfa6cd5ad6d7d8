// The integer-dot kernel's inner loop in 512-bit vectors (AVX512-BW with VNNI): two tiles, 16
// output rows, against a chunk of up to 8 activation rows; the same bits as csrc/int_dot_tile.h.

#pragma once

#include "int_dot_act.h"
#include "int_dot_formats.h"

namespace {

#if defined(KESTREL_ZMM)
inline __m512i load2(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512i spread4(__m512i x) {  // as the 256-bit spread4
  const __m512i bits = _mm512_and_si512(
      _mm512_mullo_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0xF)),
                         _mm512_set1_epi32(0x00204081)),
      _mm512_set1_epi32(0x01010101));
  return _mm512_slli_epi32(bits, 4);
}

template <int J>
inline __m512i top2(__m512i plane) {  // as the 256-bit top2
  const __m512i at = J == 0 ? _mm512_slli_epi16(plane, 4)
                     : J == 1 ? _mm512_slli_epi16(plane, 2)
                     : J == 2 ? plane
                              : _mm512_srli_epi16(plane, 2);
  return _mm512_and_si512(at, _mm512_set1_epi8(0x30));
}

// scales8's for two neighbouring tiles (tile t's 8 rows in lanes 0..7, t+1's in 8..15): each
// tile's own, side by side, so the products per lane are scales8's. The second tile's scales are
// `tile_scales` fp16 and `tile_m` bytes on.
struct Scales16 {
  __m512 d, dhi, m;
};

inline __m512 join8(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                             _mm256_castps_pd(hi), 1));
}

template <Fmt F>
[[gnu::always_inline]] inline Scales16 scales16(const uint16_t* dw, const uint8_t* mw,
                                                 int64_t b, int64_t tile_scales,
                                                 int64_t tile_m) {
  const Scales8 t0 = scales8<F>(dw, mw, b);
  const Scales8 t1 = scales8<F>(dw + tile_scales, mw == nullptr ? nullptr : mw + tile_m, b);
  return {join8(t0.d, t1.d), join8(t0.dhi, t1.dhi), join8(t0.m, t1.m)};
}

// Two neighbouring tiles (16 output rows: tile t in lanes 0..7, t+1 in lanes 8..15) against R
// activation rows with 512-bit dpbusd: each activation broadcast and each float step serves 16
// rows. Per lane the same integer sums and float steps as tile_chunk, so the same bits.
// q, dw, mw: tile t's; tile t+1's are `tile_bytes` / `tile_scales` further on.
template <Fmt F, int R>
void tile2_chunk(const uint8_t* qs, const uint16_t* dw, const uint8_t* mw, int64_t blocks,
                 const QAct& a, int64_t r0, int64_t k, float* y, int64_t n, int64_t col,
                 int64_t valid, int64_t ahead, float* kept = nullptr, bool keep = false) {
  constexpr int64_t pb = packed_bytes(F);
  constexpr int64_t sp = scales_per(F);
  const int64_t tile_bytes = blocks * pb, tile_scales = blocks * sp,
                tile_m = blocks * m_bytes(F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = qs + b * pb;
    if (ahead > 0) prefetch_block<F>(qs, dw, mw, blocks, b, ahead, 2);
    Scales16 sc16;
    if (kept == nullptr || keep) {
      sc16 = scales16<F>(dw, mw, b, tile_scales, tile_m);
      if (kept != nullptr) {
        _mm512_storeu_ps(kept + 48 * b, sc16.d);
        _mm512_storeu_ps(kept + 48 * b + 16, sc16.dhi);
        _mm512_storeu_ps(kept + 48 * b + 32, sc16.m);
      }
    } else {
      sc16 = {_mm512_loadu_ps(kept + 48 * b), _mm512_loadu_ps(kept + 48 * b + 16),
              _mm512_loadu_ps(kept + 48 * b + 32)};
    }
    const __m512 dwv = sc16.d;
    if constexpr (is_q8(F)) {
      __m512i wabs[8];
      __mmask64 neg[8];
      for (int j = 0; j < 8; ++j) {
        const __m512i w = load2(wb + 32 * j, wb + tile_bytes + 32 * j);
        wabs[j] = _mm512_abs_epi8(w);
        neg[j] = _mm512_movepi8_mask(w);  // AVX512 has no sign_epi8: negate x where w < 0
      }
      const __m512 dhi = sc16.dhi, mv = sc16.m;
      #pragma GCC unroll 8  // every row its own registers: rolled, acc[] lived on the stack
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r, ab = row * blocks + b;
        const int8_t* xq = a.q.data() + row * k + b * kBlock;
        __m512i half[2];
        for (int h = 0; h < 2; ++h) {
          __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
          for (int j = 4 * h; j < 4 * h + 4; j += 2) {
            int32_t x0, x1;
            std::memcpy(&x0, xq + 4 * j, 4);
            std::memcpy(&x1, xq + 4 * j + 4, 4);
            const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
            i0 = _mm512_dpbusd_epi32(i0, wabs[j], _mm512_mask_sub_epi8(b0, neg[j], zero, b0));
            i1 = _mm512_dpbusd_epi32(i1, wabs[j + 1],
                                     _mm512_mask_sub_epi8(b1, neg[j + 1], zero, b1));
          }
          half[h] = _mm512_add_epi32(i0, i1);
        }
        const __m512 dx = _mm512_set1_ps(a.d[ab]);
        if constexpr (F == Fmt::Q8_16) {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(half[0]), _mm512_mul_ps(dwv, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(half[1]), _mm512_mul_ps(dhi, dx), acc[r]);
        } else {
          const __m512i isum = _mm512_add_epi32(half[0], half[1]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dwv, dx), acc[r]);
        }
        if constexpr (F == Fmt::Q8_1) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[ab]), acc[r]);
      }
    } else {
      __m512i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i v = load2(wb + 32 * j, wb + tile_bytes + 32 * j);
        lo[j] = _mm512_and_si512(v, low4);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      if constexpr (five_bit(F)) {
        const __m512i qh = load2(wb + 128, wb + tile_bytes + 128);
        for (int j = 0; j < 4; ++j) {
          lo[j] = _mm512_or_si512(lo[j], spread4(_mm512_srli_epi32(qh, 4 * j)));
          hi[j] = _mm512_or_si512(hi[j], spread4(_mm512_srli_epi32(qh, 16 + 4 * j)));
        }
      }
      const __m512 dhi = sc16.dhi, mv = sc16.m;
      if constexpr (six_bit(F)) {
        const __m512i pl = load2(wb + 128, wb + tile_bytes + 128);
        const __m512i ph = load2(wb + 160, wb + tile_bytes + 160);
        lo[0] = _mm512_or_si512(lo[0], top2<0>(pl));
        lo[1] = _mm512_or_si512(lo[1], top2<1>(pl));
        lo[2] = _mm512_or_si512(lo[2], top2<2>(pl));
        lo[3] = _mm512_or_si512(lo[3], top2<3>(pl));
        hi[0] = _mm512_or_si512(hi[0], top2<0>(ph));
        hi[1] = _mm512_or_si512(hi[1], top2<1>(ph));
        hi[2] = _mm512_or_si512(hi[2], top2<2>(ph));
        hi[3] = _mm512_or_si512(hi[3], top2<3>(ph));
      }
      #pragma GCC unroll 8  // every row its own registers: rolled, acc[] lived on the stack
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = a.q.data() + row * k + b * kBlock;
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          int32_t xl, xh;
          std::memcpy(&xl, xq + 4 * j, 4);
          std::memcpy(&xh, xq + 16 + 4 * j, 4);
          i0 = _mm512_dpbusd_epi32(i0, lo[j], _mm512_set1_epi32(xl));
          i1 = _mm512_dpbusd_epi32(i1, hi[j], _mm512_set1_epi32(xh));
        }
        const int64_t ab = row * blocks + b;
        if constexpr (six_bit(F)) {
          const __m512 dx = _mm512_set1_ps(a.d[ab]);
          const __m512i h0 = _mm512_sub_epi32(i0, _mm512_set1_epi32(32 * a.half[2 * ab]));
          const __m512i h1 = _mm512_sub_epi32(i1, _mm512_set1_epi32(32 * a.half[2 * ab + 1]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h0), _mm512_mul_ps(dwv, dx), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h1), _mm512_mul_ps(dhi, dx), acc[r]);
          continue;
        }
        __m512i isum = _mm512_add_epi32(i0, i1);
        if constexpr (F == Fmt::Q4_0 || F == Fmt::Q5_0) {
          isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(zero_code(F) * a.sum[ab]));
        }
        const __m512 scale = _mm512_mul_ps(dwv, _mm512_set1_ps(a.d[ab]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
        if constexpr (has_offset(F)) {
          acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[ab]), acc[r]);
        }
      }
    }
  }
  float out[kTile * 2];
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out, acc[r]);
    std::memcpy(y + (r0 + r) * n + col, out, valid * sizeof(float));
  }
}
#endif

}  // namespace
