/* The next token of many rows at once: the argmax, or temperature, top-k and top-p (§7.4) then one draw, as
 * sampling.py's kept_tokens and choose_token define them, a row to a thread.
 *
 * A night samples (temperature 0.7, top-p 0.9 by default), and torch's way took some ten whole-vocabulary ops a
 * row, each a new tensor: Gemma 3 270M's 262k vocabulary, a batch-32 step on one core, 33-89 ms to choose its
 * tokens (benchmarks/sampling.py, Zen 5) against 54 ms for the forward step that made their logits; here 4.5-5.7.
 * A row is divided by its temperature once into a buffer that stays in L2, and its largest value, its sum of
 * exponentials and its candidates (the tokens within `reach` of the largest, which top-p sorts) each take one pass
 * over it; top-k's k-th largest value is a heap of the k largest, which most vectors of the row pass untouched.
 *
 * The same set as kept_tokens keeps, and the same draw: the candidates in the same order (most probable first, ties
 * by id), the same comparisons in the same precision (the cumulative probabilities in double, each term divided by
 * the fp32 sum before it is added). What differs is the rounding of two fp32 quantities: the sum of exponentials
 * (added in another order, exponentials within 2 units in the last place) and each kept token's exponential (libm's
 * expf against torch's vectorized one), so a cumulative probability that lands within a few units in the last place
 * of top-p or of the draw may fall the other way.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "vectors.h"

void rl_argmax_rows(const void *x, int x_bf16, int64_t m, int64_t n, int64_t *idx, int threads);

typedef struct {
    float value;
    int32_t id;
} candidate;

/* Most probable first, ties in id order: a stable sort of the candidates, found in id order, by value. */
static int by_value_then_id(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->value != y->value) return x->value > y->value ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The lanes of v (the first n) at or above `floor` (strict: above it), as bits. */
static inline unsigned lanes_from(vf v, float floor, int64_t n, int strict) {
#if VL == 16
    unsigned bits = strict ? _mm512_cmp_ps_mask(v, vset(floor), _CMP_GT_OQ) : _mm512_cmp_ps_mask(v, vset(floor), _CMP_GE_OQ);
#else
    __m256 hit = strict ? _mm256_cmp_ps(v, vset(floor), _CMP_GT_OQ) : _mm256_cmp_ps(v, vset(floor), _CMP_GE_OQ);
    unsigned bits = (unsigned)_mm256_movemask_ps(hit);
#endif
    return n < VL ? bits & ((1u << n) - 1) : bits;
}

/* x where it is at or above floor, else -inf. */
static inline vf kept_or_masked(vf x, vf floor) {
#if VL == 16
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), vset(-INFINITY), x);
#else
    return _mm256_blendv_ps(vset(-INFINITY), x, _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
#endif
}

/* The k-th largest of v[0 .. n) (k from 1, counted with repeats: torch.topk's last value): a min-heap of the k
 * largest so far in heap [k], which a vector of values passes untouched unless one of them is above its least
 * (a whole-row quickselect took longer than torch's topk). */
static float kth_largest(const float *v, int64_t n, int64_t k, float *heap) {
    int64_t size = 0;
    for (int64_t i = 0; i < n; i += VL) {
        int64_t m = n - i < VL ? n - i : VL;
        unsigned bits = size < k ? (m < VL ? (1u << m) - 1 : (unsigned)((1ull << VL) - 1))
                                 : lanes_from(vload(v, RL_FP32, i, m), heap[0], m, 1);
        for (; bits; bits &= bits - 1) {
            float x = v[i + __builtin_ctz(bits)];
            int64_t at;
            if (size < k) { /* sift up */
                for (at = size++; at > 0 && heap[(at - 1) / 2] > x; at = (at - 1) / 2) heap[at] = heap[(at - 1) / 2];
            } else if (x > heap[0]) { /* the least goes: sift down */
                for (at = 0;;) {
                    int64_t child = 2 * at + 1;
                    if (child >= k) break;
                    if (child + 1 < k && heap[child + 1] < heap[child]) child++;
                    if (heap[child] >= x) break;
                    heap[at] = heap[child];
                    at = child;
                }
            } else {
                continue;
            }
            heap[at] = x;
        }
    }
    return heap[0];
}

/* A draw over n candidates whose largest value is top: weights exp(value - top) summed in double in their order,
 * the first whose running sum passes u times their total (torch.searchsorted(..., right=True)), else the last. */
static int64_t draw(const candidate *c, int64_t n, float top, double u) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) total += (double)expf(c[j].value - top);
    double target = u * total, sum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        sum += (double)expf(c[j].value - top);
        if (sum > target) return c[j].id;
    }
    return c[n - 1].id;
}

/* exp(out[i] - top) of VL values at i (n of them real; a masked token, -inf, weighs 0), into w. */
static inline void weights(const float *out, int64_t i, int64_t n, float top, float *w) {
    vstore(w, vexp(vsub(vload(out, RL_FP32, i, n), vset(top))), n);
    for (int64_t l = 0; l < n; l++)
        if (isinf(out[i + l])) w[l] = 0.f;
}

/* A draw over every token of `out` in id order (no top-p): the running sum of their weights in double, twice (its
 * total, then the first to pass u times it), without a list of 262k candidates. */
static int64_t draw_all(const float *out, int64_t V, float top, double u) {
    float w[VL];
    double total = 0.0;
    for (int64_t i = 0; i < V; i += VL) {
        int64_t n = V - i < VL ? V - i : VL;
        weights(out, i, n, top, w);
        for (int64_t l = 0; l < n; l++) total += (double)w[l];
    }
    double target = u * total, sum = 0.0;
    for (int64_t i = 0; i < V; i += VL) {
        int64_t n = V - i < VL ? V - i : VL;
        weights(out, i, n, top, w);
        for (int64_t l = 0; l < n; l++) {
            sum += (double)w[l];
            if (sum > target) return i + l;
        }
    }
    return V - 1;
}

/* The tokens of out [V] at or above `floor`, in id order, into c; returns how many. */
static int64_t within(const float *out, int64_t V, float floor, candidate *c) {
    int64_t count = 0;
    for (int64_t i = 0; i < V; i += VL) {
        int64_t n = V - i < VL ? V - i : VL;
        for (unsigned bits = lanes_from(vload(out, RL_FP32, i, n), floor, n, 0); bits; bits &= bits - 1) {
            int64_t at = i + __builtin_ctz(bits);
            c[count++] = (candidate){out[at], (int32_t)at};
        }
    }
    return count;
}

/* One sampled row: `logits` [V] over `temperature`, top_k (0: off) and top_p (<= 0: off), and u, the row's uniform
 * number in [0, 1). out [V], scratch [V] and c [V] are the thread's buffers. */
static int64_t sample_row(const float *logits, int64_t V, float temperature, int64_t top_k, double top_p, double u,
                          float *out, float *scratch, candidate *c) {
    vf t = vset(temperature), most = vset(-INFINITY);
    for (int64_t i = 0; i < V; i += VL) {
        int64_t n = V - i < VL ? V - i : VL;
        vf v = vdiv(vload(logits, RL_FP32, i, n), t);
        vstore(out + i, v, n);
        if (n == VL) most = vmax(most, v);
    }
    float top = vhmax(most);
    for (int64_t i = V / VL * VL; i < V; i++) top = out[i] > top ? out[i] : top;
    int masked = 0 < top_k && top_k < V;
    if (masked) {
        vf kth = vset(kth_largest(out, V, top_k, scratch));
        for (int64_t i = 0; i < V; i += VL) {
            int64_t n = V - i < VL ? V - i : VL;
            vstore(out + i, kept_or_masked(vload(out, RL_FP32, i, n), kth), n);
        }
    }
    if (top_p <= 0.0) {
        if (!masked) return draw_all(out, V, top, u);
        int64_t n = within(out, V, -FLT_MAX, c);  /* the tokens top-k kept, in id order */
        return n ? draw(c, n, top, u) : 0;
    }
    /* torch's fp32 sum of exponentials (a masked token's, FLT_MIN's order, vanishes in it), then the candidates
     * within reach of the top, most probable first */
    vf sums = vzero();
    for (int64_t i = 0; i + VL <= V; i += VL) sums = vadd(sums, vexp(vsub(vload(out, RL_FP32, i, VL), vset(top))));
    float total = vhsum(sums);
    for (int64_t i = V / VL * VL; i < V; i++) total += expf(out[i] - top);
    int64_t finite = -1;  /* counted when first needed */
    for (float reach = 8.f;; reach *= 2.f) {
        int64_t n = within(out, V, top - reach, c);
        qsort(c, (size_t)n, sizeof *c, by_value_then_id);
        double cumulative = 0.0;
        for (int64_t j = 0; j < n; j++) {
            cumulative += (double)expf(c[j].value - top) / (double)total;
            if (cumulative > top_p) return draw(c, j + 1, top, u);  /* the first rank past p is kept, every later one not */
        }
        if (finite < 0) {
            finite = 0;
            for (int64_t i = 0; i < V; i++) finite += isfinite(out[i]) != 0;
        }
        if (n >= finite) return n ? draw(c, n, top, u) : 0;  /* the whole (top-k) set is within p */
    }
}

/* out[j] = the next token of row rows[j] of logits (fp32, rows ld apart, V wide) for j < count: the argmax where
 * temperature[j] <= 0 (rl_argmax_rows'), else sample_row's with top_k[j], top_p[j] and u[j]. Returns 0, or -1 when a
 * thread's buffers could not be allocated (out then holds no choice of its rows). */
int rl_sample_rows(const float *logits, int64_t ld, int64_t V, const int64_t *rows, int64_t count,
                   const float *temperature, const int64_t *top_k, const double *top_p, const double *u, int64_t *out,
                   int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = malloc((size_t)V * 2 * sizeof(float));
        candidate *c = malloc((size_t)V * sizeof(candidate));
        if (buf == NULL || c == NULL) failed = 1;
        /* dynamic: a flat row's top-p sorts thousands of candidates, a peaked one's a handful */
#pragma omp for schedule(dynamic)
        for (int64_t j = 0; j < count; j++) {
            const float *row = logits + rows[j] * ld;
            if (temperature[j] <= 0.f)
                rl_argmax_rows(row, 0, 1, V, out + j, 1);
            else if (buf != NULL && c != NULL)
                out[j] = sample_row(row, V, temperature[j], top_k[j], top_p[j], u[j], buf, buf + V, c);
        }
        free(buf);
        free(c);
    }
    return failed ? -1 : 0;
}
