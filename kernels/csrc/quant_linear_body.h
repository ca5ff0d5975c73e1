// The ISA-generic part of the quantised linear kernels. quant_linear.cpp includes this file
// once per instruction set, inside a namespace and a `#pragma GCC target` region (which gives
// every function here that target's attribute), after defining for it:
//   struct V16;                       a 16-lane float32 vector (one zmm, or two ymm)
//   V16 vzero(); V16 vload(const float*); void vstore(float*, V16); V16 vset1(float);
//   V16 vfma(V16 a, V16 b, V16 c);    a * b + c, one rounding
//   V16 vmul(V16 a, V16 b);
//   void vsum8(V16 a, float out[8]);  out[i] = a[i] + a[i + 8]
//   void dequant_nibbles(const uint8_t* q, float d, float o, V16& lo, V16& hi);
//                                     16 bytes of nibbles -> fma(nibble, d, o), low then high
//   V16 u8_to_v16(__m128i bytes);     16 unsigned bytes -> 16 floats
//   void bytes_s8(const uint8_t* q, V16& lo, V16& hi); 32 int8 -> 16 + 16 floats
//   constexpr int kFusedMaxRows, kRowGroup, kColGroup, fused_columns(rows);  register blocking
// and with Layout, kTile and the format codes (kQ8_0, ...) in scope. It includes nothing itself:
// the standard headers it uses are included by quant_linear.cpp before any target region.
//
// Batch invariance holds by construction: every output element y[m, n] is one 16-lane
// accumulator that takes, block after block (32 weights), lane l += x[32b+l] * w[32b+l] and then
// lane l += x[32b+16+l] * w[32b+16+l], each a single-rounding FMA, then the fixed tree `hsum16`.
// Nothing in that sequence depends on M, on the other rows, on how rows and columns are
// blocked into registers, or on which thread computes the tile. The AVX2 build performs the
// same operations lane by lane (a V16 there is two ymm), so both builds give identical bits.

// Lanes 0..7 + 8..15, then a fixed scalar tree; the same code for every ISA.
static inline float hsum16(V16 a) {
  float s8[8];
  vsum8(a, s8);
  const float s4[4] = {s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]};
  const float s2[2] = {s4[0] + s4[2], s4[1] + s4[3]};
  return s2[0] + s2[1];
}

// Q6_K's 32 six-bit values of a block as bytes, weights 0-15 and 16-31: the low nibbles ORed
// with their 2-bit pairs (byte j of the pairs holds weights j, j + 8, j + 16, j + 24), built
// in 128-bit registers before anything is widened.
static inline void q6_bytes(const uint8_t* q, __m128i& lo, __m128i& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i h8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16));
  const __m128i h = _mm_unpacklo_epi64(h8, h8);  // pairs for weights 0-7 | 8-15 (then +16)
  const __m128i shift = _mm_set_epi64x(2, 0);
  const __m128i nib = _mm_set1_epi8(0x0F), top = _mm_set1_epi8(0x30);
  const __m128i high_lo = _mm_and_si128(_mm_srlv_epi64(_mm_slli_epi64(h, 4), shift), top);
  const __m128i high_hi = _mm_and_si128(_mm_srlv_epi64(h, shift), top);
  lo = _mm_or_si128(_mm_and_si128(v, nib), high_lo);
  hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), nib), high_hi);
}

// out[j] = hsum16(accumulator j) for `count` accumulators of 16 floats at `accs`.
static inline void hsum_many(const float* accs, int64_t count, float* out) {
  int64_t j = 0;
#ifdef QUANT_LINEAR_HSUM16X16
  for (; j + 16 <= count; j += 16) hsum16x16(accs + 16 * j, out + j);
#endif
  for (; j < count; ++j) out[j] = hsum16(vload(accs + 16 * j));
}

// Weights of block i (= b * kTile + column) as floats, exactly as gguf's dequantisation: each
// product and FMA below is exact or rounds once where gguf's numpy rounds once (see
// quant_linear.py's docstring).
template <int FMT>
static inline void dequant(const Layout& L, const uint8_t* qs, const float* sd, const float* sb,
                           int64_t i, V16& lo, V16& hi) {
  const uint8_t* q = qs + i * quant_bytes_of(FMT);  // a constant: no per-block arithmetic
  if (FMT == kQ8_0) {
    const V16 d = vset1(sd[i]);
    bytes_s8(q, lo, hi);
    lo = vmul(lo, d);
    hi = vmul(hi, d);
  } else if (FMT == kQ6_K) {  // q * (d sc) + (-32 d sc), exact; each half its own sc
    __m128i bl, bh;
    q6_bytes(q, bl, bh);
    lo = vfma(u8_to_v16(bl), vset1(sd[i]), vset1(-32.0f * sd[i]));
    hi = vfma(u8_to_v16(bh), vset1(sb[i]), vset1(-32.0f * sb[i]));
  } else {  // Q4_0: q * d + (-8 d); Q4_1: q * d + m; Q4_K: q * (d sc) + (-(dmin m))
    dequant_nibbles(q, sd[i], sb[i], lo, hi);
  }
}

// fp16 scales to float32, four at a time (count is a multiple of kTile = 4).
static inline void convert_scales(const uint8_t* h, int64_t count, float* out) {
  for (int64_t i = 0; i < count; i += 4)
    _mm_storeu_ps(out + i,
                  _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 2 * i))));
}

// M <= kFusedMaxRows: dequantise each block into registers and use it for every row at once,
// fused_columns(R) columns of the tile per pass over K (x, small, is read again each pass).
template <int FMT, int R>
static void tile_fused(const Layout& L, const uint8_t* qs, const float* sd, const float* sb,
                       const float* x, int64_t ldx, float* y, int64_t ldy, int64_t ncols) {
  constexpr int kFusedColumns = fused_columns(R);
  for (int c0 = 0; c0 < kTile; c0 += kFusedColumns) {
    V16 acc[R][kFusedColumns];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kFusedColumns; ++c) acc[r][c] = vzero();
    for (int64_t b = 0; b < L.blocks; ++b) {
      V16 xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = vload(x + r * ldx + 32 * b);
        xh[r] = vload(x + r * ldx + 32 * b + 16);
      }
      for (int c = 0; c < kFusedColumns; ++c) {
        V16 lo, hi;
        dequant<FMT>(L, qs, sd, sb, b * kTile + c0 + c, lo, hi);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = vfma(xl[r], lo, acc[r][c]);
          acc[r][c] = vfma(xh[r], hi, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kFusedColumns; ++c)
        if (c0 + c < ncols) y[r * ldy + c0 + c] = hsum16(acc[r][c]);
  }
}

constexpr int64_t kChunkBlocks = 32;  // blocks dequantised into L1 at a time (16 KiB of floats)

// R rows (R <= kRowGroup) of the buffered path: accumulators start at zero (first chunk) or
// come from `accs` ([row][column][16]) and go back there, so that the per-element sequence
// continues across chunks unchanged.
template <int R>
static void row_group(const float* wbuf, int64_t cb, const float* x, int64_t ldx, float* accs,
                      bool first) {
  for (int c0 = 0; c0 < kTile; c0 += kColGroup) {
    V16 acc[R][kColGroup];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kColGroup; ++c)
        acc[r][c] = first ? vzero() : vload(accs + (r * kTile + c0 + c) * 16);
    // x of every row in registers, each weight vector loaded once for all R rows.
    for (int64_t bb = 0; bb < cb; ++bb) {
      V16 xl[R], xh[R];
      for (int r = 0; r < R; ++r) {
        xl[r] = vload(x + r * ldx + 32 * bb);
        xh[r] = vload(x + r * ldx + 32 * bb + 16);
      }
      for (int c = 0; c < kColGroup; ++c) {
        const float* w = wbuf + (bb * kTile + c0 + c) * 32;
        const V16 lo = vload(w), hi = vload(w + 16);
        for (int r = 0; r < R; ++r) {
          acc[r][c] = vfma(xl[r], lo, acc[r][c]);
          acc[r][c] = vfma(xh[r], hi, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kColGroup; ++c) vstore(accs + (r * kTile + c0 + c) * 16, acc[r][c]);
  }
}

template <int R>
static inline void row_group_of(const float* wbuf, int64_t cb, const float* x, int64_t ldx,
                                float* accs, bool first) {
#ifdef QUANT_LINEAR_ROW_GROUP_HALVES
  row_group_halves<R>(wbuf, cb, x, ldx, accs, first);
#else
  row_group<R>(wbuf, cb, x, ldx, accs, first);
#endif
}

static void row_group_any(int rows, const float* wbuf, int64_t cb, const float* x, int64_t ldx,
                          float* accs, bool first) {
  static_assert(kRowGroup <= 4, "row_group_any dispatches 1..4 rows");
  switch (rows) {
    case 1: row_group_of<1>(wbuf, cb, x, ldx, accs, first); break;
    case 2: row_group_of<(kRowGroup >= 2 ? 2 : 1)>(wbuf, cb, x, ldx, accs, first); break;
    case 3: row_group_of<(kRowGroup >= 3 ? 3 : 1)>(wbuf, cb, x, ldx, accs, first); break;
    default: row_group_of<kRowGroup>(wbuf, cb, x, ldx, accs, first); break;
  }
}

// M > kFusedMaxRows: dequantise a chunk of the tile once into L1, then run every row over it.
// y gets the sums of all kTile columns (padding rows of W included) as [M][kTile].
template <int FMT>
static void tile_buffered(const Layout& L, const uint8_t* qs, const float* sd, const float* sb,
                          const float* x, int64_t M, int64_t ldx, float* y,
                          std::vector<float>& accs) {
  alignas(64) float wbuf[kChunkBlocks * kTile * 32];
  if (accs.size() < static_cast<size_t>(M) * kTile * 16) accs.resize(M * kTile * 16);
  for (int64_t b0 = 0; b0 < L.blocks; b0 += kChunkBlocks) {
    const int64_t cb = std::min(kChunkBlocks, L.blocks - b0);
    for (int64_t bb = 0; bb < cb; ++bb)
      for (int c = 0; c < kTile; ++c) {
        V16 lo, hi;
        dequant<FMT>(L, qs, sd, sb, (b0 + bb) * kTile + c, lo, hi);
        vstore(wbuf + (bb * kTile + c) * 32, lo);
        vstore(wbuf + (bb * kTile + c) * 32 + 16, hi);
      }
    for (int64_t r0 = 0; r0 < M; r0 += kRowGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowGroup, M - r0));
      row_group_any(rows, wbuf, cb, x + r0 * ldx + 32 * b0, ldx, accs.data() + r0 * kTile * 16,
                    b0 == 0);
    }
  }
  hsum_many(accs.data(), M * kTile, y);
}

static inline __m128 bytes4_to_ps(const uint8_t* p, bool is_signed) {
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i v = _mm_cvtsi32_si128(word);
  return _mm_cvtepi32_ps(is_signed ? _mm_cvtepi8_epi32(v) : _mm_cvtepu8_epi32(v));
}

// The tile's scales as float32, per block and column (i = b * kTile + c): sd the factor, sb
// the offset of dequant() (Q6_K: the factors of the block's two halves). Every value is exact:
// fp16 times a small integer, or 8 d.
template <int FMT>
static void tile_scales(const Layout& L, const uint8_t* tile, float* sd, float* sb,
                        float* super_scales) {
  const int64_t count = L.blocks * kTile;
  static_assert(kTile == 4, "the K-quant scales below go four columns at a time");
  if (FMT == kQ4_K || FMT == kQ6_K) {
    const int64_t supers = count / 8;  // fp16 d (and Q4_K's dmin) per super block and column
    float* d = super_scales;
    float* dmin = super_scales + supers;
    convert_scales(tile, supers, d);
    if (FMT == kQ4_K) convert_scales(tile + 2 * supers, supers, dmin);
    const uint8_t* sc = tile + (FMT == kQ4_K ? 4 : 2) * supers;
    const __m128 sign = _mm_set1_ps(-0.0f);
    // Q6_K's int8 scales come in pairs per column; these bytes pick the four first, then the
    // four second ones.
    const __m128i halves = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t i = 0; i < count; i += kTile) {
      const int64_t s = (i / (8 * kTile)) * kTile;
      const __m128 d4 = _mm_loadu_ps(d + s);
      if (FMT == kQ4_K) {
        _mm_storeu_ps(sd + i, _mm_mul_ps(d4, bytes4_to_ps(sc + i, false)));
        const __m128 m4 = _mm_mul_ps(_mm_loadu_ps(dmin + s), bytes4_to_ps(sc + count + i, false));
        _mm_storeu_ps(sb + i, _mm_xor_ps(m4, sign));  // -(dmin m), as gguf subtracts it
      } else {
        const __m128i pairs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 2 * i));
        const __m128i split = _mm_shuffle_epi8(pairs, halves);
        _mm_storeu_ps(sd + i, _mm_mul_ps(d4, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(split))));
        const __m128i second = _mm_srli_si128(split, 4);
        _mm_storeu_ps(sb + i, _mm_mul_ps(d4, _mm_cvtepi32_ps(_mm_cvtepi8_epi32(second))));
      }
    }
    return;
  }
  convert_scales(tile, count, sd);
  if (FMT == kQ4_1) convert_scales(tile + 2 * count, count, sb);
  if (FMT == kQ4_0)
    for (int64_t i = 0; i < count; ++i) sb[i] = -8.0f * sd[i];
}

template <int FMT>
static void tiles(const Layout& L, const uint8_t* w, const float* x, int64_t M, const Output& y,
                  int64_t t0, int64_t t1) {
  std::vector<float> sd(L.blocks * kTile), sb(L.blocks * kTile), accs;
  std::vector<float> super_scales(L.blocks * kTile / 4 + 8), out(M * kTile);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * L.tile_bytes();
    const uint8_t* qs = tile + L.head_bytes();
    tile_scales<FMT>(L, tile, sd.data(), sb.data(), super_scales.data());
    const int64_t n0 = t * kTile, ncols = std::min<int64_t>(kTile, y.n - n0);
    float* o = out.data();  // [M][kTile], then stored in the output's dtype
    if (M > kFusedMaxRows) {
      tile_buffered<FMT>(L, qs, sd.data(), sb.data(), x, M, L.k(), o, accs);
    } else if (M == 1) {
      tile_fused<FMT, 1>(L, qs, sd.data(), sb.data(), x, L.k(), o, kTile, ncols);
    } else if (M == 2) {
      tile_fused<FMT, (kFusedMaxRows >= 2 ? 2 : 1)>(L, qs, sd.data(), sb.data(), x, L.k(), o,
                                                    kTile, ncols);
    } else if (M == 3) {
      tile_fused<FMT, (kFusedMaxRows >= 3 ? 3 : 1)>(L, qs, sd.data(), sb.data(), x, L.k(), o,
                                                    kTile, ncols);
    } else {
      tile_fused<FMT, (kFusedMaxRows >= 4 ? 4 : 1)>(L, qs, sd.data(), sb.data(), x, L.k(), o,
                                                    kTile, ncols);
    }
    y.store(o, M, n0, ncols);
  }
}

// y[M, N] = x[M, K] (float32) @ dequant(w)^T for tiles [t0, t1).
static void run_tiles(const Layout& L, const uint8_t* w, const float* x, int64_t M,
                      const Output& y, int64_t t0, int64_t t1) {
  switch (L.format) {
    case kQ8_0: tiles<kQ8_0>(L, w, x, M, y, t0, t1); break;
    case kQ4_0: tiles<kQ4_0>(L, w, x, M, y, t0, t1); break;
    case kQ4_1: tiles<kQ4_1>(L, w, x, M, y, t0, t1); break;
    case kQ4_K: tiles<kQ4_K>(L, w, x, M, y, t0, t1); break;
    default: tiles<kQ6_K>(L, w, x, M, y, t0, t1); break;
  }
}

// Column c of a tile as float32 weights [K] into row (its scales sd, sb as tile_scales gives
// them), each weight as dequant() gives it: gguf's own bits.
template <int FMT>
static void decode_column(const Layout& L, const uint8_t* tile, const float* sd, const float* sb,
                          int c, float* row) {
  for (int64_t b = 0; b < L.blocks; ++b) {
    V16 lo, hi;
    dequant<FMT>(L, tile + L.head_bytes(), sd, sb, b * kTile + c, lo, hi);
    vstore(row + 32 * b, lo);
    vstore(row + 32 * b + 16, hi);
  }
}

// dequant(W) as float32 rows [n][K] for tiles [t0, t1) (what the dense loader needs, without
// numpy's temporaries).
template <int FMT>
static void dequant_tiles(const Layout& L, const uint8_t* w, float* out, int64_t n, int64_t t0,
                          int64_t t1) {
  std::vector<float> sd(L.blocks * kTile), sb(L.blocks * kTile);
  std::vector<float> super_scales(L.blocks * kTile / 4 + 8);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * L.tile_bytes();
    tile_scales<FMT>(L, tile, sd.data(), sb.data(), super_scales.data());
    for (int c = 0; c < kTile && t * kTile + c < n; ++c)
      decode_column<FMT>(L, tile, sd.data(), sb.data(), c, out + (t * kTile + c) * L.k());
  }
}

// Rows rows[i0 .. i1) of dequant(W) as float32 [i][K] into out: an embedding lookup in the
// blocks.
template <int FMT>
static void dequant_rows(const Layout& L, const uint8_t* w, const int64_t* rows, float* out,
                         int64_t i0, int64_t i1) {
  std::vector<float> sd(L.blocks * kTile), sb(L.blocks * kTile);
  std::vector<float> super_scales(L.blocks * kTile / 4 + 8);
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* tile = w + rows[i] / kTile * L.tile_bytes();
    tile_scales<FMT>(L, tile, sd.data(), sb.data(), super_scales.data());
    decode_column<FMT>(L, tile, sd.data(), sb.data(), static_cast<int>(rows[i] % kTile),
                       out + i * L.k());
  }
}

static void run_dequant_rows(const Layout& L, const uint8_t* w, const int64_t* rows, float* out,
                             int64_t i0, int64_t i1) {
  switch (L.format) {
    case kQ8_0: dequant_rows<kQ8_0>(L, w, rows, out, i0, i1); break;
    case kQ4_0: dequant_rows<kQ4_0>(L, w, rows, out, i0, i1); break;
    case kQ4_1: dequant_rows<kQ4_1>(L, w, rows, out, i0, i1); break;
    case kQ4_K: dequant_rows<kQ4_K>(L, w, rows, out, i0, i1); break;
    default: dequant_rows<kQ6_K>(L, w, rows, out, i0, i1); break;
  }
}

static void run_dequant(const Layout& L, const uint8_t* w, float* out, int64_t n, int64_t t0,
                        int64_t t1) {
  switch (L.format) {
    case kQ8_0: dequant_tiles<kQ8_0>(L, w, out, n, t0, t1); break;
    case kQ4_0: dequant_tiles<kQ4_0>(L, w, out, n, t0, t1); break;
    case kQ4_1: dequant_tiles<kQ4_1>(L, w, out, n, t0, t1); break;
    case kQ4_K: dequant_tiles<kQ4_K>(L, w, out, n, t0, t1); break;
    default: dequant_tiles<kQ6_K>(L, w, out, n, t0, t1); break;
  }
}
