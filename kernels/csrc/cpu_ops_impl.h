#pragma once
// The decoder's small per-token ops on the CPU, one call each instead of eight to ten torch ops
// (a small model's batch-1 decode step is bound by their dispatch): RMSNorm with its residual
// add, the rotary embedding of queries and keys, and paged decode attention. Included by
// cpu_ops.cpp (their Python module) and by quant_linear.cpp (its fused decode layer), both
// built with -ffp-contract=off, so the two give the same bits. References: kernels/rms_norm.py and
// kernels/rope.py (rms_norm_torch, rope_torch).
//
// Every row is computed by one thread in one fixed order, whatever the number of rows or
// threads: the results are batch-invariant. Built with -ffp-contract=off, so that no product
// is fused into a sum: every product and sum rounds as the torch reference's ops do, in float32
// and (each intermediate rounded to bfloat16) in bfloat16; RoPE gives the reference's bits, and
// RMSNorm all but its mean, whose sum of squares runs in another (fixed) order.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace cpuops {

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
// squares); cloned for AVX-512, AVX2 and the baseline (GCC picks one at load time). With -ffp-contract=off every clone rounds each product and sum alike: one order, one
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

}  // namespace

// What a model changes in attention (decode_attention.h's header): window 0 is none, softcap
// 0 is none, sinks null is none (else one float logit per query head). Plain data, shared by
// both instruction-set builds.
struct Mods {
  int64_t window = 0;
  float softcap = 0.0f;
  const float* sinks = nullptr;
};

// The first position a query row of length len attends to.
static inline int64_t first_key(int64_t len, const Mods& mods) {
  return mods.window > 0 ? std::max<int64_t>(0, len - mods.window) : 0;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "v16_avx2.h"
static inline V16 load16(const float* p) { return vload(p); }
static inline V16 load16(const at::BFloat16* p) {  // exact: bfloat16 is float's top half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16);
  const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16);
  return {_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
}
// Lanes l + 8, then + 4, + 2, + 1 (dot16's tree).
static inline float sum8_tree(__m256 s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
static inline __m256 halves_sum(V16 v) { return _mm256_add_ps(v.a, v.b); }
static inline float sum_tree(V16 v) { return sum8_tree(halves_sum(v)); }
// Query heads that share each key or value row load (decode_attention.h): 16 ymm registers
// hold one head's eight scores' accumulators; more would spill.
constexpr int kScoreHeads = 1, kValueHeads = 2;
#include "decode_attention.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace avx512 {
#include "v16_avx512.h"
static inline V16 load16(const float* p) { return vload(p); }
static inline V16 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
static inline __m256 halves_sum(V16 v) {  // lanes l + 8
  const __m256 lo = _mm512_castps512_ps256(v.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.v), 1));
  return _mm256_add_ps(lo, hi);
}
static inline float sum_tree(V16 v) { return avx2::sum8_tree(halves_sum(v)); }
// 32 zmm registers: three heads' eight scores (24 accumulators), four heads' values (16).
constexpr int kScoreHeads = 3, kValueHeads = 4;
#include "decode_attention.h"
}  // namespace avx512
#pragma GCC pop_options

namespace {

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 0) return avx2;
  if (isa == 1)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  return false;
}

// q [*, H, D] float32/bfloat16 and caches [N, block_size, KVH, D] of its dtype, contiguous.
// The checks paged_decode and paged_prefill share: the instruction set, q a contiguous
// [rows, H, D] (``q_shape`` names it) of float32 or bfloat16, the caches, the head layout.
void check_attention_inputs(const at::Tensor& q, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, int64_t isa, const char* q_shape) {
  TORCH_CHECK(isa_supported(isa), "instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous ", q_shape);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "q must be float32 or bfloat16");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == q.scalar_type() &&
                  value_cache.scalar_type() == q.scalar_type() && key_cache.size(3) == q.size(2),
              "caches must be contiguous [N, block_size, KVH, D] of q's dtype and head dim");
  const int64_t kvh = key_cache.size(2);
  TORCH_CHECK(kvh > 0 && q.size(1) % kvh == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) % 16 == 0, "the head dim must be a multiple of 16, got ", q.size(2));
}

// The Mods of a call: window (0: none, else >= 1), softcap (0: none, else > 0) and sinks
// (none, or float32 [heads] contiguous), checked here; `sinks` must outlive the Mods.
Mods checked_mods(int64_t window, double softcap, const c10::optional<at::Tensor>& sinks,
                  int64_t heads) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive, got ", window);
  TORCH_CHECK(softcap >= 0.0, "softcap must be 0 (none) or positive, got ", softcap);
  Mods mods;
  mods.window = window;
  mods.softcap = static_cast<float>(softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                    sinks->size(0) == heads && sinks->is_contiguous(),
                "sinks must be a contiguous float32 [heads] tensor");
    mods.sinks = sinks->data_ptr<float>();
  }
  return mods;
}

// fn(q, key cache, value cache, out) with the typed data pointers of q's dtype.
template <typename F>
void with_typed(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out,
                F fn) {
  if (q.scalar_type() == at::kFloat)
    fn(q.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>());
  else
    fn(q.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
       out.data_ptr<at::BFloat16>());
}

// q [B, H, D] (contiguous), caches [N, block_size, KVH, D] (contiguous), block_tables int64
// [B, max_blocks], seq_lens int64 [B] (each in [1, max_blocks * block_size], the block ids
// the window reads in [0, N): checked here) -> [B, H, D] in q's dtype; float32 math. window,
// softcap, sinks: decode_attention.h's Mods.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t isa,
                        int64_t window = 0, double softcap = 0.0,
                        const c10::optional<at::Tensor>& sinks = c10::nullopt) {
  check_attention_inputs(q, key_cache, value_cache, isa, "[B, H, D]");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch &&
                  block_tables.scalar_type() == at::kLong && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == batch && seq_lens.scalar_type() == at::kLong,
              "block_tables must be int64 [B, max_blocks] and seq_lens int64 [B]");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const Mods mods = checked_mods(window, softcap, sinks, heads);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * bs, "seq_lens[", b, "] out of range");
    for (int64_t j = first_key(lp[b], mods) / bs; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * width + j] >= 0 && tp[b * width + j] < blocks, "block id out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  const int64_t group = heads / kvh;
  const float sc = static_cast<float>(scale);
  with_typed(q, key_cache, value_cache, out, [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    if (isa == 1)
      avx512::run_decode<T>(qp, kp, vp, tp, width, lp, sc, op, batch, group, kvh, d, bs, mods);
    else
      avx2::run_decode<T>(qp, kp, vp, tp, width, lp, sc, op, batch, group, kvh, d, bs, mods);
  });
  return out;
}


// Prefill/mixed tokens: q [T, H, D] (contiguous), caches as paged_decode's, block_tables int64
// [B, max_blocks], token_seqs int64 [T] (each token's row of the tables, in [0, B)),
// token_lens int64 [T] (the positions each attends to, in [1, capacity]; checked here) ->
// [T, H, D] in q's dtype; each token's rows the bits a decode step of that length gives
// (with the same window, softcap and sinks).
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& token_seqs, const at::Tensor& token_lens,
                         double scale, int64_t isa, int64_t window = 0, double softcap = 0.0,
                         const c10::optional<at::Tensor>& sinks = c10::nullopt) {
  check_attention_inputs(q, key_cache, value_cache, isa, "[T, H, D]");
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  token_seqs.dim() == 1 && token_seqs.size(0) == tokens &&
                  token_seqs.scalar_type() == at::kLong && token_lens.dim() == 1 &&
                  token_lens.size(0) == tokens && token_lens.scalar_type() == at::kLong,
              "block_tables must be int64 [B, max_blocks], token_seqs and token_lens int64 [T]");
  const at::Tensor tables = block_tables.contiguous(), seqs = token_seqs.contiguous(),
                   lens = token_lens.contiguous();
  const int64_t batch = tables.size(0), width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const Mods mods = checked_mods(window, softcap, sinks, heads);
  for (int64_t i = 0; i < tokens; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < batch, "token_seqs[", i, "] out of range");
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * bs, "token_lens[", i, "] out of range");
    for (int64_t j = first_key(lp[i], mods) / bs; j < (lp[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[sp[i] * width + j] >= 0 && tp[sp[i] * width + j] < blocks,
                  "block id out of range");
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (tokens == 0) return out;
  const int64_t group = heads / kvh;
  const float sc = static_cast<float>(scale);
  with_typed(q, key_cache, value_cache, out, [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    if (isa == 1)
      avx512::run_prefill<T>(qp, kp, vp, tp, width, sp, lp, sc, op, tokens, group, kvh, d, bs,
                             mods);
    else
      avx2::run_prefill<T>(qp, kp, vp, tp, width, sp, lp, sc, op, tokens, group, kvh, d, bs, mods);
  });
  return out;
}

}  // namespace

// The XOR of a contiguous uint8 tensor's 8-byte words (its last numel % 8 bytes left out), each
// thread over one contiguous share: a pure streaming read with next to no arithmetic, so that
// its rate is the memory's (bench/compute/memory_bandwidth.py; torch's reductions are bound by
// their arithmetic here: a float32 sum read at half the rate this loop does).
int64_t read_words(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.is_contiguous(),
              "read_words takes a contiguous uint8 CPU tensor");
  const auto* p = reinterpret_cast<const uint64_t*>(t.data_ptr<uint8_t>());
  const int64_t n = t.numel() / 8;
  const int threads = at::get_num_threads();
  std::vector<uint64_t> part(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t lo = n * i / threads, hi = n * (i + 1) / threads;
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t w = lo;
      for (; w + 4 <= hi; w += 4) {
        a0 ^= p[w];
        a1 ^= p[w + 1];
        a2 ^= p[w + 2];
        a3 ^= p[w + 3];
      }
      for (; w < hi; ++w) a0 ^= p[w];
      part[i] = a0 ^ a1 ^ a2 ^ a3;
    }
  });
  uint64_t acc = 0;
  for (uint64_t v : part) acc ^= v;
  return static_cast<int64_t>(acc);
}

}  // namespace cpuops
