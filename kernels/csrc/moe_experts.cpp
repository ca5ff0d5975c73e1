// A mixture-of-experts layer's experts in one call (see kernels/moe_experts.py): the (token,
// choice) pairs sorted by expert, each expert's gate | up GEMM with the SwiGLU (plain, or
// gpt-oss's clamped one with biases) over all of its rows, its down GEMM, then each token's
// weighted sum over its k choices. Work items are (expert, tile of output columns), shared out
// by at::parallel_for; each reads its tile of the expert's weights once for all of the
// expert's rows. Every output element is one dot product in one fixed order
// (moe_experts_body.h): a token's result never depends on the other tokens, on how many chose
// the same expert, or on the thread count (batch-invariant by construction).
//
// Instruction sets, picked by the caller: 0 AVX2 + FMA, 1 AVX-512 F/BW/VL (the same bits as
// AVX2: 16 float lanes either way), 2 AVX-512 BF16 (`vdpbf16ps` on bfloat16 rows and
// weights; its pairwise products round otherwise, so its bits differ from 0 and 1). Built with
// -ffp-contract=off, so that the scalar SwiGLU and the weighted sum round every operation as
// the torch reference's ops do.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kIsaAvx2 = 0, kIsaAvx512 = 1, kIsaAvx512Bf16 = 2;
constexpr int64_t kTileF = 16;  // ff columns of a gate | up work item (32 weight rows)
constexpr int64_t kTileH = 32;  // hidden columns of a down work item

// One layer's problem: sorted slots, weights (rows padded with zeros to kp_h / kp_f
// elements, a multiple of 32) and the SwiGLU's form.
struct Job {
  int64_t k, experts, hidden, ff, kp_h, kp_f;
  const int64_t* start;  // [experts + 1]: expert e's sorted slots are [start[e], start[e+1])
  const int64_t* token;  // [T * k]: the token of each sorted slot
  const void* gate_up;   // [experts, 2 * ff, kp_h], gate rows then up rows
  const void* down;      // [experts, hidden, kp_f]
  const float* gate_up_bias;  // [experts, 2 * ff] or null
  const float* down_bias;     // [experts, hidden] or null
  bool clamped;               // gpt-oss's SwiGLU
  float alpha, limit;
  bool round_bf16;  // the activation rounds to bfloat16 (bfloat16 weights)
};

// The 16 lanes' sum in one fixed tree (lane l + l + 8, then + 4, + 2, + 1).
inline float tree16(float* l) {
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) l[i] += l[i + width];
  return l[0];
}

inline float swiglu(const Job& j, float g, float u) {
  if (!j.clamped) return g / (1.0f + std::exp(-g)) * u;
  g = std::min(g, j.limit);
  u = std::max(std::min(u, j.limit), -j.limit);
  return (u + 1.0f) * (g * (1.0f / (1.0f + std::exp(-(g * j.alpha)))));
}

template <typename A>
inline A to_operand(float v, bool round_bf16) {
  if constexpr (std::is_same_v<A, float>)
    return round_bf16 ? static_cast<float>(static_cast<at::BFloat16>(v)) : v;
  else
    return static_cast<A>(v);
}

using Item = std::pair<int64_t, int64_t>;  // (expert, first column)

std::vector<Item> work_items(const Job& j, int64_t columns, int64_t tile) {
  std::vector<Item> items;
  for (int64_t e = 0; e < j.experts; ++e)
    if (j.start[e + 1] > j.start[e])
      for (int64_t c = 0; c < columns; c += tile) items.emplace_back(e, c);
  return items;
}

// act[slot] = swiglu(x[token] @ gate^T, x[token] @ up^T) for every expert's slots.
template <typename A, typename W, typename Dots>
void gate_up_phase(const Job& j, const A* xa, A* act, Dots dots) {
  const std::vector<Item> items = work_items(j, j.ff, kTileF);
  const W* gu = static_cast<const W*>(j.gate_up);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<const A*> rows;
    std::vector<const W*> wrows(2 * kTileF);
    std::vector<float> out;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [e, c0] = items[i];
      const int64_t tn = std::min(kTileF, j.ff - c0), s0 = j.start[e], m = j.start[e + 1] - s0;
      rows.resize(m);
      for (int64_t r = 0; r < m; ++r) rows[r] = xa + j.token[s0 + r] * j.kp_h;
      for (int64_t c = 0; c < tn; ++c) {
        wrows[c] = gu + (e * 2 * j.ff + c0 + c) * j.kp_h;
        wrows[tn + c] = gu + (e * 2 * j.ff + j.ff + c0 + c) * j.kp_h;
      }
      out.resize(m * 2 * tn);
      dots(rows.data(), m, wrows.data(), 2 * tn, j.kp_h, out.data(), 2 * tn);
      const float* b = j.gate_up_bias == nullptr ? nullptr : j.gate_up_bias + e * 2 * j.ff + c0;
      for (int64_t r = 0; r < m; ++r) {
        A* dst = act + (s0 + r) * j.kp_f + c0;
        for (int64_t c = 0; c < tn; ++c) {
          float g = out[r * 2 * tn + c], u = out[r * 2 * tn + tn + c];
          if (b != nullptr) {
            g += b[c];
            u += b[j.ff + c];
          }
          dst[c] = to_operand<A>(swiglu(j, g, u), j.round_bf16);
        }
      }
    }
  });
}

// y[slot] = act[slot] @ down^T (+ bias), float32, for every expert's slots.
template <typename A, typename W, typename Dots>
void down_phase(const Job& j, const A* act, float* y, Dots dots) {
  const std::vector<Item> items = work_items(j, j.hidden, kTileH);
  const W* dn = static_cast<const W*>(j.down);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<const A*> rows;
    std::vector<const W*> wrows(kTileH);
    std::vector<float> out;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [e, h0] = items[i];
      const int64_t th = std::min(kTileH, j.hidden - h0), s0 = j.start[e];
      const int64_t m = j.start[e + 1] - s0;
      rows.resize(m);
      for (int64_t r = 0; r < m; ++r) rows[r] = act + (s0 + r) * j.kp_f;
      for (int64_t h = 0; h < th; ++h) wrows[h] = dn + (e * j.hidden + h0 + h) * j.kp_f;
      out.resize(m * th);
      dots(rows.data(), m, wrows.data(), th, j.kp_f, out.data(), th);
      const float* b = j.down_bias == nullptr ? nullptr : j.down_bias + e * j.hidden + h0;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t h = 0; h < th; ++h)
          y[(s0 + r) * j.hidden + h0 + h] = out[r * th + h] + (b == nullptr ? 0.0f : b[h]);
    }
  });
}

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "v16_avx2.h"
using A = float;
using Acc = V16;
using Operand = V16;
constexpr int64_t kStep = 16;
constexpr int kR = 2, kN = 2;  // 4 accumulators: 8 of the 16 ymm registers
static inline V16 acc_zero() { return vzero(); }
static inline V16 aload(const float* p) { return vload(p); }
static inline V16 wload(const float* p) { return vload(p); }
static inline V16 wload(const at::BFloat16* p) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
static inline V16 dot_step(V16 acc, V16 a, V16 w) { return vfma(a, w, acc); }
static inline float reduce16(V16 v) {
  float l[16];
  vstore(l, v);
  return tree16(l);
}
#include "moe_experts_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace avx512 {
#include "v16_avx512.h"
using A = float;
using Acc = V16;
using Operand = V16;
constexpr int64_t kStep = 16;
constexpr int kR = 4, kN = 4;
static inline V16 acc_zero() { return vzero(); }
static inline V16 aload(const float* p) { return vload(p); }
static inline V16 wload(const float* p) { return vload(p); }
static inline V16 wload(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
static inline V16 dot_step(V16 acc, V16 a, V16 w) { return vfma(a, w, acc); }
static inline float reduce16(V16 v) {
  float l[16];
  vstore(l, v);
  return tree16(l);
}
#include "moe_experts_body.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
namespace avx512bf16 {
using A = at::BFloat16;
using Acc = __m512;
using Operand = __m512bh;
constexpr int64_t kStep = 32;
constexpr int kR = 4, kN = 4;
static inline __m512 acc_zero() { return _mm512_setzero_ps(); }
static inline __m512bh aload(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
static inline __m512bh wload(const at::BFloat16* p) { return aload(p); }
static inline __m512 dot_step(__m512 acc, __m512bh a, __m512bh w) {
  return _mm512_dpbf16_ps(acc, a, w);
}
static inline float reduce16(__m512 v) {
  float l[16];
  _mm512_storeu_ps(l, v);
  return tree16(l);
}
#include "moe_experts_body.h"
}  // namespace avx512bf16
#pragma GCC pop_options

namespace {

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == kIsaAvx2) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (isa == kIsaAvx512) return avx512;
  if (isa == kIsaAvx512Bf16) return avx512 && __builtin_cpu_supports("avx512bf16");
  return false;
}

// out[t] = sum_j weights[t, j] * y[slot of (t, j)], in the order j = 0..k-1, rounded to T.
template <typename T>
void combine(const Job& j, int64_t tokens, const float* y, const int64_t* slot_of,
             const float* weights, T* out) {
  const int64_t h = j.hidden, k = j.k;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / h), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < h; ++i) {
        float total = y[slot_of[t * k] * h + i] * weights[t * k];
        for (int64_t c = 1; c < k; ++c) total = total + y[slot_of[t * k + c] * h + i] * weights[t * k + c];
        out[t * h + i] = static_cast<T>(total);
      }
  });
}

// The (token, choice) pairs sorted by expert, stably: start [E + 1], token and slot_of [T * k].
void sort_pairs(const int64_t* experts, int64_t pairs, int64_t k, int64_t num_experts,
                std::vector<int64_t>& start, std::vector<int64_t>& token,
                std::vector<int64_t>& slot_of) {
  start.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(experts[p] >= 0 && experts[p] < num_experts, "expert id out of range");
    ++start[experts[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  token.resize(pairs);
  slot_of.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t s = next[experts[p]]++;
    token[s] = p / k;
    slot_of[p] = s;
  }
}

// x's rows in the operand type, zero-padded to kp elements.
at::Tensor padded_rows(const at::Tensor& x, int64_t kp, at::ScalarType type) {
  at::Tensor rows = at::zeros({x.size(0), kp}, x.options().dtype(type));
  rows.narrow(1, 0, x.size(1)).copy_(x);
  return rows;
}

template <typename W>
void run(const Job& j, const at::Tensor& x, int64_t isa, at::Tensor& y) {
  const int64_t pairs = y.size(0);
  if (isa == kIsaAvx512Bf16 && std::is_same_v<W, at::BFloat16>) {
    using B = at::BFloat16;
    const at::Tensor xa = padded_rows(x, j.kp_h, at::kBFloat16);
    at::Tensor act = at::zeros({pairs, j.kp_f}, x.options().dtype(at::kBFloat16));
    avx512bf16::run_experts<B>(j, xa.data_ptr<B>(), act.data_ptr<B>(), y.data_ptr<float>());
    return;
  }
  const at::Tensor xa = padded_rows(x, j.kp_h, at::kFloat);
  at::Tensor act = at::zeros({pairs, j.kp_f}, x.options().dtype(at::kFloat));
  if (isa >= kIsaAvx512)
    avx512::run_experts<W>(j, xa.data_ptr<float>(), act.data_ptr<float>(), y.data_ptr<float>());
  else
    avx2::run_experts<W>(j, xa.data_ptr<float>(), act.data_ptr<float>(), y.data_ptr<float>());
}

void check_args(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                const at::Tensor& gate_up, const at::Tensor& down, int64_t ff) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) && experts.is_contiguous() &&
                  experts.scalar_type() == at::kLong,
              "experts must be a contiguous int64 [T, k]");
  TORCH_CHECK(weights.sizes() == experts.sizes() && weights.is_contiguous() &&
                  weights.scalar_type() == at::kFloat,
              "weights must be a contiguous float32 [T, k]");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == x.scalar_type() && gate_up.size(1) == 2 * ff &&
                  gate_up.size(2) % 32 == 0 && gate_up.size(2) >= x.size(1),
              "gate_up must be a contiguous [E, 2 * ff, kp_h] of x's dtype, kp_h >= hidden "
              "a multiple of 32");
  TORCH_CHECK(down.dim() == 3 && down.is_contiguous() && down.scalar_type() == x.scalar_type() &&
                  down.size(0) == gate_up.size(0) && down.size(1) == x.size(1) &&
                  down.size(2) % 32 == 0 && down.size(2) >= ff,
              "down must be a contiguous [E, hidden, kp_f] of x's dtype, kp_f >= ff a "
              "multiple of 32");
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, int64_t experts, int64_t n) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == experts && bias->size(1) == n &&
                  bias->is_contiguous() && bias->scalar_type() == at::kFloat,
              "a bias must be a contiguous float32 [E, n]");
  return bias->data_ptr<float>();
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& experts, const at::Tensor& weights,
                       const at::Tensor& gate_up, const at::Tensor& down,
                       const c10::optional<at::Tensor>& gate_up_bias,
                       const c10::optional<at::Tensor>& down_bias, int64_t ff, bool clamped,
                       double alpha, double limit, int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "instruction set ", isa, " is not supported by this CPU");
  check_args(x, experts, weights, gate_up, down, ff);
  const int64_t tokens = x.size(0), k = experts.size(1), num_experts = gate_up.size(0);
  std::vector<int64_t> start, token, slot_of;
  sort_pairs(experts.data_ptr<int64_t>(), tokens * k, k, num_experts, start, token, slot_of);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Job j{k,
              num_experts,
              x.size(1),
              ff,
              gate_up.size(2),
              down.size(2),
              start.data(),
              token.data(),
              gate_up.data_ptr(),
              down.data_ptr(),
              bias_ptr(gate_up_bias, num_experts, 2 * ff),
              bias_ptr(down_bias, num_experts, x.size(1)),
              clamped,
              static_cast<float>(alpha),
              static_cast<float>(limit),
              bf16};
  at::Tensor y = at::empty({tokens * k, x.size(1)}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty_like(x);
  if (tokens == 0) return out;
  if (bf16) {
    run<at::BFloat16>(j, x, isa, y);
    combine(j, tokens, y.data_ptr<float>(), slot_of.data(), weights.data_ptr<float>(),
            out.data_ptr<at::BFloat16>());
  } else {
    run<float>(j, x, isa, y);
    combine(j, tokens, y.data_ptr<float>(), slot_of.data(), weights.data_ptr<float>(),
            out.data_ptr<float>());
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "one MoE layer's experts and their weighted sum (see "
        "kernels/moe_experts.py)", py::arg("x"), py::arg("experts"), py::arg("weights"),
        py::arg("gate_up"), py::arg("down"), py::arg("gate_up_bias"), py::arg("down_bias"),
        py::arg("ff"), py::arg("clamped"), py::arg("alpha"), py::arg("limit"), py::arg("isa"),
        py::call_guard<py::gil_scoped_release>());
  m.def("isa_supported", &isa_supported, "whether this CPU runs instruction set code (0: AVX2 "
        "and FMA, 1: AVX-512 F/BW/VL too, 2: AVX-512 BF16 too)");
}
