/* Shared inline helpers of the native kernels: a vectorizable exp, dot products, lane reductions.
 * Everything here is static inline, so each kernel file gets its own copy and the library no symbols. */
#ifndef KVPILOT_NATIVE_VEC_H
#define KVPILOT_NATIVE_VEC_H
#include <math.h>
#include <stdint.h>

/* exp(x) to ~2 ulp: Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for exp(r) (Cephes'
 * expf coefficients) and 2^n built in the exponent bits. Inputs are clamped to [-87, 88], so exp(-inf)
 * gives ~1e-38, never a NaN. exp8 is the AVX2 version (glibc's vector expf needs -ffinite-math-only);
 * exp_approx the scalar one, for tails and non-AVX2 builds. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO 2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = rintf(x * LOG2E);
    float r = x - n * LN2_HI + n * LN2_LO;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The register tile of the GEMM-shaped kernels: lo[i] / hi[i] += sum_k a[i][k] * b[k][0:8] / b[k][8:16] for
 * rows i < mr, k < K (a rows have stride as, b rows stride bs): per k, two loads of b and mr broadcasts of a
 * for 2 * mr FMAs (BLIS's Haswell sgemm blocking, mr <= 6). mr must be a literal at every call: the loops
 * then unroll and the 2 * mr accumulators stay in registers (any indexing the compiler cannot resolve
 * spills them to the stack every k, 3x slower). Also prefetches pf + k * bs for k < pf_lines. */
static inline __attribute__((always_inline)) void fma_tile16(const int mr, const float *a, int64_t as,
                                                            const float *b, int64_t bs, int64_t K, __m256 *lo,
                                                            __m256 *hi, const float *pf, int64_t pf_lines) {
    for (int64_t k = 0; k < K; k++) {
        __m256 b0 = _mm256_loadu_ps(b + k * bs), b1 = _mm256_loadu_ps(b + k * bs + 8);
        if (k < pf_lines) _mm_prefetch((const char *)(pf + k * bs), _MM_HINT_T0);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m256 x = _mm256_broadcast_ss(a + i * as + k);
            lo[i] = _mm256_fmadd_ps(x, b0, lo[i]);
            hi[i] = _mm256_fmadd_ps(x, b1, hi[i]);
        }
    }
}

/* The sum of v's eight lanes, in lane order. */
static inline float hsum8(__m256 v) {
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, v);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    return sum;
}

/* One vector of the lane sums of a0..a7, in that order (a transposing reduction). */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* x[i] = exp(x[i] - shift) for i < n; returns their sum. */
static inline float exp_shifted_sum(float *x, int64_t n, float shift) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; i < n; i++) {
        x[i] = exp_approx(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* x[i] = cap * tanh(x[i] / cap) for i < n: Gemma 2's attention-logit soft-capping
 * (docs/models.md#gemma-2), with tanh(y) = 1 - 2 / (exp(2y) + 1), which saturates to +-1 through exp's
 * clamping; ~1e-7 absolute error near 0, times cap. 8 lanes at a time on AVX2 (libm's tanhf per score
 * made a soft-capped decode x2 and prefill x3 slower). */
static inline void softcap_rows(float *x, int64_t n, float cap) {
    float k = 2.0f / cap;
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 kv = _mm256_set1_ps(k), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    __m256 c = _mm256_set1_ps(cap);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(x + i), kv));
        __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(t, c));
    }
#endif
    for (; i < n; i++) x[i] = cap * (1.0f - 2.0f / (exp_approx(x[i] * k) + 1.0f));
}

#endif
