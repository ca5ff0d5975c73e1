// The decoder's small per-token ops on the CPU, one call each instead of eight to ten torch ops
// (a small model's batch-1 decode step is bound by their dispatch): RMSNorm with its residual
// add, and the rotary embedding of queries and keys. References: kernels/rms_norm.py and
// kernels/rope.py (rms_norm_torch, rope_torch).
//
// Every row is computed by one thread in one fixed order, whatever the number of rows or
// threads: the results are batch-invariant. Built with -ffp-contract=off, so that no product
// is fused into a sum: every product and sum rounds as the torch reference's ops do, in float32
// and (each intermediate rounded to bfloat16) in bfloat16; RoPE gives the reference's bits, and
// RMSNorm all but its mean, whose sum of squares runs in another (fixed) order.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);  // bfloat16: round to nearest even, as torch's casts
}

// Rows a thread takes at once: enough work to be worth a thread.
int64_t grain_for(int64_t row_elements) { return std::max<int64_t>(1, 16384 / row_elements); }

// The dot product of two float rows in 16 lanes (i mod 16), then a fixed tree (RMSNorm's sum of
// squares and attention's scores), and acc += p * v; cloned for AVX-512, AVX2 and the baseline (GCC picks one at load
// time). With -ffp-contract=off every clone rounds each product and sum alike: one order, one
// result per machine, whatever the batch.
__attribute__((target_clones("avx512f", "avx2", "default"))) float dot16(const float* a,
                                                                          const float* b,
                                                                          int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) lanes[l] += a[i] * b[i];
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void axpy(float* acc, float p,
                                                                        const float* v,
                                                                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

template <typename T>
void rms_norm_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, const T* w, float eps,
                   T* out, T* summed, int64_t rows, int64_t hidden) {
  at::parallel_for(0, rows, grain_for(hidden), [&](int64_t r0, int64_t r1) {
    std::vector<float> h(hidden);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * ldx;
      for (int64_t i = 0; i < hidden; ++i) {
        if (res != nullptr) {
          const T s = from_f<T>(to_f(xr[i]) + to_f(res[r * ldr + i]));  // rounded, as x + res
          summed[r * hidden + i] = s;
          h[i] = to_f(s);
        } else {
          h[i] = to_f(xr[i]);
        }
      }
      // Sum of squares in dot16's fixed order: one order for every row.
      const float mean = dot16(h.data(), h.data(), hidden) / static_cast<float>(hidden);
      const float scale = 1.0f / std::sqrt(mean + eps);
      T* o = out + r * hidden;
      for (int64_t j = 0; j < hidden; ++j)
        o[j] = from_f<T>(to_f(w[j]) * to_f(from_f<T>(h[j] * scale)));
    }
  });
}

// (out, summed): out = weight * norm(h), h = x + residual (summed = h) or x (summed empty).
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, hidden] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  const bool has_res = residual.has_value();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "residual must be x's shape and dtype with contiguous rows");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor summed = has_res ? at::empty({rows, hidden}, x.options()) : at::Tensor();
  if (rows == 0) return {out, summed};
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
                     AT_DISPATCH_CASE(at::kFloat,
                                      [&] {
                                        rms_norm_rows<float>(
                                            x.data_ptr<float>(), x.stride(0),
                                            has_res ? residual->data_ptr<float>() : nullptr,
                                            has_res ? residual->stride(0) : 0,
                                            weight.data_ptr<float>(), static_cast<float>(eps),
                                            out.data_ptr<float>(),
                                            has_res ? summed.data_ptr<float>() : nullptr, rows,
                                            hidden);
                                      })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           using B = at::BFloat16;
                           rms_norm_rows<B>(x.data_ptr<B>(), x.stride(0),
                                            has_res ? residual->data_ptr<B>() : nullptr,
                                            has_res ? residual->stride(0) : 0, weight.data_ptr<B>(),
                                            static_cast<float>(eps), out.data_ptr<B>(),
                                            has_res ? summed.data_ptr<B>() : nullptr, rows, hidden);
                         }));
  return {out, summed};
}

template <typename T>
void rotate(const T* x, int64_t s0, int64_t s1, const T* cos, const T* sin, int64_t cs,
            T* out, int64_t tokens, int64_t heads, int64_t half) {
  at::parallel_for(0, tokens, grain_for(heads * 2 * half), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * cs;
      const T* s = sin + t * cs;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + t * s0 + h * s1;
        T* o = out + (t * heads + h) * 2 * half;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(xh[i]), x2 = to_f(xh[half + i]);
          const float ci = to_f(c[i]), si = to_f(s[i]);
          // Each product and difference rounded to T, as torch's x1 * cos - x2 * sin.
          const float a = to_f(from_f<T>(x1 * ci)), b = to_f(from_f<T>(x2 * si));
          const float e = to_f(from_f<T>(x2 * ci)), f = to_f(from_f<T>(x1 * si));
          o[i] = from_f<T>(a - b);
          o[half + i] = from_f<T>(e + f);
        }
      }
    }
  });
}

// Rotated copies of x [T, H, D] (heads with contiguous dims) by cos/sin [T, 1, D / 2].
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be [T, H, D] with contiguous heads and an even D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == 1 && t->size(2) == half &&
                    t->stride(2) == 1 && t->scalar_type() == x.scalar_type() &&
                    t->stride(0) == cos.stride(0),
                "cos and sin must be [T, 1, D / 2] of x's dtype with one row stride");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (tokens == 0 || heads == 0) return out;
  if (x.scalar_type() == at::kFloat)
    rotate<float>(x.data_ptr<float>(), x.stride(0), x.stride(1), cos.data_ptr<float>(),
                  sin.data_ptr<float>(), cos.stride(0), out.data_ptr<float>(), tokens, heads,
                  half);
  else
    rotate<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), x.stride(1),
                         cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
                         cos.stride(0), out.data_ptr<at::BFloat16>(), tokens, heads, half);
  return out;
}

// One (sequence, kv head) pair: its `group` query heads over the sequence's keys, each in the
// same order whatever else is in the batch (scores, max, exp, sum and the weighted values in
// position order).
template <typename T>
void decode_pair(const T* q, const T* kc, const T* vc, const int64_t* table, int64_t len,
                 float scale, T* out, int64_t group, int64_t kvh, int64_t g, int64_t d,
                 int64_t bs, std::vector<float>& work) {
  work.assign(group * d * 2 + group * len + d, 0.0f);
  float* qf = work.data();
  float* acc = qf + group * d;
  float* scores = acc + group * d;
  float* row = scores + group * len;
  for (int64_t i = 0; i < group * d; ++i) qf[i] = to_f(q[i]);
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = table[t / bs] * bs + t % bs;
    const T* k = kc + (slot * kvh + g) * d;
    for (int64_t i = 0; i < d; ++i) row[i] = to_f(k[i]);
    for (int64_t h = 0; h < group; ++h) scores[h * len + t] = dot16(qf + h * d, row, d) * scale;
  }
  std::vector<float> total(group, 0.0f);
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores + h * len;
    float top = sc[0];
    for (int64_t t = 1; t < len; ++t) top = std::max(top, sc[t]);
    for (int64_t t = 0; t < len; ++t) {
      sc[t] = std::exp(sc[t] - top);
      total[h] += sc[t];
    }
  }
  for (int64_t t = 0; t < len; ++t) {
    const int64_t slot = table[t / bs] * bs + t % bs;
    const T* v = vc + (slot * kvh + g) * d;
    for (int64_t i = 0; i < d; ++i) row[i] = to_f(v[i]);
    for (int64_t h = 0; h < group; ++h) axpy(acc + h * d, scores[h * len + t], row, d);
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = from_f<T>(acc[h * d + i] / total[h]);
}

template <typename T>
void run_decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const int64_t* tables, int64_t width, const int64_t* lens, double scale,
                at::Tensor& out, int64_t batch, int64_t group, int64_t kvh, int64_t d,
                int64_t bs) {
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, batch * kvh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kvh, g = i % kvh;
      const int64_t at = (b * kvh + g) * group * d;  // q and out rows of this pair's heads
      decode_pair<T>(qp + at, kp, vp, tables + b * width, lens[b], static_cast<float>(scale),
                     op + at, group, kvh, g, d, bs, work);
    }
  });
}

// q [B, H, D] (contiguous), caches [N, block_size, KVH, D] (contiguous), block_tables int64
// [B, max_blocks], seq_lens int64 [B] (each in [1, max_blocks * block_size], block ids in
// [0, N): checked here) -> [B, H, D] in q's dtype; float32 math.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type() && key_cache.size(3) == q.size(2),
              "caches must be contiguous [N, block_size, KVH, D] of q's dtype and head dim");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  TORCH_CHECK(kvh > 0 && heads % kvh == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  block_tables.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == batch && seq_lens.scalar_type() == at::kLong,
              "block_tables must be int64 [B, max_blocks] and seq_lens int64 [B]");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "seq_lens[", b, "] out of range");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * width + j] >= 0 && tp[b * width + j] < blocks, "block id out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t group = heads / kvh;
  AT_DISPATCH_SWITCH(q.scalar_type(), "paged_decode",
                     AT_DISPATCH_CASE(at::kFloat, [&] { run_decode<float>(q, key_cache,
                         value_cache, tp, width, lp, scale, out, batch, group, kvh, d, bs); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { run_decode<at::BFloat16>(q,
                         key_cache, value_cache, tp, width, lp, scale, out, batch, group, kvh, d,
                         bs); }));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional residual add (see rms_norm.py)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, "rotary embedding of one tensor of heads (see rope.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode", &paged_decode, "paged decode attention (see cpu_ops.py)",
        py::call_guard<py::gil_scoped_release>());
}
