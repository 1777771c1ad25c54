/* The GEMM of decode steps and small mixed steps (the engine sends it up to 256 rows), on weights packed
 * into column panels. */
#include "kernels.h"
#include "vec.h"

/* Panel layout: the [N, K] weight of nn.Linear as ceil(N / 16) panels of [K][16] floats (output columns
 * n0..n0+15 of one k side by side, rows past N zero). A tile of MR x-rows times one panel keeps 2 * MR
 * vector accumulators in registers; each k costs two panel loads and MR broadcasts of x for 2 * MR FMAs
 * (the register blocking of BLIS's Haswell sgemm kernel). A panel is read from memory once and from L2 for
 * the next tiles of rows, so at a few rows this is a stream over the weights at memory bandwidth and at
 * tens of rows it is FMA bound. bench/native_kernels.py has the figures against oneDNN. */
#define PANEL 16
#define MAX_TILE_ROWS 6

#ifdef HAVE_AVX2
/* y rows [0, mr) (row stride ys), columns [0, ncols) of this panel, from x rows [0, mr) (stride xs), with
 * vec.h's register tile (mr a literal at every call). Also prefetches the first pf_lines lines (one per k)
 * from pf. */
static inline __attribute__((always_inline)) void tile(const int mr, const float *x, int64_t xs, const float *wp,
                                                      int64_t K, const float *bias, float *y, int64_t ys,
                                                      int64_t ncols, const float *pf, int64_t pf_lines) {
    __m256 lo[MAX_TILE_ROWS], hi[MAX_TILE_ROWS];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    fma_tile16(mr, x, xs, wp, PANEL, K, lo, hi, pf, pf_lines);
    if (ncols == PANEL) {
        __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
        __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            _mm256_storeu_ps(y + i * ys, _mm256_add_ps(lo[i], b0));
            _mm256_storeu_ps(y + i * ys + 8, _mm256_add_ps(hi[i], b1));
        }
        return;
    }
    float r[MAX_TILE_ROWS][PANEL]; /* the last panel of an N that is not a multiple of 16 */
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(r[i], lo[i]);
        _mm256_storeu_ps(r[i] + 8, hi[i]);
    }
    for (int i = 0; i < mr; i++)
        for (int64_t j = 0; j < ncols; j++) y[i * ys + j] = r[i][j] + (bias ? bias[j] : 0.0f);
}

/* Lines of the next panel tile t prefetches: its share, or what is left of the K lines. */
static inline int64_t share_lines(int64_t K, int64_t t, int64_t share) {
    int64_t left = K - t * share;
    return left < share ? left : share;
}

static void panel_rows(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t p) {
    int64_t n0 = p * PANEL, ncols = N - n0 < PANEL ? N - n0 : PANEL;
    const float *w = wp + p * K * PANEL, *b = bias ? bias + n0 : 0;
    /* Only the first tile reads this panel from memory; the later ones find it in cache and leave the
     * hardware prefetcher idle, so the next panel would start cold. Each tile therefore prefetches its
     * share of the next panel (paired runs over 30 layers: 0-18% faster at 16-96 rows, never slower beyond
     * the noise; a single tile streams on its own). */
    int64_t tiles = (M + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS, t = 0;
    int64_t share = tiles > 1 && n0 + PANEL < N ? (K + tiles - 1) / tiles : 0;
    const float *next = w + K * PANEL;
    int64_t m = 0;
    for (; m + MAX_TILE_ROWS <= M; m += MAX_TILE_ROWS, t++)
        tile(6, x + m * xs, xs, w, K, b, y + m * N + n0, N, ncols, next + t * share * PANEL,
             share_lines(K, t, share));
    const float *xr = x + m * xs, *pf = next + t * share * PANEL;
    float *yr = y + m * N + n0;
    int64_t lines = share_lines(K, t, share);
    switch (M - m) {
        case 5: tile(5, xr, xs, w, K, b, yr, N, ncols, pf, lines); break;
        case 4: tile(4, xr, xs, w, K, b, yr, N, ncols, pf, lines); break;
        case 3: tile(3, xr, xs, w, K, b, yr, N, ncols, pf, lines); break;
        case 2: tile(2, xr, xs, w, K, b, yr, N, ncols, pf, lines); break;
        case 1: tile(1, xr, xs, w, K, b, yr, N, ncols, pf, lines); break;
        default: break;
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

/* y[M, N] = x[M, K] @ w^T (+ bias) with w in panels (above). x rows have stride xs; y is contiguous;
 * threads split the panels. Without AVX2 a scalar loop over the same layout (callers keep their GEMM). */
void kvp_linear(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int nthreads) {
#ifdef HAVE_AVX2
    int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < panels; p++) panel_rows(x, xs, wp, bias, y, M, N, K, p);
#else
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const float *w = wp + (n / PANEL) * K * PANEL + n % PANEL;
            float s = bias ? bias[n] : 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * xs + k] * w[k * PANEL];
            y[m * N + n] = s;
        }
    (void)nthreads;
#endif
}
