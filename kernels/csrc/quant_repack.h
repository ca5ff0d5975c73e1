// GGUF block bytes -> the kernel's tile layout (see Layout in quant_linear.cpp), one pass over
// the file's bytes: the same bytes as quant_formats.py's numpy repack, which is its reference
// (tests compare the two). Plain C++, compiled for the baseline target. Included once by
// quant_linear.cpp inside its anonymous namespace, after Layout.

// Byte offsets of a tile's sections, in quant_formats.FORMATS order.
struct Sections {
  int64_t d = 0, m = 0, dmin = 0, sc = 0, q = 0;
};

Sections sections_of(const Layout& L) {
  const int64_t count = L.blocks * kTile, supers = count / 8;
  Sections s;
  switch (L.format) {
    case kQ4_1: s.m = 2 * count; s.q = 4 * count; break;
    case kQ4_K:
      s.dmin = 2 * supers;
      s.sc = 4 * supers;
      s.m = s.sc + count;
      s.q = s.m + count;
      break;
    case kQ6_K: s.sc = 2 * supers; s.q = s.sc + 2 * count; break;
    default: s.q = 2 * count; break;  // Q8_0, Q4_0
  }
  return s;
}

// 32 values 0..15 -> 16 bytes: value j in the low nibble, value j + 16 in the high one.
inline void nibbles_q4_0_order(const uint8_t* v, uint8_t* out) {
  for (int t = 0; t < 16; ++t) out[t] = static_cast<uint8_t>(v[t] | (v[t + 16] << 4));
}

// One 32-weight block (Q8_0, Q4_0, Q4_1) of tile column c, block b.
void repack_block32(const Layout& L, const Sections& s, const uint8_t* src, int64_t b, int c,
                    uint8_t* tile) {
  const int64_t i = b * kTile + c;
  std::memcpy(tile + s.d + 2 * i, src, 2);
  if (L.format == kQ4_1) std::memcpy(tile + s.m + 2 * i, src + 2, 2);
  const int64_t head = L.format == kQ4_1 ? 4 : 2;
  std::memcpy(tile + s.q + L.quant_bytes() * i, src + head, L.quant_bytes());
}

// One 256-weight Q4_K super block of tile column c, super block sb.
void repack_q4_k(const Sections& s, const uint8_t* src, int64_t sb, int c, uint8_t* tile) {
  std::memcpy(tile + s.d + 2 * (sb * kTile + c), src, 2);
  std::memcpy(tile + s.dmin + 2 * (sb * kTile + c), src + 2, 2);
  const uint8_t* k = src + 4;  // 12 bytes of 6-bit scales and mins (gguf's get_scale_min)
  const uint8_t* qs = src + 16;
  for (int j = 0; j < 8; ++j) {
    const int64_t i = (sb * 8 + j) * kTile + c;
    const bool low = j < 4;
    tile[s.sc + i] = low ? (k[j] & 63) : ((k[j + 4] & 0x0F) | ((k[j - 4] >> 6) << 4));
    tile[s.m + i] = low ? (k[j + 4] & 63) : ((k[j + 4] >> 4) | ((k[j] >> 6) << 4));
    uint8_t v[32];  // sub block j: low nibbles of qs[32 (j / 2) ...] when j is even, else high
    for (int l = 0; l < 32; ++l) v[l] = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F;
    nibbles_q4_0_order(v, tile + s.q + 16 * i);
  }
}

// One 256-weight Q6_K super block of tile column c, super block sb.
void repack_q6_k(const Sections& s, const uint8_t* src, int64_t sb, int c, uint8_t* tile) {
  const uint8_t* ql = src;
  const uint8_t* qh = src + 128;
  std::memcpy(tile + s.d + 2 * (sb * kTile + c), src + 208, 2);
  uint8_t v[256];  // six-bit values as gguf's Q6_K.dequantize_blocks orders them
  for (int w = 0; w < 256; ++w) {
    const int h = w / 128, r = w % 128;
    const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
    const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
    v[w] = static_cast<uint8_t>(low | (high << 4));
  }
  for (int j = 0; j < 8; ++j) {
    const int64_t i = (sb * 8 + j) * kTile + c;
    std::memcpy(tile + s.sc + 2 * i, src + 192 + 2 * j, 2);  // int8 scales of its two halves
    const uint8_t* b = v + 32 * j;
    uint8_t lo[32];
    for (int l = 0; l < 32; ++l) lo[l] = b[l] & 0x0F;
    uint8_t* q = tile + s.q + 24 * i;
    nibbles_q4_0_order(lo, q);
    for (int t = 0; t < 8; ++t)  // byte t: weights t, t + 8, t + 16, t + 24 of the block
      q[16 + t] = static_cast<uint8_t>((b[t] >> 4) | ((b[t + 8] >> 4) << 2) |
                                       ((b[t + 16] >> 4) << 4) | ((b[t + 24] >> 4) << 6));
  }
}

// Tiles [t0, t1) of the packed weight from raw ([n, row_bytes] GGUF blocks); rows past n
// stay zero (out is zero-filled by the caller).
void repack_tiles(const Layout& L, const uint8_t* raw, int64_t n, int64_t row_bytes,
                  uint8_t* out, int64_t t0, int64_t t1) {
  const Sections s = sections_of(L);
  const bool k_quant = L.format >= kQ4_K;
  const int64_t block_bytes = k_quant ? (L.format == kQ4_K ? 144 : 210) : L.quant_bytes() +
                                                                           (L.format == kQ4_1 ? 4 : 2);
  const int64_t units = row_bytes / block_bytes;
  for (int64_t t = t0; t < t1; ++t) {
    uint8_t* tile = out + t * L.tile_bytes();
    for (int c = 0; c < kTile && t * kTile + c < n; ++c) {
      const uint8_t* row = raw + (t * kTile + c) * row_bytes;
      for (int64_t u = 0; u < units; ++u) {
        const uint8_t* src = row + u * block_bytes;
        if (L.format == kQ4_K)
          repack_q4_k(s, src, u, c, tile);
        else if (L.format == kQ6_K)
          repack_q6_k(s, src, u, c, tile);
        else
          repack_block32(L, s, src, u, c, tile);
      }
    }
  }
}
