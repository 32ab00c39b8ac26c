/* What the kernels (gemv.c, gemm.c, norm.c, attend.c) share: bf16 and fp16 conversions as torch rounds them, an
 * AVX2 sum, and the staging of a product's activations as fp32 rows. */
#ifndef ROBOT_LLM_FLOATS_H
#define ROBOT_LLM_FLOATS_H
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  /* round to nearest even, as torch does */
}

/* The dtypes a tensor crosses the boundary in (gemv.py's DTYPE_CODES). */
enum { RL_FP32 = 0, RL_BF16 = 1, RL_FP16 = 2, RL_INT8 = 3 };

static inline float load_float(const void *p, int dtype, int64_t i) {
    if (dtype == RL_BF16) return bf16_to_float(((const uint16_t *)p)[i]);
    if (dtype == RL_FP16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* p[i] = v in `dtype`, RL_FP32 or RL_BF16 (rounded to nearest even, as torch's cast). */
static inline void store_float(void *p, int dtype, int64_t i, float v) {
    if (dtype == RL_BF16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to bf16 where the tensor is bf16: what a torch op in that dtype stores. */
static inline float round_to(float v, int dtype) { return dtype == RL_BF16 ? bf16_to_float(float_to_bf16(v)) : v; }

/* Columns c0 .. c1 - 1 of the fp32 values from [m, n] rounded to bf16 into to [m, n]: a product's block of outputs
 * in a bf16 compute dtype, rounded by the thread that computed it while it is in that thread's caches (rl_int8_linear
 * rounded whole outputs after the product, on one thread: 1.6 % of a batch-32 decode step's samples at 2 threads,
 * the other thread waiting meanwhile). */
static inline void round_columns(const float *from, uint16_t *to, int64_t m, int64_t n, int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = c0; j < c1; j++) to[i * n + j] = float_to_bf16(from[i * n + j]);
}

/* Eight values from element j of fp32 or bf16 (bf16: their bits shifted up into an fp32's) as fp32. */
static inline __m256 load8(const void *p, int bf16, int64_t j) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + j))), 16));
    return _mm256_loadu_ps((const float *)p + j);
}

/* The sum of an AVX2 vector's eight floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One butterfly stage within 8-lane vectors (h = 1, 2 or 4): lane j below its partner (j & h == 0) gets u + v, the
 * partner u - v, u the lower lane's value and v the upper's, as the scalar butterfly computes them. */
static inline __m256 butterfly8(__m256 x, int h) {
    __m256 partner;
    int upper;
    if (h == 1) {
        partner = _mm256_permute_ps(x, 0xB1), upper = 0xAA;
    } else if (h == 2) {
        partner = _mm256_permute_ps(x, 0x4E), upper = 0xCC;
    } else {
        partner = _mm256_permute2f128_ps(x, x, 0x01), upper = 0xF0;
    }
    /* lower lanes: x (u) + partner (v); upper lanes: partner (u) - x (v) */
    __m256 sum = _mm256_add_ps(x, partner), diff = _mm256_sub_ps(partner, x);
    switch (upper) {
    case 0xAA: return _mm256_blend_ps(sum, diff, 0xAA);
    case 0xCC: return _mm256_blend_ps(sum, diff, 0xCC);
    default: return _mm256_blend_ps(sum, diff, 0xF0);
    }
}

/* row [n] (fp32) times the Sylvester Hadamard matrix of +-1 entries in every run of `block` columns (a power of two;
 * n a multiple of it): the fast transform, stage h = 1, 2, 4, ... pairing each column j (j & h == 0) with j + h into
 * (u + v, u - v), each op rounded in fp32. The stages below 8 run within vectors, the rest between them. */
static inline void hadamard_rows(float *row, int64_t n, int64_t block) {
    if (block >= 8) {
        for (int64_t j = 0; j < n; j += 8) {
            __m256 x = _mm256_loadu_ps(row + j);
            x = butterfly8(butterfly8(butterfly8(x, 1), 2), 4);
            _mm256_storeu_ps(row + j, x);
        }
    }
    for (int64_t h = block >= 8 ? 8 : 1; h < block; h *= 2)
        for (int64_t b = 0; b < n; b += block)
            for (int64_t a = b; a < b + block; a += 2 * h) {
                if (h >= 8) {
                    for (int64_t j = a; j < a + h; j += 8) {
                        __m256 u = _mm256_loadu_ps(row + j), v = _mm256_loadu_ps(row + j + h);
                        _mm256_storeu_ps(row + j, _mm256_add_ps(u, v));
                        _mm256_storeu_ps(row + j + h, _mm256_sub_ps(u, v));
                    }
                } else {
                    for (int64_t j = a; j < a + h; j++) {
                        float u = row[j], v = row[j + h];
                        row[j] = u + v;
                        row[j + h] = u - v;
                    }
                }
            }
}

/* x [m, kx] (fp32, or bf16 where x_bf16) into fp32 [m, k], zero-padded, each run of `rotation` columns
 * (0: none) times the Sylvester Hadamard matrix of +-1 entries (hadamard_rows; int8act.rotate's matrix). */
static inline void stage_rows(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t k, int64_t rotation, float *out) {
    for (int64_t i = 0; i < m; i++) {
        float *row = out + i * k;
        for (int64_t j = 0; j < kx; j++)
            row[j] = x_bf16 ? bf16_to_float(((const uint16_t *)x)[i * kx + j]) : ((const float *)x)[i * kx + j];
        for (int64_t j = kx; j < k; j++) row[j] = 0.f;
        if (rotation) hadamard_rows(row, k, rotation);
    }
}

#endif
