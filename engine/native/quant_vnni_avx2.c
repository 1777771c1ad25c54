/* The int8-activation GEMM (quant_vnni.c) for CPUs with AVX2 but no AVX-512 VNNI: the same packed tiles
 * (quant_tiles.h) and the same rounding of activations, vpdpbusd emulated as llama.cpp's AVX2 kernels do
 * (maddubs: u8 x s8 pairs into s16, then madd by ones into s32 lanes of 4 products).
 *
 * - Nibble codes (u <= 15) times int8 activations (|q| <= 127): a pair is at most 3810, so the s16 sums
 *   of a whole 32-input block (8 pairs a lane) stay below 32767 and one madd per block widens them.
 * - Byte codes: maddubs cannot take u = w + 128 (a pair could reach 64770 and saturate), so each code goes
 *   back to its signed weight w and the product runs as |w| x (q with w's sign) (at most 32512 a pair).
 *   The offset term m = -128 d then cancels exactly, so y = d dx (w . q) per block: the reference's value.
 * Each 16-row tile runs as two 8-row halves (AVX2's 16 registers hold one half's codes and accumulators).
 * The reference is reference.reference_vnni_linear, as for the AVX-512 kernel. */
#include <string.h>

#include "quant_blocks.h"
#include "quant_tiles.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>

/* x rows sharing one unpacked half tile: 4 accumulator pairs + the codes fit 16 registers */
#define ROW_CHUNK 4

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* One x row (K inputs) -> q[K], dx[K / 32], sx[K / 32], exactly as the AVX-512 kernel rounds it. */
static inline void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / QK; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        float a = hmax8(amax);
        __m256 id = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        /* packs interleave 128-bit lanes: the permutation restores input order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
        dx[b] = a / 127.0f;
        sx[b] = dx[b] * (float)hsum8i(sum);
    }
}

void kvp_int8_quantize_avx2(const float *x, int64_t xs, int8_t *q, float *dx, float *sx, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * xs, K, q + r * K, dx + r * (K / QK), sx + r * (K / QK));
}

static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc[r] = x rows r < mr times half h (rows 8h..8h+7) of one tile, over every block. */
static inline __attribute__((always_inline)) void half_chunk(const int kind, const int mr, const uint8_t *tile,
                                                            int64_t nb, int h, const int8_t *q, int64_t K,
                                                            const float *dx, const float *sx, __m256 acc[]) {
    const int64_t tb = tile_block_bytes(kind), codes = tile_codes_bytes(kind);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tb;
        __m256i dot[ROW_CHUNK];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) dot[r] = _mm256_setzero_si256();
        if (kind == KIND_Q4) {
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * p + 32 * h));
                __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    const int8_t *qb = q + r * K + b * QK + 8 * p;
                    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(qb)),
                                                 _mm256_maddubs_epi16(hi, broadcast4(qb + 4)));
                    dot[r] = _mm256_add_epi16(dot[r], s);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) dot[r] = _mm256_madd_epi16(dot[r], ones);
        } else {
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 * g + 32 * h)), flip);
                __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    __m256i a = _mm256_sign_epi8(broadcast4(q + r * K + b * QK + 4 * g), w);
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a), ones));
                }
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + codes + 16 * h)));
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + codes + 32 + 16 * h)));
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            int64_t i = r * nb + b;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[i])), acc[r]);
            if (kind == KIND_Q4) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[i]), acc[r]);
        }
    }
}

#define CHUNK(KIND, MR) half_chunk(KIND, MR, tile, nb, h, q + m0 * K, K, dx + m0 * nb, sx + m0 * nb, acc)
#define CHUNK_ROWS(KIND)               \
    switch (mr) {                      \
        case 4: CHUNK(KIND, 4); break; \
        case 3: CHUNK(KIND, 3); break; \
        case 2: CHUNK(KIND, 2); break; \
        default: CHUNK(KIND, 1); break; \
    }

void kvp_int8_linear_avx2(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias,
                          float *y, int64_t M, int64_t N, int64_t K, int8_t *q, float *dx, float *sx, int nthreads) {
    int64_t nb = K / QK, tiles = (N + TILE_ROWS - 1) / TILE_ROWS, tb = tile_block_bytes(kind);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * xs, K, q + r * K, dx + r * nb, sx + r * nb);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const uint8_t *tile = packed + t * nb * tb;
            for (int h = 0; h < 2; h++) {
                int64_t n0 = t * TILE_ROWS + 8 * h, live = N - n0 < 8 ? N - n0 : 8;
                if (live <= 0) break;
                float bias8[8] = {0};
                if (bias) memcpy(bias8, bias + n0, (size_t)live * sizeof(float));
                __m256 bv = _mm256_loadu_ps(bias8);
                for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
                    int64_t mr = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
                    __m256 acc[ROW_CHUNK];
                    if (kind == KIND_Q4) {
                        CHUNK_ROWS(KIND_Q4)
                    } else {
                        CHUNK_ROWS(KIND_Q8)
                    }
                    for (int64_t r = 0; r < mr; r++) {
                        float *dst = y + (m0 + r) * N + n0;
                        __m256 out = _mm256_add_ps(acc[r], bv);
                        if (live == 8) {
                            _mm256_storeu_ps(dst, out);
                        } else {
                            float tmp[8];
                            _mm256_storeu_ps(tmp, out);
                            memcpy(dst, tmp, (size_t)live * sizeof(float));
                        }
                    }
                }
            }
        }
    }
}
#else
/* Not built for this target (no AVX2, or AVX-512 VNNI's kernel serves it): quant_vnni.c never calls these. */
void kvp_int8_quantize_avx2(const float *x, int64_t xs, int8_t *q, float *dx, float *sx, int64_t M, int64_t K) {
    (void)x, (void)xs, (void)q, (void)dx, (void)sx, (void)M, (void)K;
}

void kvp_int8_linear_avx2(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias,
                          float *y, int64_t M, int64_t N, int64_t K, int8_t *q, float *dx, float *sx, int nthreads) {
    (void)x, (void)xs, (void)packed, (void)kind, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)q, (void)dx,
        (void)sx, (void)nthreads;
}
#endif
