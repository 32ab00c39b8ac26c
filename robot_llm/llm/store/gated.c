/* The gated MLP's activation times its up projection, in one pass over fp32 rows: Gemma 3's gelu_tanh(gate) * up,
 * Llama's and Qwen 3's silu(gate) * up.
 *
 * torch computes each as two ops, and its vectorized tanh (Sleef's, on the AVX2 kind) is slow: a Gemma 3 270M
 * prefill of 4 rows of 512 spent 5.8 % of its time in gelu (2,048 x 2,048 values, 10.7 ms a layer at 2 threads,
 * 0.4 G values/s) and 1.8 % in the product. Both are one sigmoid: gelu_tanh(x) = x / 2 * (1 + tanh(u)) =
 * x * sigmoid(2u), u = sqrt(2 / pi) * (x + 0.044715 x^3), and silu(x) = x * sigmoid(x); the sigmoid of t is
 * 1 / (1 + e) for t >= 0 and e / (1 + e) below, e = exp(-|t|) (vexp, within 2 units in the last place), so that no
 * exponential overflows and no small value is the difference of two near 1. The values are torch's within a few
 * units in the last place of fp32 (its own tanh is within one).
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

/* kind's activation of gate times up, VL values. */
static inline vf gated(vf x, vf up, int kind) {
    vf t = x;
    if (kind == GELU_TANH) /* 2u = 2 sqrt(2 / pi) (x + 0.044715 x^3) */
        t = vmul(vset(1.5957691216057308f), vfma(vmul(vset(0.044715f), x), vmul(x, x), x));
    vf e = vexp(vsub(vzero(), vmax(t, vsub(vzero(), t)))); /* exp(-|t|) */
    vf sigmoid = vdiv(select_nonnegative(t, vset(1.f), e), vadd(vset(1.f), e));
    return vmul(vmul(x, sigmoid), up);
}

/* The same for one value (a row's tail). */
static inline float gated_one(float x, float up, int kind) {
    float t = kind == GELU_TANH ? 1.5957691216057308f * (0.044715f * x * (x * x) + x) : x;
    float e = expf(-fabsf(t));
    return x * ((t >= 0.f ? 1.f : e) / (1.f + e)) * up;
}

/* out[i] = act(gate[i]) * up[i] for i < n (fp32; out may be gate or up), act by kind: 0 gelu_tanh, 1 silu. Split
 * over the threads from PARALLEL_FROM values (a batch-32 decode step's 65,536 at 2 threads: 28 us against 53 on
 * one, AVX2 body; torch's two ops 105). */
#define PARALLEL_FROM (1 << 15)
void rl_gated(const float *gate, const float *up, int64_t n, int kind, float *out, int threads) {
    int64_t whole = n / VL * VL;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_FROM)
    for (int64_t i = 0; i < whole; i += VL)
        vstore(out + i, gated(vload(gate, RL_FP32, i, VL), vload(up, RL_FP32, i, VL), kind), VL);
    for (int64_t i = whole; i < n; i++) out[i] = gated_one(gate[i], up[i], kind);
}
