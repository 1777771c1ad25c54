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

#define QK 32 /* weights per block (every format; int8 rows are read in 32-weight chunks too) */
enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_INT8 = 3 };
static const int64_t BLOCK_BYTES[] = {18, 20, 34, 32};
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
#endif /* HAVE_AVX2 */
#endif
