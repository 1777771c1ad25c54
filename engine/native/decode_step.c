/* A decode step's decoder layers in one call: the kernels the Python native path calls layer by layer
 * (model/layers.py forward_native), called here in the same order on the same buffers, so the hidden
 * states are bit for bit the same and the ~10 Python-level kernel calls (with their checks) per layer
 * are gone. What it runs: dense llama-shaped layers (input norm, fused qkv, RoPE, K/V write, paged
 * decode attention, o_proj, post-attention norm, fused gate/up, SiLU, down), each projection
 * a float32 panel GEMM (small_gemm.c) or a quantized one (quant_gemm.c, or quant_vnni.c with int8
 * activations). The caller checks that a model is of that shape and that the step is decode-only
 * (model/native_decode.py). */
#include <stddef.h>
#include <string.h>

#include "kernels.h"

#define MAX_PARTS 3

typedef struct {
    const void *weight;  /* float32 panels (kvp_linear) or quantized rows (kvp_quant_linear) */
    const float *scales; /* int8 rows' scales, else NULL */
    int64_t out_features;
    int64_t format; /* -1: float32 panels; else the quantized format's code (quant_blocks.h) */
    const void *packed; /* the weight repacked for the int8-activation GEMM (kvp_vnni_linear), or NULL */
    int64_t packed_kind;
} dec_part_t;

/* A projection: one weight, or a fused one whose parts are stored in different formats (a Q4_K_M file's
 * Q4_K q/k beside its Q6_K v), their outputs side by side, then the bias over all of them. */
typedef struct {
    dec_part_t parts[MAX_PARTS];
    int64_t num_parts;
    const float *bias; /* or NULL */
    int64_t out_features, in_features;
} dec_linear_t;

typedef struct {
    const float *input_norm, *post_attention_norm; /* RMSNorm multipliers */
    dec_linear_t qkv, o, gate_up, down;
    const float *cos, *sin; /* this layer's RoPE tables [max_position, rotary_dims] */
    int64_t rotary_dims;
    void *key_cache, *value_cache; /* HND */
    float *k_rows, *v_rows;        /* int8 / fp8 per-row scales, else NULL */
    float k_scale, v_scale;
    int64_t kv_kind;
    float attn_scale, softcap; /* softcap 0: none */
    int64_t window;            /* 0: none */
} dec_layer_t;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps;
    const float *final_norm;
} dec_model_t;

static int64_t widest_projection(const dec_model_t *m) {
    int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim, gate_up = 2 * m->intermediate;
    return qkv > gate_up ? qkv : gate_up;
}

/* Floats of scratch kvp_decode_step needs for T rows. */
int64_t kvp_decode_step_scratch(const dec_model_t *m, int64_t T) {
    int64_t qkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    return T * (2 * m->hidden + qkv + m->num_heads * m->head_dim + 3 * m->intermediate + widest_projection(m));
}

static int project_part(const dec_part_t *p, const float *x, int64_t xs, const float *bias, float *y, int64_t T,
                        int64_t K, int nthreads) {
    if (p->format < 0) {
        kvp_linear(x, xs, (const float *)p->weight, bias, y, T, p->out_features, K, nthreads);
        return 0;
    }
    if (p->packed)
        return kvp_vnni_linear(x, xs, (const uint8_t *)p->packed, (int)p->packed_kind, bias, y, T,
                               p->out_features, K, nthreads) ? -2 : 0;
    return kvp_quant_linear(x, xs, (const uint8_t *)p->weight, p->scales, (int)p->format, bias, y, T,
                            p->out_features, K, nthreads) ? -2 : 0;
}

/* y [T, out_features] = x W^T + bias; a split projection computes its parts in part_buf, side by side into
 * y, then adds the bias (SplitQuantLinear's concatenation and add). */
static int project(const dec_linear_t *l, const float *x, int64_t xs, float *y, int64_t T, float *part_buf,
                   int nthreads) {
    if (l->num_parts == 1) return project_part(&l->parts[0], x, xs, l->bias, y, T, l->in_features, nthreads);
    int64_t N = l->out_features, col = 0;
    for (int64_t p = 0; p < l->num_parts; p++) {
        int64_t n = l->parts[p].out_features;
        int status = project_part(&l->parts[p], x, xs, NULL, part_buf, T, l->in_features, nthreads);
        if (status) return status;
        for (int64_t t = 0; t < T; t++) memcpy(y + t * N + col, part_buf + t * n, (size_t)n * sizeof(float));
        col += n;
    }
    if (l->bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < N; j++) y[t * N + j] += l->bias[j];
    return 0;
}

/* residual [T, hidden] holds the embeddings and accumulates every sublayer's output; out [T, hidden]
 * gets the final norm of it. One token per sequence: token t is sequence t (positions, slots, row t of
 * block_tables with stride bts, seq_lens). Returns 0; -1 when decode attention could not allocate its
 * buffers, -2 when a quantized projection's format is unknown. */
int kvp_decode_step(const dec_model_t *m, const dec_layer_t *layers, int64_t T, float *residual,
                    const int64_t *positions, const int64_t *slots, const int32_t *block_tables, int64_t bts,
                    const int32_t *seq_lens, float *scratch, float *out, int nthreads) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
    const int64_t I = m->intermediate, W = (Hq + 2 * Hkv) * D;
    float *hidden = scratch, *qkv = hidden + T * H, *attn = qkv + T * W, *proj = attn + T * Hq * D;
    float *gate_up = proj + T * H, *act = gate_up + T * 2 * I, *parts = act + T * I;
    kvp_add_rms_norm(residual, H, NULL, 0, layers[0].input_norm, hidden, T, H, m->eps, nthreads);
    for (int64_t i = 0; i < m->num_layers; i++) {
        const dec_layer_t *L = &layers[i];
        int status = project(&L->qkv, hidden, H, qkv, T, parts, nthreads);
        if (status) return status;
        /* q heads then k heads lead each row: one pass rotates both */
        kvp_rope_inplace(qkv, W, T, Hq + Hkv, L->rotary_dims, D, positions, L->cos, L->sin, nthreads);
        kvp_write_kv(qkv + Hq * D, W, qkv + (Hq + Hkv) * D, W, L->key_cache, L->value_cache, slots, T, Hkv, D,
                     m->block_size, (int)L->kv_kind, L->k_rows, L->v_rows, L->k_scale, L->v_scale, nthreads);
        if (kvp_paged_decode(attn, qkv, W, L->key_cache, L->value_cache, block_tables, bts, seq_lens, T, Hq, Hkv,
                             D, m->block_size, L->attn_scale, L->window, L->softcap, (int)L->kv_kind, L->k_rows,
                             L->v_rows, L->k_scale, L->v_scale, nthreads))
            return -1;
        if ((status = project(&L->o, attn, Hq * D, proj, T, parts, nthreads))) return status;
        kvp_add_rms_norm(residual, H, proj, H, L->post_attention_norm, hidden, T, H, m->eps, nthreads);
        if ((status = project(&L->gate_up, hidden, H, gate_up, T, parts, nthreads))) return status;
        kvp_silu_mul(gate_up, act, T, I, nthreads);
        if ((status = project(&L->down, act, I, proj, T, parts, nthreads))) return status;
        const float *next = i + 1 < m->num_layers ? layers[i + 1].input_norm : m->final_norm;
        kvp_add_rms_norm(residual, H, proj, H, next, i + 1 < m->num_layers ? hidden : out, T, H, m->eps,
                         nthreads);
    }
    return 0;
}
