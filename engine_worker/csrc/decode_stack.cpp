// A whole decoder stack's decode rows in one call (issue 21): the layers of model/llama.py for
// one-token rows whose every linear is an integer-dot layer, with nothing between the ops but
// C++. Profiled on the Ice Lake, a batch-1 decode step spent more time in the ~25 Python-level
// torch calls per layer around the matmuls (RMSNorm's pieces, RoPE's chunk/cat/mul, index_copy,
// views, the residual adds) than in the matmuls themselves.
//
// Per layer, the same ops in the same order as the Python layer, so that a row computed here is
// bit for bit the row the Python layers compute (tests/engine_worker/model/test_decode_stack.py):
//
//   h = rms_norm(x, w1)                          rms_norm_rows below (the norms call it too)
//   qkv = int_dot(h) + bias                      kestrel::int_dot_<fmt> through the dispatcher
//   q, k = rope(qkv[:, :H+Hkv])                  x*cos + rot(x)*sin, each product rounded
//   k_cache[slot], v_cache[slot] = k, v        in the cache's dtype (float32, bfloat16, float16,
//                                                or 8-bit codes and scales: kv_cache.py encode)
//   o = paged_decode_attention(q, caches, table, lens)
//   x = x + int_dot_o(o) + bias
//   h = rms_norm(x, w2); g, u = int_dot_gate_up(h) + bias
//   x = x + int_dot_down(silu(g) * u) + bias
//
// The matmul and attention kernels are the libraries built beside this one (int_dot.cpp,
// paged_attention.cpp), reached through torch's dispatcher, so each stays in one place.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using Mm = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
using MmOffset = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t);
using Attn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, int64_t);

// Whether a cache holds 8-bit codes with per-group float16 scales in each row (int8, fp8).
bool scaled(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }
// Scales per head row of size d, and a head row's elements (engine_worker/kv_cache.py).
int64_t scale_groups(int64_t d) { return d % 32 == 0 ? d / 32 : 1; }
int64_t row_width(at::ScalarType t, int64_t d) { return scaled(t) ? d + 2 * scale_groups(d) : d; }

// One head's d values as an 8-bit cache row at dst: each group's codes, its largest magnitude
// over `top` as a float16 scale, the codes x / scale rounded (int8: to nearest even, clamped to
// +-127; fp8: torch's own e4m3 rounding after a clamp to +-448), in the order and the float32
// arithmetic of kv_cache.encode, so both write the same bits.
template <typename Code>
void write_scaled(const float* x, uint8_t* dst, int64_t d, float top) {
  const int64_t ng = scale_groups(d), gs = d / ng;
  for (int64_t g = 0; g < ng; ++g) {
    const float* xs = x + g * gs;
    float amax = 0.f;
    for (int64_t i = 0; i < gs; ++i) amax = std::max(amax, std::fabs(xs[i]));
    const at::Half scale(amax / top);
    const float s = static_cast<float>(scale);
    const float inv = s == 0.f ? 1.f : s;
    for (int64_t i = 0; i < gs; ++i) {
      const float v = std::min(std::max(xs[i] / inv, -top), top);
      if constexpr (std::is_same_v<Code, int8_t>) {
        dst[g * gs + i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(v)));
      } else {
        dst[g * gs + i] = c10::Float8_e4m3fn(v).x;
      }
    }
    std::memcpy(dst + d + 2 * g, &scale.x, 2);
  }
}

// One head's d float32 values into its cache row (element at_elem) in the cache's dtype,
// rounded as torch's own casts do, so the Python layers' kv_cache.write writes the same.
void write_row(const float* src, const at::Tensor& cache, int64_t at_elem, int64_t n) {
  if (scaled(cache.scalar_type())) {  // at_elem counts bytes: one a code
    uint8_t* row = static_cast<uint8_t*>(cache.data_ptr()) + at_elem;
    if (cache.scalar_type() == at::kChar)
      write_scaled<int8_t>(src, row, n, 127.f);
    else
      write_scaled<c10::Float8_e4m3fn>(src, row, n, 448.f);
    return;
  }
  switch (cache.scalar_type()) {
    case at::kFloat:
      std::memcpy(cache.data_ptr<float>() + at_elem, src, n * sizeof(float));
      return;
    case at::kBFloat16: {
      at::BFloat16* dst = cache.data_ptr<at::BFloat16>() + at_elem;
      for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);
      return;
    }
    default: {  // kHalf, checked by the caller
      at::Half* dst = cache.data_ptr<at::Half>() + at_elem;
      for (int64_t i = 0; i < n; ++i) dst[i] = at::Half(src[i]);
      return;
    }
  }
}

c10::OperatorHandle find_op(const std::string& name) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  TORCH_CHECK(op.has_value(), "decode_stack: ", name, " is not registered (load it first)");
  return *op;
}

struct Part {
  at::Tensor qs, d;
  c10::optional<at::Tensor> m, bias;
  int64_t n = 0, k = 0;
  c10::optional<c10::TypedOperatorHandle<Mm>> op;
  c10::optional<c10::TypedOperatorHandle<MmOffset>> op_offset;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = op_offset ? op_offset->call(x, qs, d, *m, n) : op->call(x, qs, d, n);
    return bias ? y + *bias : y;
  }
};

// One matmul, or matrices over one input in different formats (model/gguf_native.py's Parts:
// a file's q|k in Q4_K with v in Q6_K), their outputs side by side.
struct Linear {
  std::vector<Part> parts;
  int64_t n = 0, k = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (parts.size() == 1) return parts[0](x);
    std::vector<at::Tensor> ys;
    for (const Part& p : parts) ys.push_back(p(x));
    return at::cat(ys, -1);
  }
};

struct Layer {
  at::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
};

// RoPE on the first `heads` heads of each row of qkv (B, heads_all, D), written to out
// (B, heads, D): out = x*cos + rot(x)*sin_signed, rot(x) = (x2, x1). Each product is rounded
// on its own and then summed, as the Python path's three tensor ops do: no fused multiply-add.
__attribute__((optimize("fp-contract=off"))) void rope(const float* qkv, int64_t b,
                                                         int64_t heads_all, int64_t heads,
                                                         int64_t d, const float* cos,
                                                         const float* sin, float* out) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < b; ++r) {
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    for (int64_t hh = 0; hh < heads; ++hh) {
      const float* x = qkv + (r * heads_all + hh) * d;
      float* y = out + (r * heads + hh) * d;
      for (int64_t i = 0; i < d; ++i) {
        const float rot = i < half ? x[i + half] : x[i - half];
        const float a = x[i] * c[i];
        const float bb = rot * s[i];
        y[i] = a + bb;
      }
    }
  }
}

// RMSNorm of each row of x (N, C) float32: y = x * (1 / sqrt(mean(x^2) + eps)) * w, the sum of
// squares in double. Called from Python on the Ice Lake at C = 576, one row, torch's CPU
// rms_norm took 33 us (six ops inside) and this 6.6 us, most of it the call itself; a layer has
// two. model/decode_stack.py has the Python layers of a model the stack serves call it too, so
// both paths keep one set of numerics.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t c = w.numel();
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
                  x.size(-1) == c && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "rms_norm_rows: float32 x (..., C) and w (C,) on the CPU");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = c ? xc.numel() / c : 0;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * c;
      float* yr = yp + r * c;
      double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= c; i += 8)
        for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(xr[i + j]) * xr[i + j];
      for (; i < c; ++i) part[0] += static_cast<double>(xr[i]) * xr[i];
      const double ss = ((part[0] + part[1]) + (part[2] + part[3])) +
                        ((part[4] + part[5]) + (part[6] + part[7]));
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / c + eps));
      for (int64_t k = 0; k < c; ++k) yr[k] = xr[k] * inv * wp[k];
    }
  });
  return y;
}

struct DecodeStack : torch::CustomClassHolder {
  int64_t h, hkv, d;
  double eps;
  std::vector<Part> parts;
  std::vector<Linear> pending;
  std::vector<Layer> layers;
  c10::TypedOperatorHandle<Attn> attn;

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double rms_eps)
      : h(heads), hkv(kv_heads), d(head_dim), eps(rms_eps),
        attn(find_op("kestrel::paged_decode_attention").typed<Attn>()) {
    TORCH_CHECK(h > 0 && hkv > 0 && h % hkv == 0 && d > 0 && d % 2 == 0,
                "decode_stack: bad head sizes");
  }

  // One matrix of the linear being added (add_part ... end_linear).
  void add_part(const std::string& fmt, at::Tensor qs, at::Tensor dd,
                c10::optional<at::Tensor> m, int64_t n, int64_t k,
                c10::optional<at::Tensor> bias) {
    Part p;
    p.qs = std::move(qs);
    p.d = std::move(dd);
    p.m = std::move(m);
    p.n = n;
    p.k = k;
    p.bias = std::move(bias);
    auto op = find_op("kestrel::int_dot_" + fmt);
    if (p.m)
      p.op_offset = op.typed<MmOffset>();
    else
      p.op = op.typed<Mm>();
    TORCH_CHECK(parts.empty() || parts[0].k == k, "decode_stack: parts of one linear differ in K");
    parts.push_back(std::move(p));
  }

  void end_linear() {
    TORCH_CHECK(!parts.empty(), "decode_stack: a linear needs at least one part");
    Linear lin;
    lin.k = parts[0].k;
    for (const Part& p : parts) lin.n += p.n;
    lin.parts = std::move(parts);
    parts.clear();
    pending.push_back(std::move(lin));
  }

  // The four linears added last, in the order q|k|v, o, gate|up, down, become one layer.
  void add_layer(at::Tensor norm1, at::Tensor norm2) {
    TORCH_CHECK(pending.size() == 4, "decode_stack: add_layer needs 4 linears, got ",
                pending.size());
    const int64_t c = norm1.numel();
    const Linear &qkv = pending[0], &o = pending[1], &gu = pending[2], &dn = pending[3];
    TORCH_CHECK(norm1.scalar_type() == at::kFloat && norm2.scalar_type() == at::kFloat &&
                    norm2.numel() == c,
                "decode_stack: norms must be float32 of one size");
    TORCH_CHECK(qkv.k == c && qkv.n == (h + 2 * hkv) * d && o.k == h * d && o.n == c &&
                    gu.k == c && gu.n % 2 == 0 && dn.k == gu.n / 2 && dn.n == c,
                "decode_stack: linear shapes do not chain");
    layers.push_back({std::move(norm1), std::move(norm2), pending[0], pending[1], pending[2],
                      pending[3]});
    pending.clear();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // x (B, C) float32, the embedded decode rows; cos, sin (B, D) at their positions; caches per
  // layer (Hkv, slots, W): float32, bfloat16 or float16 (W = D), or 8-bit codes and scales
  // (kv_cache.py: each head's rows in their own run, in slot order);
  // slots (B,), table (B, nblk), lens (B,)
  // int64.
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
                     const at::Tensor& table, const at::Tensor& lens, int64_t block_size) {
    const int64_t b = x.size(0);
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && b >= 1,
                "decode_stack: x must be (B, C) float32");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() &&
                    v_caches.size() == k_caches.size(),
                "decode_stack: one K and one V cache per layer");
    at::Tensor cs = cos.contiguous(), sn = sin.contiguous(), sl = slots.contiguous();
    TORCH_CHECK(cs.scalar_type() == at::kFloat && cs.numel() == b * d && sn.numel() == b * d,
                "decode_stack: cos and sin must be (B, D) float32");
    TORCH_CHECK(sl.scalar_type() == at::kLong && sl.numel() == b, "decode_stack: slots (B,)");
    const int64_t* sp = sl.data_ptr<int64_t>();
    const int64_t all = h + 2 * hkv;
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
      const auto ct = kc.scalar_type();
      TORCH_CHECK((ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf ||
                   scaled(ct)) &&
                      vc.scalar_type() == ct && kc.is_contiguous() && vc.is_contiguous() &&
                      kc.dim() == 3 && kc.size(0) == hkv && kc.size(2) == row_width(ct, d) &&
                      vc.sizes() == kc.sizes(),
                  "decode_stack: caches must be contiguous float32, bfloat16, float16, int8 "
                  "or float8_e4m3fn (Hkv, slots, W)");
      at::Tensor qkv = L.qkv(rms_norm_rows(x, L.norm1, eps)).contiguous();  // (B, all*D)
      at::Tensor qk = at::empty({b, h + hkv, d}, x.options());
      const float* src = qkv.data_ptr<float>();
      rope(src, b, all, h + hkv, d, cs.data_ptr<float>(), sn.data_ptr<float>(),
           qk.data_ptr<float>());
      const int64_t slots_total = kc.size(1), w = kc.size(2);
      for (int64_t r = 0; r < b; ++r) {
        TORCH_CHECK(sp[r] >= 0 && sp[r] < slots_total, "decode_stack: slot ", sp[r],
                    " out of range");
        for (int64_t hh = 0; hh < hkv; ++hh) {
          const int64_t elem = (hh * slots_total + sp[r]) * w;
          write_row(qk.data_ptr<float>() + (r * (h + hkv) + h + hh) * d, kc, elem, d);
          write_row(src + (r * all + h + hkv + hh) * d, vc, elem, d);
        }
      }
      at::Tensor o = attn.call(qk.narrow(1, 0, h), kc, vc, table, lens, block_size);
      x = x + L.o(o.reshape({b, h * d}));
      at::Tensor gu = L.gate_up(rms_norm_rows(x, L.norm2, eps));
      const int64_t inter = gu.size(1) / 2;
      at::Tensor a = at::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
      x = x + L.down(a);
    }
    return x;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(kestrel, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double>())
      .def("add_part", &DecodeStack::add_part)
      .def("end_linear", &DecodeStack::end_linear)
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
  // what kernel_build.load_kernel looks for to know the library is loaded
  m.def("decode_stack_loaded() -> bool", []() { return true; });
  m.def("rms_norm_rows(Tensor x, Tensor w, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(kestrel, CPU, m) {
  m.impl("rms_norm_rows", &rms_norm_rows);
}
