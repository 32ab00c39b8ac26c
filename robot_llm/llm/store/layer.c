/* A decoder layer of a decode step (one new position per row) in one call: the norms, the products with int8
 * activations, the rotary, the step's keys and values into the cache, the attention and the gated MLP, each by the
 * kernel the families' Python path calls for it (rl_rms_norm, rl_int8_linear, rl_decode_attention, rl_gated), in
 * the same order on the same operands, so the layer's output is that path's to the bit.
 *
 * A batch-1 step of Gemma 3 270M spent about 5 ms of its 20-31 in the Python between those calls (some 15 calls a
 * layer, each with its checks, views and a new tensor), whatever the threads: a share of the step that grows as
 * the threads shrink the kernels' own time. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "floats.h"

int rl_rms_norm(const void *x, int dtype, int64_t rows, int64_t n, const void *w, int w_dtype, float offset,
                int gain_rounded, float eps, const void *cos, const void *sin, int64_t heads, const void *residual,
                void *out, int threads);
int rl_int8_linear(const void *x, int x_bf16, int64_t m, int64_t k, int64_t width, int64_t rotation, int levels,
                   const int64_t *mats, int count, int y_bf16, int threads);
int rl_decode_attention(const void *q, int q_dtype, int64_t B, int64_t n_heads, int64_t kv_heads, int64_t hd,
                        const void *k, const void *v, int kv_dtype, int64_t sb, int64_t ss, int64_t sh,
                        const uint16_t *ks, const uint16_t *vs, int64_t tb, int64_t ts, int64_t th,
                        const uint8_t *mask, int64_t mb, int64_t ms, int64_t S, float scale, float softcap, void *out,
                        int threads);
void rl_gated(const void *gate, const void *up, int64_t n, int kind, int bf16, void *out, int threads);

/* Matrices that meet one input, as rl_int8_linear takes them: six int64 each (the codes' address, their row
 * stride, their rows, the fp32 scales' address, the output's address, which the layer fills in, and packed codes'
 * offsets or 0), their padded width and the Hadamard block of their input columns. */
#define MATRIX_ARGS 6 /* gemv.c's */
typedef struct {
    int64_t mats[3 * MATRIX_ARGS];
    int64_t width, rotation;
} products;

/* The layer, as decode_layer.py fills it (field for field its ctypes Structure). dtype: the activations' (RL_FP32
 * or RL_BF16); the norms' gains in norm_dtype, a NULL one not applied (q_norm, k_norm: the rotary alone; the post
 * norms: the residual added to the product as it is); gain_rounded and offset as rl_rms_norm takes them. The cache
 * [B, slots, kv_heads, hd] at element strides (sb, ss, sh), in kv_dtype (RL_FP32, RL_BF16, or RL_INT8: codes, with
 * their fp16 scales k_scales, v_scales [B, slots, kv_heads] at element strides tb, ts, th); this step writes slot
 * `slot` and attends slots 0 .. S - 1 where mask [B, S] (byte strides mb, ms) is false. cos, sin: the rotary's
 * factors [B, hd] in dtype, for queries and keys alike. act: rl_gated's kind. */
typedef struct {
    const void *x;
    void *out;
    int64_t rows, hidden, heads, kv_heads, hd, intermediate;
    int32_t dtype, norm_dtype, gain_rounded, act, levels, threads;
    float eps, offset, scale, softcap;
    const void *input_norm, *q_norm, *k_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm;
    products qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    int64_t sb, ss, sh, slot, S, mb, ms;
    int32_t kv_dtype, pad;
    const uint8_t *mask;
    const void *cos, *sin;
    uint16_t *k_scales, *v_scales;
    int64_t tb, ts, th;
} decode_layer;

/* y = the int8-activation products of x [rows, k] by p's `count` matrices, into outs. */
static int multiply(const decode_layer *L, products *p, int count, const void *x, int64_t k, void *const *outs) {
    for (int j = 0; j < count; j++) p->mats[MATRIX_ARGS * j + 4] = (int64_t)(intptr_t)outs[j];
    int bf16 = L->dtype == RL_BF16;
    return rl_int8_linear(x, bf16, L->rows, k, p->width, p->rotation, L->levels, p->mats, count, bf16, L->threads);
}

static int norm(const decode_layer *L, const void *x, int64_t rows, int64_t n, const void *w, int rotary,
                int64_t heads, const void *residual, void *out) {
    return rl_rms_norm(x, L->dtype, rows, n, w, L->norm_dtype, L->offset, L->gain_rounded, L->eps,
                       rotary ? L->cos : NULL, rotary ? L->sin : NULL, heads, residual, out, L->threads);
}

/* One head's hd values of `from` (dtype, from element `at`) as an int8 cache's codes and fp16 scale, as
 * kvquant.QuantKV.write makes them: the scale the largest magnitude / 127 (at least 2^-14) rounded to fp16, each code
 * the value / that scale rounded to nearest even within -127..127 (a NaN's code 0, as torch's cast makes it). */
static void quantize_head(const decode_layer *L, const void *from, int64_t at, int8_t *codes, uint16_t *scale) {
    float most = 0.f;
    for (int64_t j = 0; j < L->hd; j++) {
        float a = fabsf(load_float(from, L->dtype, at + j));
        most = a > most || a != a ? a : most; /* torch's amax keeps a NaN */
    }
    float step = most / 127.f;
    *scale = _cvtss_sh(step < 0x1p-14f ? 0x1p-14f : step, _MM_FROUND_TO_NEAREST_INT);
    float by = _cvtsh_ss(*scale);
    for (int64_t j = 0; j < L->hd; j++) {
        float r = nearbyintf(load_float(from, L->dtype, at + j) / by);
        codes[j] = r != r ? 0 : (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
}

/* Each row's kv_heads x hd values of `from` (dtype) into the cache's slot: as they are in the cache's dtype, fp32
 * rounded to a bf16 cache as torch's copy rounds, or as an int8 cache's codes and scales (quantize_head; `scales`
 * the cache's own), the caches decode_layer.py lets through. */
static void store(const decode_layer *L, const void *from, void *cache, uint16_t *scales) {
    size_t esize = L->kv_dtype == RL_BF16 ? 2 : L->kv_dtype == RL_INT8 ? 1 : 4;
    for (int64_t b = 0; b < L->rows; b++)
        for (int64_t g = 0; g < L->kv_heads; g++) {
            int64_t at = (b * L->kv_heads + g) * L->hd;
            if (L->kv_dtype == RL_INT8) {
                int8_t *to = (int8_t *)cache + b * L->sb + L->slot * L->ss + g * L->sh;
                quantize_head(L, from, at, to, scales + b * L->tb + L->slot * L->ts + g * L->th);
                continue;
            }
            char *to = (char *)cache + (size_t)(b * L->sb + L->slot * L->ss + g * L->sh) * esize;
            if (L->kv_dtype == L->dtype)
                memcpy(to, (const char *)from + (size_t)at * esize, (size_t)L->hd * esize);
            else
                for (int64_t j = 0; j < L->hd; j++) ((uint16_t *)to)[j] = float_to_bf16(((const float *)from)[at + j]);
        }
}

/* Returns 0, or -1 when a buffer could not be allocated (the cache's slot may then hold this step's keys). */
int rl_decode_layer(decode_layer *L) {
    int64_t m = L->rows, H = L->hidden, q_n = L->heads * L->hd, kv_n = L->kv_heads * L->hd, I = L->intermediate;
    size_t esize = L->dtype == RL_BF16 ? 2 : 4;
    /* normed, q, k, v, the rotated q and k, attention, o, h, the MLP's input, gate, up, act * up, down */
    int64_t sizes[] = {H, q_n, kv_n, kv_n, q_n, kv_n, q_n, H, H, H, I, I, I, H};
    enum { NORMED, Q, K, V, QR, KR, ATT, O, HID, MLP_IN, GATE, UP, ACT, DOWN, BUFFERS };
    void *buf[BUFFERS];
    int64_t total = 0;
    for (int i = 0; i < BUFFERS; i++) total += m * sizes[i];
    char *base = malloc((size_t)total * esize);
    if (base == NULL) return -1;
    for (int i = 0, at = 0; i < BUFFERS; at += (int)(m * sizes[i]), i++) buf[i] = base + (size_t)at * esize;

    int failed = norm(L, L->x, m, H, L->input_norm, 0, 1, NULL, buf[NORMED]);
    if (!failed) failed = multiply(L, &L->qkv, 3, buf[NORMED], H, (void *[]){buf[Q], buf[K], buf[V]});
    if (!failed) failed = norm(L, buf[Q], m * L->heads, L->hd, L->q_norm, 1, L->heads, NULL, buf[QR]);
    if (!failed) failed = norm(L, buf[K], m * L->kv_heads, L->hd, L->k_norm, 1, L->kv_heads, NULL, buf[KR]);
    if (!failed) {
        store(L, buf[KR], L->k_cache, L->k_scales);
        store(L, buf[V], L->v_cache, L->v_scales);
        failed = rl_decode_attention(buf[QR], L->dtype, m, L->heads, L->kv_heads, L->hd, L->k_cache, L->v_cache,
                                     L->kv_dtype, L->sb, L->ss, L->sh, L->k_scales, L->v_scales, L->tb, L->ts, L->th,
                                     L->mask, L->mb, L->ms, L->S, L->scale, L->softcap, buf[ATT], L->threads);
    }
    if (!failed) failed = multiply(L, &L->o, 1, buf[ATT], q_n, (void *[]){buf[O]});
    if (!failed) failed = norm(L, buf[O], m, H, L->post_attention_norm, 0, 1, L->x, buf[HID]);
    if (!failed) failed = norm(L, buf[HID], m, H, L->pre_mlp_norm, 0, 1, NULL, buf[MLP_IN]);
    if (!failed) failed = multiply(L, &L->gate_up, 2, buf[MLP_IN], H, (void *[]){buf[GATE], buf[UP]});
    if (!failed) {
        rl_gated(buf[GATE], buf[UP], m * I, L->act, L->dtype == RL_BF16, buf[ACT], L->threads);
        failed = multiply(L, &L->down, 1, buf[ACT], I, (void *[]){buf[DOWN]});
    }
    if (!failed) failed = norm(L, buf[DOWN], m, H, L->post_mlp_norm, 0, 1, buf[HID], L->out);
    free(base);
    return failed ? -1 : 0;
}
