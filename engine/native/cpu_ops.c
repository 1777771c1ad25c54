/* Fused float32 CPU kernels for the engine's hot loop (built and loaded by build.py, called via ctypes).
 *
 * Each replaces a chain of small PyTorch ops whose per-op dispatch and memory round trips dominated a
 * decode step on 2 cores: RMSNorm (with the residual add fused in), rotate-half RoPE in place, the
 * K/V scatter into the paged cache, SiLU-and-multiply, and paged decode attention that reads K/V blocks
 * in place (no gather copy) with an online softmax. ops.py holds a PyTorch reference for each.
 *
 * Conventions: row-major float32; every "stride" is in elements between consecutive tokens (rows), so
 * q/k/v may be column slices of one fused qkv row. The KV cache is head-major inside a block ("HND"):
 * [num_blocks, num_kv_heads, block_size, head_dim]. Work is split over tokens (or sequence x KV head)
 * with OpenMP using the thread count the caller passes (torch's). Compiled with -ffast-math (vector
 * exp, reassociated dot products) but linked without it, so FTZ/DAZ are never switched on process-wide.
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256

/* exp(x) to ~2 ulp: Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for exp(r) (Cephes'
 * expf coefficients) and 2^n built in the exponent bits. Inputs are clamped to [-87, 88], so exp(-inf)
 * gives ~1e-38, never a NaN. exp8 is the AVX2 version (glibc's vector expf needs -ffinite-math-only);
 * exp_approx the scalar one, for tails and non-AVX2 builds. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO 2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_approx(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = rintf(x * LOG2E);
    float r = x - n * LN2_HI + n * LN2_LO;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_EXP8 1
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* x[i] = exp(x[i] - shift) for i < n; returns their sum. */
static inline float exp_shifted_sum(float *x, int64_t n, float shift) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef HAVE_EXP8
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < n; i++) {
        x[i] = exp_approx(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out = weight * x * rsqrt(mean(x^2) + eps), after residual += delta when delta is not NULL.
 * residual [T, H] (stride rs), delta [T, H] (stride ds), out [T, H] contiguous. */
void kvp_add_rms_norm(float *residual, int64_t rs, const float *delta, int64_t ds, const float *weight,
                      float *out, int64_t T, int64_t H, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        float *x = residual + t * rs;
        if (delta) {
            const float *d = delta + t * ds;
#pragma omp simd
            for (int64_t i = 0; i < H; i++) x[i] += d[i];
        }
        float inv = 1.0f / sqrtf(dot(x, x, H) / (float)H + eps);
        float *o = out + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; i++) o[i] = weight[i] * (x[i] * inv);
    }
}

/* Rotate-half RoPE in place on the first num_heads heads of each row of x (stride xs):
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin rows [max_pos, D] (the halves repeat). */
void kvp_rope_inplace(float *x, int64_t xs, int64_t T, int64_t num_heads, int64_t D, const int64_t *positions,
                      const float *cos_table, const float *sin_table, int nthreads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D;
        const float *s = sin_table + positions[t] * D;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * xs + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* Scatter token t's K/V heads ([Hkv, D] rows at k + t*ks, v + t*vs) into cache slot slots[t] (HND);
 * a negative slot means "padding, do not write". */
void kvp_write_kv(const float *k, int64_t ks, const float *v, int64_t vs, float *key_cache, float *value_cache,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t D, int64_t block_size, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        int64_t slot = slots[t];
        if (slot < 0) continue;
        int64_t block = slot / block_size, off = slot % block_size;
        for (int64_t h = 0; h < Hkv; h++) {
            int64_t dst = ((block * Hkv + h) * block_size + off) * D;
            const float *ksrc = k + t * ks + h * D, *vsrc = v + t * vs + h * D;
            for (int64_t i = 0; i < D; i++) {
                key_cache[dst + i] = ksrc[i];
                value_cache[dst + i] = vsrc[i];
            }
        }
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i] for x [T, 2I] (gate then up, the fused projection). */
void kvp_silu_mul(const float *x, float *out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef HAVE_EXP8
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* s[j] = scale * <q, k_j> for the n rows k_j of kb (row length D). The AVX2 path scores 8 keys at a
 * time with 8 vector accumulators and one transposing reduction, instead of a horizontal sum per key. */
static inline void key_scores(const float *q, const float *kb, int64_t n, int64_t D, float scale, float *s) {
    int64_t j = 0;
#ifdef HAVE_EXP8
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
            /* lane sums of a0..a7 into one vector, in key order */
            __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
            __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            _mm256_storeu_ps(s + j, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
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

/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for small M (decode batches), reading w in its nn.Linear layout.
 * At small M a GEMM is a stream over the weights; this one reads each weight row once per two rows of x
 * (tiles of 2 x-rows by 4 weight rows: 8 accumulators, 6 loads per 8 FMAs) and reached 16 GB/s at M=1
 * against oneDNN's 12 on this project's 2-core host. Needs AVX2/FMA and K % 8 == 0 (the wrapper checks
 * ``kvp_has_avx2``). x rows have stride xs; y is contiguous; threads split the weight rows. */
#ifdef HAVE_EXP8
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static void linear_rows4(const float *x, int64_t xs, const float *w, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t n) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    __m256 z = _mm256_setzero_ps();
    for (int64_t m = 0; m < M; m += 2) {
        int pair = m + 1 < M;
        const float *x0 = x + m * xs, *x1 = pair ? x0 + xs : x0;
        __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x1 + k);
            __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
            __m256 v2 = _mm256_loadu_ps(w2 + k), v3 = _mm256_loadu_ps(w3 + k);
            a0 = _mm256_fmadd_ps(xa, v0, a0);
            a1 = _mm256_fmadd_ps(xa, v1, a1);
            a2 = _mm256_fmadd_ps(xa, v2, a2);
            a3 = _mm256_fmadd_ps(xa, v3, a3);
            a4 = _mm256_fmadd_ps(xb, v0, a4);
            a5 = _mm256_fmadd_ps(xb, v1, a5);
            a6 = _mm256_fmadd_ps(xb, v2, a6);
            a7 = _mm256_fmadd_ps(xb, v3, a7);
        }
        float r[8];
        _mm256_storeu_ps(r, reduce8(a0, a1, a2, a3, a4, a5, a6, a7));
        for (int j = 0; j < 4; j++) {
            float b = bias ? bias[n + j] : 0.0f;
            y[m * N + n + j] = r[j] + b;
            if (pair) y[(m + 1) * N + n + j] = r[4 + j] + b;
        }
    }
}
#endif

int kvp_has_avx2(void) {
#ifdef HAVE_EXP8
    return 1;
#else
    return 0;
#endif
}

void kvp_linear(const float *x, int64_t xs, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                int64_t K, int nthreads) {
#ifdef HAVE_EXP8
    int64_t tiles = N / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) linear_rows4(x, xs, w, bias, y, M, N, K, 4 * t);
#endif
    for (int64_t n = kvp_has_avx2() ? N - N % 4 : 0; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = dot(x + m * xs, w + n * K, K) + (bias ? bias[n] : 0.0f);
}

/* Paged decode attention: sequence b's single query (row b of q, stride qs; heads [Hq, D]) attends
 * keys [start, seq_lens[b]) of its blocks (block_tables row b, stride bts), start = len - window when a
 * window is set. GQA: query head h reads KV head h / (Hq / Hkv). Online softmax per block of keys;
 * out [B, Hq, D] contiguous. One task per (sequence, KV head): its group's queries share each K/V row. */
void kvp_paged_decode(float *out, const float *q, int64_t qs, const float *key_cache, const float *value_cache,
                      const int32_t *block_tables, int64_t bts, const int32_t *seq_lens, int64_t B, int64_t Hq,
                      int64_t Hkv, int64_t D, int64_t block_size, float scale, int64_t window, int nthreads) {
    int64_t G = Hq / Hkv;
#pragma omp parallel for collapse(2) num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t kh = 0; kh < Hkv; kh++) {
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
                const float *kb = key_cache + (block * Hkv + kh) * block_size * D;
                const float *vb = value_cache + (block * Hkv + kh) * block_size * D;
                if (first + block_size < len) {
                    /* blocks are scattered: the hardware prefetcher cannot guess the next one */
                    int64_t next = block_tables[b * bts + first / block_size + 1];
                    const char *nk = (const char *)(key_cache + (next * Hkv + kh) * block_size * D);
                    const char *nv = (const char *)(value_cache + (next * Hkv + kh) * block_size * D);
                    for (int64_t byte = 0; byte < block_size * D * (int64_t)sizeof(float); byte += 64) {
                        __builtin_prefetch(nk + byte);
                        __builtin_prefetch(nv + byte);
                    }
                }
                /* keys in chunks of up to 64 (the score buffer); block_size may exceed it */
                for (int64_t c0 = j0; c0 < j1; c0 += 64) {
                    int64_t c1 = c0 + 64 < j1 ? c0 + 64 : j1;
                    for (int64_t g = 0; g < G; g++) {
                        int64_t n = c1 - c0;
                        key_scores(qh + g * D, kb + c0 * D, n, D, scale, s[g]);
                        float mx = m[g];
                        for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
                        float corr = exp_approx(m[g] - mx);
                        float sum = exp_shifted_sum(s[g], n, mx);
                        float *a = acc + g * D;
#pragma omp simd
                        for (int64_t i = 0; i < D; i++) a[i] *= corr;
                        weighted_rows_add(a, s[g], vb + c0 * D, n, D);
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
        }
    }
}
