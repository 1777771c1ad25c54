/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept quantized: GGUF blocks as llama.cpp stores them (Q4_0, Q4_1,
 * Q8_0: rows of 32-weight blocks, an fp16 scale in front of each; Q4_K, Q6_K: rows of 256-weight super-blocks,
 * each 32-weight sub-block with its own scales, quant_blocks.h) or int8 rows with one float scale per
 * output row. The weights are dequantized in registers, never written out as a float matrix.
 *
 * Two schedules (docs/architecture.md#quantized-weights):
 * - a few rows (decode): dot-product form. Each thread streams its share of W's rows once; per 32-weight
 *   block the 32 floats are made in registers (four AVX2 or two AVX-512 vectors, quant_blocks.h) and
 *   multiplied into every x row at once, so memory traffic is the quantized bytes (a Q4_1 weight is 5
 *   bits, 1/6 of float32) and x stays in L1.
 * - more rows (prefill, big batches): a slab of 12 W rows x 512 inputs is dequantized once into an L1
 *   buffer, then register tiles (3 x 3 on AVX2, 4 x 4 on AVX-512: x rows by slab rows, dot-product form)
 *   run every x row over it:
 *   the dequantization is paid once per weight per call and the FMAs run from L1.
 * Without AVX2/FMA a scalar loop computes the same sums (block by block). */
#include "kernels.h"
#include "quant_blocks.h"

/* At most this many x rows take the dot-product schedule, in tiles of up to DOT_TILE rows (measured on
 * SmolLM2's shapes with bench/quant_kernels.py, which builds other thresholds with -DDOT_MAX_ROWS=n). */
#ifndef DOT_MAX_ROWS
#define DOT_MAX_ROWS 4
#endif
#define DOT_TILE 4
#define SLAB 12  /* W rows per dequantized slab (3 or 4 register tiles' rows) */
#define KC 512   /* inputs per slab slice: 12 x 544 floats, 26 KiB, L1-resident */

#ifdef HAVE_AVX2
/* out[i] = x row i . W row (whole blocks, then a scalar tail of an int8 row), for i < mr (a literal). Up to
 * two rows get four accumulators each (blocks taken in pairs): at most one FMA per accumulator per block,
 * so the 4-cycle FMA latency never stalls the stream; more rows interleave their own chains. */
static inline __attribute__((always_inline)) void dot_rows(const int fmt, const int mr, const float *x,
                                                          int64_t xs, const uint8_t *row, float row_scale,
                                                          int64_t K, float *out) {
    const int nacc = mr <= 2 ? 4 : 2;
    vecf acc[DOT_TILE][4]; /* registers: the loops over mr, h and c unroll fully */
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < nacc; c++) acc[i][c] = v_zero();
    int64_t blocks = K / QK, blk = 0;
    for (; blk + 2 <= blocks; blk += 2) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            vecf w[BV];
            dequant_block_at(fmt, row, blk + h, row_scale, w);
            const float *xb = x + (blk + h) * QK;
#pragma GCC unroll 4
            for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
                for (int c = 0; c < BV; c++) {
                    int a = (h * BV + c) % nacc;
                    acc[i][a] = v_fma(w[c], v_load(xb + i * xs + VL * c), acc[i][a]);
                }
        }
    }
    if (blk < blocks) {
        vecf w[BV];
        dequant_block_at(fmt, row, blk, row_scale, w);
        const float *xb = x + blk * QK;
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
            for (int c = 0; c < BV; c++) acc[i][c % nacc] = v_fma(w[c], v_load(xb + i * xs + VL * c), acc[i][c % nacc]);
    }
    float tail[QK];
    int64_t rest = K - blocks * QK;
    if (rest) dequant_at_scalar(fmt, row, blocks, row_scale, rest, tail);
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        vecf sum = acc[i][0];
#pragma GCC unroll 4
        for (int c = 1; c < nacc; c++) sum = v_add(sum, acc[i][c]);
        float s = v_sum(sum);
        for (int64_t j = 0; j < rest; j++) s += tail[j] * x[i * xs + blocks * QK + j];
        out[i] = s;
    }
}

/* y[:, n] for every x row: output n of the dot-product schedule. */
static inline __attribute__((always_inline)) void dot_output(const int fmt, const float *x, int64_t xs,
                                                            const uint8_t *w, const float *scales,
                                                            const float *bias, float *y, int64_t M, int64_t N,
                                                            int64_t K, int64_t n) {
    int64_t row_bytes = row_bytes_of(fmt, K);
    const uint8_t *row = w + n * row_bytes;
    float s = scales ? scales[n] : 0.0f, out[DOT_TILE], b = bias ? bias[n] : 0.0f;
    for (int64_t m = 0; m < M; m += DOT_TILE) {
        int64_t mr = M - m < DOT_TILE ? M - m : DOT_TILE;
        const float *xm = x + m * xs;
        switch (mr) {
            case 4: dot_rows(fmt, 4, xm, xs, row, s, K, out); break;
            case 3: dot_rows(fmt, 3, xm, xs, row, s, K, out); break;
            case 2: dot_rows(fmt, 2, xm, xs, row, s, K, out); break;
            default: dot_rows(fmt, 1, xm, xs, row, s, K, out); break;
        }
        for (int64_t i = 0; i < mr; i++) y[(m + i) * N + n] = out[i] + b;
    }
}

/* CALL with the format as a literal: inside an OpenMP loop body, whose outlined function would otherwise
 * receive fmt as a variable and keep every format's branches in the inner loops (2-3x slower). */
#define FORMAT_LITERAL(CALL)                        \
    switch (fmt) {                                  \
        case FMT_Q4_0: CALL(FMT_Q4_0); break;       \
        case FMT_Q4_1: CALL(FMT_Q4_1); break;       \
        case FMT_Q8_0: CALL(FMT_Q8_0); break;       \
        case FMT_Q4_K: CALL(FMT_Q4_K); break;       \
        case FMT_Q6_K: CALL(FMT_Q6_K); break;       \
        default: CALL(FMT_INT8); break;             \
    }

static void dot_schedule(int fmt, const float *x, int64_t xs, const uint8_t *w, const float *scales,
                         const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
#define DOT_OUTPUT(F) dot_output(F, x, xs, w, scales, bias, y, M, N, K, n)
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) FORMAT_LITERAL(DOT_OUTPUT)
#undef DOT_OUTPUT
}

/* buf[r][k] = W[n0 + r][k0 + k] for r < rows, k < kc (row stride KC + QK): a slab of W dequantized. kc is
 * a multiple of 32 except at an int8 row's end, whose last block is dequantized as far as it goes. */
static inline __attribute__((always_inline)) void dequant_slab(const int fmt, const uint8_t *w,
                                                              int64_t row_bytes, const float *scales,
                                                              int64_t n0, int64_t rows, int64_t k0,
                                                              int64_t kc, float *buf) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = w + (n0 + r) * row_bytes;
        float s = scales ? scales[n0 + r] : 0.0f, *dst = buf + r * (KC + QK);
        int64_t kb = 0, b0 = k0 / QK;
        for (; kb + QK <= kc; kb += QK) {
            vecf v[BV];
            dequant_block_at(fmt, row, b0 + kb / QK, s, v);
            for (int c = 0; c < BV; c++) v_store(dst + kb + VL * c, v[c]);
        }
        if (kb < kc) dequant_at_scalar(fmt, row, b0 + kb / QK, s, kc - kb, dst + kb);
    }
}

/* Register tile of the slab schedule: 16 accumulators + 4 slab vectors + 1 x vector of AVX-512's 32
 * registers, 9 + 3 + 1 of AVX2's 16. */
#ifdef __AVX512F__
#define TILE_M 4
#define TILE_N 4
#else
#define TILE_M 3
#define TILE_N 3
#endif

/* y[i][j] (+)= x row i . slab row j over kc inputs, i < mr, j < nr (literals): mr * nr accumulators, each
 * step loads nr slab vectors and mr x vectors (the dot-product form of a register tile; no broadcasts).
 * The first K slice starts from the bias, the later ones add to y. */
static inline __attribute__((always_inline)) void slab_tile(const int mr, const int nr, const float *x,
                                                           int64_t xs, const float *wr, int64_t kc, float *y,
                                                           int64_t ys, int first, const float *bias) {
    vecf acc[TILE_M][TILE_N];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) acc[i][j] = v_zero();
    int64_t k = 0;
    for (; k + VL <= kc; k += VL) {
        vecf wv[TILE_N];
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) wv[j] = v_load(wr + j * (KC + QK) + k);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            vecf xv = v_load(x + i * xs + k);
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) acc[i][j] = v_fma(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) {
            float s = v_sum(acc[i][j]);
            for (int64_t t = k; t < kc; t++) s += x[i * xs + t] * wr[j * (KC + QK) + t];
            y[i * ys + j] = (first ? (bias ? bias[j] : 0.0f) : y[i * ys + j]) + s;
        }
}

#define SLAB_TILE(MR, NR) slab_tile(MR, NR, xm, xs, wr, kc, ym, N, first, bj)
#define SLAB_ROW_TILES(MR)                                      \
    switch (nr) {                                               \
        case 4: SLAB_TILE(MR, TILE_N > 3 ? 4 : 1); break;       \
        case 3: SLAB_TILE(MR, 3); break;                        \
        case 2: SLAB_TILE(MR, 2); break;                        \
        default: SLAB_TILE(MR, 1); break;                       \
    }
/* Slab p of the slab schedule: each K slice of its SLAB rows is dequantized once into an L1 buffer, then
 * every TILE_M-row tile of x runs over it in TILE_M x TILE_N register tiles. */
static inline __attribute__((always_inline)) void slab_rows(const int fmt, const float *x, int64_t xs,
                                                           const uint8_t *w, const float *scales,
                                                           const float *bias, float *y, int64_t M, int64_t N,
                                                           int64_t K, int64_t p) {
    int64_t row_bytes = row_bytes_of(fmt, K);
    float buf[SLAB * (KC + QK)];
    int64_t n0 = p * SLAB, rows = N - n0 < SLAB ? N - n0 : SLAB;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kc = K - k0 < KC ? K - k0 : KC;
        int first = k0 == 0;
        dequant_slab(fmt, w, row_bytes, scales, n0, rows, k0, kc, buf);
        for (int64_t m = 0; m < M; m += TILE_M) {
            int64_t mr = M - m < TILE_M ? M - m : TILE_M;
            const float *xm = x + m * xs + k0;
            for (int64_t j0 = 0; j0 < rows; j0 += TILE_N) {
                int64_t nr = rows - j0 < TILE_N ? rows - j0 : TILE_N;
                const float *wr = buf + j0 * (KC + QK), *bj = bias ? bias + n0 + j0 : 0;
                float *ym = y + m * N + n0 + j0;
                switch (mr) {
                    case 4: SLAB_ROW_TILES(TILE_M > 3 ? 4 : 1); break;
                    case 3: SLAB_ROW_TILES(3); break;
                    case 2: SLAB_ROW_TILES(2); break;
                    default: SLAB_ROW_TILES(1); break;
                }
            }
        }
    }
}

/* Threads split W into slabs of SLAB rows. */
static void slab_schedule(int fmt, const float *x, int64_t xs, const uint8_t *w, const float *scales,
                          const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t slabs = (N + SLAB - 1) / SLAB;
#define SLAB_ROWS(F) slab_rows(F, x, xs, w, scales, bias, y, M, N, K, p)
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < slabs; p++) FORMAT_LITERAL(SLAB_ROWS)
#undef SLAB_ROWS
}

#endif

#ifndef HAVE_AVX2
/* The scalar version: per output, block by block, the same products (any CPU). */
static void scalar_schedule(int fmt, const float *x, int64_t xs, const uint8_t *w, const float *scales,
                            const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t row_bytes = row_bytes_of(fmt, K);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float vals[QK];
        for (int64_t m = 0; m < M; m++) y[m * N + n] = bias ? bias[n] : 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += QK) {
            int64_t count = K - k0 < QK ? K - k0 : QK;
            dequant_at_scalar(fmt, w + n * row_bytes, k0 / QK, scales ? scales[n] : 0.0f, count, vals);
            for (int64_t m = 0; m < M; m++) y[m * N + n] += dot(vals, x + m * xs + k0, count);
        }
    }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias). w: N rows of K / 32 blocks (GGUF formats; K a multiple of 32) or of K
 * int8 values (FMT_INT8, with scales[N]); x rows have stride xs; y is contiguous. Threads split W's rows
 * (or 16-row panels). Returns 0, or -1 for an unknown format. */
int kvp_quant_linear(const float *x, int64_t xs, const uint8_t *w, const float *scales, int fmt,
                     const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (fmt < FMT_Q4_0 || fmt > FMT_LAST) return -1;
    if (M <= 0 || N <= 0) return 0;
#ifdef HAVE_AVX2
    if (M <= DOT_MAX_ROWS)
        dot_schedule(fmt, x, xs, w, scales, bias, y, M, N, K, nthreads);
    else
        slab_schedule(fmt, x, xs, w, scales, bias, y, M, N, K, nthreads);
#else
    scalar_schedule(fmt, x, xs, w, scales, bias, y, M, N, K, nthreads);
#endif
    return 0;
}

/* y[N, K] = W dequantized to float32 (for large batches, where a float32 GEMM library beats the slab
 * schedule; callers dequantize a slice of rows at a time). Returns 0, or -1 for an unknown format. */
int kvp_quant_dequantize(const uint8_t *w, const float *scales, int fmt, float *y, int64_t N, int64_t K,
                         int nthreads) {
    if (fmt < FMT_Q4_0 || fmt > FMT_LAST) return -1;
    int64_t row_bytes = row_bytes_of(fmt, K);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *src = w + n * row_bytes;
        float s = scales ? scales[n] : 0.0f, *dst = y + n * K;
        for (int64_t k = 0; k < K; k += QK) {
            int64_t count = K - k < QK ? K - k : QK;
#ifdef HAVE_AVX2
            if (count == QK) {
                vecf v[BV];
#define DEQUANT_BLOCK(F) dequant_block_at(F, src, k / QK, s, v)
                FORMAT_LITERAL(DEQUANT_BLOCK)
#undef DEQUANT_BLOCK
                for (int c = 0; c < BV; c++) v_store(dst + k + VL * c, v[c]);
                continue;
            }
#endif
            dequant_at_scalar(fmt, src, k / QK, s, count, dst + k);
        }
    }
    return 0;
}

/* Whether kvp_quant_linear has its vector kernels (else the scalar loop). */
int kvp_quant_has_avx2(void) {
#ifdef HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}
