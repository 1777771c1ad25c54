/* The KV cache's element formats (docs/architecture.md#kv-cache-dtype) as the C kernels read and write
 * them; their PyTorch reference is kvpilot.engine.kv.kv_quant. Codes round to nearest, ties to even:
 * fp8 e4m3fn of x * (1 / s) saturating at +-448 (torch's float -> float8_e4m3fn), s per tensor or
 * absmax * (1/448) per (slot, KV head); int8 rintf(x * (1 / s)) with s = absmax * (1/127) per row. */
#ifndef KVPILOT_NATIVE_KV_CODES_H
#define KVPILOT_NATIVE_KV_CODES_H
#include <math.h>
#include <stdint.h>
#include "vec.h"

#define KV_FLOAT 0
#define KV_FP8 1
#define KV_INT8 2
#define KV_FP8_ROWS 3
#define FP8_MAX 448.0f
#define INT8_MAX_CODE 127.0f

/* One cache (K or V) of one layer, HND [num_blocks, Hkv, block_size, D]: float values, or codes with
 * fp8's per-tensor scale or scales per (block, head, slot) row (int8, fp8 rows). */
struct kv_view {
    const void *data;
    int kind;
    const float *row_scales;
    float scale;
};

/* value of an e4m3fn bit pattern (0x7F/0xFF, NaN, are never written: codes saturate at 0x7E) */
static inline float fp8_e4m3_value(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float mag = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return (c & 0x80) ? -mag : mag;
}

/* each translation unit fills its own table once, when the library loads */
static float fp8_table[256];
__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int c = 0; c < 256; c++) fp8_table[c] = fp8_e4m3_value((uint8_t)c);
}

#ifdef HAVE_AVX2
/* fp8_e4m3_value of 8 codes at once (the same bits): a normal code's exponent and mantissa shifted into
 * float position with the exponent rebiased by 120, a subnormal's mantissa times 2^-9, then the sign. */
static inline __m256 fp8x8_values(const uint8_t *p) {
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i em = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
    __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0.001953125f));
    __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
    __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
}
#endif

/* out[i] = value of codes p[i] times s, for i < n */
static inline void fp8_scaled(float *out, const uint8_t *p, int64_t n, float s) {
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 sv = _mm256_set1_ps(s);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(fp8x8_values(p + i), sv));
#endif
    for (; i < n; i++) out[i] = fp8_table[p[i]] * s;
}

/* the e4m3fn code of y, saturated at +-448 */
static inline uint8_t fp8_e4m3_code(float y) {
    union { float f; uint32_t u; } v = {.f = y};
    uint8_t sign = (uint8_t)((v.u >> 24) & 0x80);
    float a = fabsf(y);
    if (!(a < FP8_MAX)) return sign | 0x7E;
    if (a < 0.015625f) return sign | (uint8_t)rintf(a * 512.0f); /* subnormals: multiples of 2^-9 */
    v.f = a;
    uint32_t u = v.u + 0x7FFFFu + ((v.u >> 20) & 1u); /* 23 -> 3 mantissa bits, ties to even */
    return sign | (uint8_t)((u >> 20) - (120u << 3));
}

static inline int8_t int8_code(float y) {
    float r = rintf(y);
    return (int8_t)(r > INT8_MAX_CODE ? INT8_MAX_CODE : (r < -INT8_MAX_CODE ? -INT8_MAX_CODE : r));
}

/* Rows [row0, row0 + n) (row = (block * Hkv + head) * block_size + slot) of c as floats: a pointer into a
 * float cache, else the rows dequantized into buf (n * D floats). */
static inline const float *kv_rows(const struct kv_view *c, int64_t row0, int64_t n, int64_t D, float *buf) {
    if (c->kind == KV_FLOAT) return (const float *)c->data + row0 * D;
    if (c->kind == KV_FP8) {
        fp8_scaled(buf, (const uint8_t *)c->data + row0 * D, n * D, c->scale);
        return buf;
    }
    if (c->kind == KV_FP8_ROWS) {
        const uint8_t *p = (const uint8_t *)c->data + row0 * D;
        for (int64_t j = 0; j < n; j++) fp8_scaled(buf + j * D, p + j * D, D, c->row_scales[row0 + j]);
        return buf;
    }
    const int8_t *p = (const int8_t *)c->data + row0 * D;
    for (int64_t j = 0; j < n; j++) {
        float s = c->row_scales[row0 + j];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) buf[j * D + d] = (float)p[j * D + d] * s;
    }
    return buf;
}

/* bytes of one cache element */
static inline int64_t kv_elem_bytes(int kind) { return kind == KV_FLOAT ? 4 : 1; }

#endif
