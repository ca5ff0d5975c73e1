// The K-quant linears (Q4_K, Q6_K) with int8 activations, llama.cpp's numerics: each row of x
// is quantised per 256 values (one float32 scale dx = amax / 127, values rounded to the nearest
// int8, ties to even) and every block's dot product is taken in integers (u8 weights x s8
// activations with vpmaddubsw, then the block's integer scale with vpmaddwd). Only a super
// block's totals (256 weights) meet floating point:
//   Q4_K: y = sum_s (d dx) * sum_j sc_j (q . x)_j  -  sum_s (dmin dx) * sum_j m_j sum(x_j)
//   Q6_K: y = sum_s (d dx) * (sum_h sc_h (q . x)_h - 32 sum_h sc_h sum(x_h))  (h: 16 weights)
// The sums of x (per 32 or 16 values) meet the weights' mins or scales once per super block,
// outside the loop over its blocks, which is left with the products alone.
// Per output column there are 4 float32 lanes of each sum, walked over the super blocks in
// order and added by a fixed tree at the end (Q4_K: the first total minus the second).
//
// Batch invariance holds by construction: a row's quantisation reads only that row; the
// integer sums are exact (a vpmaddubsw pair is at most 2 * 63 * 127 < 2^15, a Q4_K pair of
// them 2 * 15 * 127 * 2; a super block's lane < 2^31); the float32 steps, per lane, are the
// same sequence whatever M, the other rows, the register blocking or the thread split. The
// code uses AVX2 intrinsics only, so the AVX2 and AVX-512 builds (the latter with 32 registers
// for more rows at once) give the same bits.
//
// Included by quant_linear.cpp once per instruction set, after quant_linear_body.h, inside
// that set's namespace and target region; needs kQ8Rows (rows per pass at most) defined there
// and Q8Rows (quant_linear.cpp) in scope.

// The sums of a quantised row's values per super block as Q8Rows' aux holds them: per 16
// values (halves, Q6_K's) or per 32 (Q4_K's, the last 8 of the 16 entries zero).
static void q8k_aux_sums(const int8_t* q, int64_t k, int16_t* aux, bool halves) {
  for (int64_t s = 0; s < k / 256; ++s) {
    const int8_t* qs = q + 256 * s;
    int16_t* a = aux + kAuxPerSuper * s;
    for (int h = 0; h < 16; ++h) {
      const int width = halves ? 16 : 32;
      int sum = 0;
      if (halves || h < 8)
        for (int i = 0; i < width; ++i) sum += qs[width * h + i];
      a[h] = static_cast<int16_t>(sum);
    }
  }
}

// Row x [k] -> q, d, aux as Q8Rows describes (k a multiple of 256).
static void q8k_quantize_row(const float* x, int64_t k, int8_t* q, float* d, int16_t* aux,
                             bool halves) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t s = 0; s < k / 256; ++s) {
    const float* xs = x + 256 * s;
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 256; i += 8)
      amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, amax8);
    float amax = 0.0f;
    for (float v : lanes) amax = std::max(amax, v);
    d[s] = amax / 127.0f;
    const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    int8_t* qs = q + 256 * s;
    for (int i = 0; i < 256; i += 32) {
      // cvtps rounds to nearest even (the default MXCSR mode); |x * inv| <= 127 + rounding.
      __m256i v[4];
      for (int u = 0; u < 4; ++u)
        v[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + i + 8 * u), inv));
      const __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
      const __m256i b = _mm256_packs_epi16(w01, w23);  // lanes interleaved by the two packs
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + i),
                          _mm256_permutevar8x32_epi32(b, order));
    }
  }
  q8k_aux_sums(q, k, aux, halves);
}

// Two bytes a (p[0]) and b (p[1]) as 16-bit lanes: [a x 8 | b x 8], unsigned.
static inline __m256i pair_u8(const uint8_t* p) {
  uint16_t w;
  std::memcpy(&w, p, 2);
  const __m256i pick = _mm256_setr_epi8(0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1, 0, -1,
                                        1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  return _mm256_shuffle_epi8(_mm256_set1_epi16(static_cast<int16_t>(w)), pick);
}

// Signed bytes p[i0] and p[i0 + 2] of four as 16-bit lanes: [p[i0] x 8 | p[i0 + 2] x 8].
static inline __m256i pair_s8(uint32_t word, int i0) {
  const char a = static_cast<char>(i0), b = static_cast<char>(i0 + 2);
  const __m256i pick = _mm256_setr_epi8(-1, a, -1, a, -1, a, -1, a, -1, a, -1, a, -1, a, -1, a,
                                        -1, b, -1, b, -1, b, -1, b, -1, b, -1, b, -1, b, -1, b);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(word)), pick);
  return _mm256_srai_epi16(v, 8);
}

// q6_bytes (quant_linear_body.h) for two adjacent blocks at q (24 bytes each) at once: lo holds
// weights 0-15 of the first block then of the second, hi weights 16-31 likewise.
static inline void q6_pair_bytes(const uint8_t* q, __m256i& lo, __m256i& hi) {
  const __m256i v = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 24)), 1);
  uint64_t h0, h1;
  std::memcpy(&h0, q + 16, 8);
  std::memcpy(&h1, q + 40, 8);
  const __m256i h = _mm256_set_epi64x(static_cast<int64_t>(h1), static_cast<int64_t>(h1),
                                      static_cast<int64_t>(h0), static_cast<int64_t>(h0));
  const __m256i shift = _mm256_set_epi64x(2, 0, 2, 0);
  const __m256i nib = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i high_lo = _mm256_and_si256(_mm256_srlv_epi64(_mm256_slli_epi64(h, 4), shift), top);
  const __m256i high_hi = _mm256_and_si256(_mm256_srlv_epi64(h, shift), top);
  lo = _mm256_or_si256(_mm256_and_si256(v, nib), high_lo);
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), high_hi);
}

static inline __m256i bcast16(const void* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Rows [r0, r0 + R) of a tile, all four columns in one pass (P = 2 column pairs: the tile is
// read once, in order, and each row's x once per block): out[r][0 .. kTile). d, dmin: the
// tile's super block scales as float32, [super block][kTile].
// ahead: bytes to prefetch into L2 while the blocks go by (a tile two ahead; nullptr: none), about
// ahead_bytes / blocks of them per block. Without it, a 32768 x 2048 Q6_K weight at one row
// read 8.2 GB/s from DRAM (1 thread; 16.1 on 2) against 10.8 (22.8) with it, AMD EPYC Genoa:
// its arithmetic per byte left the hardware prefetchers behind.
template <int FMT, int R>
static void q8k_pass(const Layout& L, const uint8_t* tile, const float* d, const float* dmin,
                     const int16_t* sums, const Q8Rows& X, int64_t r0, float* out,
                     const uint8_t* ahead, int64_t ahead_bytes) {
  static_assert(kTile == 4, "a pass covers two column pairs");
  constexpr int P = 2;
  const Sections sec = sections_of(L);
  const uint8_t* qs = tile + sec.q;
  const uint8_t* sc = tile + sec.sc;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  // whole cache lines per block, enough to cover ahead_bytes (no division in the loop)
  const int64_t ahead_step = 64 * ((ahead_bytes + 64 * L.blocks - 1) / (64 * L.blocks));
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = X.qrow(r0 + r);
  __m256 facc[R][P], macc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) facc[r][p] = macc[r][p] = _mm256_setzero_ps();
  for (int64_t s = 0; s < L.blocks / 8; ++s) {
    __m256i isum[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) isum[r][p] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      if (ahead != nullptr)
        for (int64_t off = b * ahead_step; off < (b + 1) * ahead_step && off < ahead_bytes;
             off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T1);
      for (int p = 0; p < P; ++p) {
        const int64_t i = b * kTile + 2 * p;
        if (FMT == kQ4_K) {
          const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 16 * i));
          const __m256i lo = _mm256_and_si256(qv, m4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qv, 4), m4);
          const __m256i scv = pair_u8(sc + i);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = xrow[r] + 32 * b;
            const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast16(x)),
                                               _mm256_maddubs_epi16(hi, bcast16(x + 16)));
#ifdef Q8K_VNNI
            isum[r][p] = _mm256_dpwssd_epi32(isum[r][p], q, scv);
#else
            isum[r][p] = _mm256_add_epi32(isum[r][p], _mm256_madd_epi16(q, scv));
#endif
          }
        } else {
          __m256i lo, hi;
          q6_pair_bytes(qs + 24 * i, lo, hi);
          uint32_t word;
          std::memcpy(&word, sc + 2 * i, 4);  // [c lo, c hi, c + 1 lo, c + 1 hi]
          const __m256i slo = pair_s8(word, 0), shi = pair_s8(word, 1);
          for (int r = 0; r < R; ++r) {
            const int8_t* x = xrow[r] + 32 * b;
            const __m256i pl = _mm256_maddubs_epi16(lo, bcast16(x));
            const __m256i ph = _mm256_maddubs_epi16(hi, bcast16(x + 16));
#ifdef Q8K_VNNI
            isum[r][p] = _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(isum[r][p], pl, slo), ph, shi);
#else
            isum[r][p] = _mm256_add_epi32(
                isum[r][p],
                _mm256_add_epi32(_mm256_madd_epi16(pl, slo), _mm256_madd_epi16(ph, shi)));
#endif
          }
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      const int64_t e = s * kTile + 2 * p;
      // per (super block, column pair): Q4_K [m_j of c | of c + 1]; Q6_K those of sc_h,
      // h 0-7 then 8-15 (tile_sums in q8k_tiles)
      const int16_t* ts = sums + (s * 2 + p) * (FMT == kQ4_K ? 16 : 32);
      const __m256 dd = _mm256_set_m128(_mm_set1_ps(d[e + 1]), _mm_set1_ps(d[e]));
      __m256 dm = _mm256_setzero_ps();
      if (FMT == kQ4_K) dm = _mm256_set_m128(_mm_set1_ps(dmin[e + 1]), _mm_set1_ps(dmin[e]));
      for (int r = 0; r < R; ++r) {
        const int16_t* a = X.auxrow(r0 + r) + kAuxPerSuper * s;
        __m256i isr = isum[r][p];
        if (FMT == kQ6_K) {  // - 32 sum_h sc_h sum(x_h)
          const __m256i corr = _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ts)),
                                bcast16(a)),
              _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ts + 16)),
                                bcast16(a + 8)));
          isr = _mm256_sub_epi32(isr, _mm256_slli_epi32(corr, 5));
        }
        const __m256 dx = _mm256_set1_ps(X.drow(r0 + r)[s]);
        facc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isr), _mm256_mul_ps(dd, dx), facc[r][p]);
        if (FMT == kQ4_K) {
          const __m256i msum = _mm256_madd_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ts)), bcast16(a));
          macc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, dx),
                                       macc[r][p]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      float f[8], m[8];
      _mm256_storeu_ps(f, facc[r][p]);
      _mm256_storeu_ps(m, macc[r][p]);
      for (int h = 0; h < 2; ++h) {
        const float* a = f + 4 * h;
        const float* b = m + 4 * h;
        out[r * kTile + 2 * p + h] =
            ((a[0] + a[1]) + (a[2] + a[3])) - ((b[0] + b[1]) + (b[2] + b[3]));
      }
    }
}

// The weights' side of the per-super-block sums, per (super block, column pair) as 16-bit
// lanes [column c | column c + 1], 8 each: Q4_K the mins m_j (j = 0..7); Q6_K the scales sc_h
// of the 16-weight halves h = 0..7, then h = 8..15 (h = 2 j + half).
template <int FMT>
static void tile_sums(const Layout& L, const uint8_t* tile, int16_t* out) {
  const Sections sec = sections_of(L);
  const int64_t count = L.blocks * kTile;
  for (int64_t s = 0; s < L.blocks / 8; ++s) {
    if (FMT == kQ4_K) {
      // 32 mins, byte 4 j + c -> per 128-bit lane [c0 j0-3 | c1 | c2 | c3] (j 0-3, then 4-7)
      const __m256i by_column = _mm256_setr_epi8(
          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
          0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
      const __m256i m = _mm256_shuffle_epi8(
          _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(tile + sec.sc + count + 32 * s)),
          by_column);
      for (int pair = 0; pair < 2; ++pair) {
        const int c = 2 * pair;  // [c j0-3, c j4-7, c+1 j0-3, c+1 j4-7]
        const __m256i g = _mm256_permutevar8x32_epi32(
            m, _mm256_setr_epi32(c, c + 4, c + 1, c + 5, 0, 0, 0, 0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (s * 2 + pair) * 16),
                            _mm256_cvtepu8_epi16(_mm256_castsi256_si128(g)));
      }
    } else {
      // 64 scales, byte 8 j + 2 c + part; h = 2 j + part; j 0-3 (h 0-7) then j 4-7
      const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      for (int quarter = 0; quarter < 2; ++quarter) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(tile + sec.sc + 64 * s + 32 * quarter));
        for (int pair = 0; pair < 2; ++pair) {  // 32-bit groups 2 j + pair: (c, c+1) of j
          const __m256i g = _mm256_permutevar8x32_epi32(
              v, _mm256_setr_epi32(pair, pair + 2, pair + 4, pair + 6, 0, 0, 0, 0));
          const __m128i bytes = _mm_shuffle_epi8(_mm256_castsi256_si128(g), split);
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(out + (s * 2 + pair) * 32 + 16 * quarter),
              _mm256_cvtepi8_epi16(bytes));
        }
      }
    }
  }
}

template <int FMT>
static void q8k_rows(int rows, const Layout& L, const uint8_t* tile, const float* d,
                     const float* dmin, const int16_t* sums, const Q8Rows& X, int64_t r0,
                     float* out, const uint8_t* ahead, int64_t ahead_bytes) {
  static_assert(kQ8Rows <= 8, "q8k_rows dispatches 1..8 rows");
#define Q8K_ROWS_CASE(n)                                                                    \
  case n:                                                                                   \
    q8k_pass<FMT, (n <= kQ8Rows ? n : 1)>(L, tile, d, dmin, sums, X, r0, out, ahead,        \
                                          ahead_bytes);                                     \
    break;
  switch (rows) {
    Q8K_ROWS_CASE(1)
    Q8K_ROWS_CASE(2)
    Q8K_ROWS_CASE(3)
    Q8K_ROWS_CASE(4)
    Q8K_ROWS_CASE(5)
    Q8K_ROWS_CASE(6)
    Q8K_ROWS_CASE(7)
    default:
      q8k_pass<FMT, kQ8Rows>(L, tile, d, dmin, sums, X, r0, out, ahead, ahead_bytes);
  }
#undef Q8K_ROWS_CASE
}

template <int FMT>
static void q8k_tiles(const Layout& L, const uint8_t* w, const Q8Rows& X, int64_t M,
                      const Output& y, int64_t t0, int64_t t1) {
  static_assert(kTile == 4, "a pass covers two column pairs or one");
  const int64_t supers = L.blocks / 2;  // (super block, column) pairs of a tile
  std::vector<float> scales(2 * supers + 8), out(M * kTile);
  std::vector<int16_t> sums(L.blocks / 8 * 2 * 32);
  float* d = scales.data();
  float* dmin = d + supers;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * L.tile_bytes();
    convert_scales(tile, supers, d);
    if (FMT == kQ4_K) convert_scales(tile + 2 * supers, supers, dmin);
    tile_sums<FMT>(L, tile, sums.data());
    // The tile two ahead is prefetched into L2, spread over this tile's blocks: Q6_K always;
    // Q4_K from K = 4096 on. Measured on an AMD EPYC Genoa, 2 threads, one row: the 8B shape's
    // Q4_K layers (K = 4096) read 15-17 GB/s with no prefetch and 22-23 with the next tile's
    // into L1; the 1B shape's (K = 2048, tiles of 4.6 KB) 27-28 without and 24-26 with. Into
    // L2 and two tiles ahead instead of L1 and one (scratch kb_dram.py, distinct 8B-shape
    // matrices cycled so that none is in L3, quiet machine, interleaved): 1 thread 14.1-14.2
    // -> 18.3-18.5 GB/s, 2 threads 20.0-23.6 -> 24.2-27.0; 4 tiles ahead gave the same.
    const bool ahead = FMT == kQ6_K || L.blocks >= 128;
    const uint8_t* next = ahead && t + 2 < t1 ? tile + 2 * L.tile_bytes() : nullptr;
    const int64_t tb = L.tile_bytes();
    for (int64_t r0 = 0; r0 < M; r0 += kQ8Rows, next = nullptr) {
      const int rows = static_cast<int>(std::min<int64_t>(kQ8Rows, M - r0));
      q8k_rows<FMT>(rows, L, tile, d, dmin, sums.data(), X, r0, out.data() + r0 * kTile, next,
                    tb);
    }
    const int64_t n0 = t * kTile;
    y.store(out.data(), M, n0, std::min<int64_t>(kTile, y.n - n0));
  }
}

static void run_q8k(const Layout& L, const uint8_t* w, const Q8Rows& X, int64_t M,
                    const Output& y, int64_t t0, int64_t t1) {
  if (L.format == kQ4_K)
    q8k_tiles<kQ4_K>(L, w, X, M, y, t0, t1);
  else
    q8k_tiles<kQ6_K>(L, w, X, M, y, t0, t1);
}
