/* The RMSNorm of the Hugging Face families (Gemma 3, Llama, Qwen 3) with what follows it in a layer (the
 * rotary of a normed query or key, the residual add after a post-norm), in one call over rows.
 *
 * torch computes each of these as a chain of small ops (the fp32 cast, the squares, their mean, the rsqrt,
 * two products, the cast back; the rotary's halves, negation, two products and a sum): 5-7 us apiece at a
 * decode step's sizes, about 40 us a norm, some 110 norms and 36 rotaries a Gemma 3 270M step. Here a norm is
 * one pass over its row. The arithmetic is torch's, op by op, with each op's result rounded to the tensor's
 * dtype where torch's op would store it (bf16), so the output is torch's but for the sum of squares, which is
 * accumulated in double (torch: fp32): at most one unit in the last place of the mean. Compiled without
 * contraction (-ffp-contract=off), so that no product and sum fuse into an FMA that torch's ops do not.
 */
#include <math.h>
#include <stdlib.h>

#include "floats.h"

/* For each of `rows` rows of n values (x: fp32 or bf16, `dtype`; rows contiguous):
 *   y = x * rsqrt(mean(x^2) + eps), computed in fp32, then
 *     * (offset + w) in fp32 and rounded once (Gemma: offset 1), or, with gain_rounded, rounded first and
 *       times w in the dtype (Llama: w in x's dtype); w NULL: no norm at all, y = x;
 *   where cos is given (with sin; [rows / heads, n], x's dtype): the rotate-half ("NeoX") rotary,
 *     y = y * cos + rotate_half(y) * sin, row r using row r / heads of the tables;
 *   where residual is given ([rows, n], x's dtype): y = residual + y.
 * out [rows, n] in x's dtype (it may be x itself). Returns 0, or -1 when a row buffer could not be had. */
int rl_rms_norm(const void *x, int dtype, int64_t rows, int64_t n, const void *w, int w_dtype, float offset,
                int gain_rounded, float eps, const void *cos, const void *sin, int64_t heads, const void *residual,
                void *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * n >= 65536) reduction(| : failed)
    {
        float *y = malloc((size_t)n * sizeof(float));
        if (y == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (y == NULL) continue;
            int64_t at = r * n;
            for (int64_t j = 0; j < n; j++) y[j] = load_float(x, dtype, at + j);
            if (w != NULL) {
                double squares = 0.0;
                for (int64_t j = 0; j < n; j++) squares += (double)y[j] * y[j];
                float rstd = 1.0f / sqrtf((float)(squares / (double)n) + eps);
                for (int64_t j = 0; j < n; j++) {
                    float normed = y[j] * rstd;
                    y[j] = gain_rounded ? round_to(round_to(normed, dtype) * load_float(w, w_dtype, j), dtype)
                                        : round_to(normed * (offset + load_float(w, w_dtype, j)), dtype);
                }
            }
            if (cos != NULL) {
                int64_t table = (r / heads) * n, half = n / 2;
                float first[half > 0 ? half : 1];  /* the first half, before its outputs overwrite it */
                for (int64_t j = 0; j < half; j++) first[j] = y[j];
                for (int64_t j = 0; j < n; j++) {
                    float v = j < half ? first[j] : y[j];
                    float other = j < half ? -y[j + half] : first[j - half];
                    float a = round_to(v * load_float(cos, dtype, table + j), dtype);
                    float b = round_to(other * load_float(sin, dtype, table + j), dtype);
                    y[j] = round_to(a + b, dtype);
                }
            }
            for (int64_t j = 0; j < n; j++) {
                float v = residual != NULL ? round_to(load_float(residual, dtype, at + j) + y[j], dtype) : y[j];
                if (dtype == RL_BF16)
                    ((uint16_t *)out)[at + j] = float_to_bf16(v);
                else
                    ((float *)out)[at + j] = v;
            }
        }
        free(y);
    }
    return failed ? -1 : 0;
}
