/* Decode-step attention on the CPU: one new query position per row over the keys and values of the cache,
 * read where and as they are stored (bf16 or fp32, any row/position/head strides), the masked keys skipped.
 *
 * torch's fused attention takes 150-190 us a layer for one row of Gemma 3 270M (4 query heads on one KV
 * head, 256 wide, 600 keys: 0.6 MB of bf16 keys and values, which one core reads in 60 us), and its eager
 * form (two matmuls and a softmax) as much at batch 32. Here each work item is one row's KV head with its
 * query heads (every key read once for all of them) or, with fewer such items than threads, one query head
 * (a row at batch 1 still spreads over the threads). Scores, softmax and the weighted sum are fp32; the
 * output is rounded once to the query's dtype. A fully masked row comes out zero, as torch's fused kernel's.
 */
#include <math.h>
#include <stdlib.h>

#include "floats.h"

/* Eight values of a key or value row as fp32 (bf16: its bits shifted up into an fp32's). */
static inline __m256 load8(const void *p, int dtype, int64_t j) {
    if (dtype == RL_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + j))), 16));
    return _mm256_loadu_ps((const float *)p + j);
}

/* Heads handled together: every key and value vector loaded once for HB heads' products (HB x 2 running
 * sums keep the FMAs' latency hidden; one head's dot product alone is a chain of dependent adds). */
#define HB 4

/* scores[h * S + i] = (q_h . k[live[i]]) * scale for nb <= HB heads (q: fp32 [nb, hd], hd a multiple of 8). */
static inline __attribute__((always_inline)) void score_block(const float *q, int64_t nb, int64_t hd, const char *keys, int64_t stride, int dtype,
                        const int32_t *live, int64_t count, float scale, float *scores, int64_t S) {
    for (int64_t i = 0; i < count; i++) {
        const void *key = keys + (size_t)live[i] * stride;
        __m256 acc[HB][2];
        for (int h = 0; h < HB; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= hd; j += 16) {
            __m256 k0 = load8(key, dtype, j), k1 = load8(key, dtype, j + 8);
            for (int h = 0; h < nb; h++) {
                acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + j), k0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + j + 8), k1, acc[h][1]);
            }
        }
        if (j < hd) {
            __m256 k0 = load8(key, dtype, j);
            for (int h = 0; h < nb; h++) acc[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * hd + j), k0, acc[h][0]);
        }
        for (int h = 0; h < nb; h++) scores[h * S + i] = hsum8(_mm256_add_ps(acc[h][0], acc[h][1])) * scale;
    }
}

/* out_h = sum_i p[h * S + i] * v[live[i]] for nb <= HB heads, 16 columns at a time (fp32 [nb, hd]). */
static inline __attribute__((always_inline)) void weigh_block(const float *p, int64_t nb, int64_t hd, const char *values, int64_t stride, int dtype,
                        const int32_t *live, int64_t count, float *out, int64_t S) {
    for (int64_t j = 0; j < hd; j += 16) {
        int wide = j + 16 <= hd;
        __m256 acc[HB][2];
        for (int h = 0; h < HB; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < count; i++) {
            const void *value = values + (size_t)live[i] * stride;
            __m256 v0 = load8(value, dtype, j), v1 = wide ? load8(value, dtype, j + 8) : _mm256_setzero_ps();
            for (int h = 0; h < nb; h++) {
                __m256 w = _mm256_broadcast_ss(p + h * S + i);
                acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
            }
        }
        for (int h = 0; h < nb; h++) {
            _mm256_storeu_ps(out + h * hd + j, acc[h][0]);
            if (wide) _mm256_storeu_ps(out + h * hd + j + 8, acc[h][1]);
        }
    }
}

/* The blocks with their head count a constant, so that the running sums stay in registers. */
#define BY_HEADS(call, nb, ...)                                           \
    switch (nb) {                                                         \
        case 1: call(__VA_ARGS__, 1); break;                              \
        case 2: call(__VA_ARGS__, 2); break;                              \
        case 3: call(__VA_ARGS__, 3); break;                              \
        default: call(__VA_ARGS__, 4); break;                             \
    }

static void scores_for(const float *q, int64_t hd, const char *keys, int64_t stride, int dtype, const int32_t *live,
                       int64_t count, float scale, float *scores, int64_t S, int64_t nb) {
#define SCORE(q, hd, keys, stride, dtype, live, count, scale, scores, S, n) \
    score_block(q, n, hd, keys, stride, dtype, live, count, scale, scores, S)
    BY_HEADS(SCORE, nb, q, hd, keys, stride, dtype, live, count, scale, scores, S)
}

static void weights_for(const float *p, int64_t hd, const char *values, int64_t stride, int dtype, const int32_t *live,
                        int64_t count, float *out, int64_t S, int64_t nb) {
#define WEIGH(p, hd, values, stride, dtype, live, count, out, S, n) \
    weigh_block(p, n, hd, values, stride, dtype, live, count, out, S)
    BY_HEADS(WEIGH, nb, p, hd, values, stride, dtype, live, count, out, S)
}

/* q [B, n_heads, hd] (q_dtype, contiguous); k, v [B, S, kv_heads, hd] at element strides (sb, ss, sh), the
 * head dimension contiguous (kv_dtype); mask [B, S] bool at byte strides (mb, ms), true where forbidden;
 * query head h uses KV head h / (n_heads / kv_heads). out [B, n_heads * hd] in q_dtype. softcap 0: none, else
 * scores are tanh(s / softcap) * softcap after the scale. Returns 0, or -1 when a work buffer could not be had. */
int rl_decode_attention(const void *q, int q_dtype, int64_t B, int64_t n_heads, int64_t kv_heads, int64_t hd,
                        const void *k, const void *v, int kv_dtype, int64_t sb, int64_t ss, int64_t sh,
                        const uint8_t *mask, int64_t mb, int64_t ms, int64_t S, float scale, float softcap,
                        void *out, int threads) {
    int64_t group = n_heads / kv_heads;
    int per_head = B * kv_heads < threads;                /* a few rows: one query head per work item */
    int64_t width = per_head ? 1 : group;                  /* query heads per item */
    int64_t items = B * kv_heads * (group / width);
    size_t esize = kv_dtype == RL_BF16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Per thread: the item's queries, their scores (then probabilities) over the live keys, their outputs,
         * and the live keys' positions. */
        float *qs = malloc((size_t)(width * (hd + S + hd)) * sizeof(float));
        int32_t *live = malloc((size_t)S * sizeof(int32_t));
        if (qs == NULL || live == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (qs == NULL || live == NULL) continue;
            int64_t per_row = kv_heads * (group / width), b = it / per_row, rest = it % per_row;
            int64_t g = rest / (group / width), h0 = g * group + (rest % (group / width)) * width;
            float *scores = qs + width * hd, *acc = scores + width * S;
            for (int64_t h = 0; h < width; h++)
                for (int64_t j = 0; j < hd; j++)
                    qs[h * hd + j] = load_float(q, q_dtype, (b * n_heads + h0 + h) * hd + j);
            const char *kb = (const char *)k + (size_t)(b * sb + g * sh) * esize;
            const char *vb = (const char *)v + (size_t)(b * sb + g * sh) * esize;
            int64_t count = 0;
            for (int64_t s = 0; s < S; s++)
                if (!mask[b * mb + s * ms]) live[count++] = (int32_t)s;
            for (int64_t h = 0; h < width; h += HB)
                scores_for(qs + h * hd, hd, kb, ss * esize, kv_dtype, live, count, scale, scores + h * S, S,
                           width - h < HB ? width - h : HB);
            for (int64_t h = 0; h < width; h++) {
                float *row = scores + h * S, top = -INFINITY, total = 0.f;
                for (int64_t i = 0; i < count; i++) {
                    if (softcap > 0.f) row[i] = tanhf(row[i] / softcap) * softcap;
                    if (row[i] > top) top = row[i];
                }
                for (int64_t i = 0; i < count; i++) total += row[i] = expf(row[i] - top);
                float inv = count ? 1.f / total : 0.f;  /* every key masked: zero */
                for (int64_t i = 0; i < count; i++) row[i] *= inv;
            }
            for (int64_t h = 0; h < width; h += HB)
                weights_for(scores + h * S, hd, vb, ss * esize, kv_dtype, live, count, acc + h * hd, S,
                            width - h < HB ? width - h : HB);
            for (int64_t h = 0; h < width; h++) {
                int64_t at = (b * n_heads + h0 + h) * hd;
                for (int64_t j = 0; j < hd; j++) {
                    if (q_dtype == RL_BF16)
                        ((uint16_t *)out)[at + j] = float_to_bf16(acc[h * hd + j]);
                    else
                        ((float *)out)[at + j] = acc[h * hd + j];
                }
            }
        }
        free(live);
        free(qs);
    }
    return failed ? -1 : 0;
}
