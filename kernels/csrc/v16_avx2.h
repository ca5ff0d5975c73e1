// 16 float lanes as two AVX2 registers and their basic operations: included inside an AVX2
// namespace and target region (quant_linear.cpp, cpu_ops_impl.h). Lane l holds element l.
struct V16 {
  __m256 a, b;  // lanes 0..7, 8..15
};
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void vstore(float* p, V16 v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
static inline V16 vset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline V16 vfma(V16 x, V16 y, V16 z) {
  return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
static inline V16 vmul(V16 x, V16 y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline V16 vdiv(V16 x, V16 y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
