/* Causal attention of a step's prefill/extend tokens over the paged HND cache
 * ([num_blocks, num_kv_heads, block_size, head_dim]); the tokens' own K/V are already written to it. A
 * quantized cache (kv_codes.h) is dequantized one 16-key chunk at a time into the task's scratch. */
#include <stdlib.h>
#include "kv_codes.h"
#include "vec.h"

#define KEYS 16       /* keys per chunk: one 16-column tile of scores */
#define TILE_ROWS 24  /* query rows (tokens x the heads of one KV head) a task aims for */
#define MAX_ROWS 64   /* = MAX_GROUP: a group larger than TILE_ROWS takes one token per task */
#define MAX_DIM 256

#ifdef HAVE_AVX2
/* c[i][0:16] (row stride cs) = (scale_i * c[i][0:16] when scale is given, else 0) + sum_k a[i][k] b[k][0:16]
 * for rows i < mr, k < K; a rows have stride as, b rows stride bs (vec.h's register tile; mr a literal). */
static inline __attribute__((always_inline)) void tile16(const int mr, const float *a, int64_t as, const float *b,
                                                        int64_t bs, int64_t K, float *c, int64_t cs,
                                                        const float *scale) {
    __m256 lo[6], hi[6];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        if (scale) {
            __m256 f = _mm256_set1_ps(scale[i]);
            lo[i] = _mm256_mul_ps(_mm256_loadu_ps(c + i * cs), f);
            hi[i] = _mm256_mul_ps(_mm256_loadu_ps(c + i * cs + 8), f);
        } else {
            lo[i] = hi[i] = _mm256_setzero_ps();
        }
    }
    fma_tile16(mr, a, as, b, bs, K, lo, hi, 0, 0);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++) {
        _mm256_storeu_ps(c + i * cs, lo[i]);
        _mm256_storeu_ps(c + i * cs + 8, hi[i]);
    }
}

/* tile16 over rows [0, R) in tiles of 6. */
static void rows16(int64_t R, const float *a, int64_t as, const float *b, int64_t bs, int64_t K, float *c,
                   int64_t cs, const float *scale) {
    int64_t r = 0;
    for (; r + 6 <= R; r += 6) tile16(6, a + r * as, as, b, bs, K, c + r * cs, cs, scale ? scale + r : 0);
    const float *ar = a + r * as, *sr = scale ? scale + r : 0;
    float *cr = c + r * cs;
    switch (R - r) {
        case 5: tile16(5, ar, as, b, bs, K, cr, cs, sr); break;
        case 4: tile16(4, ar, as, b, bs, K, cr, cs, sr); break;
        case 3: tile16(3, ar, as, b, bs, K, cr, cs, sr); break;
        case 2: tile16(2, ar, as, b, bs, K, cr, cs, sr); break;
        case 1: tile16(1, ar, as, b, bs, K, cr, cs, sr); break;
        default: break;
    }
}

/* kt[d][j] = k[j][d] for j < n keys (row length D, a multiple of 8), zero for n <= j < KEYS: the chunk's
 * keys as the [D][16] panel the score tile reads. Full chunks go through 8x8 register transposes. */
static void transpose_keys(const float *k, int64_t n, int64_t D, float *kt) {
    if (n < KEYS) {
        for (int64_t d = 0; d < D; d++)
            for (int64_t j = 0; j < KEYS; j++) kt[d * KEYS + j] = j < n ? k[j * D + d] : 0.0f;
        return;
    }
    for (int64_t j0 = 0; j0 < KEYS; j0 += 8)
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
            __m256 r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(k + (j0 + i) * D + d0);
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int i = 0; i < 4; i++) {
                t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
                t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(kt + (d0 + i) * KEYS + j0, t[i]);
        }
}

/* One chunk's online-softmax update of row r: s (16 scores, -inf where masked) becomes the weights
 * exp(s - m_new) (exactly 0 where masked), corr the factor that rescales the row's earlier sums. */
static inline void softmax_chunk(float *s, float *m, float *l, float *corr) {
    __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    __m256 mx = _mm256_max_ps(s0, s1);
    mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4E));
    mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xB1));
    float chunk_max = _mm256_cvtss_f32(mx);
    if (chunk_max == -INFINITY) { /* this row sees none of these keys */
        _mm256_storeu_ps(s, _mm256_setzero_ps());
        _mm256_storeu_ps(s + 8, _mm256_setzero_ps());
        *corr = 1.0f;
        return;
    }
    float m_new = chunk_max > *m ? chunk_max : *m;
    __m256 shift = _mm256_set1_ps(m_new), ninf = _mm256_set1_ps(-INFINITY);
    __m256 e0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, shift)), _mm256_cmp_ps(s0, ninf, _CMP_NEQ_OQ));
    __m256 e1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, shift)), _mm256_cmp_ps(s1, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s, e0);
    _mm256_storeu_ps(s + 8, e1);
    float sum = hsum8(_mm256_add_ps(e0, e1));
    *corr = *m == -INFINITY ? 0.0f : exp_approx(*m - m_new);
    *l = *l * *corr + sum;
    *m = m_new;
}

/* Buffers of one thread's tasks. */
struct prefill_scratch {
    float q[MAX_ROWS * MAX_DIM], o[MAX_ROWS * MAX_DIM], kt[MAX_DIM * KEYS], s[MAX_ROWS * KEYS];
    float k[KEYS * MAX_DIM], v[KEYS * MAX_DIM]; /* a quantized chunk's rows as floats */
    float m[MAX_ROWS], l[MAX_ROWS], corr[MAX_ROWS];
};

/* Rows of one task: tokens [i0, i0 + nq) of a sequence (positions pos0 + i), each with the G query heads
 * of KV head kh; row r = token r / G, head r % G. */
static void prefill_task(struct prefill_scratch *w, float *out, const float *q, int64_t qs, int64_t q_row0,
                         int64_t out_row0, const struct kv_view *K, const struct kv_view *V, const int32_t *table,
                         int64_t pos0, int64_t nq, int64_t kh, int64_t G, int64_t Hq, int64_t Hkv, int64_t D,
                         int64_t block_size, float scale, int64_t window, float softcap) {
    int64_t R = nq * G, p_last = pos0 + nq - 1;
    for (int64_t r = 0; r < R; r++) {
        const float *src = q + (q_row0 + r / G) * qs + (kh * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) w->q[r * D + d] = src[d] * scale;
        for (int64_t d = 0; d < D; d++) w->o[r * D + d] = 0.0f;
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    int64_t kfirst = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0, kend = p_last + 1;
    for (int64_t first = kfirst - kfirst % block_size; first < kend; first += block_size) {
        int64_t block = table[first / block_size];
        int64_t j0 = first < kfirst ? kfirst - first : 0, j1 = kend - first < block_size ? kend - first : block_size;
        int64_t row0 = (block * Hkv + kh) * block_size;
        for (int64_t c0 = j0; c0 < j1; c0 += KEYS) {
            int64_t n = j1 - c0 < KEYS ? j1 - c0 : KEYS, k0 = first + c0; /* positions k0 .. k0 + n - 1 */
            const float *kc = kv_rows(K, row0 + c0, n, D, w->k), *vc = kv_rows(V, row0 + c0, n, D, w->v);
            transpose_keys(kc, n, D, w->kt);
            rows16(R, w->q, D, w->kt, KEYS, D, w->s, KEYS, 0);
            /* Gemma 2: cap * tanh(s / cap) on the scaled scores, before the mask */
            if (softcap > 0.0f) softcap_rows(w->s, R * KEYS, softcap);
            /* mask: keys past a row's position, before its window, and the padding past n */
            int whole = n == KEYS && k0 + KEYS - 1 <= pos0 && (window <= 0 || k0 > p_last - window);
            for (int64_t r = 0; r < R; r++) {
                float *s = w->s + r * KEYS;
                if (!whole) {
                    int64_t p = pos0 + r / G;
                    for (int64_t j = 0; j < KEYS; j++)
                        if (j >= n || k0 + j > p || (window > 0 && k0 + j <= p - window)) s[j] = -INFINITY;
                }
                softmax_chunk(s, w->m + r, w->l + r, w->corr + r);
            }
            /* o[r][c:c+16] = corr_r * o[r][c:c+16] + sum_j s[r][j] v[j][c:c+16] */
            for (int64_t c = 0; c < D; c += 16) rows16(R, w->s, KEYS, vc + c, D, n, w->o + c, D, w->corr);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float inv = 1.0f / w->l[r];
        float *dst = out + (out_row0 + r / G) * Hq * D + (kh * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = w->o[r * D + d] * inv;
    }
}
#endif

/* Prefill/extend attention for S sequences: sequence s has new tokens at query rows [query_start[s],
 * query_start[s + 1]) of q (row stride qs; heads [Hq, D]), at positions seq_lens[s] - its token count + i,
 * and block table row s (stride bts). Token at position p attends keys [p + 1 - window, p] (from 0 without
 * a window); softcap > 0 soft-caps the scaled scores. out [query_start[S] - query_start[0], Hq, D]
 * contiguous. D must be a multiple of 16 and at most 256, Hq / Hkv at most 64. kind, k_rows/v_rows and
 * k_scale/v_scale say how the caches hold K/V (struct kv_view). Returns 0, or -1 when scratch memory could
 * not be allocated (out is then incomplete). Needs AVX2 (kvp_has_avx2): without it this returns -2 at once
 * and callers keep their own attention. */
int kvp_paged_prefill(float *out, const float *q, int64_t qs, const void *key_cache, const void *value_cache,
                      const int32_t *block_tables, int64_t bts, const int32_t *query_start, const int32_t *seq_lens,
                      int64_t S, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window,
                      float softcap, int kind, const float *k_rows, const float *v_rows, float k_scale,
                      float v_scale, int nthreads) {
#ifdef HAVE_AVX2
    struct kv_view K = {key_cache, kind, k_rows, k_scale}, V = {value_cache, kind, v_rows, v_scale};
    int64_t G = Hq / Hkv, per_task = G >= TILE_ROWS ? 1 : TILE_ROWS / G;
    int64_t *tile_seq = malloc(sizeof(int64_t) * 2 * (size_t)(query_start[S] - query_start[0] + 1));
    if (!tile_seq) return -1;
    int64_t *tile_first = tile_seq + (query_start[S] - query_start[0] + 1), tiles = 0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t i = 0; i < query_start[s + 1] - query_start[s]; i += per_task) {
            tile_seq[tiles] = s;
            tile_first[tiles++] = i;
        }
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        struct prefill_scratch *w = malloc(sizeof *w);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tiles * Hkv; task++) {
            if (!w) continue;
            /* last tiles first: they attend the most keys */
            int64_t t = tiles - 1 - task / Hkv, kh = task % Hkv, s = tile_seq[t], i0 = tile_first[t];
            int64_t q_len = query_start[s + 1] - query_start[s];
            int64_t nq = q_len - i0 < per_task ? q_len - i0 : per_task;
            prefill_task(w, out, q, qs, query_start[s] + i0, query_start[s] + i0 - query_start[0], &K, &V,
                         block_tables + s * bts, seq_lens[s] - q_len + i0, nq, kh, G, Hq, Hkv, D,
                         block_size, scale, window, softcap);
        }
        free(w);
    }
    free(tile_seq);
    return failed ? -1 : 0;
#else
    (void)out, (void)q, (void)qs, (void)key_cache, (void)value_cache, (void)block_tables, (void)bts;
    (void)query_start, (void)seq_lens, (void)S, (void)Hq, (void)Hkv, (void)D, (void)block_size, (void)scale;
    (void)window, (void)softcap, (void)kind, (void)k_rows, (void)v_rows, (void)k_scale, (void)v_scale;
    (void)nthreads;
    return -2;
#endif
}
