/* y[M, N] = x[M, K] @ W^T (+ bias) with W kept quantized: GGUF blocks as llama.cpp stores them (Q4_0, Q4_1,
 * Q8_0: rows of 32-weight blocks, an fp16 scale in front of each) or int8 rows with one float scale per
 * output row. The weights are dequantized in registers, never written out as a float matrix.
 *
 * Two schedules (docs/architecture.md#quantized-weights):
 * - a few rows (decode): dot-product form. Each thread streams its share of W's rows once; per 32-weight
 *   block the 32 floats are made in four AVX registers and multiplied into every x row at once, so memory
 *   traffic is the quantized bytes (a Q4_1 weight is 5 bits, 1/6 of float32) and x stays in L1.
 * - more rows (prefill, big batches): a slab of 12 W rows x 512 inputs is dequantized once into an L1
 *   buffer, then 3 x 3 register tiles (3 x rows by 3 slab rows, dot-product form) run every x row over it:
 *   the dequantization is paid once per weight per call and the FMAs run from L1.
 * Without AVX2/FMA a scalar loop computes the same sums (block by block). */
#include <string.h>

#include "vec.h"
#if defined(__F16C__) && !defined(HAVE_AVX2)
#include <immintrin.h>
#endif

#define QK 32 /* weights per block (every format; int8 rows are read in 32-weight chunks too) */
enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_INT8 = 3 };
static const int64_t BLOCK_BYTES[] = {18, 20, 34, 32};
/* At most this many x rows take the dot-product schedule, in tiles of up to DOT_TILE rows (measured on
 * SmolLM2's shapes with bench/quant_kernels.py, which builds other thresholds with -DDOT_MAX_ROWS=n). */
#ifndef DOT_MAX_ROWS
#define DOT_MAX_ROWS 4
#endif
#define DOT_TILE 4
#define SLAB 12  /* W rows per dequantized slab (3 or 4 register tiles' rows) */
#define KC 512   /* inputs per slab slice: 12 x 544 floats, 26 KiB, L1-resident */

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal half: normalise into a float */
        exp = 127 - 15 + 1;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    union { uint32_t u; float f; } v = {.u = bits};
    return v.f;
#endif
}

/* Block scale (d) and offset of one block: w = d * q + offset for Q4 (q the unsigned nibble; offset -8 d
 * for Q4_0, the stored min for Q4_1), w = d * q for the int8 formats (offset 0). */
static inline void block_scale(int fmt, const uint8_t *b, float row_scale, float *d, float *offset) {
    *d = fmt == FMT_INT8 ? row_scale : half_to_float(b);
    *offset = fmt == FMT_Q4_0 ? -8.0f * *d : fmt == FMT_Q4_1 ? half_to_float(b + 2) : 0.0f;
}

static inline const uint8_t *block_quants(int fmt, const uint8_t *b) {
    return b + (fmt == FMT_Q4_1 ? 4 : fmt == FMT_INT8 ? 0 : 2);
}

/* The first n (<= 32) weights of one block as floats. Q4 blocks hold weight j in the low nibble of byte j
 * and weight j + 16 in its high nibble. */
static void dequant_block_scalar(int fmt, const uint8_t *b, float row_scale, int64_t n, float *out) {
    float d, offset;
    block_scale(fmt, b, row_scale, &d, &offset);
    const uint8_t *q = block_quants(fmt, b);
    for (int64_t j = 0; j < n; j++) {
        float v;
        if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1)
            v = (float)(j < 16 ? q[j] & 0x0f : q[j - 16] >> 4);
        else
            v = (float)(int8_t)q[j];
        out[j] = d * v + offset;
    }
}

#ifdef HAVE_AVX2
/* One whole block as four vectors: w[c] holds weights 8c .. 8c + 7. fmt is a literal at every call (the
 * kernels below are specialised per format), so the branches fold away. A Q4 block's bytes 0-7 widened
 * to 32-bit lanes hold weights 0-7 (low nibbles) and 16-23 (high nibbles), bytes 8-15 the rest: two
 * widening loads, the nibbles split by and / shift in 32-bit lanes. */
static inline __attribute__((always_inline)) void dequant32(const int fmt, const uint8_t *b, float row_scale,
                                                           __m256 w[4]) {
    float ds, os;
    block_scale(fmt, b, row_scale, &ds, &os);
    __m256 d = _mm256_set1_ps(ds);
    const uint8_t *q = block_quants(fmt, b);
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        __m256i mask = _mm256_set1_epi32(0x0f);
        __m256 off = _mm256_set1_ps(os);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h)));
            __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
            __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            w[h] = _mm256_fmadd_ps(lo, d, off);
            w[h + 2] = _mm256_fmadd_ps(hi, d, off);
        }
    } else {
        for (int c = 0; c < 4; c++) {
            __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * c));
            w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
        }
    }
}

/* out[i] = x row i . W row (whole blocks, then a scalar tail of an int8 row), for i < mr (a literal). Up to
 * two rows get four accumulators each: one FMA per accumulator per block, so the 4-cycle FMA latency never
 * stalls the stream; more rows interleave their own chains. */
static inline __attribute__((always_inline)) void dot_rows(const int fmt, const int mr, const float *x,
                                                          int64_t xs, const uint8_t *row, float row_scale,
                                                          int64_t K, float *out) {
    const int nacc = mr <= 2 ? 4 : 2;
    __m256 acc[DOT_TILE][4]; /* registers: the loops over mr and c unroll fully */
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int c = 0; c < nacc; c++) acc[i][c] = _mm256_setzero_ps();
    int64_t blocks = K / QK;
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256 w[4];
        dequant32(fmt, row + blk * BLOCK_BYTES[fmt], row_scale, w);
        const float *xb = x + blk * QK;
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                acc[i][c % nacc] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xb + i * xs + 8 * c), acc[i][c % nacc]);
    }
    float tail[QK];
    int64_t rest = K - blocks * QK;
    if (rest) dequant_block_scalar(fmt, row + blocks * BLOCK_BYTES[fmt], row_scale, rest, tail);
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        __m256 sum = acc[i][0];
#pragma GCC unroll 4
        for (int c = 1; c < nacc; c++) sum = _mm256_add_ps(sum, acc[i][c]);
        float s = hsum8(sum);
        for (int64_t j = 0; j < rest; j++) s += tail[j] * x[i * xs + blocks * QK + j];
        out[i] = s;
    }
}

static inline __attribute__((always_inline)) void dot_schedule(const int fmt, const float *x, int64_t xs,
                                                              const uint8_t *w, const float *scales,
                                                              const float *bias, float *y, int64_t M,
                                                              int64_t N, int64_t K, int nthreads) {
    int64_t row_bytes = fmt == FMT_INT8 ? K : K / QK * BLOCK_BYTES[fmt];
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
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
}

/* buf[r][k] = W[n0 + r][k0 + k] for r < rows, k < kc (row stride KC + QK): a slab of W dequantized. kc is
 * a multiple of 32 except at an int8 row's end, whose last block is dequantized as far as it goes. */
static inline __attribute__((always_inline)) void dequant_slab(const int fmt, const uint8_t *w,
                                                              int64_t row_bytes, const float *scales,
                                                              int64_t n0, int64_t rows, int64_t k0,
                                                              int64_t kc, float *buf) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = w + (n0 + r) * row_bytes + k0 / QK * BLOCK_BYTES[fmt];
        float s = scales ? scales[n0 + r] : 0.0f, *dst = buf + r * (KC + QK);
        int64_t kb = 0;
        for (; kb + QK <= kc; kb += QK, src += BLOCK_BYTES[fmt]) {
            __m256 v[4];
            dequant32(fmt, src, s, v);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(dst + kb + 8 * c, v[c]);
        }
        if (kb < kc) dequant_block_scalar(fmt, src, s, kc - kb, dst + kb);
    }
}

/* The slab tile's vectors: 16 lanes where the compiler targets AVX-512 (twice the FMA width; the slab is
 * already dequantized, so only loads and FMAs run here), else AVX2's 8. */
#ifdef __AVX512F__
typedef __m512 svec;
#define SV_LANES 16
#define TILE_M 4 /* 16 accumulators + 4 slab vectors + 1 x vector of AVX-512's 32 registers */
#define TILE_N 4
#define sv_zero _mm512_setzero_ps
#define sv_load _mm512_loadu_ps
#define sv_fma _mm512_fmadd_ps
#define sv_sum _mm512_reduce_add_ps
#else
typedef __m256 svec;
#define SV_LANES 8
#define TILE_M 3 /* 9 accumulators + 3 slab vectors + 1 x vector of AVX2's 16 registers */
#define TILE_N 3
#define sv_zero _mm256_setzero_ps
#define sv_load _mm256_loadu_ps
#define sv_fma _mm256_fmadd_ps
#define sv_sum hsum8
#endif

/* y[i][j] (+)= x row i . slab row j over kc inputs, i < mr, j < nr (literals): mr * nr accumulators, each
 * step loads nr slab vectors and mr x vectors (the dot-product form of a register tile; no broadcasts).
 * The first K slice starts from the bias, the later ones add to y. */
static inline __attribute__((always_inline)) void slab_tile(const int mr, const int nr, const float *x,
                                                           int64_t xs, const float *wr, int64_t kc, float *y,
                                                           int64_t ys, int first, const float *bias) {
    svec acc[TILE_M][TILE_N];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) acc[i][j] = sv_zero();
    int64_t k = 0;
    for (; k + SV_LANES <= kc; k += SV_LANES) {
        svec wv[TILE_N];
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) wv[j] = sv_load(wr + j * (KC + QK) + k);
#pragma GCC unroll 4
        for (int i = 0; i < mr; i++) {
            svec xv = sv_load(x + i * xs + k);
#pragma GCC unroll 4
            for (int j = 0; j < nr; j++) acc[i][j] = sv_fma(xv, wv[j], acc[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nr; j++) {
            float s = sv_sum(acc[i][j]);
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
/* The slab schedule: threads split W into slabs of SLAB rows; each K slice of a slab is dequantized once
 * into an L1 buffer, then every TILE_M-row tile of x runs over it in TILE_M x TILE_N register tiles. */
static inline __attribute__((always_inline)) void slab_schedule(const int fmt, const float *x, int64_t xs,
                                                               const uint8_t *w, const float *scales,
                                                               const float *bias, float *y, int64_t M,
                                                               int64_t N, int64_t K, int nthreads) {
    int64_t row_bytes = fmt == FMT_INT8 ? K : K / QK * BLOCK_BYTES[fmt], slabs = (N + SLAB - 1) / SLAB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < slabs; p++) {
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
}

#define SCHEDULE(F)                                                                \
    do {                                                                           \
        if (M <= DOT_MAX_ROWS)                                                     \
            dot_schedule(F, x, xs, w, scales, bias, y, M, N, K, nthreads);         \
        else                                                                       \
            slab_schedule(F, x, xs, w, scales, bias, y, M, N, K, nthreads);        \
    } while (0)
#endif

#ifndef HAVE_AVX2
/* The scalar version: per output, block by block, the same products (any CPU). */
static void scalar_schedule(int fmt, const float *x, int64_t xs, const uint8_t *w, const float *scales,
                            const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t row_bytes = fmt == FMT_INT8 ? K : K / QK * BLOCK_BYTES[fmt];
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float vals[QK];
        for (int64_t m = 0; m < M; m++) y[m * N + n] = bias ? bias[n] : 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += QK) {
            int64_t count = K - k0 < QK ? K - k0 : QK;
            dequant_block_scalar(fmt, w + n * row_bytes + k0 / QK * BLOCK_BYTES[fmt], scales ? scales[n] : 0.0f,
                                 count, vals);
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
    if (fmt < FMT_Q4_0 || fmt > FMT_INT8) return -1;
    if (M <= 0 || N <= 0) return 0;
#ifdef HAVE_AVX2
    switch (fmt) {
        case FMT_Q4_0: SCHEDULE(FMT_Q4_0); break;
        case FMT_Q4_1: SCHEDULE(FMT_Q4_1); break;
        case FMT_Q8_0: SCHEDULE(FMT_Q8_0); break;
        default: SCHEDULE(FMT_INT8); break;
    }
#else
    scalar_schedule(fmt, x, xs, w, scales, bias, y, M, N, K, nthreads);
#endif
    return 0;
}

/* y[N, K] = W dequantized to float32 (for large batches, where a float32 GEMM library beats the slab
 * schedule; callers dequantize a slice of rows at a time). Returns 0, or -1 for an unknown format. */
int kvp_quant_dequantize(const uint8_t *w, const float *scales, int fmt, float *y, int64_t N, int64_t K,
                         int nthreads) {
    if (fmt < FMT_Q4_0 || fmt > FMT_INT8) return -1;
    int64_t row_bytes = fmt == FMT_INT8 ? K : K / QK * BLOCK_BYTES[fmt];
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *src = w + n * row_bytes;
        float s = scales ? scales[n] : 0.0f, *dst = y + n * K;
        for (int64_t k = 0; k < K; k += QK, src += BLOCK_BYTES[fmt]) {
            int64_t count = K - k < QK ? K - k : QK;
#ifdef HAVE_AVX2
            if (count == QK) {
                __m256 v[4];
                switch (fmt) {
                    case FMT_Q4_0: dequant32(FMT_Q4_0, src, s, v); break;
                    case FMT_Q4_1: dequant32(FMT_Q4_1, src, s, v); break;
                    case FMT_Q8_0: dequant32(FMT_Q8_0, src, s, v); break;
                    default: dequant32(FMT_INT8, src, s, v); break;
                }
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(dst + k + 8 * c, v[c]);
                continue;
            }
#endif
            dequant_block_scalar(fmt, src, s, count, dst + k);
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
