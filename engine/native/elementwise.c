/* Per-token fused ops: RMSNorm with the residual add, rotate-half RoPE in place, SiLU-and-multiply (the K/V
 * scatter is kv_write.c). Each replaces a chain of small PyTorch ops on the decode path. */
#include "kernels.h"
#include "vec.h"

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

/* Rotate-half RoPE in place on the first num_heads heads (head_stride floats apart) of each row of x
 * (stride xs): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over each head's first D dims, with cos/sin
 * rows [max_pos, D] (the halves repeat). D < head_stride is partial rotary (Phi-4-mini): the rest of a
 * head passes through. */
void kvp_rope_inplace(float *x, int64_t xs, int64_t T, int64_t num_heads, int64_t D, int64_t head_stride,
                      const int64_t *positions, const float *cos_table, const float *sin_table, int nthreads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_table + positions[t] * D;
        const float *s = sin_table + positions[t] * D;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * xs + h * head_stride, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
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
#ifdef HAVE_AVX2
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* out[t, i] = gelu_tanh(x[t, i]) * x[t, I + i] for x [T, 2I] (GeGLU, Gemma's MLP): gelu_tanh(g) =
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), torch's approximate="tanh". */
void kvp_gelu_tanh_mul(const float *x, float *out, int64_t T, int64_t I, int nthreads) {
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I > 32768)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (int64_t i = 0; i < I; i++) {
            float v = g[i];
            o[i] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v))) * u[i];
        }
    }
}
