/* What the kernels (gemv.c, norm.c, attend.c) share: bf16 and fp16 conversions as torch rounds them, an AVX2 sum. */
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
enum { RL_FP32 = 0, RL_BF16 = 1, RL_FP16 = 2 };

static inline float load_float(const void *p, int dtype, int64_t i) {
    if (dtype == RL_BF16) return bf16_to_float(((const uint16_t *)p)[i]);
    if (dtype == RL_FP16) return _cvtsh_ss(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* v rounded to bf16 where the tensor is bf16: what a torch op in that dtype stores. */
static inline float round_to(float v, int dtype) { return dtype == RL_BF16 ? bf16_to_float(float_to_bf16(v)) : v; }

/* The sum of an AVX2 vector's eight floats. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
