// The weight formats of the integer-dot kernel (csrc/int_dot.cpp): the host's instruction set,
// the packed layouts, and how a block's scales and codes are unpacked for a tile of 8 rows.
//
// Packed layouts (made once at load by engine_worker/int_dot.py from the GGUF bytes; N padded to
// a multiple of 8 with zero rows; T = ceil(N/8) tiles, B = K/32 blocks):
//   Q4_0 / Q4_1: qs uint8 (T, B, 128): 4 vectors of 32 bytes per (tile, block); in vector j,
//     bytes 4i..4i+3 are bytes 4j..4j+3 of row i's GGUF nibbles, so the low nibbles are its
//     elements 4j..4j+3 and the high nibbles elements 16+4j..16+4j+3.
//     d float16 (T, B, 8) (and for Q4_1 m float16 (T, B, 8)); w = d*(q-8) (Q4_0), d*q + m (Q4_1).
//   Q8_0: qs int8 (T, B, 256): 8 vectors of 32 bytes; in vector j, bytes 4i..4i+3 are row i's
//     codes 4j..4j+3. d float16 (T, B, 8), the GGUF's own scales; w = d*q.
//   Q8_1: as Q8_0 plus m float16 (T, B, 8); w = d*q + m (codes 0..31).
//   Q5_0: qs uint8 (T, B, 160): Q4_0's 128 bytes of nibbles, then 8 little-endian 32-bit words,
//     row i's fifth bits (bit e: element e); w = d*(q-16), q = nibble | bit << 4 in 0..31.
//   Q8_16: as Q8_0 with d float16 (T, B, 16): lanes 0..7 scale inputs 0..15 of rows 0..7,
//     lanes 8..15 inputs 16..31; the integer dot is taken per half block (vectors 0-3, 4-7).
//   Q6_16: Q6_K's 6-bit codes in 7 bits a weight (Q8_16 takes 9): qs uint8 (T, B, 192): Q4_x's
//     128 bytes of low nibbles, then two vectors of the codes' top two bits: in the first, byte
//     4i+c holds in bits 2j..2j+1 those of row i's element 4j+c (j = 0..3), in the second those
//     of element 16+4j+c, so a shift and a mask put them beside the nibbles of vector j. d as
//     Q8_16's; w = d*(q-32), q in 0..63, applied per half block as isum - 32 * sum(codes).
//   Q4_K: qs as Q4_1's; d float16 (T, B/8, 16): lanes 0..7 the 8 rows' super-block scale d,
//     8..15 their dmin; m uint8 (T, B, 12): byte i holds row i's 6-bit block scale (low 4 bits)
//     and min (high 4), then a little-endian word whose bits 4i..4i+3 hold row i's top two
//     bits of each (scale, then min). w = (d*sc)*q - (dmin*min): 4.5 bits a weight, the file's.
//   Q5_K: qs as Q5_0's (nibbles, then each row's 32 fifth bits a block); d and m as Q4_K's;
//     w = (d*sc)*q - (dmin*min), q in 0..31: 5.5 bits a weight, the file's.
//   Q6_K: qs as Q6_16's; d float16 (T, B/8, 8), the rows' super-block scale; m int8 (T, B, 16):
//     lanes 0..7 the rows' scales of inputs 0..15, 8..15 of inputs 16..31; w = (d*sc)*(q-32):
//     6.5625 bits a weight, the file's. For both, d*sc (and dmin*min) are exact in float32 (11
//     significant bits times 6 or 8), so they are multiplied out per block (scales8) and then
//     take Q4_1's (Q6_16's) float steps. With many rows a tile's unpacked scales are kept for
//     the group's later chunks of rows (`kept`).
// Rows are taken in groups of 64: each group meets every tile while its codes stay in cache.
// So one 32-bit lane of a vector holds 4 consecutive inputs of one output row: a dot of 4 bytes
// per lane (maddubs+madd, or dpbusd) against the activation's 4 matching codes broadcast to all
// lanes leaves lane i holding row i's partial sum, with no horizontal reduction.
//
// Integer products (unsigned * signed bytes, as the instructions take them):
//   Q4_x: nibble q in 0..15 (unsigned) * activation code in -127..127; Q4_0's -8 is applied once
//     per block as isum - 8 * sum(activation codes). AVX2 sums the 8 maddubs results of a block
//     in int16 (at most 8 * 2 * 15 * 127 = 30480 < 32767) before one madd.
//   Q8_0: signed * signed with the sign trick: |w| (unsigned) * (x with w's sign).
// Integer sums are exact and the float steps are the same in every path and for every row count,
// so AVX512-VNNI, AVX-VNNI, AVX2 and scalar builds give the same bits, and a row's result does not
// depend on the other rows of the batch.
//
// ISA: chosen at compile time; engine_worker/kernel_build.py builds per host with -march=native
// (or capped by KESTREL_CPU_ISA), so this is the host's run-time choice. int_dot_isa() says which.
//
// Included by int_dot.cpp and its kernels' headers (engine_worker/kernel_build.py hashes
// csrc/*.h with each kernel's source, so an edit here rebuilds it).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KESTREL_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KESTREL_VNNI 1
#define KESTREL_DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#if defined(__AVX512BW__)
#define KESTREL_ZMM 1  // two tiles (16 output rows) per 512-bit vector: tile2_chunk
#endif
constexpr const char* kIsa = "avx512vnni";
#elif defined(__AVXVNNI__)
#define KESTREL_VNNI 1
#define KESTREL_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
constexpr const char* kIsa = "avxvnni";
#else
constexpr const char* kIsa = "avx2";
#endif
#else
constexpr const char* kIsa = "scalar";
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;      // output rows interleaved per block
constexpr int64_t kRowGroup = 64;  // activation rows whose codes stay in cache across tiles
// activation rows that share one pass over a tile's weights: 5, so a draft round's k = 4 drafts
// and the row before them are verified in one pass (with 4 they took 4 + 1 passes: on an AMD
// EPYC Zen 4 under the AVX2 caps, bench_int_dot_stream.py's 1.5B Q4_K layers at 5 rows took
// 35.2-36.3 ms against 38.4-38.8, 64 rows no slower; 16 ymm registers still hold a chunk)
constexpr int kChunk = 5;
// the same for a pair of tiles in 512-bit vectors, whose 32 registers hold 8 rows' sums
constexpr int kChunk2 = 8;
constexpr int64_t kAhead = 2;      // prefetch distance in work items (tiles, or pairs of tiles)

enum class Fmt { Q4_0, Q4_1, Q8_0, Q8_1, Q8_16, Q5_0, Q6_16, Q4_K, Q5_K, Q6_K };

constexpr int64_t kSuper = 8;  // blocks of 32 per K-quant super-block (256 inputs)

constexpr bool is_q8(Fmt f) { return f == Fmt::Q8_0 || f == Fmt::Q8_1 || f == Fmt::Q8_16; }
// the K-quants as stored: fp16 scales per super-block (d), small integer scales per block (m)
constexpr bool is_k(Fmt f) { return f == Fmt::Q4_K || f == Fmt::Q5_K || f == Fmt::Q6_K; }
// Q4_K's and Q5_K's scales: 6-bit scale and min per block under fp16 d and dmin
constexpr bool k4_scaled(Fmt f) { return f == Fmt::Q4_K || f == Fmt::Q5_K; }
// a fifth bit per code beside the nibbles (Q5_0's layout: a 32-bit word a row and block)
constexpr bool five_bit(Fmt f) { return f == Fmt::Q5_0 || f == Fmt::Q5_K; }
// w = d*q + m: the offset taken through the activations' code sums
constexpr bool has_offset(Fmt f) { return f == Fmt::Q4_1 || f == Fmt::Q8_1 || k4_scaled(f); }
constexpr bool six_bit(Fmt f) { return f == Fmt::Q6_16 || f == Fmt::Q6_K; }
constexpr int64_t packed_bytes(Fmt f) {
  return is_q8(f) ? 256 : five_bit(f) ? 160 : six_bit(f) ? 192 : 128;
}
// one scale per half block (16 inputs): the integer dot is kept per half
constexpr bool per_half(Fmt f) { return f == Fmt::Q8_16 || six_bit(f); }
// fp16 scales per (tile, block): one per row, or one per row and half block; the K-quants' per
// super-block (d and dmin of 8 rows for Q4_K: 16 per 8 blocks; d of 8 rows for Q6_K: 8)
constexpr int64_t scales_per(Fmt f) {
  return k4_scaled(f) ? 2 : f == Fmt::Q6_K ? 1 : per_half(f) ? 2 * kTile : kTile;
}
// bytes of the third tensor (m) per (tile, block): fp16 offsets of 8 rows (Q4_1, Q8_1); Q4_K's
// 6-bit scales and mins of 8 rows in 12 bytes; Q6_K's int8 scales of 8 rows' two halves
constexpr int64_t m_bytes(Fmt f) {
  return k4_scaled(f) ? 12 : f == Fmt::Q6_K ? 2 * kTile : has_offset(f) ? 2 * kTile : 0;
}
constexpr bool has_m(Fmt f) { return m_bytes(f) > 0; }
constexpr const char* fmt_name(Fmt f) {
  return f == Fmt::Q4_0   ? "q4_0"
         : f == Fmt::Q4_1 ? "q4_1"
         : f == Fmt::Q8_0 ? "q8_0"
         : f == Fmt::Q8_1 ? "q8_1"
         : f == Fmt::Q5_0 ? "q5_0"
         : f == Fmt::Q6_16 ? "q6_16"
         : f == Fmt::Q4_K ? "q4_k"
         : f == Fmt::Q5_K ? "q5_k"
         : f == Fmt::Q6_K ? "q6_k"
                          : "q8_16";
}

// The weights' scales stay fp16 as in the GGUF (fewer bytes to stream at one row); the
// conversion to float32 is exact, so the paths still agree to the bit.
inline float h2f(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The code the unsigned nibble codes are offset by: w = d * (q - zero_code).
constexpr int32_t zero_code(Fmt f) { return f == Fmt::Q5_0 ? 16 : six_bit(f) ? 32 : 8; }

#if defined(KESTREL_SIMD)
inline __m256 load8h(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Bits 0..3 of each 32-bit lane -> bit 4 of its bytes 0..3 (Q5_0's fifth bits beside the
// nibbles): the multiply copies the 4 bits 7 apart, the mask keeps one per byte.
inline __m256i spread4(__m256i x) {
  const __m256i bits = _mm256_and_si256(
      _mm256_mullo_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xF)),
                         _mm256_set1_epi32(0x00204081)),
      _mm256_set1_epi32(0x01010101));
  return _mm256_slli_epi32(bits, 4);
}

// Q6_16: the top two bits of vector j's codes, from their plane, at bits 4..5 of each byte.
template <int J>
inline __m256i top2(__m256i plane) {
  const __m256i at = J == 0 ? _mm256_slli_epi16(plane, 4)
                     : J == 1 ? _mm256_slli_epi16(plane, 2)
                     : J == 2 ? plane
                              : _mm256_srli_epi16(plane, 2);
  return _mm256_and_si256(at, _mm256_set1_epi8(0x30));
}

// A block's float scales for one tile's 8 rows: d (for the per-half formats the first half's),
// the second half's d, and the offset m of w = d*q + m. The K-quants' are made here from their
// super-block's fp16 scale times the block's small integer scale: both exact in float32 (11
// significant bits times 6 or 8), so every path multiplies the same floats. Q4_K's offset is
// -(dmin * min), negated exactly.
struct Scales8 {
  __m256 d, dhi, m;
};

template <Fmt F>
[[gnu::always_inline]] inline Scales8 scales8(const uint16_t* dw, const uint8_t* mw, int64_t b) {
  constexpr int64_t sp = scales_per(F);
  Scales8 s{_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  if constexpr (k4_scaled(F)) {
    const uint8_t* mb = mw + b * m_bytes(F);
    // bytes 0..7: row i's scale (low 4 bits) and min (high 4); the word after: row i's top two
    // bits of each at bits 4i..4i+1 (scale) and 4i+2..4i+3 (min)
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mb)));
    uint32_t word;
    std::memcpy(&word, mb + kTile, 4);
    const __m256i top = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(word)),
                                          _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xF)),
                                       _mm256_slli_epi32(_mm256_and_si256(top, three), 4));
    const __m256i mn = _mm256_or_si256(
        _mm256_srli_epi32(v, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(top, 2),
                                                                    three), 4));
    const uint16_t* ds = dw + (b / kSuper) * 2 * kTile;
    s.d = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), load8h(ds));
    s.m = _mm256_xor_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mn), load8h(ds + kTile)),
                        _mm256_set1_ps(-0.f));
  } else if constexpr (F == Fmt::Q6_K) {
    const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + b * m_bytes(F)));
    const __m256 sup = load8h(dw + (b / kSuper) * kTile);
    s.d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sb)), sup);
    s.dhi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sb, sb))),
                          sup);
  } else {
    s.d = load8h(dw + b * sp);
    if constexpr (per_half(F)) s.dhi = load8h(dw + b * sp + kTile);
    if constexpr (has_offset(F)) s.m = load8h(reinterpret_cast<const uint16_t*>(mw) + b * kTile);
  }
  return s;
}
#endif

// The same scales for row i of a tile, in the scalar build: the same float products.
template <Fmt F>
inline void scales1(const uint16_t* dw, const uint8_t* mw, int64_t b, int i, float& d,
                    float& dhi, float& m) {
  constexpr int64_t sp = scales_per(F);
  dhi = m = 0.f;
  if constexpr (k4_scaled(F)) {
    const uint8_t* mb = mw + b * m_bytes(F);
    uint32_t word;
    std::memcpy(&word, mb + kTile, 4);
    const uint32_t top = (word >> (4 * i)) & 0xF;
    const int32_t sc = (mb[i] & 0xF) | ((top & 3) << 4), mn = (mb[i] >> 4) | ((top >> 2) << 4);
    const uint16_t* ds = dw + (b / kSuper) * 2 * kTile;
    d = static_cast<float>(sc) * h2f(ds[i]);
    m = -(static_cast<float>(mn) * h2f(ds[kTile + i]));
  } else if constexpr (F == Fmt::Q6_K) {
    const int8_t* sb = reinterpret_cast<const int8_t*>(mw + b * m_bytes(F));
    const float sup = h2f(dw[(b / kSuper) * kTile + i]);
    d = static_cast<float>(sb[i]) * sup;
    dhi = static_cast<float>(sb[kTile + i]) * sup;
  } else {
    d = h2f(dw[b * sp + i]);
    if constexpr (per_half(F)) dhi = h2f(dw[b * sp + kTile + i]);
    if constexpr (has_offset(F)) m = h2f(reinterpret_cast<const uint16_t*>(mw)[b * kTile + i]);
  }
}

// Software prefetch of block b of `count` tiles starting `ahead` tiles after this one (weights
// and scales), issued by the first pass over a tile. The hardware's prefetchers alone follow the
// six streams of a pair of tiles (two of codes, two of scales, two of offsets) too late: with
// this, the 1.5B's layers at one row went from 32 to 36 GB/s and at 16 rows from 73.5 to 56.8 ms
// (Zen 5, 2 threads). Scales are fetched a cache line (32 of them) at a time. The codes go to L2
// (locality 2), not L1: the 512-bit path runs 4 tiles ahead, up to 48 KB a thread, more than a
// Zen 4's 32 KB L1D holds beside the blocks in use; on an AMD EPYC Zen 4 (2 threads, the 1.5B
// Qwen's layers, bench_int_dot_stream.py) one row took 24.0-28.1 ms for q4_k and 32.6-37.9 for
// q6_k with L2 against 30.4 and 43.1 with L1, and 16 rows 84-97 against 89 (q4_k).
// (always inlined: a call would make the caller spill its vector registers every block)
template <Fmt F>
[[gnu::always_inline]] inline void prefetch_block(const uint8_t* qs, const uint16_t* dw,
                                                  const uint8_t* mw, int64_t blocks, int64_t b,
                                                  int64_t ahead, int count) {
  constexpr int64_t pb = packed_bytes(F), sp = scales_per(F), mb = m_bytes(F);
  for (int i = 0; i < count; ++i) {
    const int64_t tile = ahead + i;
    const uint8_t* wb = qs + tile * blocks * pb + b * pb;
    for (int64_t off = 0; off < pb; off += 64) __builtin_prefetch(wb + off, 0, 2);
    if ((b * sp) % 32 == 0) __builtin_prefetch(dw + tile * blocks * sp + b * sp, 0, 3);
    if (mw != nullptr && (b * mb) % 64 < mb) {
      __builtin_prefetch(mw + tile * blocks * mb + b * mb, 0, 3);
    }
  }
}

}  // namespace
