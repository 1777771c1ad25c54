/* The library's exported kernels that other kernels call (decode_step.c runs a decode step's layers
 * through them); each defining file includes this header, so a prototype cannot drift from its
 * definition. */
#ifndef KVPILOT_NATIVE_KERNELS_H
#define KVPILOT_NATIVE_KERNELS_H
#include <stdint.h>

void kvp_add_rms_norm(float *residual, int64_t rs, const float *delta, int64_t ds, const float *weight,
                      float *out, int64_t T, int64_t H, float eps, int nthreads);
void kvp_rope_inplace(float *x, int64_t xs, int64_t T, int64_t num_heads, int64_t D, int64_t head_stride,
                      const int64_t *positions, const float *cos_table, const float *sin_table, int nthreads);
void kvp_silu_mul(const float *x, float *out, int64_t T, int64_t I, int nthreads);
void kvp_gelu_tanh_mul(const float *x, float *out, int64_t T, int64_t I, int nthreads);
void kvp_write_kv(const float *k, int64_t ks, const float *v, int64_t vs, void *key_cache, void *value_cache,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t block_size, int kind,
                  float *k_rows, float *v_rows, float k_scale, float v_scale, int nthreads);
int kvp_paged_decode(float *out, const float *q, int64_t qs, const void *key_cache, const void *value_cache,
                     const int32_t *block_tables, int64_t bts, const int32_t *seq_lens, int64_t B, int64_t Hq,
                     int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window, float softcap,
                     int kind, const float *k_rows, const float *v_rows, float k_scale, float v_scale,
                     int nthreads);
void kvp_linear(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int nthreads);
int kvp_quant_linear(const float *x, int64_t xs, const uint8_t *w, const float *scales, int fmt,
                     const float *bias, float *y, int64_t M, int64_t N, int64_t K, int nthreads);
int kvp_vnni_linear(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K, int nthreads);

#endif
