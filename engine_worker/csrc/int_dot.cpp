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
//   taken by torch's threads as they come free: parallel_chunks), for each chunk of up to 4
//   activation rows, for each block: one integer dot of the block's 32 codes with each of the
//   tile's 8 rows (int32, exact), then in float32
//   acc[i] = fma(float(isum_i), dw_i * dx, acc[i])   (+ fma(m_i, dx * sum(q), acc[i]) for Q4_1).
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

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
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
constexpr int kChunk = 4;          // activation rows that share one pass over a tile's weights
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
  // about 8 chunks a thread: few enough that the shared counter costs nothing
  const int64_t chunk = std::max<int64_t>(min_chunk, n / (threads * 8));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t lo = next.fetch_add(chunk); lo < n; lo = next.fetch_add(chunk))
      body(lo, std::min(n, lo + chunk));
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
