/* y[M, N] = x[M, K] @ W^T (+ bias) with int8 activations: llama.cpp's CPU scheme (its Q8 activations),
 * laid out for AVX-512 VNNI's vpdpbusd (docs/architecture.md#quantized-weights); on CPUs with AVX2 but
 * no VNNI, quant_vnni_avx2.c runs the same tiles.
 *
 * - Weights are repacked once at load (kvp_vnni_pack) from their stored blocks into tiles of 16 output
 *   rows x 32 inputs: every weight as an unsigned code u (a 4-bit nibble for Q4_0, Q4_1, Q4_K; a byte for
 *   Q8_0 and int8 rows, stored + 128) with w = d u + m per (row, 32-weight block), d and m fp16 (so a
 *   Q4_1 tile has the bytes of its blocks: at batch 1 the kernel streams weights at memory bandwidth).
 *   Q4_0, Q4_1 and Q8_0 scales are fp16 already (m = -8 d, -128 d exactly); Q4_K's sub-block d sc and
 *   dmin m and int8 rows' scales are rounded to fp16 (a relative 2^-11, against the activations' 2^-8).
 *   In a tile's 32-bit lane j sit 4 consecutive inputs of row j, so one vpdpbusd does 16 rows x 4 inputs
 *   (the layout: quant_tiles.h).
 * - Each x row is quantized per 32-input block (x ~ dx q, q = round(x 127 / amax) in [-127, 127]), so
 *   x . w over a block = d dx (u . q) + m sx with sx = dx sum(q); u . q is exact int32 arithmetic.
 * - The result is the float product of the packed weights d u + m with the rounded activations dx q
 *   (up to summation order); the reference is reference.reference_vnni_linear.
 * The exact float path (quant_gemm.c) stays for CPUs without AVX2 and for activation_quantization=none. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant_blocks.h"
#include "quant_tiles.h"

/* Which kernel this build has: 2 AVX-512 VNNI, 1 AVX2 (quant_vnni_avx2.c), 0 none. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_GEMM 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT8_GEMM 1
#else
#define INT8_GEMM 0
#endif

/* x rows sharing one unpacked weight tile: 6 float accumulators + 8 unpacked code vectors + transient
 * int accumulators fit AVX-512's 32 registers; 6 rows were 12-20% faster than 4 at 256 rows on SmolLM2's
 * projections (8 spill), the same at 1-64 rows */
#define ROW_CHUNK 6

/* Which layout a stored format repacks to (0: none; Q6_K's scales change every 16 weights). */
int kvp_vnni_kind(int fmt) {
    switch (fmt) {
        case FMT_Q4_0: case FMT_Q4_1: case FMT_Q4_K: return KIND_Q4;
        case FMT_Q8_0: case FMT_INT8: return KIND_Q8;
        default: return 0;
    }
}

/* Bytes kvp_vnni_pack writes for N rows of K inputs of format fmt, or -1 where it has no layout (the
 * format, or K not whole 32-input blocks). */
int64_t kvp_vnni_packed_bytes(int fmt, int64_t N, int64_t K) {
    int kind = kvp_vnni_kind(fmt);
    if (!kind || K % QK) return -1;
    return (N + TILE_ROWS - 1) / TILE_ROWS * (K / QK) * tile_block_bytes(kind);
}

#if INT8_GEMM
#include <immintrin.h>

/* Block b of a stored row as codes u[32] and its scale d (the arithmetic of quant_blocks.h's scalar
 * dequantization, so the packed weights are the same floats). Returns the codes' zero point z, w = d (u - z)
 * (8 for Q4_0, 128 for the byte formats), or 0 where the format stores an offset instead: *m, w = d u + m. */
static int block_codes(int fmt, const uint8_t *row, int64_t b, float row_scale, uint8_t u[32], float *d,
                       float *m) {
    if (fmt == FMT_Q4_K) {
        const uint8_t *sb = block_at(fmt, row, b);
        int t = (int)(b % 8), sc, mn;
        k4_scale_min(sb + 4, t, &sc, &mn);
        *d = half_to_float(sb) * (float)sc;
        *m = -(half_to_float(sb + 2) * (float)mn);
        const uint8_t *q = sb + 16 + 32 * (t / 2);
        for (int j = 0; j < 32; j++) u[j] = (q[j] >> (4 * (t & 1))) & 0xF;
        return 0;
    }
    const uint8_t *blk = block_at(fmt, row, b);
    block_scale(fmt, blk, row_scale, d, m);
    const uint8_t *q = block_quants(fmt, blk);
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) {
        for (int j = 0; j < 32; j++) u[j] = j < 16 ? q[j] & 0xF : q[j - 16] >> 4;
        return fmt == FMT_Q4_0 ? 8 : 0;
    }
    for (int j = 0; j < 32; j++) u[j] = (uint8_t)((int)(int8_t)q[j] + 128);
    return 128;
}

/* Repack N stored rows of K inputs (K a multiple of 32) into out (kvp_vnni_packed_bytes): ceil(N / 16)
 * tiles of K / 32 tile blocks (rows past N zero). Returns the bytes written, or -1 for a format without a
 * VNNI layout. */
int64_t kvp_vnni_pack(const uint8_t *w, const float *scales, int fmt, uint8_t *out, int64_t N, int64_t K,
                      int nthreads) {
    int64_t bytes = kvp_vnni_packed_bytes(fmt, N, K);
    if (bytes < 0) return -1;
    int kind = kvp_vnni_kind(fmt);
    int64_t nb = K / QK, tiles = (N + TILE_ROWS - 1) / TILE_ROWS, tb = tile_block_bytes(kind);
    int64_t row_bytes = row_bytes_of(fmt, K), codes = tile_codes_bytes(kind);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + (t * nb + b) * tb;
            uint16_t *half = (uint16_t *)(dst + codes);
            memset(dst, 0, (size_t)tb);
            for (int j = 0; j < TILE_ROWS && t * TILE_ROWS + j < N; j++) {
                int64_t n = t * TILE_ROWS + j;
                uint8_t u[32];
                float d, m;
                int zero = block_codes(fmt, w + n * row_bytes, b, scales ? scales[n] : 0.0f, u, &d, &m);
                half[j] = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
                /* a zero point's offset from the rounded d (exact), so w = d (u - z) even when d is an
                 * fp16 subnormal */
                if (zero) m = -(float)zero * _cvtsh_ss(half[j]);
                half[TILE_ROWS + j] = _cvtss_sh(m, _MM_FROUND_TO_NEAREST_INT);
                for (int k = 0; k < 32; k++) {
                    int g = k / 4, lane = 4 * j + k % 4;
                    if (kind == KIND_Q8)
                        dst[64 * g + lane] = u[k];
                    else /* group pair p = g / 2: low nibbles group 2p, high nibbles group 2p + 1 */
                        dst[64 * (g / 2) + lane] |= (uint8_t)(u[k] << (4 * (g & 1)));
                }
            }
        }
    }
    return bytes;
}
#endif

#if INT8_GEMM == 2
/* x row (K inputs) -> q[K], dx[K / 32], sx[K / 32] (see the top of the file): per block amax,
 * q = round-to-nearest-even(x (127 / amax)), dx = amax / 127. */
static inline void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *sx) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / QK; b++) {
        __m512 v0 = _mm512_loadu_ps(x + b * QK), v1 = _mm512_loadu_ps(x + b * QK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = amax / 127.0f;
        sx[b] = dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* acc[r] = x rows r < mr of one row chunk times one tile, over every block (kind and mr literals). */
static inline __attribute__((always_inline)) void tile_chunk(const int kind, const int mr, const uint8_t *tile,
                                                            int64_t nb, const int8_t *q, int64_t K,
                                                            const float *dx, const float *sx, __m512 acc[]) {
    const int64_t tb = tile_block_bytes(kind), codes = tile_codes_bytes(kind);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tb;
        __m512i u[8];
        if (kind == KIND_Q4) {
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * p));
                u[2 * p] = _mm512_and_si512(v, low4);
                u[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) u[g] = _mm512_loadu_si512((const void *)(blk + 64 * g));
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + codes)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + codes + 32)));
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const int8_t *qb = q + r * K + b * QK;
            __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int g = 0; g < 8; g += 2) {
                int32_t a, c;
                memcpy(&a, qb + 4 * g, 4);
                memcpy(&c, qb + 4 * g + 4, 4);
                even = _mm512_dpbusd_epi32(even, u[g], _mm512_set1_epi32(a));
                odd = _mm512_dpbusd_epi32(odd, u[g + 1], _mm512_set1_epi32(c));
            }
            int64_t i = r * nb + b;
            __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(dx[i])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[r]);
        }
    }
}

#define CHUNK(KIND, MR) tile_chunk(KIND, MR, tile, nb, q + m0 * K, K, dx + m0 * nb, sx + m0 * nb, acc)
#define CHUNK_ROWS(KIND)                      \
    switch (mr) {                             \
        case 6: CHUNK(KIND, 6); break;        \
        case 5: CHUNK(KIND, 5); break;        \
        case 4: CHUNK(KIND, 4); break;        \
        case 3: CHUNK(KIND, 3); break;        \
        case 2: CHUNK(KIND, 2); break;        \
        default: CHUNK(KIND, 1); break;       \
    }

/* One parallel region: the threads quantize x's rows into q, dx, sx, then split the tiles. */
static void linear_avx512(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias, float *y,
                          int64_t M, int64_t N, int64_t K, int8_t *q, float *dx, float *sx, int nthreads) {
    int64_t nb = K / QK, tiles = (N + TILE_ROWS - 1) / TILE_ROWS, tb = tile_block_bytes(kind);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * xs, K, q + r * K, dx + r * nb, sx + r * nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = packed + t * nb * tb;
            int64_t n0 = t * TILE_ROWS, live = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
            __mmask16 keep = (__mmask16)((1u << live) - 1u);
            __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
            for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
                int64_t mr = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
                __m512 acc[ROW_CHUNK];
                if (kind == KIND_Q4) {
                    CHUNK_ROWS(KIND_Q4)
                } else {
                    CHUNK_ROWS(KIND_Q8)
                }
                for (int64_t r = 0; r < mr; r++)
                    _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, keep, _mm512_add_ps(acc[r], b));
            }
        }
    }
}

#endif

/* Activations as kvp_vnni_linear quantizes them (tests compare them with the PyTorch reference). */
void kvp_vnni_quantize(const float *x, int64_t xs, int8_t *q, float *dx, float *sx, int64_t M, int64_t K) {
#if INT8_GEMM == 2
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * xs, K, q + r * K, dx + r * (K / QK), sx + r * (K / QK));
#else
    kvp_int8_quantize_avx2(x, xs, q, dx, sx, M, K);
#endif
}

/* y[M, N] = x[M, K] @ W^T (+ bias) on kvp_vnni_pack's tiles (layout kind 4 or 8). Returns 0, -1 for a bad
 * kind or K (or a build without the kernel), -2 when the activation buffers cannot be allocated. */
int kvp_vnni_linear(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    if ((kind != KIND_Q4 && kind != KIND_Q8) || K % QK || !INT8_GEMM) return -1;
    if (M <= 0 || N <= 0) return 0;
    int64_t nb = K / QK;
    int8_t *q = malloc((size_t)(M * K));
    float *dx = malloc((size_t)(2 * M * nb) * sizeof(float));
    if (!q || !dx) {
        free(q);
        free(dx);
        return -2;
    }
#if INT8_GEMM == 2
    linear_avx512(x, xs, packed, kind, bias, y, M, N, K, q, dx, dx + M * nb, nthreads);
#else
    kvp_int8_linear_avx2(x, xs, packed, kind, bias, y, M, N, K, q, dx, dx + M * nb, nthreads);
#endif
    free(q);
    free(dx);
    return 0;
}

#if !INT8_GEMM
int64_t kvp_vnni_pack(const uint8_t *w, const float *scales, int fmt, uint8_t *out, int64_t N, int64_t K,
                      int nthreads) {
    (void)w, (void)scales, (void)fmt, (void)out, (void)N, (void)K, (void)nthreads;
    return -1;
}
#endif

/* Which int8-activation kernel this build has: 2 AVX-512 VNNI, 1 AVX2, 0 none. */
int kvp_vnni_available(void) { return INT8_GEMM; }
