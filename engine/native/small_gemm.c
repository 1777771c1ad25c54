/* The small-batch GEMM of decode steps, on nn.Linear's [out, in] weights. */
#include "vec.h"

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for small M (decode batches), reading w in its nn.Linear layout.
 * At small M a GEMM is a stream over the weights; this one reads each weight row once per two rows of x
 * (tiles of 2 x-rows by 4 weight rows: 8 accumulators, 6 loads per 8 FMAs) and reached 16 GB/s at M=1
 * against oneDNN's 12 on this project's 2-core host. Needs AVX2/FMA and K % 8 == 0 (the wrapper checks
 * ``kvp_has_avx2``). x rows have stride xs; y is contiguous; threads split the weight rows. */
#ifdef HAVE_AVX2
static void linear_rows4(const float *x, int64_t xs, const float *w, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t n) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 z = _mm256_setzero_ps();
    for (int64_t m = 0; m < M; m += 2) {
        int pair = m + 1 < M;
        const float *x0 = x + m * xs, *x1 = pair ? x0 + xs : x0;
        __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
            __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
            __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
            a0 = _mm256_fmadd_ps(xa, v0, a0);
            a1 = _mm256_fmadd_ps(xa, v1, a1);
            a2 = _mm256_fmadd_ps(xa, v2, a2);
            a3 = _mm256_fmadd_ps(xa, v3, a3);
            a4 = _mm256_fmadd_ps(xb, v0, a4);
            a5 = _mm256_fmadd_ps(xb, v1, a5);
            a6 = _mm256_fmadd_ps(xb, v2, a6);
            a7 = _mm256_fmadd_ps(xb, v3, a7);
        }
        float r[8];
        _mm256_storeu_ps(r, reduce8(a0, a1, a2, a3, a4, a5, a6, a7));
        for (int j = 0; j < 4; j++) {
            float b = bias ? bias[n + j] : 0.0f;
            y[m * N + n + j] = r[j] + b;
            if (pair) y[(m + 1) * N + n + j] = r[4 + j] + b;
        }
    }
}
#endif

int kvp_has_avx2(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

void kvp_linear(const float *x, int64_t xs, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int nthreads) {
#ifdef HAVE_AVX2
    int64_t tiles = N / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) linear_rows4(x, xs, w, bias, y, M, N, K, 4 * t);
#endif
    for (int64_t n = kvp_has_avx2() ? N - N % 4 : 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot(x + m * xs, w + n * K, K) + (bias ? bias[n] : 0.0f);
}
