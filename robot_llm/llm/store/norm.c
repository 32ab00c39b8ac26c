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
/* The row's squares summed in double, eight running sums (so that the adds pipeline and vectorize). */
static double sum_of_squares(const float *y, int64_t n) {
    double part[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) part[l] += (double)y[j + l] * y[j + l];
    for (; j < n; j++) part[0] += (double)y[j] * y[j];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

static void round_row(float *y, int64_t n, int dtype) {
    if (dtype == RL_BF16)
        for (int64_t j = 0; j < n; j++) y[j] = bf16_to_float(float_to_bf16(y[j]));
}

/* The rotate-half ("NeoX") rotary of the row y [n] in place, by the tables' row at element `table` (in `dtype`, x's,
 * a constant at each call so that the loop vectorizes: at 1 thread a batch-32 q norm of 32 x 4 x 256 in bf16 114 ->
 * 44 us natively, a 4 x 512 prefill's in fp32 3.0 -> 2.1 ms on the AVX2 kind), each op rounded as torch's:
 * y * cos + rotate_half(y) * sin, the second half negated into the first. `first` holds the first half meanwhile. */
static inline __attribute__((always_inline)) void rotate_row(float *y, float *first, const void *cos, const void *sin,
                                                             int64_t table, int64_t n, int dtype) {
    int64_t half = n / 2;
    memcpy(first, y, (size_t)half * sizeof(float)); /* before its outputs overwrite it */
    for (int64_t j = 0; j < n; j++) {
        float c = load_float(cos, dtype, table + j), s = load_float(sin, dtype, table + j);
        float other = j < half ? -y[j + half] : first[j - half];
        float a = round_to(c * (j < half ? first[j] : y[j]), dtype), b = round_to(other * s, dtype);
        y[j] = round_to(a + b, dtype);
    }
}

int rl_rms_norm(const void *x, int dtype, int64_t rows, int64_t n, const void *w, int w_dtype, float offset,
                int gain_rounded, float eps, const void *cos, const void *sin, int64_t heads, const void *residual,
                void *out, int threads) {
    int failed = 0;
    /* Threads from 8,192 values (a batch-32 step's norms: 32 x 4 x 256 with the rotary, 2 threads, 114 -> 62 us in
     * bf16); a batch-1 step's few rows stay on one (the threads' wake-up would cost more than the rows). */
#pragma omp parallel num_threads(threads) if (rows * n >= 8192) reduction(| : failed)
    {
        /* The row, the gain (offset + w, or w: the same for every row) and the rotary's half row. */
        float *y = malloc((size_t)(3 * n) * sizeof(float)), *gain = y + n, *first = y + 2 * n;
        if (y == NULL) failed = 1;
        for (int64_t j = 0; y != NULL && w != NULL && j < n; j++)
            gain[j] = gain_rounded ? load_float(w, w_dtype, j) : offset + load_float(w, w_dtype, j);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (y == NULL) continue;
            int64_t at = r * n;
            if (dtype == RL_BF16)
                for (int64_t j = 0; j < n; j++) y[j] = bf16_to_float(((const uint16_t *)x)[at + j]);
            else
                memcpy(y, (const float *)x + at, (size_t)n * sizeof(float));
            if (w != NULL) {
                float rstd = 1.0f / sqrtf((float)(sum_of_squares(y, n) / (double)n) + eps);
                for (int64_t j = 0; j < n; j++) y[j] *= rstd;
                if (gain_rounded) round_row(y, n, dtype);  /* Llama: the normed row is cast before the gain */
                for (int64_t j = 0; j < n; j++) y[j] *= gain[j];
                round_row(y, n, dtype);
            }
            if (cos != NULL && dtype == RL_BF16)
                rotate_row(y, first, cos, sin, (r / heads) * n, n, RL_BF16);
            else if (cos != NULL)
                rotate_row(y, first, cos, sin, (r / heads) * n, n, RL_FP32);
            if (residual != NULL) {
                for (int64_t j = 0; j < n; j++) y[j] += load_float(residual, dtype, at + j);
                round_row(y, n, dtype);
            }
            if (dtype == RL_BF16)
                for (int64_t j = 0; j < n; j++) ((uint16_t *)out)[at + j] = float_to_bf16(y[j]);
            else
                memcpy((float *)out + at, y, (size_t)n * sizeof(float));
        }
        free(y);
    }
    return failed ? -1 : 0;
}
