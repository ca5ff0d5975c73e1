// Paged decode attention (one query token per sequence) for one instruction set: included by
// cpu_ops.cpp twice, inside its AVX2 and AVX-512 namespaces and target regions, after that
// namespace's V16 (16 float lanes: two ymm or one zmm) and its helpers (vzero, vload,
// vstore, vset1, vfma, vdiv, load16 of float or bfloat16, sum_tree).
//
// One (sequence, kv head) pair is one task; its `group` query heads take, per query row:
//   score_t = (sum over 16 lanes of fma(q_i, k_t,i), lane i mod 16, i rising; then the fixed
//             tree of sum_tree) * scale, for t in position order;
//   top = max_t score_t;  p_t = exp8(score_t - top) (exp8: one AVX2 polynomial, below);
//   total = 8 lanes over t (lane t mod 8, t rising), then the tree 4, 2, 1;
//   out_i = (fma over t rising of p_t * v_t,i) / total.
// (Eight scores are reduced at once by sum_tree8, the same tree as sum_tree's.)
// Optional, the same way everywhere (`Mods` and `first_key`, defined once by the includer for
// both builds): a window W attends to positions [max(0, len - W), len) only; a soft cap c
// replaces each scaled score by c * tanh8(score / c) before the maximum; a sink logit s per query head joins the maximum and adds exp8(s - top)
// to the total after its tree (a key without a value: gpt-oss).
// How many heads share a key or value row load (kScoreHeads, kValueHeads: set per build by the
// includer) changes which registers hold what, never a lane's operations.
// Every lane's sequence of operations is the same whatever the batch, the other sequences,
// the thread count or the instruction set (the AVX-512 build runs the same lane operations in
// one register where the AVX2 build uses two; exp8 and the sum of p are AVX2 code in both):
// a row's result is the same bits alone, in any batch, on every machine with AVX2 and FMA.

// exp(x) for x <= 0 (scores minus their maximum), 8 lanes: x clamped at -87.3, split as
// n ln2 + r with n = round(x / ln2), e^r by Cephes' degree-5 polynomial (about 1 ulp), times
// 2^n built in the exponent bits. Only AVX2/FMA operations: the same bits in both builds.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// tanh(x), 8 lanes: Cephes' tanhf, x + x^3 P(x^2) below |x| = 0.625 and
// 1 - 2 / (1 + e^(2|x|)) (as (1 - e) / (1 + e), e = exp8(-2|x|)) above, the sign put back.
// Only AVX2/FMA operations: the same bits in both builds.
static inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 e = exp8(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 large = _mm256_or_ps(
      _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e)), sign);
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_blendv_ps(large, small, is_small);
}

// scores[0, len) (padded to a multiple of 8 with room) soft-capped in place.
static inline void soft_cap(float* scores, int64_t len, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 s = _mm256_loadu_ps(scores + t);
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(c, tanh8(_mm256_mul_ps(s, inv))));
  }
}

// scores[0, len) -> exp(scores - max) in place (padded to a multiple of 8 with room); returns
// their sum, plus exp(sink - max) where there is a sink (`sink` not null; it joins the max).
static inline float softmax_numerators(float* scores, int64_t len, const float* sink) {
  // The maximum in 8 lanes, then across them: max is exact, so any order gives its bits.
  __m256 m = _mm256_set1_ps(scores[0]);
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(scores + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float top = lanes[0];
  for (int l = 1; l < 8; ++l) top = std::max(top, lanes[l]);
  for (; t < len; ++t) top = std::max(top, scores[t]);
  if (sink != nullptr) top = std::max(top, *sink);
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vtop));
    _mm256_storeu_ps(scores + t, p);
    const int live = static_cast<int>(std::min<int64_t>(8, len - t));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), lane));
    total = _mm256_add_ps(total, _mm256_and_ps(p, keep));
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  float sum = _mm_cvtss_f32(s);
  if (sink != nullptr)
    sum += _mm256_cvtss_f32(exp8(_mm256_set1_ps(*sink - top)));
  return sum;
}

// Eight (per-lane) sums at once, each by sum_tree's tree (lanes l + 8, + 4, + 2, + 1), as one
// transposed reduction: score j of the result is sum_tree(v[j]).
static inline void sum_tree8(const V16* v, float* out) {
  __m256 w[8];
  for (int j = 0; j < 8; ++j) w[j] = halves_sum(v[j]);  // lanes l + 8
  __m256 x[4], y[2];
  for (int j = 0; j < 4; ++j)  // [w2j lanes 0-3 + 4-7 | w2j+1 lanes 0-3 + 4-7]
    x[j] = _mm256_add_ps(_mm256_permute2f128_ps(w[2 * j], w[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(w[2 * j], w[2 * j + 1], 0x31));
  for (int j = 0; j < 2; ++j)  // lanes 0,1 + 2,3 of each half
    y[j] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(x[2 * j], x[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 0 + lane 1: [s0, s2, s4, s6 | s1, s3, s5, s7]
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// out chunks [c0, c0 + W) of H heads (scores p, out and total per head, p `ld` apart): the
// values' rows weighted by p, one fma chain per lane over t rising (W * H accumulators in
// registers, each row of values loaded once for the H heads), divided by total.
template <typename T, int W, int H>
static inline void weighted_values_w(const float* const* values, int64_t c0, const float* p,
                                     int64_t ld, int64_t len, const float* total, T* out,
                                     int64_t d) {
  V16 acc[H][W];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < W; ++c) acc[h][c] = vzero();
  for (int64_t u = 0; u < len; ++u) {
    const float* v = values[u] + 16 * c0;
    V16 row[W];
    for (int c = 0; c < W; ++c) row[c] = vload(v + 16 * c);
    for (int h = 0; h < H; ++h) {
      const V16 pu = vset1(p[h * ld + u]);
      for (int c = 0; c < W; ++c) acc[h][c] = vfma(pu, row[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < W; ++c) {
      float o[16];
      vstore(o, vdiv(acc[h][c], vset1(total[h])));
      for (int l = 0; l < 16; ++l) out[h * d + 16 * (c0 + c) + l] = static_cast<T>(o[l]);
    }
}

template <typename T, int H>
static void weighted_values_h(int64_t width, const float* const* values, int64_t c0,
                            const float* p, int64_t ld, int64_t len, const float* total, T* out,
                            int64_t d) {
  if (width == 4)
    weighted_values_w<T, 4, H>(values, c0, p, ld, len, total, out, d);
  else if (width == 3)
    weighted_values_w<T, 3, H>(values, c0, p, ld, len, total, out, d);
  else if (width == 2)
    weighted_values_w<T, 2, H>(values, c0, p, ld, len, total, out, d);
  else
    weighted_values_w<T, 1, H>(values, c0, p, ld, len, total, out, d);
}

// weighted_values_h for `heads` (1 to kValueHeads) heads.
template <typename T>
static void weighted_values(int64_t heads, int64_t width, const float* const* values, int64_t c0,
                            const float* p, int64_t ld, int64_t len, const float* total, T* out,
                            int64_t d) {
  if (kValueHeads >= 4 && heads == 4)
    weighted_values_h<T, (kValueHeads >= 4 ? 4 : 1)>(width, values, c0, p, ld, len, total, out, d);
  else if (kValueHeads >= 3 && heads == 3)
    weighted_values_h<T, (kValueHeads >= 3 ? 3 : 1)>(width, values, c0, p, ld, len, total, out, d);
  else if (heads == 2)
    weighted_values_h<T, 2>(width, values, c0, p, ld, len, total, out, d);
  else
    weighted_values_h<T, 1>(width, values, c0, p, ld, len, total, out, d);
}

// Scores of H heads (q rows `d` apart, scores `ld` apart) over keys[0, len), the order the
// header describes; each key row is loaded once for the H heads.
template <int H>
static void head_scores_h(const float* q, const float* const* keys, int64_t len, int64_t d,
                          float scale, float* scores, int64_t ld) {
  const int64_t chunks = d / 16;
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    V16 a[H][8];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 8; ++j) a[h][j] = vzero();
    for (int64_t c = 0; c < chunks; ++c) {
      V16 qc[H];
      for (int h = 0; h < H; ++h) qc[h] = vload(q + h * d + 16 * c);
      for (int j = 0; j < 8; ++j) {
        const V16 k = vload(keys[t + j] + 16 * c);
        for (int h = 0; h < H; ++h) a[h][j] = vfma(qc[h], k, a[h][j]);
      }
    }
    for (int h = 0; h < H; ++h) {
      float* sh = scores + h * ld;
      sum_tree8(a[h], sh + t);
      for (int j = 0; j < 8; ++j) sh[t + j] *= scale;
    }
  }
  for (; t < len; ++t)
    for (int h = 0; h < H; ++h) {
      V16 a = vzero();
      for (int64_t c = 0; c < chunks; ++c) a = vfma(vload(q + h * d + 16 * c), vload(keys[t] + 16 * c), a);
      scores[h * ld + t] = sum_tree(a) * scale;
    }
}

static void head_scores(int64_t heads, const float* q, const float* const* keys, int64_t len,
                        int64_t d, float scale, float* scores, int64_t ld) {
  if (kScoreHeads >= 3 && heads == 3)
    head_scores_h<(kScoreHeads >= 3 ? 3 : 1)>(q, keys, len, d, scale, scores, ld);
  else if (kScoreHeads >= 2 && heads == 2)
    head_scores_h<(kScoreHeads >= 2 ? 2 : 1)>(q, keys, len, d, scale, scores, ld);
  else
    head_scores_h<1>(q, keys, len, d, scale, scores, ld);
}

// One (sequence, kv head) pair's key and value rows for positions [from, to), in position
// order, as float32: the cache's own rows, or (bfloat16) widened once into `widened` for all
// the query rows that read them. With n = to - from, rows[0, n) are keys, rows[n, 2 n)
// values. Blocks before `from` are never read (a window's may be back in the pool).
template <typename T>
static void gather_rows(const T* kc, const T* vc, const int64_t* table, int64_t from, int64_t to,
                        int64_t kvh, int64_t g, int64_t d, int64_t bs,
                        std::vector<float>& widened, std::vector<const float*>& rows) {
  const int64_t chunks = d / 16, len = to - from;
  rows.resize(2 * len);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < len; ++i) {
      const int64_t t = from + i;
      const int64_t at = ((table[t / bs] * bs + t % bs) * kvh + g) * d;
      rows[i] = kc + at;
      rows[len + i] = vc + at;
    }
  } else {
    widened.resize(2 * len * d);
    for (int64_t i = 0; i < len; ++i) {
      const int64_t t = from + i;
      const int64_t at = ((table[t / bs] * bs + t % bs) * kvh + g) * d;
      float* kw = widened.data() + i * d;
      float* vw = widened.data() + (len + i) * d;
      for (int64_t c = 0; c < chunks; ++c) {
        vstore(kw + 16 * c, load16(kc + at + 16 * c));
        vstore(vw + 16 * c, load16(vc + at + 16 * c));
      }
      rows[i] = kw;
      rows[len + i] = vw;
    }
  }
}

// One query token's `group` heads (q / out [group, d] of T) over keys[0, len) and
// values[0, len) (the positions its window keeps): the order the header describes. sinks:
// the group's sink logits, or null. work: scratch.
template <typename T>
static void attend(const T* q, const float* const* keys, const float* const* values,
                   int64_t len, float scale, T* out, int64_t group, int64_t d, float softcap,
                   const float* sinks, std::vector<float>& work) {
  const int64_t padded = (len + 7) / 8 * 8, chunks = d / 16;
  // Not cleared: every score read is written first (the lanes past len are masked or unused).
  work.resize(group * d + group * padded);
  float* qf = work.data();
  float* scores = qf + group * d;
  for (int64_t i = 0; i < group * d; ++i) qf[i] = static_cast<float>(q[i]);
  std::vector<float> totals(group);
  for (int64_t h0 = 0; h0 < group; h0 += kScoreHeads) {
    const int64_t heads = std::min<int64_t>(kScoreHeads, group - h0);
    head_scores(heads, qf + h0 * d, keys, len, d, scale, scores + h0 * padded, padded);
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * padded;
    if (softcap > 0.0f) soft_cap(sh, len, softcap);
    totals[h] = softmax_numerators(sh, len, sinks == nullptr ? nullptr : sinks + h);
  }
  // kValueHeads heads at a time share each row of values.
  for (int64_t h = 0; h < group; h += kValueHeads) {
    const int64_t heads = std::min<int64_t>(kValueHeads, group - h);
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      const int64_t width = std::min<int64_t>(4, chunks - c0);
      weighted_values<T>(heads, width, values, c0, scores + h * padded, padded, len,
                         totals.data() + h, out + h * d, d);
    }
  }
}

template <typename T>
static void run_decode(const T* qp, const T* kp, const T* vp, const int64_t* tables,
                       int64_t width, const int64_t* lens, float scale, T* op, int64_t batch,
                       int64_t group, int64_t kvh, int64_t d, int64_t bs, const Mods& mods) {
  at::parallel_for(0, batch * kvh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work, widened;
    std::vector<const float*> rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kvh, g = i % kvh;
      const int64_t at = (b * kvh + g) * group * d;  // q and out rows of this pair's heads
      const int64_t from = first_key(lens[b], mods), n = lens[b] - from;
      gather_rows<T>(kp, vp, tables + b * width, from, lens[b], kvh, g, d, bs, widened, rows);
      const float* sinks = mods.sinks == nullptr ? nullptr : mods.sinks + g * group;
      attend<T>(qp + at, rows.data(), rows.data() + n, n, scale, op + at, group, d,
                mods.softcap, sinks, work);
    }
  });
}

// Prefill (or mixed) tokens: token i of q [T, H, D] belongs to sequence seqs[i] and attends
// to its positions [0, lens[i]) (causal), each computed as a decode step of that length
// computes it (attend: the same bits). The tokens of one sequence come in runs of rising
// length; a run of up to kPrefillRun of them shares one gather of its key/value rows.
constexpr int64_t kPrefillRun = 32;

template <typename T>
static void run_prefill(const T* qp, const T* kp, const T* vp, const int64_t* tables,
                        int64_t width, const int64_t* seqs, const int64_t* lens, float scale,
                        T* op, int64_t tokens, int64_t group, int64_t kvh, int64_t d,
                        int64_t bs, const Mods& mods) {
  std::vector<int64_t> starts;  // runs: same sequence, consecutive tokens
  for (int64_t i = 0; i < tokens; ++i)
    if (i == 0 || seqs[i] != seqs[i - 1] || i - starts.back() == kPrefillRun) starts.push_back(i);
  const int64_t runs = static_cast<int64_t>(starts.size());
  starts.push_back(tokens);
  at::parallel_for(0, runs * kvh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> work, widened;
    std::vector<const float*> rows;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t run = i / kvh, g = i % kvh;
      const int64_t first = starts[run], end = starts[run + 1];
      int64_t longest = 0, from = lens[first];
      for (int64_t j = first; j < end; ++j) {
        longest = std::max(longest, lens[j]);
        from = std::min(from, first_key(lens[j], mods));
      }
      const int64_t n = longest - from;
      gather_rows<T>(kp, vp, tables + seqs[first] * width, from, longest, kvh, g, d, bs,
                     widened, rows);
      const float* sinks = mods.sinks == nullptr ? nullptr : mods.sinks + g * group;
      for (int64_t j = first; j < end; ++j) {
        const int64_t at = (j * kvh + g) * group * d;
        const int64_t skip = first_key(lens[j], mods) - from;
        attend<T>(qp + at, rows.data() + skip, rows.data() + n + skip, lens[j] - from - skip,
                  scale, op + at, group, d, mods.softcap, sinks, work);
      }
    }
  });
}
