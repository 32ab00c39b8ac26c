/* The gated MLP's activation times its up projection, in one pass over fp32 or bf16 rows: Gemma 3's
 * gelu_tanh(gate) * up, Llama's and Qwen 3's silu(gate) * up.
 *
 * torch computes each as two ops, and its vectorized tanh (Sleef's, on the AVX2 kind) is slow: a Gemma 3 270M
 * prefill of 4 rows of 512 spent 5.8 % of its time in gelu (2,048 x 2,048 values, 10.7 ms a layer at 2 threads,
 * 0.4 G values/s) and 1.8 % in the product. Both are one sigmoid: gelu_tanh(x) = x / 2 * (1 + tanh(u)) =
 * x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3), and silu(x) = x * sigmoid(x); the sigmoid of t is
 * 1 / (1 + e) for t >= 0 and e / (1 + e) below, e = exp(-|t|) (vexp, within 2 units in the last place), so that no
 * exponential overflows and no small value is the difference of two near 1. The values are torch's within a few
 * units in the last place of fp32 (its own tanh is within one). In bf16 the activation is rounded to bf16 before
 * the product, as torch's ops store it: torch's bf16 but where the fp32 value lies within those few units of a
 * rounding boundary (a 2,048 x 2,048 prefill's values natively, 2 threads: torch's ops 4.4-5.4 ms, these 1.6-2.1).
 */
#include <math.h>

#include "vectors.h"

enum { GELU_TANH = 0, SILU = 1 };

#if VL == 16
static inline vf select_nonnegative(vf t, vf yes, vf no) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, vzero(), _CMP_GE_OQ), no, yes);
}
#else
static inline vf select_nonnegative(vf t, vf yes, vf no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(t, vzero(), _CMP_GE_OQ));
}
#endif

/* kind's activation of x, VL values. */
static inline vf activation(vf x, int kind) {
    vf t = x;
    if (kind == GELU_TANH) /* 2u = 2 sqrt(2 / pi) (x + 0.044715 x^3) */
        t = vmul(vset(1.5957691216057308f), vfma(vmul(vset(0.044715f), x), vmul(x, x), x));
    vf e = vexp(vsub(vzero(), vmax(t, vsub(vzero(), t)))); /* exp(-|t|) */
    return vmul(x, vdiv(select_nonnegative(t, vset(1.f), e), vadd(vset(1.f), e)));
}

/* The same for one value (a row's tail). */
static inline float activation_one(float x, int kind) {
    float t = kind == GELU_TANH ? 1.5957691216057308f * (0.044715f * x * (x * x) + x) : x;
    float e = expf(-fabsf(t));
    return x * ((t >= 0.f ? 1.f : e) / (1.f + e));
}

/* out[i] = act(gate[i]) * up[i] for i < n, act by kind: 0 gelu_tanh, 1 silu; fp32, or bf16 throughout (bf16: the
 * activation rounded to bf16 before the product, then the product, as torch's two ops round them; out may be gate
 * or up). Split over the threads from PARALLEL_FROM values (a batch-32 decode step's 65,536 at 2 threads: 28 us
 * against 53 on one, AVX2 body; torch's two ops 105). */
#define PARALLEL_FROM (1 << 15)
void rl_gated(const void *gate, const void *up, int64_t n, int kind, int bf16, void *out, int threads) {
    int64_t whole = n / VL * VL;
    int dtype = bf16 ? RL_BF16 : RL_FP32;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < whole; i += VL) {
        vf act = activation(vload(gate, dtype, i, VL), kind), u = vload(up, dtype, i, VL);
        if (bf16)
            vstore_bf16((uint16_t *)out + i, vmul(vround_bf16(act), u));
        else
            vstore((float *)out + i, vmul(act, u), VL);
    }
    for (int64_t i = whole; i < n; i++) {
        float y = round_to(activation_one(load_float(gate, dtype, i), kind), dtype) * load_float(up, dtype, i);
        store_float(out, dtype, i, y);
    }
}
