// The blocked dot products of the grouped expert kernel (moe_experts.cpp), included once per
// instruction set inside its namespace and target region, after the operand type `A`, the
// block shape kR x kN and, for each weight type W, `wload(const W*)` -> the 16 (or 32) lanes
// that match `aload(const A*)`, and `dot_step(acc, a, w)`. Lane l of an accumulator sums the
// products of elements at i = l (mod its width), and its lanes then add up in one fixed tree
// (`reduce16`): an output element's value depends only on its own row and weight row, never
// on the block it was computed in, the other rows or the thread count.

// dots[r * ldo + n] = sum_i a[r][i] * w[n][i] over kp elements (a multiple of kStep), for R
// rows and N weight rows.
template <int R, int N, typename W>
static inline void dot_block(const A* const* a, const W* const* w, int64_t kp, float* out,
                             int64_t ldo) {
  Acc acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) acc[r][n] = acc_zero();
  for (int64_t i = 0; i < kp; i += kStep) {
    Operand wv[N];
    for (int n = 0; n < N; ++n) wv[n] = wload(w[n] + i);
    for (int r = 0; r < R; ++r) {
      const Operand av = aload(a[r] + i);
      for (int n = 0; n < N; ++n) acc[r][n] = dot_step(acc[r][n], av, wv[n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) out[r * ldo + n] = reduce16(acc[r][n]);
}

template <int R, typename W>
static inline void dot_rows(const A* const* a, const W* const* w, int64_t n, int64_t kp,
                            float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + kN <= n; j += kN) dot_block<R, kN>(a, w + j, kp, out + j, ldo);
  for (; j < n; ++j) dot_block<R, 1>(a, w + j, kp, out + j, ldo);
}

// out[r * ldo + j] = dot(a[r], w[j]) for m rows and n weight rows.
template <typename W>
static void dots(const A* const* a, int64_t m, const W* const* w, int64_t n, int64_t kp,
                 float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + kR <= m; r += kR) dot_rows<kR>(a + r, w, n, kp, out + r * ldo, ldo);
  switch (m - r) {
    case 3:
      dot_rows<3>(a + r, w, n, kp, out + r * ldo, ldo);
      break;
    case 2:
      dot_rows<2>(a + r, w, n, kp, out + r * ldo, ldo);
      break;
    case 1:
      dot_rows<1>(a + r, w, n, kp, out + r * ldo, ldo);
      break;
    default:
      break;
  }
}

// One layer's experts on this instruction set: see moe_experts.cpp's `Job`.
template <typename W>
static void run_experts(const Job& job, const A* xa, A* act, float* y) {
  gate_up_phase<A, W>(job, xa, act, [](const A* const* a, int64_t m, const W* const* w,
                                       int64_t n, int64_t kp, float* out, int64_t ldo) {
    dots<W>(a, m, w, n, kp, out, ldo);
  });
  down_phase<A, W>(job, act, y, [](const A* const* a, int64_t m, const W* const* w, int64_t n,
                                   int64_t kp, float* out, int64_t ldo) {
    dots<W>(a, m, w, n, kp, out, ldo);
  });
}
