/* The vector arithmetic the float kernels (attend.c, gated.c) share, on the widest body the build has: AVX512
 * (16 lanes) or AVX2 with FMA (8); vf is its vector of floats, VL its lanes. */
#ifndef ROBOT_LLM_VECTORS_H
#define ROBOT_LLM_VECTORS_H
#include "floats.h"

/* The vector type vf of a body and its arithmetic, by the intrinsics' prefix. */
#define VECTOR_OPS(type, p)                                                   \
    typedef type vf;                                                          \
    static inline vf vzero(void) { return p##_setzero_ps(); }                 \
    static inline vf vset(float a) { return p##_set1_ps(a); }                 \
    static inline vf vfma(vf a, vf b, vf c) { return p##_fmadd_ps(a, b, c); } \
    static inline vf vmul(vf a, vf b) { return p##_mul_ps(a, b); }            \
    static inline vf vadd(vf a, vf b) { return p##_add_ps(a, b); }            \
    static inline vf vsub(vf a, vf b) { return p##_sub_ps(a, b); }            \
    static inline vf vmax(vf a, vf b) { return p##_max_ps(a, b); }            \
    static inline vf vdiv(vf a, vf b) { return p##_div_ps(a, b); }

/* Its vector of 32-bit integers vi, the floats' bits, and the integer ops bf16 rounding needs (bits: its width). */
#define VECTOR_INT_OPS(type, p, bits)                                                 \
    typedef type vi;                                                                  \
    static inline vi vbits(vf v) { return p##_castps_si##bits(v); }                  \
    static inline vf vfloats(vi v) { return p##_castsi##bits##_ps(v); }               \
    static inline vi vadd32(vi a, vi b) { return p##_add_epi32(a, b); }               \
    static inline vi vand32(vi a, vi b) { return p##_and_si##bits(a, b); }            \
    static inline vi vset32(int32_t a) { return p##_set1_epi32(a); }                  \
    static inline vi vshr32(vi a, int n) { return p##_srli_epi32(a, n); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VL 16
VECTOR_OPS(__m512, _mm512)
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
/* n <= VL values from element j of a row (bf16: their bits shifted up into fp32's), the rest zero. */
static inline vf vload(const void *p, int dtype, int64_t j, int64_t n) {
    if (dtype == RL_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first(n), (const uint16_t *)p + j)), 16));
    if (dtype == RL_INT8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(first(n), (const int8_t *)p + j)));
    return _mm512_maskz_loadu_ps(first(n), (const float *)p + j);
}
static inline void vstore(float *p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
VECTOR_INT_OPS(__m512i, _mm512, 512)
/* bits, with nan's lanes where v holds a NaN. */
static inline vi vnan_to(vf v, vi bits, vi nan) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), bits, nan);
}
/* VL 32-bit lanes holding 16-bit values, stored as VL uint16. */
static inline void vstore16(uint16_t *p, vi v) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(v)); }
/* 2^n for integral n in [-126, 127] in every lane, times x. */
static inline vf vscale2(vf x, vf n) { return _mm512_scalef_ps(x, n); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
VECTOR_OPS(__m256, _mm256)
static inline float vhmax(vf a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float vhsum(vf a) { return hsum8(a); }
/* Whole vectors only (VL values from element j; n is the AVX512 body's): the callers' widths are multiples of 8. */
static inline vf vload(const void *p, int dtype, int64_t j, int64_t n) {
    (void)n;
    if (dtype == RL_INT8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + j))));
    return load8(p, dtype == RL_BF16, j);
}
static inline void vstore(float *p, vf v, int64_t n) {
    (void)n;
    _mm256_storeu_ps(p, v);
}
VECTOR_INT_OPS(__m256i, _mm256, 256)
/* bits, with nan's lanes where v holds a NaN. */
static inline vi vnan_to(vf v, vi bits, vi nan) {
    return _mm256_blendv_epi8(bits, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline void vstore16(uint16_t *p, vi v) { /* packus interleaves the 128-bit lanes; the permute orders them */
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08)));
}
static inline vf vscale2(vf x, vf n) {
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(x, _mm256_castsi256_ps(bits));
}
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#else
#error "the float kernels need AVX2 and FMA (gemv.py compiles them only where the CPU has them)"
#endif

/* v's lanes rounded to bf16 as float_to_bf16 rounds them (to nearest even, a NaN to 0x7fc0), their bits in the
 * upper halves of the lanes (as fp32: the rounded values) or, shifted, in the lower (vstore16's operand). */
static inline vi vbf16_upper(vf v) {
    vi u = vbits(v), lsb = vand32(vshr32(u, 16), vset32(1));
    return vnan_to(v, vand32(vadd32(vadd32(u, vset32(0x7fff)), lsb), vset32((int32_t)0xffff0000u)), vset32(0x7fc00000));
}
static inline vf vround_bf16(vf v) { return vfloats(vbf16_upper(v)); }
static inline void vstore_bf16(uint16_t *p, vf v) { vstore16(p, vshr32(vbf16_upper(v), 16)); }

/* exp(x) for x <= 0 (a score minus the row's largest, a sigmoid's -|t|), within 2 units in the last place: Cephes' expf (the
 * remainder after whole powers of two, in two parts of ln 2, and a degree-6 polynomial). Below ln(FLT_MIN) it
 * gives FLT_MIN's order instead of zero, which no sum of probabilities can tell apart. */
static inline vf vexp(vf x) {
    x = vmax(x, vset(-87.33654f));
    vf n = vround(vmul(x, vset(1.44269504088896341f)));
    vf r = vfma(n, vset(-0.693359375f), x);
    r = vfma(n, vset(2.12194440e-4f), r);
    vf y = vset(1.9875691500e-4f);
    y = vfma(y, r, vset(1.3981999507e-3f));
    y = vfma(y, r, vset(8.3334519073e-3f));
    y = vfma(y, r, vset(4.1665795894e-2f));
    y = vfma(y, r, vset(1.6666665459e-1f));
    y = vfma(y, r, vset(5.0000001201e-1f));
    y = vfma(y, vmul(r, r), vadd(r, vset(1.f)));
    return vscale2(y, n);
}

#endif
