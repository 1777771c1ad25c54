/* The quantized formats' blocks, as quant_gemm.c reads them (docs/architecture.md#quantized-weights):
 * per-block scales, a scalar dequantization (any CPU) and, with AVX2/FMA, a whole block dequantized into
 * registers (four AVX2 or, where the compiler targets AVX-512, two 16-lane vectors: vecf, VL, BV) with
 * the vector operations the GEMM loops use. Everything is static inline. */
#ifndef KVPILOT_NATIVE_QUANT_BLOCKS_H
#define KVPILOT_NATIVE_QUANT_BLOCKS_H
#include <string.h>

#include "vec.h"
#if defined(__F16C__) && !defined(HAVE_AVX2)
#include <immintrin.h>
#endif

#define QK 32 /* weights per block the kernels work on (int8 rows and K-quant sub-blocks too) */
enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_INT8 = 3, FMT_Q4_K = 4, FMT_Q6_K = 5, FMT_LAST = 5 };
/* bytes of one stored block of BLOCK_WEIGHTS[fmt] weights: a K-quant's super-block holds eight of the
 * kernels' 32-weight blocks, their scales packed in its header */
static const int64_t BLOCK_BYTES[] = {18, 20, 34, 32, 144, 210};
static const int64_t BLOCK_WEIGHTS[] = {32, 32, 32, 32, 256, 256};
#define IS_K(fmt) ((fmt) >= FMT_Q4_K)

static inline int64_t row_bytes_of(int fmt, int64_t K) {
    return fmt == FMT_INT8 ? K : K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
}

/* The bytes that hold 32-weight block b of a row: the block itself, or a K-quant's super-block. */
static inline const uint8_t *block_at(int fmt, const uint8_t *row, int64_t b) {
    return IS_K(fmt) ? row + (b / 8) * BLOCK_BYTES[fmt] : row + b * BLOCK_BYTES[fmt];
}
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

/* Q4_K's 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4). */
static inline void k4_scale_min(const uint8_t *sc, int j, int *d, int *m) {
    if (j < 4) {
        *d = sc[j] & 63;
        *m = sc[j + 4] & 63;
    } else {
        *d = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

/* The first n (<= 32) weights of sub-block t of a K-quant super-block sb, as llama.cpp dequantizes them.
 * Q4_K (144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles): weight j
 * is d sc_t q - dmin m_t, q the low (t even) or high nibble of byte 32 (t / 2) + j. Q6_K (210 bytes: 128
 * of low nibbles ql, 64 of high bit pairs qh, 16 int8 scales, fp16 d): in each half h of 128 weights,
 * group g = t % 4 takes ql[64 h + 32 (g & 1) + j]'s low (g < 2) or high nibble and bits 2g of
 * qh[32 h + j], minus 32, times d times one scale per 16 weights. */
static inline void dequant_k_scalar(int fmt, const uint8_t *sb, int t, int64_t n, float *out) {
    if (fmt == FMT_Q4_K) {
        int sc, m;
        k4_scale_min(sb + 4, t, &sc, &m);
        float ds = half_to_float(sb) * (float)sc, ms = half_to_float(sb + 2) * (float)m;
        const uint8_t *q = sb + 16 + 32 * (t / 2);
        int shift = 4 * (t & 1);
        for (int64_t j = 0; j < n; j++) out[j] = ds * (float)((q[j] >> shift) & 0xF) - ms;
    } else {
        const int8_t *sc = (const int8_t *)(sb + 192);
        float d = half_to_float(sb + 208);
        int half = t / 4, g = t % 4, lshift = g >= 2 ? 4 : 0, hshift = 2 * g;
        const uint8_t *lo = sb + 64 * half + 32 * (g & 1), *hi = sb + 128 + 32 * half;
        for (int64_t j = 0; j < n; j++) {
            int q = (((lo[j] >> lshift) & 0xF) | (((hi[j] >> hshift) & 3) << 4)) - 32;
            out[j] = d * (float)sc[8 * half + 2 * g + j / 16] * (float)q;
        }
    }
}

/* The first n weights of 32-weight block b of a row, any format. */
static inline void dequant_at_scalar(int fmt, const uint8_t *row, int64_t b, float row_scale, int64_t n,
                                     float *out) {
    if (IS_K(fmt))
        dequant_k_scalar(fmt, block_at(fmt, row, b), (int)(b % 8), n, out);
    else
        dequant_block_scalar(fmt, block_at(fmt, row, b), row_scale, n, out);
}

#ifdef HAVE_AVX2
/* One whole block as four vectors: w[c] holds weights 8c .. 8c + 7. fmt is a literal at every call (the
 * kernels below are specialised per format), so the branches fold away. A Q4 block's bytes 0-7 widened
 * to 32-bit lanes hold weights 0-7 (low nibbles) and 16-23 (high nibbles), bytes 8-15 the rest: two
 * widening loads, the nibbles split by and / shift in 32-bit lanes. */
/* A K-quant sub-block t of super-block sb as four vectors (dequant_k_scalar's arithmetic, 8 lanes at a time). */
static inline __attribute__((always_inline)) void dequant32_k(const int fmt, const uint8_t *sb, int t, __m256 w[4]) {
    __m256i mask4 = _mm256_set1_epi32(0x0f);
    if (fmt == FMT_Q4_K) {
        int sc, m;
        k4_scale_min(sb + 4, t, &sc, &m);
        __m256 ds = _mm256_set1_ps(half_to_float(sb) * (float)sc);
        __m256 ms = _mm256_set1_ps(-(half_to_float(sb + 2) * (float)m));
        const uint8_t *q = sb + 16 + 32 * (t / 2);
        __m128i shift = _mm_cvtsi32_si128(4 * (t & 1));
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * c)));
            w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v, shift), mask4)), ds, ms);
        }
    } else {
        const int8_t *sc = (const int8_t *)(sb + 192);
        float d = half_to_float(sb + 208);
        int half = t / 4, g = t % 4;
        const uint8_t *lo = sb + 64 * half + 32 * (g & 1), *hi = sb + 128 + 32 * half;
        __m128i lshift = _mm_cvtsi32_si128(g >= 2 ? 4 : 0), hshift = _mm_cvtsi32_si128(2 * g);
        for (int c = 0; c < 4; c++) {
            __m256i l4 = _mm256_and_si256(
                _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(lo + 8 * c))), lshift), mask4);
            __m256i h2 = _mm256_and_si256(
                _mm256_srl_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(hi + 8 * c))), hshift),
                _mm256_set1_epi32(3));
            __m256i q = _mm256_sub_epi32(_mm256_or_si256(l4, _mm256_slli_epi32(h2, 4)), _mm256_set1_epi32(32));
            w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d * (float)sc[8 * half + 2 * g + c / 2]));
        }
    }
}

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

/* The vectors of the FMA loops: 16 lanes where the compiler targets AVX-512 (twice the width per
 * instruction: a block is two vectors, dequantized with half the instructions), else AVX2's 8 (four per
 * block). dequant_block gives a block's 32 weights as BV vectors of VL consecutive weights. */
#ifdef __AVX512F__
typedef __m512 vecf;
#define VL 16
#define v_zero _mm512_setzero_ps
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_fma _mm512_fmadd_ps
#define v_add _mm512_add_ps
#define v_sum _mm512_reduce_add_ps
static inline __attribute__((always_inline)) void dequant_block(const int fmt, const uint8_t *b, float row_scale,
                                                               vecf w[2]) {
    float ds, os;
    block_scale(fmt, b, row_scale, &ds, &os);
    __m512 d = _mm512_set1_ps(ds);
    const uint8_t *q = block_quants(fmt, b);
    if (fmt == FMT_Q4_0 || fmt == FMT_Q4_1) { /* bytes 0-15 widened: weights 0-15 low, 16-31 high nibbles */
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        __m512 off = _mm512_set1_ps(os);
        w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f))), d, off);
        w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, off);
    } else {
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
            w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(v), d);
        }
    }
}
#else
typedef __m256 vecf;
#define VL 8
#define v_zero _mm256_setzero_ps
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_fma _mm256_fmadd_ps
#define v_add _mm256_add_ps
#define v_sum hsum8
#define dequant_block dequant32
#endif
#define BV (QK / VL) /* vectors per block */

/* 32-weight block b of a row as BV vectors, any format (K-quants: their sub-block). */
static inline __attribute__((always_inline)) void dequant_block_at(const int fmt, const uint8_t *row, int64_t b,
                                                                  float row_scale, vecf w[BV]) {
    if (IS_K(fmt)) {
#ifdef __AVX512F__
        float buf[QK];
        dequant_k_scalar(fmt, block_at(fmt, row, b), (int)(b % 8), QK, buf);
        for (int c = 0; c < BV; c++) w[c] = v_load(buf + VL * c);
#else
        dequant32_k(fmt, block_at(fmt, row, b), (int)(b % 8), w);
#endif
    } else {
        dequant_block(fmt, block_at(fmt, row, b), row_scale, w);
    }
}
#endif /* HAVE_AVX2 */
#endif
