// Linear layers with GGUF block-quantised weights (Q8_0, Q4_0, Q4_1) on x86-64 CPUs:
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T, float32 accumulation, batch-invariant.
//
// Built by torch.utils.cpp_extension.load without any -m flag: each instruction set's code is
// compiled under its own `#pragma GCC target` region (a per-function target attribute) and
// picked at run time by the caller from isa_supported(), so one build runs on an AVX2-only
// EPYC and uses AVX-512 on a machine that has it. The weight layout is written by
// quant_linear.py's repack(); the kernels themselves are in quant_linear_body.h.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ops_impl.h"

namespace {

// Format codes shared with quant_formats.py (FORMATS).
constexpr int kQ8_0 = 0;
constexpr int kQ4_0 = 1;
constexpr int kQ4_1 = 2;
constexpr int kQ4_K = 3;
constexpr int kQ6_K = 4;
// Activation numerics shared with quant_linear.py (ACTIVATIONS).
constexpr int64_t kActFloat = 0;
constexpr int64_t kActInt8 = 1;
// Instruction sets shared with quant_linear.py (ISAS).
constexpr int64_t kIsaAvx2 = 0;
constexpr int64_t kIsaAvx512 = 1;
constexpr int64_t kIsaAvx512Vnni = 2;

// Output columns per tile: the tile's blocks are interleaved column by column so that one tile
// is one sequential stream of bytes (see repack()).
constexpr int kTile = 4;

// One repacked weight (quant_formats.py's layout): tiles of kTile rows of W, each tile its
// format's sections one after another, a section being [units][kTile][width] values:
//   Q8_0: fp16 d per block, int8 q[32];   Q4_0: fp16 d, q[16] (nibbles: j low, j + 16 high)
//   Q4_1: fp16 d, fp16 m, q[16];          Q4_K: fp16 d, fp16 dmin per 256; u8 sc, u8 m, q[16]
//   Q6_K: fp16 d per 256; int8 sc[2] (weights 0-15, 16-31); q[24]: 16 bytes of low nibbles as
//         Q4_0 orders them, then 8 bytes of high 2-bit pairs, byte j holding weights j, j + 8,
//         j + 16, j + 24 in bits 0-1, 2-3, 4-5, 6-7
// (a block is 32 weights). The quants come last, after every scale of the tile.
constexpr int64_t quant_bytes_of(int format) {
  return format == kQ8_0 ? 32 : format == kQ6_K ? 24 : 16;
}

struct Layout {
  int format;
  int64_t blocks;  // K / 32
  int64_t quant_bytes() const { return quant_bytes_of(format); }
  int64_t head_bytes() const {  // scales of one tile
    const int64_t per_tile = blocks * kTile;
    if (format == kQ4_1) return per_tile * 4;
    if (format == kQ4_K) return per_tile / 8 * 4 + per_tile * 2;
    if (format == kQ6_K) return per_tile / 8 * 2 + per_tile * 2;
    return per_tile * 2;
  }
  int64_t tile_bytes() const { return head_bytes() + blocks * kTile * quant_bytes(); }
  int64_t k() const { return blocks * 32; }
  int64_t block_weights() const { return format >= kQ4_K ? 256 : 32; }
};

// The output [M, n] in x's dtype. Each thread stores its own tiles' results, so a bfloat16
// call has no extra parallel pass (each one costs a wait for every thread, which on a shared
// 2-core machine was a scheduler slice).
// One weight's columns of it: n of them, from f32 / bf16 on, rows ld apart (a part of a
// multi-weight call writes its columns of the shared output).
struct Output {
  float* f32;
  at::BFloat16* bf16;
  int64_t n;
  int64_t ld;
  // values [M][kTile] of columns n0 .. n0 + ncols
  void store(const float* values, int64_t M, int64_t n0, int64_t ncols) const {
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < ncols; ++c) {
        const float v = values[r * kTile + c];
        if (f32 != nullptr)
          f32[r * ld + n0 + c] = v;
        else
          bf16[r * ld + n0 + c] = at::BFloat16(v);  // round to nearest even, as torch's .to()
      }
  }
};

#include "quant_repack.h"

// One call's quantised activations: per row, q [k] int8, d [k / 256] scales and aux, kAuxPerSuper
// int16 sums of q per super block (256 values): Q4_K (sums) the 8 sums of its 32-value blocks
// then 8 zeros; Q6_K (halves) the 16 sums of its 16-value halves.
constexpr int64_t kAuxPerSuper = 16;
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const int16_t* aux;
  int64_t k;
  const int8_t* qrow(int64_t r) const { return q + r * k; }
  const float* drow(int64_t r) const { return d + r * (k / 256); }
  const int16_t* auxrow(int64_t r) const { return aux + r * (k / 256) * kAuxPerSuper; }
};

}  // namespace

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

#include "v16_avx2.h"
static inline void vsum8(V16 v, float out[8]) { _mm256_storeu_ps(out, _mm256_add_ps(v.a, v.b)); }
static inline V16 u8_to_v16(__m128i bytes) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)))};
}
static inline void dequant_nibbles(const uint8_t* q, float d, float o, V16& lo, V16& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const V16 vd = vset1(d), vo = vset1(o);
  lo = vfma(u8_to_v16(_mm_and_si128(v, mask)), vd, vo);
  hi = vfma(u8_to_v16(_mm_and_si128(_mm_srli_epi16(v, 4), mask)), vd, vo);
}
static inline V16 s8_to_v16(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
static inline void bytes_s8(const uint8_t* q, V16& lo, V16& hi) {
  lo = s8_to_v16(q);
  hi = s8_to_v16(q + 16);
}
// 16 ymm registers. Fused: one row with all 4 columns per pass (accumulators 8, x 4, weights
// 4; four independent FMA chains), or 2 rows with one column per pass (accumulators 4, x 8,
// weights 4). Buffered, the two 8-lane halves of every accumulator go in two passes (lanes
// are independent, so each keeps its order): 3 rows x 2 columns of half accumulators (6)
// beside x (6) and weights (2).
constexpr int kFusedMaxRows = 2;
constexpr int fused_columns(int rows) { return rows == 1 ? 4 : 1; }
constexpr int kRowGroup = 3;
constexpr int kColGroup = 2;

#define QUANT_LINEAR_ROW_GROUP_HALVES
// The buffered path's row group (see row_group in quant_linear_body.h), one 8-lane half at a
// time: accs and wbuf hold 16-float accumulators and [lo 16 | hi 16] weight blocks.
template <int R>
static void row_group_halves(const float* wbuf, int64_t cb, const float* x, int64_t ldx,
                             float* accs, bool first) {
  for (int h = 0; h < 16; h += 8)
    for (int c0 = 0; c0 < kTile; c0 += kColGroup) {
      __m256 acc[R][kColGroup];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kColGroup; ++c)
          acc[r][c] = first ? _mm256_setzero_ps()
                            : _mm256_loadu_ps(accs + (r * kTile + c0 + c) * 16 + h);
      for (int64_t bb = 0; bb < cb; ++bb) {
        __m256 xl[R], xh[R];
        for (int r = 0; r < R; ++r) {
          xl[r] = _mm256_loadu_ps(x + r * ldx + 32 * bb + h);
          xh[r] = _mm256_loadu_ps(x + r * ldx + 32 * bb + 16 + h);
        }
        for (int c = 0; c < kColGroup; ++c) {
          const float* w = wbuf + (bb * kTile + c0 + c) * 32 + h;
          const __m256 lo = _mm256_loadu_ps(w), hi = _mm256_loadu_ps(w + 16);
          for (int r = 0; r < R; ++r) {
            acc[r][c] = _mm256_fmadd_ps(xl[r], lo, acc[r][c]);
            acc[r][c] = _mm256_fmadd_ps(xh[r], hi, acc[r][c]);
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kColGroup; ++c)
          _mm256_storeu_ps(accs + (r * kTile + c0 + c) * 16 + h, acc[r][c]);
    }
}

#include "quant_linear_body.h"
#undef QUANT_LINEAR_ROW_GROUP_HALVES

// 16 ymm: two rows, both column pairs a pass (their sums spill once per super block): against
// one pair a pass, 16 rows of a 1B-shape step 236 -> 217 ms and 2 rows 44 -> 37 (in-process
// A/B, 2 threads, AMD EPYC Genoa running this build).
constexpr int kQ8Rows = 2;
#include "quant_linear_q8k.h"

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {

#include "v16_avx512.h"
static inline void vsum8(V16 x, float out[8]) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm512_castps512_ps256(x.v), hi));
}
// The block's 16 possible weights fma(i, d, o) (the same exact values as converting each
// nibble), then looked up per weight: vpermps reads only the low 4 bits of each index.
static inline void dequant_nibbles(const uint8_t* q, float d, float o, V16& lo, V16& hi) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(o));
  const __m512i v =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  lo = {_mm512_permutexvar_ps(v, table)};
  hi = {_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table)};
}
static inline void bytes_s8(const uint8_t* q, V16& lo, V16& hi) {
  lo = {_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))))};
  hi = {_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))))};
}
static inline V16 u8_to_v16(__m128i bytes) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes))};
}
// 16 accumulators summed at once by hsum16's tree (lanes i + 8, i + 4, i + 2, i + 1 at each
// level, the same additions as the scalar code, so the same bits) with 15 vector adds instead
// of 16 scalar trees; out[j] = hsum16(accumulator j).
#define QUANT_LINEAR_HSUM16X16
static inline void hsum16x16(const float* a, float* out) {
  __m512 l1[8], l2[4], l3[2];
  for (int m = 0; m < 8; ++m) {  // [acc 2m lanes 0-7 | acc 2m+1] + [their lanes 8-15]
    const __m512 x = _mm512_loadu_ps(a + 32 * m), y = _mm512_loadu_ps(a + 32 * m + 16);
    l1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int p = 0; p < 4; ++p)  // 128-bit lane L: acc 4p + L, lanes 0-3 + 4-7
    l2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(l1[2 * p], l1[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int q = 0; q < 2; ++q)  // lane L: acc 8q + L and 8q + 4 + L, lanes 0-1 + 2-3
    l3[q] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * q], l2[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(l2[2 * q], l2[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // r[4 L + e] is acc L + 4 e
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
}

// 32 zmm registers: up to 4 rows x 4 columns of accumulators (16) beside x and weights.
constexpr int kFusedMaxRows = 4;
constexpr int fused_columns(int) { return 4; }
constexpr int kRowGroup = 4;
constexpr int kColGroup = 4;

#include "quant_linear_body.h"
#undef QUANT_LINEAR_HSUM16X16

// The same AVX2 code with 32 registers (EVEX): four rows, both column pairs a pass (against
// one pair: 16 rows of a 1B-shape step 187 -> 162 ms, 4 rows 62 -> 50; same A/B).
constexpr int kQ8Rows = 4;
#include "quant_linear_q8k.h"

}  // namespace avx512
#pragma GCC pop_options

// The AVX-512 build's int8 kernel with AVX512-VNNI's vpdpwssd (a 16-bit pair product added
// into int32 in one instruction) where it takes vpmaddwd then vpaddd: the same exact integer
// sums (no product or sum here can overflow), so the same bits, in fewer instructions for
// the many-row steps the multiplies bound.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512vnni {
using namespace avx512;
constexpr int kQ8Rows = 4;
#define Q8K_VNNI
#include "quant_linear_q8k.h"
#undef Q8K_VNNI
}  // namespace avx512vnni
#pragma GCC pop_options

namespace {

bool isa_supported(int64_t isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == kIsaAvx2) return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  if (isa == kIsaAvx512) return avx512;
  if (isa == kIsaAvx512Vnni) return avx512 && __builtin_cpu_supports("avx512vnni");
  return false;
}

// The Python wrapper validates arguments with clear ValueErrors; these checks only keep a
// direct caller from reading out of bounds. The layout of a packed weight w [n, k] of format.
Layout checked_layout(const at::Tensor& w, int64_t format, int64_t n, int64_t k) {
  TORCH_CHECK(format >= kQ8_0 && format <= kQ6_K, "unknown format ", format);
  const Layout L{static_cast<int>(format), k / 32};
  TORCH_CHECK(k > 0 && k % L.block_weights() == 0 && n > 0, "bad N or K");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() == (n + kTile - 1) / kTile * L.tile_bytes(),
              "packed weight does not match format, N and K");
  return L;
}

// x [M, k] times several packed weights (formats[i], ns[i] columns each) -> y [M, sum ns],
// each weight's columns after the previous ones'. One parallel region for all of them, its
// threads given equal shares of the weights' bytes (a decode step is bound by reading them);
// x is quantised once for the int8 path. Each output element is computed as a one-weight call
// computes it, so the result is the one-weight results side by side, bit for bit.
at::Tensor quant_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                              const std::vector<int64_t>& formats, const std::vector<int64_t>& ns,
                              int64_t k, int64_t isa, int64_t activations) {
  TORCH_CHECK(isa_supported(isa), "instruction set ", isa, " is not supported by this CPU");
  TORCH_CHECK(!ws.empty() && ws.size() == formats.size() && ws.size() == ns.size(),
              "one format and one N per weight, at least one weight");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k,
              "x must be a 2-D CPU tensor of ", k, " columns, got ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  const size_t parts = ws.size();
  std::vector<Layout> layouts;
  std::vector<int64_t> first_tile(parts + 1, 0), first_col(parts + 1, 0), byte_end(parts, 0);
  bool q4k = false, q6k = false;
  int64_t total_bytes = 0;
  for (size_t p = 0; p < parts; ++p) {
    layouts.push_back(checked_layout(ws[p], formats[p], ns[p], k));
    const int64_t ntiles = (ns[p] + kTile - 1) / kTile;
    first_tile[p + 1] = first_tile[p] + ntiles;
    first_col[p + 1] = first_col[p] + ns[p];
    total_bytes += ntiles * layouts[p].tile_bytes();
    byte_end[p] = total_bytes;
    q4k |= formats[p] == kQ4_K;
    q6k |= formats[p] == kQ6_K;
  }
  const int64_t M = x.size(0), width = first_col[parts], ntiles = first_tile[parts];
  at::Tensor y = at::empty({M, width}, x.options());
  if (M == 0) return y;
  at::Tensor xf = x.contiguous();
  if (x.scalar_type() == at::kBFloat16) {  // exact widening, serial (see Output)
    const at::Tensor xb = xf;
    xf = at::empty({M, k}, x.options().dtype(at::kFloat));
    const at::BFloat16* src = xb.data_ptr<at::BFloat16>();
    float* dst = xf.data_ptr<float>();
    for (int64_t i = 0; i < M * k; ++i) dst[i] = static_cast<float>(src[i]);
  }
  const bool f32 = x.scalar_type() == at::kFloat;
  const float* xp = xf.data_ptr<float>();
  // The int8 rows of x: q and d shared, the sums of x per 32 (Q4_K) and per 16 (Q6_K) apart.
  const bool int8 = activations == kActInt8 && (q4k || q6k);
  const int64_t supers = k / 256;
  std::vector<int8_t> q(int8 ? M * k : 0);
  std::vector<float> d(int8 ? M * supers : 0);
  std::vector<int16_t> aux4(int8 && q4k ? M * supers * kAuxPerSuper : 0);
  std::vector<int16_t> aux6(int8 && q6k ? M * supers * kAuxPerSuper : 0);
  if (int8)
    at::parallel_for(0, M, std::max<int64_t>(1, 65536 / k), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t at = r * supers * kAuxPerSuper;
        const bool four = q4k;  // Q4_K's sums first; Q6_K's, if wanted too, from the same q
        avx2::q8k_quantize_row(xp + r * k, k, q.data() + r * k, d.data() + r * supers,
                               (four ? aux4 : aux6).data() + at, !four);
        if (q4k && q6k) avx2::q8k_aux_sums(q.data() + r * k, k, aux6.data() + at, true);
      }
    });
  // Tiles [t0, t1) of the whole output (all parts' tiles in order) on this thread.
  auto run = [&](int64_t t0, int64_t t1) {
    for (size_t p = 0; p < parts; ++p) {
      const int64_t a = std::max(t0, first_tile[p]), b = std::min(t1, first_tile[p + 1]);
      if (a >= b) continue;
      const Layout& L = layouts[p];
      const Output out{f32 ? y.data_ptr<float>() + first_col[p] : nullptr,
                       f32 ? nullptr : y.data_ptr<at::BFloat16>() + first_col[p], ns[p], width};
      const uint8_t* wp = ws[p].data_ptr<uint8_t>();
      const int64_t lo = a - first_tile[p], hi = b - first_tile[p];
      if (activations == kActInt8 && L.format >= kQ4_K) {
        const Q8Rows X{q.data(), d.data(), (L.format == kQ4_K ? aux4 : aux6).data(), k};
        if (isa == kIsaAvx512Vnni)
          avx512vnni::run_q8k(L, wp, X, M, out, lo, hi);
        else if (isa == kIsaAvx512)
          avx512::run_q8k(L, wp, X, M, out, lo, hi);
        else
          avx2::run_q8k(L, wp, X, M, out, lo, hi);
      } else if (isa >= kIsaAvx512) {  // the float path has no VNNI form
        avx512::run_tiles(L, wp, xp, M, out, lo, hi);
      } else {
        avx2::run_tiles(L, wp, xp, M, out, lo, hi);
      }
    }
  };
  // Equal shares of the bytes, each at least `grain` tiles (small weights: fewer threads).
  const int64_t grain = std::max<int64_t>(1, 16384 / k);
  const int64_t shares =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntiles / grain));
  auto tile_at = [&](int64_t byte) {  // the first tile that ends after `byte`
    size_t p = 0;
    while (p + 1 < parts && byte >= byte_end[p]) ++p;
    const int64_t before = p == 0 ? 0 : byte_end[p - 1];
    return std::min(first_tile[p + 1], first_tile[p] + (byte - before) / layouts[p].tile_bytes());
  };
  if (shares == 1) {
    run(0, ntiles);
    return y;
  }
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      run(tile_at(total_bytes * s / shares),
          s + 1 == shares ? ntiles : tile_at(total_bytes * (s + 1) / shares));
  });
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t format, int64_t n,
                        int64_t k, int64_t isa, int64_t activations) {
  return quant_linear_parts(x, {w}, {format}, {n}, k, isa, activations);
}

// A projection's packed weights as decode_layer takes them (QuantProjection's arguments).
struct Projection {
  std::vector<at::Tensor> ws;
  std::vector<int64_t> formats, ns;
  int64_t k;
  at::Tensor operator()(const at::Tensor& x, int64_t isa, int64_t activations) const {
    return quant_linear_parts(x, ws, formats, ns, k, isa, activations);
  }
};

// One Llama-family decoder layer of a pure-decode step on the CPU, every projection in GGUF
// blocks, in one call: the ops and the order of the model's own forward (models/llama.py:
// RMSNorm with the residual add, QKV (+ bias), RoPE, the cache write, paged decode attention,
// O, RMSNorm, gate/up, SiLU(gate) * up, down), each op the one the unfused path calls, so the
// bits are its bits. Returns (mlp output, residual stream).
std::vector<at::Tensor> decode_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& norm1,
    const at::Tensor& norm2, double eps, const std::vector<at::Tensor>& qkv_w,
    const std::vector<int64_t>& qkv_f, const std::vector<int64_t>& qkv_n,
    const c10::optional<at::Tensor>& qkv_bias, const std::vector<at::Tensor>& o_w,
    const std::vector<int64_t>& o_f, const std::vector<int64_t>& o_n,
    const std::vector<at::Tensor>& gu_w, const std::vector<int64_t>& gu_f,
    const std::vector<int64_t>& gu_n, const std::vector<at::Tensor>& down_w,
    const std::vector<int64_t>& down_f, const std::vector<int64_t>& down_n,
    const std::vector<int64_t>& shape, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t isa,
    int64_t activations, int64_t attention_isa) {
  TORCH_CHECK(shape.size() == 4, "shape must be (heads, kv heads, head dim, intermediate)");
  const int64_t heads = shape[0], kv_heads = shape[1], head_dim = shape[2], inter = shape[3];
  const int64_t t = x.size(0), hidden = x.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const Projection qkv{qkv_w, qkv_f, qkv_n, hidden}, o{o_w, o_f, o_n, q_size};
  const Projection gate_up{gu_w, gu_f, gu_n, hidden}, down{down_w, down_f, down_n, inter};
  at::Tensor h, res;
  if (residual.has_value()) {
    const std::vector<at::Tensor> r = cpuops::rms_norm(x, norm1, eps, residual);
    h = r[0];
    res = r[1];
  } else {
    h = cpuops::rms_norm(x, norm1, eps, c10::nullopt)[0];
    res = x;
  }
  at::Tensor qkv_out = qkv(h, isa, activations);
  if (qkv_bias.has_value()) qkv_out = qkv_out + *qkv_bias;
  TORCH_CHECK(qkv_out.size(1) == q_size + 2 * kv_size, "the QKV weights do not match the shape");
  const std::vector<at::Tensor> parts = qkv_out.split_with_sizes({q_size, kv_size, kv_size}, -1);
  const at::Tensor q = cpuops::rope(parts[0].view({t, heads, head_dim}), cos, sin);
  const at::Tensor k = cpuops::rope(parts[1].view({t, kv_heads, head_dim}), cos, sin);
  const at::Tensor v = parts[2].view({t, kv_heads, head_dim});
  key_cache.view({-1, kv_heads, head_dim}).index_copy_(0, slots, k);
  value_cache.view({-1, kv_heads, head_dim}).index_copy_(0, slots, v);
  const at::Tensor attn = cpuops::paged_decode(q.contiguous(), key_cache, value_cache,
                                               block_tables, seq_lens, scale, attention_isa);
  const at::Tensor out = o(attn.reshape({t, q_size}), isa, activations);
  const std::vector<at::Tensor> r2 = cpuops::rms_norm(out, norm2, eps, res);
  const std::vector<at::Tensor> gu = gate_up(r2[0], isa, activations).split_with_sizes({inter, inter}, -1);
  const at::Tensor act = at::silu(gu[0]) * gu[1];
  return {down(act, isa, activations), r2[1]};
}

// dequant(w) as float32 [n, k] (the weights' gguf values; threads over tiles).
at::Tensor dequantize(const at::Tensor& w, int64_t format, int64_t n, int64_t k) {
  TORCH_CHECK(isa_supported(kIsaAvx2), "dequantize needs AVX2, FMA and F16C");
  const Layout L = checked_layout(w, format, n, k);
  const int64_t ntiles = (n + kTile - 1) / kTile;
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, ntiles, std::max<int64_t>(1, 16384 / k),
                   [&](int64_t t0, int64_t t1) { avx2::run_dequant(L, wp, op, n, t0, t1); });
  return out;
}

// Rows `rows` (int64, each in [0, n), checked by the wrapper) of dequant(w) as float32
// [len(rows), k]: gguf's values, as dequantize() gives them.
at::Tensor dequantize_rows(const at::Tensor& w, int64_t format, int64_t n, int64_t k,
                           const at::Tensor& rows) {
  TORCH_CHECK(isa_supported(kIsaAvx2), "dequantize_rows needs AVX2, FMA and F16C");
  const Layout L = checked_layout(w, format, n, k);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be 1-D int64");
  const at::Tensor idx = rows.contiguous();
  const int64_t count = idx.numel();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "row out of range");
  at::Tensor out = at::empty({count, k}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, count, std::max<int64_t>(1, 16384 / k),
                   [&](int64_t i0, int64_t i1) { avx2::run_dequant_rows(L, wp, ip, op, i0, i1); });
  return out;
}

// How many of torch's intra-op threads an at::parallel_for of n one-item chunks ran on: the
// build's check that this file was compiled with OpenMP (without it the loop runs serially).
int64_t parallel_threads_used(int64_t n) {
  std::vector<int> seen(at::get_num_threads(), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}

// quant_formats.repack's bytes, from raw GGUF blocks [n, row_bytes] (checked by the wrapper),
// written into out: zero-filled uint8 of the packed size (padding bytes are not written).
void repack_into(const at::Tensor& raw, int64_t format, int64_t n, int64_t k, at::Tensor out) {
  TORCH_CHECK(format >= kQ8_0 && format <= kQ6_K, "unknown format ", format);
  const Layout L{static_cast<int>(format), k / 32};
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.size(0) == n && n > 0 && k > 0 && k % L.block_weights() == 0,
              "raw must be contiguous uint8 [n, row_bytes] of whole blocks");
  const int64_t ntiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 1 && out.scalar_type() == at::kByte &&
                  out.is_contiguous() && out.numel() == ntiles * L.tile_bytes(),
              "out must be contiguous uint8 of the packed size ", ntiles * L.tile_bytes());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = raw.size(1);
  at::parallel_for(0, ntiles, 16, [&](int64_t t0, int64_t t1) {
    repack_tiles(L, src, n, row_bytes, dst, t0, t1);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ dequant(w)^T (see quant_linear.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layer", &decode_layer, "one decoder layer of a CPU decode step (see "
        "models/cpu_decode.py)", py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_parts", &quant_linear_parts,
        "y = x @ [dequant(w_0); dequant(w_1); ...]^T (see quant_linear.py)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "dequant(w) as float32 [n, k] (gguf's values)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, "rows of dequant(w) as float32 (gguf's values)",
        py::call_guard<py::gil_scoped_release>());
  m.def("parallel_threads_used", &parallel_threads_used,
        "threads an at::parallel_for over n items ran on (1 when built without OpenMP)");
  m.def("isa_supported", &isa_supported, "whether this CPU runs the instruction set code");
  m.def("repack_into", &repack_into,
        "GGUF blocks -> the kernel's layout, written into out (see quant_formats.py)",
        py::call_guard<py::gil_scoped_release>());
}
