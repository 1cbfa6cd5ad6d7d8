// The integer-dot kernel's inner loop in 256-bit vectors (AVX2, AVX-VNNI, AVX512-VNNI's
// 256-bit form) and in scalar code: one tile of 8 output rows against a chunk of activation rows.
// csrc/int_dot_tile2.h does two tiles at once in 512-bit vectors; int_dot.cpp chooses.

#pragma once

#include "int_dot_act.h"
#include "int_dot_formats.h"

namespace {

// One tile (8 output rows) against R activation rows: writes y[r, col .. col+valid).
// qs: the tile's packed bytes (B * packed_bytes); dw, mw: the tile's (B, 8) scales / offsets.
template <Fmt F, int R>
void tile_chunk(const uint8_t* qs, const uint16_t* dw, const uint8_t* mw, int64_t blocks,
                const QAct& a, int64_t r0, int64_t k, float* y, int64_t n, int64_t col,
                int64_t valid, int64_t ahead, float* kept = nullptr, bool keep = false) {
  constexpr int64_t pb = packed_bytes(F);
  float out[R][kTile];
#if defined(KESTREL_SIMD)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#if !defined(KESTREL_VNNI)
  const __m256i ones16 = _mm256_set1_epi16(1);
#endif
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = qs + b * pb;
    if (ahead > 0) prefetch_block<F>(qs, dw, mw, blocks, b, ahead, 1);
    Scales8 sc8;
    if (kept == nullptr || keep) {
      sc8 = scales8<F>(dw, mw, b);
      if (kept != nullptr) {
        _mm256_storeu_ps(kept + 24 * b, sc8.d);
        _mm256_storeu_ps(kept + 24 * b + 8, sc8.dhi);
        _mm256_storeu_ps(kept + 24 * b + 16, sc8.m);
      }
    } else {
      sc8 = {_mm256_loadu_ps(kept + 24 * b), _mm256_loadu_ps(kept + 24 * b + 8),
             _mm256_loadu_ps(kept + 24 * b + 16)};
    }
    const __m256 dwv = sc8.d;
    if constexpr (is_q8(F)) {
      __m256i wabs[8], w[8];
      for (int j = 0; j < 8; ++j) {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
        wabs[j] = _mm256_abs_epi8(w[j]);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r, ab = row * blocks + b;
        const int8_t* xq = a.q.data() + row * k + b * kBlock;
        // half[h]: the integer dot over inputs 16h..16h+15 (vectors 4h..4h+3)
        __m256i half[2];
        for (int h = 0; h < 2; ++h) {
          __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
          for (int j = 4 * h; j < 4 * h + 4; j += 2) {
            int32_t x0, x1;
            std::memcpy(&x0, xq + 4 * j, 4);
            std::memcpy(&x1, xq + 4 * j + 4, 4);
            const __m256i s0 = _mm256_sign_epi8(_mm256_set1_epi32(x0), w[j]);
            const __m256i s1 = _mm256_sign_epi8(_mm256_set1_epi32(x1), w[j + 1]);
#if defined(KESTREL_VNNI)
            i0 = KESTREL_DPBUSD(i0, wabs[j], s0);
            i1 = KESTREL_DPBUSD(i1, wabs[j + 1], s1);
#else
            i0 = _mm256_add_epi32(i0,
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j], s0), ones16));
            i1 = _mm256_add_epi32(
                i1, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[j + 1], s1), ones16));
#endif
          }
          half[h] = _mm256_add_epi32(i0, i1);
        }
        const __m256 dx = _mm256_set1_ps(a.d[ab]);
        if constexpr (F == Fmt::Q8_16) {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half[0]), _mm256_mul_ps(dwv, dx), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half[1]), _mm256_mul_ps(sc8.dhi, dx),
                                   acc[r]);
        } else {
          const __m256i isum = _mm256_add_epi32(half[0], half[1]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dwv, dx), acc[r]);
        }
        if constexpr (F == Fmt::Q8_1) {
          acc[r] = _mm256_fmadd_ps(sc8.m, _mm256_set1_ps(a.s[ab]), acc[r]);
        }
      }
    } else {
      __m256i lo[4], hi[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
        lo[j] = _mm256_and_si256(v, low4);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      if constexpr (five_bit(F)) {  // lane i: row i's 32 fifth bits
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128));
        for (int j = 0; j < 4; ++j) {
          lo[j] = _mm256_or_si256(lo[j], spread4(_mm256_srli_epi32(qh, 4 * j)));
          hi[j] = _mm256_or_si256(hi[j], spread4(_mm256_srli_epi32(qh, 16 + 4 * j)));
        }
      }
      if constexpr (six_bit(F)) {  // the top two bits beside the nibbles: codes 0..63
        const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128));
        const __m256i ph = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 160));
        lo[0] = _mm256_or_si256(lo[0], top2<0>(pl));
        lo[1] = _mm256_or_si256(lo[1], top2<1>(pl));
        lo[2] = _mm256_or_si256(lo[2], top2<2>(pl));
        lo[3] = _mm256_or_si256(lo[3], top2<3>(pl));
        hi[0] = _mm256_or_si256(hi[0], top2<0>(ph));
        hi[1] = _mm256_or_si256(hi[1], top2<1>(ph));
        hi[2] = _mm256_or_si256(hi[2], top2<2>(ph));
        hi[3] = _mm256_or_si256(hi[3], top2<3>(ph));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* xq = a.q.data() + row * k + b * kBlock;
#if defined(KESTREL_VNNI)
        __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          int32_t xl, xh;
          std::memcpy(&xl, xq + 4 * j, 4);
          std::memcpy(&xh, xq + 16 + 4 * j, 4);
          i0 = KESTREL_DPBUSD(i0, lo[j], _mm256_set1_epi32(xl));
          i1 = KESTREL_DPBUSD(i1, hi[j], _mm256_set1_epi32(xh));
        }
        __m256i isum = _mm256_add_epi32(i0, i1);
#else
        __m256i isum, i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
        if constexpr (six_bit(F)) {  // per half; two pairs of 6-bit products fit int16
          __m256i p[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i* v = h == 0 ? lo : hi;
            __m256i s32 = _mm256_setzero_si256();
            for (int j = 0; j < 4; j += 2) {
              int32_t x0, x1;
              std::memcpy(&x0, xq + 16 * h + 4 * j, 4);
              std::memcpy(&x1, xq + 16 * h + 4 * j + 4, 4);
              const __m256i p16 = _mm256_add_epi16(
                  _mm256_maddubs_epi16(v[j], _mm256_set1_epi32(x0)),
                  _mm256_maddubs_epi16(v[j + 1], _mm256_set1_epi32(x1)));
              s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(p16, ones16));
            }
            p[h] = s32;
          }
          i0 = p[0];
          i1 = p[1];
          isum = _mm256_setzero_si256();
        } else if constexpr (five_bit(F)) {  // 5-bit codes: a pair's sum fits int16, eight do not
          isum = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            int32_t xl, xh;
            std::memcpy(&xl, xq + 4 * j, 4);
            std::memcpy(&xh, xq + 16 + 4 * j, 4);
            const __m256i pl = _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(xl));
            const __m256i ph = _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(xh));
            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_add_epi16(pl, ph), ones16));
          }
        } else {
          __m256i p16 = _mm256_setzero_si256();
          for (int j = 0; j < 4; ++j) {
            int32_t xl, xh;
            std::memcpy(&xl, xq + 4 * j, 4);
            std::memcpy(&xh, xq + 16 + 4 * j, 4);
            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(xl)));
            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(xh)));
          }
          isum = _mm256_madd_epi16(p16, ones16);
        }
#endif
        const int64_t ab = row * blocks + b;
        if constexpr (six_bit(F)) {  // as Q8_16's float steps: the same bits
          const __m256 dx = _mm256_set1_ps(a.d[ab]);
          const __m256i h0 = _mm256_sub_epi32(i0, _mm256_set1_epi32(32 * a.half[2 * ab]));
          const __m256i h1 = _mm256_sub_epi32(i1, _mm256_set1_epi32(32 * a.half[2 * ab + 1]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h0), _mm256_mul_ps(dwv, dx), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h1), _mm256_mul_ps(sc8.dhi, dx), acc[r]);
          continue;
        }
        if constexpr (F == Fmt::Q4_0 || F == Fmt::Q5_0) {
          isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(zero_code(F) * a.sum[ab]));
        }
        const __m256 scale = _mm256_mul_ps(dwv, _mm256_set1_ps(a.d[ab]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
        if constexpr (has_offset(F)) {
          acc[r] = _mm256_fmadd_ps(sc8.m, _mm256_set1_ps(a.s[ab]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out[r], acc[r]);
#else
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < kTile; ++i) out[r][i] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = qs + b * pb;
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r, ab = row * blocks + b;
      const int8_t* xq = a.q.data() + row * k + b * kBlock;
      for (int i = 0; i < kTile; ++i) {
        float dwi, dhi, mi;
        scales1<F>(dw, mw, b, i, dwi, dhi, mi);
        int32_t isum = 0;
        if constexpr (is_q8(F)) {
          int32_t half[2] = {0, 0};
          for (int j = 0; j < 8; ++j)
            for (int c = 0; c < 4; ++c)
              half[j / 4] += static_cast<int32_t>(static_cast<int8_t>(wb[32 * j + 4 * i + c])) *
                             xq[4 * j + c];
          if constexpr (F == Fmt::Q8_16) {
            out[r][i] = std::fma(static_cast<float>(half[0]), dwi * a.d[ab], out[r][i]);
            out[r][i] = std::fma(static_cast<float>(half[1]), dhi * a.d[ab], out[r][i]);
            continue;
          }
          isum = half[0] + half[1];
        } else if constexpr (six_bit(F)) {
          int32_t half[2] = {0, 0};
          for (int j = 0; j < 4; ++j)
            for (int c = 0; c < 4; ++c) {
              const uint8_t v = wb[32 * j + 4 * i + c];
              const int32_t top_lo = (wb[128 + 4 * i + c] >> (2 * j)) & 3;
              const int32_t top_hi = (wb[160 + 4 * i + c] >> (2 * j)) & 3;
              half[0] += ((v & 0x0F) | (top_lo << 4)) * xq[4 * j + c];
              half[1] += ((v >> 4) | (top_hi << 4)) * xq[16 + 4 * j + c];
            }
          half[0] -= 32 * a.half[2 * ab];
          half[1] -= 32 * a.half[2 * ab + 1];
          out[r][i] = std::fma(static_cast<float>(half[0]), dwi * a.d[ab], out[r][i]);
          out[r][i] = std::fma(static_cast<float>(half[1]), dhi * a.d[ab], out[r][i]);
          continue;
        } else {
          uint32_t qh = 0;
          if constexpr (five_bit(F)) std::memcpy(&qh, wb + 128 + 4 * i, 4);
          for (int j = 0; j < 4; ++j)
            for (int c = 0; c < 4; ++c) {
              const uint8_t v = wb[32 * j + 4 * i + c];
              const int32_t ql = (v & 0x0F) | (((qh >> (4 * j + c)) & 1) << 4);
              const int32_t qhi = (v >> 4) | (((qh >> (16 + 4 * j + c)) & 1) << 4);
              isum += ql * xq[4 * j + c] + qhi * xq[16 + 4 * j + c];
            }
          if constexpr (F == Fmt::Q4_0 || F == Fmt::Q5_0) isum -= zero_code(F) * a.sum[ab];
        }
        out[r][i] = std::fma(static_cast<float>(isum), dwi * a.d[ab], out[r][i]);
        if constexpr (has_offset(F)) out[r][i] = std::fma(mi, a.s[ab], out[r][i]);
      }
    }
  }
#endif
  for (int r = 0; r < R; ++r) std::memcpy(y + (r0 + r) * n + col, out[r], valid * sizeof(float));
}

}  // namespace
