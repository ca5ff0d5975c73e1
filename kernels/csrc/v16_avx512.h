// 16 float lanes as one AVX-512 register and their basic operations (v16_avx2.h's, lane for
// lane): included inside an AVX-512 namespace and target region.
struct V16 {
  __m512 v;
};
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline void vstore(float* p, V16 x) { _mm512_storeu_ps(p, x.v); }
static inline V16 vset1(float s) { return {_mm512_set1_ps(s)}; }
static inline V16 vfma(V16 x, V16 y, V16 z) { return {_mm512_fmadd_ps(x.v, y.v, z.v)}; }
static inline V16 vmul(V16 x, V16 y) { return {_mm512_mul_ps(x.v, y.v)}; }
static inline V16 vdiv(V16 x, V16 y) { return {_mm512_div_ps(x.v, y.v)}; }
