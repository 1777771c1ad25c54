/* The K/V scatter of a step's new tokens into the paged (HND) cache, as float values or as the codes of
 * a quantized cache (kv_codes.h). */
#include "kernels.h"
#include "kv_codes.h"

/* one head's D values x into the cache row at dst (element index), with its scale when scaled per row */
static inline void write_row(const float *x, int64_t D, void *cache, int kind, float *row_scales, float inv_scale,
                             int64_t row) {
    int64_t dst = row * D;
    if (kind == KV_FLOAT) {
        float *c = (float *)cache;
        for (int64_t i = 0; i < D; i++) c[dst + i] = x[i];
    } else if (kind == KV_FP8) {
        uint8_t *c = (uint8_t *)cache;
        for (int64_t i = 0; i < D; i++) c[dst + i] = fp8_e4m3_code(x[i] * inv_scale);
    } else {
        float absmax = 0.0f;
        for (int64_t i = 0; i < D; i++) absmax = fmaxf(absmax, fabsf(x[i]));
        float s = absmax * (kind == KV_INT8 ? 1.0f / INT8_MAX_CODE : 1.0f / FP8_MAX);
        float inv = 1.0f / (s > 0.0f ? s : 1.0f);
        if (kind == KV_INT8) {
            int8_t *c = (int8_t *)cache;
            for (int64_t i = 0; i < D; i++) c[dst + i] = int8_code(x[i] * inv);
        } else {
            uint8_t *c = (uint8_t *)cache;
            for (int64_t i = 0; i < D; i++) c[dst + i] = fp8_e4m3_code(x[i] * inv);
        }
        row_scales[row] = s;
    }
}

/* Scatter token t's K/V heads ([Hkv, D] rows at k + t*ks, v + t*vs) into cache slot slots[t] (HND);
 * a negative slot means "padding, do not write". kind: KV_FLOAT (float caches), KV_FP8 (codes of
 * x / k_scale, x / v_scale), KV_INT8 or KV_FP8_ROWS (codes, and each row's scale into k_rows/v_rows
 * [blocks, Hkv, bs]). */
void kvp_write_kv(const float *k, int64_t ks, const float *v, int64_t vs, void *key_cache, void *value_cache,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t block_size, int kind,
                  float *k_rows, float *v_rows, float k_scale, float v_scale, int nthreads) {
    float k_inv = 1.0f / k_scale, v_inv = 1.0f / v_scale;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t block = slot / block_size, off = slot % block_size;
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t row = (block * Hkv + h) * block_size + off;
            write_row(k + t * ks + h * D, D, key_cache, kind, k_rows, k_inv, row);
            write_row(v + t * vs + h * D, D, value_cache, kind, v_rows, v_inv, row);
        }
    }
}
