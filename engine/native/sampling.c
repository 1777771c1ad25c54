/* The sampler's steps 3-5 for rows that sample (docs/architecture.md#sampling-pipeline): temperature,
 * min-p, top-k, top-p and the inverse-CDF draw, one pass-light loop per row instead of a chain of
 * full-vocabulary tensor ops (the PyTorch pipeline, engine/sampling/, is the reference this is tested
 * against). Support sets are the reference's: the order is (z/T descending, token id ascending); top-k keeps
 * the first k of it, top-p the shortest prefix whose mass reaches p (within TOP_P_TOLERANCE), and the draw
 * walks the kept tokens in id order, so one uniform number picks the same token as the reference's CDF
 * except where rounding moves a boundary (~1e-7 of the mass).
 *
 * Compiled with -fno-reciprocal-math (build.py): z / T must round as the reference's division does. */
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define TOP_P_TOLERANCE 1e-6
/* the heap's size for a nucleus (top-p without top-k): real models' nuclei are mostly smaller */
#define NUCLEUS_CANDIDATES 64
/* top-k by a selection up to this vocabulary, by the heap beyond (where few tokens ever enter it and
 * blocks of 8 are skipped at once) */
#define SELECT_MAX_VOCAB 8192

typedef struct {
    float s;
    int32_t id;
} cand_t;

/* a comes before b in the sampling order */
static inline int before(cand_t a, cand_t b) { return a.s > b.s || (a.s == b.s && a.id < b.id); }

static inline int less(cand_t a, cand_t b, const int by_id) { return by_id ? a.id < b.id : before(a, b); }

/* Sorts a[0..n) in the sampling order or by id (by_id a literal): insertion-sorted runs of 8, merged
 * bottom-up through tmp (n entries). Keys are unique (ids are), so the result is the one order there is;
 * an inlined comparison instead of qsort's call per comparison (the candidate sorts were most of a small
 * vocabulary's per-row cost). */
static inline __attribute__((always_inline)) void sort_cands(cand_t *a, int64_t n, cand_t *tmp, const int by_id) {
    enum { RUN = 8 };
    for (int64_t s = 0; s < n; s += RUN) {
        int64_t e = s + RUN < n ? s + RUN : n;
        for (int64_t i = s + 1; i < e; i++) {
            cand_t x = a[i];
            int64_t j = i;
            for (; j > s && less(x, a[j - 1], by_id); j--) a[j] = a[j - 1];
            a[j] = x;
        }
    }
    cand_t *src = a, *dst = tmp;
    for (int64_t width = RUN; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) dst[k++] = less(src[j], src[i], by_id) ? src[j++] : src[i++];
            while (i < mid) dst[k++] = src[i++];
            while (j < hi) dst[k++] = src[j++];
        }
        cand_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(cand_t));
}

static void sort_by_order(cand_t *a, int64_t n, cand_t *tmp) { sort_cands(a, n, tmp, 0); }
static void sort_by_id(cand_t *a, int64_t n, cand_t *tmp) { sort_cands(a, n, tmp, 1); }

/* heap[0] is the last of the heap in the sampling order */
static void sift_down(cand_t *heap, int64_t n, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, last = i;
        if (l < n && before(heap[last], heap[l])) last = l;
        if (r < n && before(heap[last], heap[r])) last = r;
        if (last == i) return;
        cand_t t = heap[i];
        heap[i] = heap[last];
        heap[last] = t;
        i = last;
    }
}

static void sift_up(cand_t *heap, int64_t i) {
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!before(heap[p], heap[i])) return;
        cand_t t = heap[i];
        heap[i] = heap[p];
        heap[p] = t;
        i = p;
    }
}

static inline void offer(cand_t *heap, int64_t *n, int64_t cap, float v, int64_t i) {
    cand_t c = {v, (int32_t)i};
    if (*n < cap) {
        heap[*n] = c;
        sift_up(heap, (*n)++);
    } else if (v > heap[0].s) { /* equal s: a later token has the larger id, so it comes after */
        heap[0] = c;
        sift_down(heap, *n, 0);
    }
}

/* The first min(cap, kept) tokens in the sampling order among the kept ones (s > -inf and s >= lo), sorted
 * in that order; returns their count. *kept_total gets how many tokens are kept. Once the heap is full, a
 * token can only enter above its last element, so blocks of 8 with none above it are skipped at once. */
static int64_t first_in_order(const float *s, int64_t V, float lo, int64_t cap, cand_t *out, cand_t *tmp,
                              int64_t *kept_total) {
    int64_t n = 0, kept = 0, i = 0;
    for (; i < V && n < cap; i++) {
        if (s[i] >= lo && s[i] != -INFINITY) {
            kept++;
            offer(out, &n, cap, s[i], i);
        }
    }
#ifdef HAVE_AVX2
    __m256 vlo = _mm256_set1_ps(lo), ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(s + i);
        __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ));
        kept += __builtin_popcount((unsigned)_mm256_movemask_ps(keep));
        int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(out[0].s), _CMP_GT_OQ));
        while (above) {
            int b = __builtin_ctz((unsigned)above);
            above &= above - 1;
            offer(out, &n, cap, s[i + b], i + b);
        }
    }
#endif
    for (; i < V; i++) {
        if (s[i] >= lo && s[i] != -INFINITY) {
            kept++;
            offer(out, &n, cap, s[i], i);
        }
    }
    sort_by_order(out, n, tmp);
    *kept_total = kept;
    return n;
}

/* A float's bits as an unsigned key in the float's order (larger float, larger key). */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The value of the k-th largest of keys[0..n) (order keys; k >= 1, n >= k), overwriting keys: a radix
 * select, 8 bits a pass from the top, each pass counting the keys that share the bits found so far and
 * keeping only those (branch-free). A quickselect's comparisons mispredict about every other time on
 * logits: ~4x slower at 512 values. */
static float kth_largest(uint32_t *keys, int64_t n, int64_t k) {
    uint32_t prefix = 0;
    for (int shift = 24;; shift -= 8) {
        int64_t count[256] = {0};
        for (int64_t i = 0; i < n; i++) count[(keys[i] >> shift) & 0xffu]++;
        int b = 255;
        while (count[b] < k) k -= count[b--];
        prefix |= (uint32_t)b << shift;
        if (shift == 0) break;
        int64_t kept = 0;
        for (int64_t i = 0; i < n; i++) {
            keys[kept] = keys[i];
            kept += ((keys[i] >> shift) & 0xffu) == (uint32_t)b;
        }
        n = kept;
    }
    /* the key back to its float: order_key's inverse */
    uint32_t bits = (prefix & 0x80000000u) ? (prefix & 0x7fffffffu) : ~prefix;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* top-k for small vocabularies, where the heap's insertions cost more than a selection: the first k kept
 * tokens in the sampling order, listed in id order (those above the k-th value, then the ties at it by
 * lowest id); returns their count. buf: V floats of scratch (used as order keys). */
static int64_t top_k_by_select(const float *s, int64_t V, float lo, int64_t k, cand_t *out, float *buf) {
    int64_t kept = 0;
    uint32_t *keys = (uint32_t *)buf; /* only ever read as keys here */
    for (int64_t i = 0; i < V; i++)
        if (s[i] >= lo && s[i] != -INFINITY) keys[kept++] = order_key(s[i]);
    float kth = kept > k ? kth_largest(keys, kept, k) : -INFINITY;
    int64_t above = 0;
    for (int64_t i = 0; i < V; i++)
        if (s[i] > kth && s[i] >= lo) above++;
    int64_t ties = (kept > k ? k : kept) - above, n = 0;
    for (int64_t i = 0; i < V; i++) {
        float v = s[i];
        if (!(v >= lo) || v == -INFINITY) continue;
        if (v > kth || (v == kth && ties-- > 0)) out[n++] = (cand_t){v, (int32_t)i};
    }
    return n;
}

/* Sum of exp(s - m) over the kept tokens of the whole row; w gets each token's weight (0 if not kept). */
static double kept_mass(const float *s, int64_t V, float lo, float m, float *w) {
    int64_t i = 0;
    double total = 0.0;
#ifdef HAVE_AVX2
    __m256 vm = _mm256_set1_ps(m), vlo = _mm256_set1_ps(lo), ninf = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(s + i);
        __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ));
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(v, vm)), keep);
        _mm256_storeu_ps(w + i, e);
    }
#endif
    for (; i < V; i++) w[i] = (s[i] >= lo && s[i] != -INFINITY) ? exp_approx(s[i] - m) : 0.0f;
    for (int64_t j = 0; j < V; j++) total += w[j];
    return total;
}

/* The index of the first weight whose running sum exceeds target, walking w[0..n) (the inverse CDF); the
 * last positive weight when rounding leaves the target past the end. */
static int64_t walk_cdf(const float *w, int64_t n, double target) {
    double cum = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < n; i++) {
        if (w[i] <= 0.0f) continue;
        cum += w[i];
        last = i;
        if (cum > target) return i;
    }
    return last;
}

/* The nucleus of a row too flat for the candidate heap, in O(V): the boundary value v* is the largest value
 * whose tokens at or above it hold the mass `reach` (the tokens above v* hold less). Radix select on the
 * order keys finds it in three histogram passes (11 + 11 + 10 bits), each summing the weights per bucket
 * among the tokens that share the bits found so far. Tokens above v* are kept; of those equal to it, the
 * lowest ids while the mass before them stays below `reach`. w becomes the nucleus weights (0 elsewhere);
 * returns their sum. */
static double nucleus_by_radix(const float *s, int64_t V, float *w, double reach) {
    static const int SHIFT[3] = {21, 10, 0}, BITS[3] = {11, 11, 10};
    double mass[2048];
    uint32_t prefix = 0, prefix_mask = 0;
    double above = 0.0; /* mass of the tokens whose key is above every key sharing the prefix */
    for (int pass = 0; pass < 3; pass++) {
        int buckets = 1 << BITS[pass];
        memset(mass, 0, sizeof(double) * (size_t)buckets);
        for (int64_t i = 0; i < V; i++) {
            if (w[i] <= 0.0f) continue;
            uint32_t k = order_key(s[i]);
            if ((k & prefix_mask) == prefix) mass[(k >> SHIFT[pass]) & (uint32_t)(buckets - 1)] += w[i];
        }
        int b = buckets - 1;
        while (b > 0 && above + mass[b] < reach) above += mass[b--];
        prefix |= (uint32_t)b << SHIFT[pass];
        prefix_mask |= (uint32_t)(buckets - 1) << SHIFT[pass];
    }
    /* prefix is now v*'s key; `above` is the mass of the tokens above v* */
    double total = 0.0, equal_before = 0.0;
    for (int64_t i = 0; i < V; i++) {
        if (w[i] <= 0.0f) continue;
        uint32_t k = order_key(s[i]);
        if (k == prefix) {
            int stays = above + equal_before < reach; /* the first always: above < reach */
            equal_before += w[i];
            if (!stays) w[i] = 0.0f;
        } else if (k < prefix) {
            w[i] = 0.0f;
        }
        total += w[i];
    }
    return total;
}

/* The inverse-CDF draw over candidates listed in id order (w: n floats of scratch). */
static int64_t draw_by_id(const cand_t *cands, int64_t n, float m, float u, float *w) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) {
        w[j] = exp_approx(cands[j].s - m);
        total += w[j];
    }
    return cands[walk_cdf(w, n, (double)u * total)].id;
}

/* One row: s is z / T (scratch, V floats), cands 3 V entries (candidates, sort scratch, an id-ordered
 * copy), w V floats. */
static int64_t sample_row(const float *z, int64_t V, const float *param, float u, float *s, cand_t *cands,
                          float *w) {
    cand_t *tmp = cands + V, *in_id_order = cands + 2 * V;
    float T = param[0], min_p = param[1], top_p = param[3];
    int64_t top_k = (int64_t)param[2];
    float m = -INFINITY;
    int64_t i = 0;
#ifdef HAVE_AVX2
    __m256 vT = _mm256_set1_ps(T), vm = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(z + i), vT);
        _mm256_storeu_ps(s + i, v);
        vm = _mm256_max_ps(vm, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int l = 0; l < 8; l++) m = fmaxf(m, lanes[l]);
#endif
    for (; i < V; i++) {
        s[i] = z[i] / T;
        m = fmaxf(m, s[i]);
    }
    /* min-p: p_i >= min_p * p_max, i.e. s_i - m >= log(min_p) */
    float lo = min_p > 0.0f ? m + logf(min_p) : -INFINITY;
    int use_top_k = top_k > 0 && top_k < V, use_top_p = top_p < 1.0f;
    if (!use_top_k && !use_top_p) {
        double total = kept_mass(s, V, lo, m, w);
        return walk_cdf(w, V, (double)u * total);
    }
    int64_t n = 0, kept = 0;
    if (use_top_k && V <= SELECT_MAX_VOCAB) {
        n = top_k_by_select(s, V, lo, top_k, cands, w);
        if (!use_top_p) return draw_by_id(cands, n, m, u, w);
        memcpy(in_id_order, cands, (size_t)n * sizeof(cand_t));
        sort_by_order(cands, n, tmp);
    } else if (use_top_k) {
        n = first_in_order(s, V, lo, top_k, cands, tmp, &kept);
    }
    int64_t selected = use_top_k && V <= SELECT_MAX_VOCAB ? n : 0; /* entries of in_id_order */
    if (use_top_p) {
        double total = 0.0;
        if (use_top_k) {
            for (int64_t j = 0; j < n; j++) total += exp_approx(cands[j].s - m);
        } else {
            total = kept_mass(s, V, lo, m, w);
        }
        double reach = ((double)top_p - TOP_P_TOLERANCE) * total;
        if (!use_top_k) n = first_in_order(s, V, lo, NUCLEUS_CANDIDATES, cands, tmp, &kept);
        /* the prefix: every token whose mass before it is below p (the first token always stays) */
        double before_mass = 0.0;
        int64_t j = 0;
        while (j < n && (j == 0 || before_mass < reach)) before_mass += exp_approx(cands[j++].s - m);
        /* the candidates hold the nucleus once it ended among them (the next token's mass before it
         * reaches p) or when they are every kept token; else the row is flat: radix select */
        if (!(before_mass >= reach || n == kept || use_top_k)) {
            double nucleus = nucleus_by_radix(s, V, w, reach);
            return walk_cdf(w, V, (double)u * nucleus);
        }
        n = j;
    }
    if (selected) { /* the nucleus in id order: the selection's tokens up to its last one in the order */
        cand_t last = cands[n - 1];
        int64_t kept_ids = 0;
        for (int64_t j = 0; j < selected; j++)
            if (!before(last, in_id_order[j])) in_id_order[kept_ids++] = in_id_order[j];
        return draw_by_id(in_id_order, kept_ids, m, u, w);
    }
    sort_by_id(cands, n, tmp);
    return draw_by_id(cands, n, m, u, w);
}

/* tokens[r] for each of `rows` rows of logits (row stride ls); params [rows, 5]: temperature (> 0), min_p,
 * top_k (as a float; <= 0 or >= V: off), top_p, typical_p (must be 1: the caller keeps typical rows on the
 * reference); uniforms [rows] in [0, 1). Returns 0, or -1 when scratch memory could not be allocated. */
int kvp_sample_rows(const float *logits, int64_t rows, int64_t V, int64_t ls, const float *params,
                    const float *uniforms, int64_t *tokens, int nthreads) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (rows > 1)
    {
        float *s = malloc((size_t)V * sizeof(float)), *w = malloc((size_t)V * sizeof(float));
        cand_t *cands = malloc(3 * (size_t)V * sizeof(cand_t));
        if (!s || !w || !cands) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; r++) {
            if (s && w && cands)
                tokens[r] = sample_row(logits + r * ls, V, params + r * 5, uniforms[r], s, cands, w);
        }
        free(s);
        free(w);
        free(cands);
    }
    return failed ? -1 : 0;
}
