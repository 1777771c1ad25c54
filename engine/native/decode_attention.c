/* Paged decode attention over the HND cache ([num_blocks, num_kv_heads, block_size, head_dim]), reading
 * K/V blocks in place with an online softmax. A quantized cache (kv_codes.h) is dequantized a chunk of
 * rows at a time, once for the whole GQA group that reads it. */
#include <stdlib.h>
#include "kernels.h"
#include "kv_codes.h"
#include "vec.h"

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256

/* s[j] = scale * <q, k_j> for the n rows k_j of kb (row length D). The AVX2 path scores 8 keys at a
 * time with 8 vector accumulators and one transposing reduction, instead of a horizontal sum per key. */
static inline void key_scores(const float *q, const float *kb, int64_t n, int64_t D, float scale, float *s) {
    int64_t j = 0;
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        for (; j + 8 <= n; j += 8) {
            const float *k = kb + j * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * D + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * D + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * D + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * D + d), a7);
            }
            _mm256_storeu_ps(s + j, _mm256_mul_ps(reduce8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
        }
    }
#endif
    for (; j < n; j++) s[j] = dot(q, kb + j * D, D) * scale;
}

/* a += sum_j p[j] * v_j over the n rows v_j of vb: four rows per pass over a, so the accumulator is
 * loaded and stored once per four keys. */
static inline void weighted_rows_add(float *a, const float *p, const float *vb, int64_t n, int64_t D) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *v0 = vb + j * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
        float p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];
#pragma omp simd
        for (int64_t i = 0; i < D; i++) a[i] += p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i];
    }
    for (; j < n; j++) {
        const float *v = vb + j * D;
#pragma omp simd
        for (int64_t i = 0; i < D; i++) a[i] += p[j] * v[i];
    }
}

/* Paged decode attention: sequence b's single query (row b of q, stride qs; heads [Hq, D]) attends
 * keys [start, seq_lens[b]) of its blocks (block_tables row b, stride bts), start = len - window when a
 * window is set. GQA: query head h reads KV head h / (Hq / Hkv). Online softmax per block of keys;
 * out [B, Hq, D] contiguous. One task per (sequence, KV head): its group's queries share each K/V row.
 * softcap > 0 soft-caps the scaled scores (vec.h's softcap_rows). kind, k_rows/v_rows and k_scale/v_scale
 * say how the caches hold K/V (struct kv_view). Returns 0, or -1 when a quantized cache's row buffers could
 * not be allocated (out is then incomplete). */
int kvp_paged_decode(float *out, const float *q, int64_t qs, const void *key_cache, const void *value_cache,
                     const int32_t *block_tables, int64_t bts, const int32_t *seq_lens, int64_t B, int64_t Hq,
                     int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window, float softcap,
                     int kind, const float *k_rows, const float *v_rows, float k_scale, float v_scale,
                     int nthreads) {
    int64_t G = Hq / Hkv, elem = kv_elem_bytes(kind);
    struct kv_view K = {key_cache, kind, k_rows, k_scale}, V = {value_cache, kind, v_rows, v_scale};
    int failed = 0;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t kh = 0; kh < Hkv; kh++) {
            /* a quantized chunk's K and V rows as floats (64 rows each) */
            float *kbuf = kind == KV_FLOAT ? 0 : malloc(sizeof(float) * 2 * 64 * (size_t)D);
            float *vbuf = kbuf ? kbuf + 64 * D : 0;
            if (kind != KV_FLOAT && !kbuf) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float acc[MAX_GROUP * MAX_HEAD_DIM];
            float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][64];
            int64_t len = seq_lens[b];
            int64_t start = (window > 0 && len > window) ? len - window : 0;
            const float *qh = q + b * qs + kh * G * D;
            for (int64_t g = 0; g < G; g++) {
                m[g] = -INFINITY;
                l[g] = 0.0f;
                for (int64_t i = 0; i < D; i++) acc[g * D + i] = 0.0f;
            }
            for (int64_t first = start - start % block_size; first < len; first += block_size) {
                int64_t block = block_tables[b * bts + first / block_size];
                int64_t j0 = first < start ? start - first : 0;
                int64_t j1 = len - first < block_size ? len - first : block_size;
                int64_t row0 = (block * Hkv + kh) * block_size;
                /* Blocks are scattered, so the hardware prefetcher cannot follow: fetch the next block
                 * ourselves, a 1/G share of its lines before each query head's pass over this block (all
                 * at once stalled the pass: ~10-20% slower over 30 layers at batch 32 x 300 tokens). */
                const char *next_k = 0, *next_v = 0;
                int64_t lines = block_size * D * elem / 64;
                if (first + block_size < len) {
                    int64_t next = block_tables[b * bts + first / block_size + 1];
                    next_k = (const char *)key_cache + (next * Hkv + kh) * block_size * D * elem;
                    next_v = (const char *)value_cache + (next * Hkv + kh) * block_size * D * elem;
                }
                /* keys in chunks of up to 64 (the score buffer); block_size may exceed it */
                for (int64_t c0 = j0; c0 < j1; c0 += 64) {
                    int64_t c1 = c0 + 64 < j1 ? c0 + 64 : j1;
                    const float *kc = kv_rows(&K, row0 + c0, c1 - c0, D, kbuf);
                    const float *vc = kv_rows(&V, row0 + c0, c1 - c0, D, vbuf);
                    for (int64_t g = 0; g < G; g++) {
                        int64_t n = c1 - c0;
                        if (next_k && c0 == j0)
                            for (int64_t line = g * lines / G; line < (g + 1) * lines / G; line++) {
                                __builtin_prefetch(next_k + 64 * line);
                                __builtin_prefetch(next_v + 64 * line);
                            }
                        key_scores(qh + g * D, kc, n, D, scale, s[g]);
                        if (softcap > 0.0f) softcap_rows(s[g], n, softcap);
                        float mx = m[g];
                        for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
                        float corr = exp_approx(m[g] - mx);
                        float sum = exp_shifted_sum(s[g], n, mx);
                        float *a = acc + g * D;
#pragma omp simd
                        for (int64_t i = 0; i < D; i++) a[i] *= corr;
                        weighted_rows_add(a, s[g], vc, n, D);
                        l[g] = l[g] * corr + sum;
                        m[g] = mx;
                    }
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
                float *o = out + (b * Hq + kh * G + g) * D;
                for (int64_t i = 0; i < D; i++) o[i] = acc[g * D + i] * inv;
            }
            free(kbuf);
        }
    }
    return failed ? -1 : 0;
}
