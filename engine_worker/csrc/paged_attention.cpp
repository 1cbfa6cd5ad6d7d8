// Decode attention that reads K and V straight from the paged KV cache (issue 10).
//
// Data flow, for each (sequence b, KV head h) as one task of at::parallel_for:
//   q rows of the G = H / Hkv query heads of KV head h (scaled by 1/sqrt(D), as float32)
//   -> pass 1: walk the sequence's block table; each K row (one slot) is read once and scored
//      against all G query rows: scores (G, T) in float32
//   -> softmax per query row (max, exp, sum; float32)
//   -> pass 2: walk the table again; each V row is read once and added into the G float32
//      accumulators weighted by its G probabilities
//   -> out[b, h*G + g, :] = acc / sum, cast to the query's dtype
// No copy of the context is made: a K or V row is read where it sits, slot = block * bs + offset.
//
// Layouts (checked in `paged_decode_attention`): q (B, H, D) with unit last stride; k_cache and
// v_cache (Hkv, slots, W) contiguous (engine_worker/kv_cache.py): each head's rows in their own
// run, so a task (one head) reads its context as one stream where the blocks are consecutive.
// (With a slot's heads side by side, (slots, Hkv, D), a task read every other 256 bytes and
// decode attention ran at a third of the read bandwidth; with each block's heads side by side
// the 4 KB runs left the prefetcher cold at each one: 1.5B shapes, 8,192 tokens, 2-vCPU Zen 4,
// ~36 and ~29 ms against ~22 ms here.) A block out of sequence is prefetched one block ahead.
// block_table (B, nblk) int64; context_lens (B,) int64, each in [0, nblk * bs]. A sequence of
// length 0 (a padded row) gets zeros, never NaN.
// q and out are float32 or bfloat16; the cache float32, bfloat16 or float16, its own dtype read
// in place (a 16-bit cache is half the bytes a decode step reads of the context; issue 53): a
// 16-bit row is widened to float32 once per row into a block buffer (a shift for bfloat16,
// vcvtph2ps for float16), the arithmetic is float32 throughout (exp by a polynomial, ~1 ulp).
// Where the build has AVX512-BF16, a bfloat16 cache is not widened: vdpbf16ps takes K rows as
// stored against the query split into two bfloat16 halves, and V rows paired two by two against
// the softmax's numerators rounded to bfloat16 (bf16_task; attention_math.h): 1.5B shapes at
// 8,192 tokens on a 2-vCPU Zen 4, 20.7 -> 12.5 ms a step, its error under half the cache's own.
// An 8-bit cache (int8 or fp8 e4m3) has rows of D + 2 * groups bytes: D codes, then a float16
// scale per group of 32 along D (one group when D is not a multiple of 32;
// engine_worker/kv_cache.py writes them); a row is widened into the buffer as code * scale.
// The inner loops run over D: for D = 64 or 128 on vector-extension values as wide as the host's
// registers (vw), otherwise as `omp simd` loops, so that -O3 -march=native vectorises them:
// AVX512 where the host has it, AVX2 elsewhere. Work is tiled by KV block: a block's rows come
// from memory once and serve the G query rows from L1, and each output accumulator stays in
// registers across a block.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_math.h"

namespace {

// The element types: float, bfloat16 and float16 as distinct types (both 16-bit ones are two
// bytes; the tag says how to widen them).
struct bf16 {
  uint16_t bits;
};
struct f16 {
  _Float16 v;
};
struct q8 {  // an int8 cache's code
  int8_t v;
};
struct e4m3 {  // an fp8 cache's code: sign, 4 exponent bits (bias 7), 3 mantissa bits
  uint8_t bits;
};

// Whether a cache element type is an 8-bit code whose row carries its scales.
template <typename C>
constexpr bool kScaled = false;
template <>
constexpr bool kScaled<q8> = true;
template <>
constexpr bool kScaled<e4m3> = true;

// Scales per row of head size d (kv_cache.py scale_groups), and a row's elements.
inline int64_t scale_groups(int64_t d) { return d % 32 == 0 ? d / 32 : 1; }
template <typename C>
inline int64_t row_width(int64_t d) {
  return kScaled<C> ? d + 2 * scale_groups(d) : d;
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
inline float widen(f16 x) { return static_cast<float>(x.v); }
inline float widen(q8 x) { return static_cast<float>(x.v); }
// e4m3 -> float32, exactly and without branches: the code's exponent and mantissa bits placed at
// float32's (exponent field e, so 2^(e-127) * 1.m), then times 2^120 to move the bias from 127 to
// 7; a subnormal code (e = 0) lands as a float32 subnormal and scales the same way. No NaN is
// ever written (kv_cache.py clamps to +-448).
inline float widen(e4m3 x) {
  const uint32_t u = x.bits;
  const uint32_t bits = ((u & 0x80u) << 24) | ((u & 0x7fu) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f * 0x1p120f;
}

inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, bf16* out) {  // round to nearest even, as c10::BFloat16 does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) {
    out->bits = 0x7fc0;
    return;
  }
  bits += 0x7fff + ((bits >> 16) & 1);
  out->bits = static_cast<uint16_t>(bits >> 16);
}
inline void narrow(float x, f16* out) { out->v = static_cast<_Float16>(x); }

// One block's first n rows of one head as float32 rows: a float32 cache is read in place (rows
// `row` apart), a 16-bit one widened into buf once per row (rows d apart). *stride says which.
inline const float* block_f32(const float* src, int64_t, int64_t, int64_t row, float*,
                              int64_t* stride) {
  *stride = row;
  return src;
}
template <typename T>
inline const float* block_f32(const T* src, int64_t n, int64_t d, int64_t row, float* buf,
                              int64_t* stride) {
  if constexpr (kScaled<T>) {  // codes times their group's float16 scale
    const int64_t ng = scale_groups(d), gs = d / ng;
    for (int64_t r = 0; r < n; ++r) {
      const T* codes = src + r * row;
      const char* scales = reinterpret_cast<const char*>(codes + d);
      for (int64_t g = 0; g < ng; ++g) {
        _Float16 half;
        std::memcpy(&half, scales + 2 * g, sizeof(half));
        const float s = static_cast<float>(half);
        float* dst = buf + r * d + g * gs;
        const T* c = codes + g * gs;
#pragma omp simd
        for (int64_t i = 0; i < gs; ++i) dst[i] = widen(c[i]) * s;
      }
    }
  } else {
    for (int64_t r = 0; r < n; ++r)
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buf[r * d + i] = widen(src[r * row + i]);
  }
  *stride = d;
  return buf;
}

template <typename T>
inline void load_row(const T* src, float* dst, float s, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = widen(src[i]) * s;
}

template <typename T>
inline void store_row(T* dst, const float* src, float s, int64_t d) {
  for (int64_t i = 0; i < d; ++i) narrow(src[i] * s, dst + i);
}


// One block's rows of one head (`bytes` contiguous) toward the caches ahead of their use: the
// hardware prefetcher follows a head's run of consecutive blocks, not a jump to another block.
inline void prefetch_rows(const void* src, int64_t bytes) {
  const char* p = static_cast<const char*>(src);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 0);
}


// Each of a sequence's blocks of one head in turn, f(rows, n, t): rows the block's first row of
// that head (rows `width` elements apart), n its rows within the context, t the position of its
// first. A block that does not follow the one before it in memory is prefetched a block ahead:
// the hardware prefetcher follows a head's run of consecutive blocks, not a jump.
template <typename C, typename F>
inline void walk_blocks(const C* head, const int64_t* tbl, int64_t t_len, int64_t bs,
                        int64_t width, F f) {
  for (int64_t j = 0, t = 0; t < t_len; ++j, t += bs) {
    if (t + bs < t_len && tbl[j + 1] != tbl[j] + 1)
      prefetch_rows(head + tbl[j + 1] * bs * width, bs * width * sizeof(C));
    f(head + tbl[j] * bs * width, std::min(bs, t_len - t), t);
  }
}

#if defined(KESTREL_BF16_DOT)
// One thread's buffers for bf16_task, reused across its tasks: the query rows as hi and lo
// halves, the numerators as bfloat16, a block's V rows paired, the sums in paired order.
struct Bf16Scratch {
  std::vector<bh> q, p, pairs;
  std::vector<float> paired;
  Bf16Scratch(int64_t G, int64_t D, int64_t bs)
      : q(2 * G * D), pairs((bs + 1) * D), paired(G * D) {}
};

// One (sequence, KV head) task over a bfloat16 cache with vdpbf16ps: k and v point at the head's
// run of slots; scores (G * t_len), acc (G * D) and sums (G) are filled as decode_kernel's
// float32 passes fill them, acc in value order.
template <int DC>
void bf16_task(const float* qf, const bh* k, const bh* v, const int64_t* tbl, int64_t t_len,
               int64_t G, int64_t bs, int64_t width, float* scores, float* acc, float* sums,
               Bf16Scratch& s) {
  // each query row as its bfloat16 rounding, then the rounding of what that left (hi, lo)
  for (int64_t g = 0; g < G; ++g) {
    bh* hi = &s.q[2 * g * DC];
    round_bf16(qf + g * DC, hi, DC);
    float rest[DC];
    for (int64_t i = 0; i < DC; ++i) rest[i] = qf[g * DC + i] - widen(bf16{hi[i]});
    round_bf16(rest, hi + DC, DC);
  }
  walk_blocks(k, tbl, t_len, bs, width, [&](const bh* kb, int64_t n, int64_t t) {
    for (int64_t g = 0; g < G; ++g)
      scores_block_bh<DC>(&s.q[2 * g * DC], kb, n, width, &scores[g * t_len + t]);
  });
  s.p.resize(G * t_len);
  for (int64_t g = 0; g < G; ++g) {
    sums[g] = softmax_numerators(&scores[g * t_len], t_len);
    round_bf16(&scores[g * t_len], &s.p[g * t_len], t_len);
  }
  std::fill(s.paired.begin(), s.paired.end(), 0.f);
  walk_blocks(v, tbl, t_len, bs, width, [&](const bh* vb, int64_t n, int64_t t) {
    pair_rows<DC>(vb, n, width, s.pairs.data());
    for (int64_t g = 0; g < G; ++g)
      axpy_block_bh<DC>(&s.paired[g * DC], &s.p[g * t_len + t], s.pairs.data(), n);
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < DC; ++e) acc[g * DC + paired_index(e)] = s.paired[g * DC + e];
}
#endif

template <typename T, typename C, int DC>
void decode_kernel(const T* q, int64_t q_sb, int64_t q_sh, const C* kc, const C* vc,
                   const int64_t* table, const int64_t* lens, T* out, int64_t B, int64_t H,
                   int64_t Hkv, int64_t D, int64_t nblk, int64_t bs, int64_t nslots) {
  const int64_t G = H / Hkv;
  const int64_t width = row_width<C>(D);  // one head's elements in a slot
  const int64_t head_rows = nslots * width;  // one head's whole run of slots
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), buf(bs * D), scores, sums(G);
#if defined(KESTREL_BF16_DOT)
    Bf16Scratch scratch(G, D, bs);
#endif
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t t_len = lens[b];
      T* o = out + (b * H + h * G) * D;
      if (t_len <= 0) {  // a padded row: zeros, so nothing downstream sees NaN
        std::memset(static_cast<void*>(o), 0, sizeof(T) * G * D);
        continue;
      }
      for (int64_t g = 0; g < G; ++g)
        load_row(q + b * q_sb + (h * G + g) * q_sh, &qf[g * D], scale, D);
      scores.resize(G * t_len);
      const int64_t* tbl = table + b * nblk;
      int64_t stride;
#if defined(KESTREL_BF16_DOT)
      if constexpr (std::is_same_v<C, bf16> && DC > 0 && DC % 32 == 0) {
        bf16_task<DC>(qf.data(), reinterpret_cast<const bh*>(kc + h * head_rows),
                      reinterpret_cast<const bh*>(vc + h * head_rows), tbl, t_len, G, bs,
                      width, scores.data(), acc.data(), sums.data(), scratch);
        for (int64_t g = 0; g < G; ++g) store_row(o + g * D, &acc[g * D], 1.f / sums[g], D);
        continue;
      }
#endif
      // pass 1: scores[g, t] = q_g . k_t; a block's K rows are read from memory once, then
      // serve the G query rows from L1
      walk_blocks(kc + h * head_rows, tbl, t_len, bs, width, [&](const C* rows, int64_t n,
                                                                    int64_t t) {
        const float* kb = block_f32(rows, n, D, width, buf.data(), &stride);
        for (int64_t g = 0; g < G; ++g)
          scores_block<DC>(&qf[g * D], kb, n, stride, D, &scores[g * t_len + t]);
      });
      for (int64_t g = 0; g < G; ++g) sums[g] = softmax_numerators(&scores[g * t_len], t_len);
      // pass 2: acc[g] = sum_t p[g, t] v_t; V read once per block, as K was
      std::fill(acc.begin(), acc.end(), 0.f);
      walk_blocks(vc + h * head_rows, tbl, t_len, bs, width, [&](const C* rows, int64_t n,
                                                                    int64_t t) {
        const float* vb = block_f32(rows, n, D, width, buf.data(), &stride);
        for (int64_t g = 0; g < G; ++g)
          axpy_block<DC>(&acc[g * D], &scores[g * t_len + t], vb, n, stride, D);
      });
      for (int64_t g = 0; g < G; ++g) store_row(o + g * D, &acc[g * D], 1.f / sums[g], D);
    }
  });
}

template <typename T, typename C>
void dispatch(const T* q, int64_t q_sb, int64_t q_sh, const C* kc, const C* vc,
              const int64_t* table, const int64_t* lens, T* out, int64_t B, int64_t H,
              int64_t Hkv, int64_t D, int64_t nblk, int64_t bs, int64_t nslots) {
  if (D == 64)
    decode_kernel<T, C, 64>(q, q_sb, q_sh, kc, vc, table, lens, out, B, H, Hkv, D, nblk, bs, nslots);
  else if (D == 128)
    decode_kernel<T, C, 128>(q, q_sb, q_sh, kc, vc, table, lens, out, B, H, Hkv, D, nblk, bs, nslots);
  else
    decode_kernel<T, C, 0>(q, q_sb, q_sh, kc, vc, table, lens, out, B, H, Hkv, D, nblk, bs, nslots);
}

template <typename T>
const T* as(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

// The cache's element type, under q's (T).
template <typename T>
void dispatch_cache(const T* q, int64_t q_sb, int64_t q_sh, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const int64_t* table, const int64_t* lens, T* out,
                    int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t nblk, int64_t bs, int64_t nslots) {
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      return dispatch<T, float>(q, q_sb, q_sh, as<float>(k_cache), as<float>(v_cache), table,
                                lens, out, B, H, Hkv, D, nblk, bs, nslots);
    case at::kBFloat16:
      return dispatch<T, bf16>(q, q_sb, q_sh, as<bf16>(k_cache), as<bf16>(v_cache), table,
                               lens, out, B, H, Hkv, D, nblk, bs, nslots);
    case at::kChar:
      return dispatch<T, q8>(q, q_sb, q_sh, as<q8>(k_cache), as<q8>(v_cache), table, lens, out,
                             B, H, Hkv, D, nblk, bs, nslots);
    case at::kFloat8_e4m3fn:
      return dispatch<T, e4m3>(q, q_sb, q_sh, as<e4m3>(k_cache), as<e4m3>(v_cache), table, lens,
                               out, B, H, Hkv, D, nblk, bs, nslots);
    default:  // kHalf, checked by the caller
      return dispatch<T, f16>(q, q_sb, q_sh, as<f16>(k_cache), as<f16>(v_cache), table, lens,
                              out, B, H, Hkv, D, nblk, bs, nslots);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, int64_t block_size) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q (B, H, D), k_cache and v_cache (Hkv, slots, W)");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q: float32 or bfloat16 only");
  const auto cache_type = k_cache.scalar_type();
  const bool scaled = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16 ||
                  cache_type == at::kHalf || scaled,
              "the cache: float32, bfloat16, float16, int8 or float8_e4m3fn only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens are int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = k_cache.size(0), slots = k_cache.size(1);
  const int64_t width = scaled ? D + 2 * scale_groups(D) : D;
  TORCH_CHECK((!scaled || D % 2 == 0) && k_cache.size(2) == width && Hkv > 0 && H % Hkv == 0,
              "head sizes do not match");
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, "bad block_size");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B, "block_table is (B, nblk)");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B, "context_lens is (B,)");
  at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  at::Tensor tbl = block_table.contiguous(), lens = context_lens.contiguous();
  const int64_t nblk = tbl.size(1), num_blocks = slots / block_size;
  // The kernel trusts these: a bad id or length would read outside the cache.
  const int64_t* tp = tbl.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] <= nblk * block_size, "context length ", lp[b], " exceeds the table");
    for (int64_t j = 0; j * block_size < lp[b]; ++j)
      TORCH_CHECK(tp[b * nblk + j] >= 0 && tp[b * nblk + j] < num_blocks, "block id ",
                  tp[b * nblk + j], " out of range");
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_cache<float>(qc.data_ptr<float>(), qc.stride(0), qc.stride(1), k_cache, v_cache, tp,
                          lp, out.data_ptr<float>(), B, H, Hkv, D, nblk, block_size, slots);
  } else {
    dispatch_cache<bf16>(as<bf16>(qc), qc.stride(0), qc.stride(1), k_cache, v_cache, tp, lp,
                         reinterpret_cast<bf16*>(out.data_ptr()), B, H, Hkv, D, nblk,
                         block_size, slots);
  }
  return out;
}

// Whether this build reads a bfloat16 cache by vdpbf16ps (bf16_task) or widens it to float32.
bool paged_attention_bf16_dot() {
#if defined(KESTREL_BF16_DOT)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor context_lens, int block_size) -> Tensor");
  m.def("paged_attention_bf16_dot() -> bool", &paged_attention_bf16_dot);  // catch-all
}

TORCH_LIBRARY_IMPL(kestrel, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
