/* Few-row products over int8 codes on the CPU: y[i, r] = scale[r] * sum_j x[i, j] * q[r, j].
 *
 * Compiled once per machine by gemv.py (cc -O3 -march=native -fopenmp); the AVX512 or the AVX2 body is
 * chosen by what the compiler was allowed. The codes are widened to fp32 in registers and multiplied by fp32
 * activations, so the product is exact up to fp32 rounding (no activation quantization), and the weights are
 * read once per call whatever the number of rows: at one to a few rows a call is a pass over the codes, and a
 * pass must run at the memory's speed. Weight rows are taken RT at a time and activation rows MT at a time,
 * so each loaded activation vector meets RT rows and each widened weight vector MT activation rows.
 * The activations come in as the engine holds them (bf16 or fp32, the unpadded width) and the call pads,
 * Hadamard-rotates (for a matrix whose columns were rotated, int8act.py) and writes the output dtype itself:
 * at a decode step's sizes each of those would otherwise be a torch op of 5-7 us, a hundred times a step.
 */
#include <math.h>
#include <stdlib.h>

#include "floats.h"

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vfloat;
static inline vfloat widen(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}
#define FMA _mm512_fmadd_ps
#define ZERO _mm512_setzero_ps
#define LOAD _mm512_loadu_ps
static inline float hsum(vfloat v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vfloat;
static inline vfloat widen(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}
#define FMA _mm256_fmadd_ps
#define ZERO _mm256_setzero_ps
#define LOAD _mm256_loadu_ps
static inline float hsum(vfloat v) { return hsum8(v); }
#else
#error "gemv.c needs AVX2 and FMA (gemv.py compiles it only where the CPU has them)"
#endif

#define RT 4
#define MT 4
#define PREFETCH 4096

/* The widths this build needs: k (and every row stride) a multiple of it. */
int64_t rl_gemv_lanes(void) { return LANES; }

/* y [m, n] (fp32, or bf16 where y_bf16) = stage_rows(x) @ (q * scale)^T over q int8 [n, ldq] (k columns used),
 * scale bf16 [n]; k a multiple of LANES and of rotation; threads: OpenMP threads to split the rows over.
 * Returns 0, or -1 when the staging buffer could not be allocated. */
int rl_int8_gemv(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t k, int64_t rotation, const int8_t *q,
                 int64_t ldq, const uint16_t *scale, void *y, int y_bf16, int64_t n, int threads) {
    float *xs = aligned_alloc(64, (size_t)((m * k * sizeof(float) + 63) / 64 * 64));
    if (xs == NULL) return -1;
    stage_rows(x, x_bf16, m, kx, k, rotation, xs);
    int64_t tiles = (n + RT - 1) / RT;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t r0 = t * RT;
        int64_t nr = n - r0 < RT ? n - r0 : RT;
        const int8_t *w[RT];
        for (int r = 0; r < RT; r++) w[r] = q + (r0 + (r < nr ? r : 0)) * ldq;  /* a short tile repeats a row */
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int64_t mi = m - i0 < MT ? m - i0 : MT;
            const float *xi = xs + i0 * k;
            vfloat acc[MT][RT];
            for (int i = 0; i < MT; i++)
                for (int r = 0; r < RT; r++) acc[i][r] = ZERO();
            for (int64_t j = 0; j < k; j += LANES) {
                vfloat wv[RT];
                /* The tile's rows are contiguous: one line a step, PREFETCH bytes ahead, keeps the memory busy
                 * (without it a single core read a 168 MB head at 6 GB/s, with it at 10; a sum reads 12.5). */
                _mm_prefetch((const char *)w[0] + PREFETCH + j * RT, _MM_HINT_T0);
                for (int r = 0; r < RT; r++) wv[r] = widen(w[r] + j);
                for (int i = 0; i < MT; i++) {
                    if (i < mi) {
                        vfloat xv = LOAD(xi + i * k + j);
                        for (int r = 0; r < RT; r++) acc[i][r] = FMA(xv, wv[r], acc[i][r]);
                    }
                }
            }
            for (int64_t i = 0; i < mi; i++)
                for (int64_t r = 0; r < nr; r++) {
                    float v = hsum(acc[i][r]) * bf16_to_float(scale[r0 + r]);
                    int64_t at = (i0 + i) * n + r0 + r;
                    if (y_bf16)
                        ((uint16_t *)y)[at] = float_to_bf16(v);
                    else
                        ((float *)y)[at] = v;
                }
        }
    }
    free(xs);
    return 0;
}

/* The epilogue of an int8 x int8 product: out [m, n] = (float)acc * scale[col] * row_scale[row], fp32, in one pass
 * and in torch's order of ops (int32 -> fp32, times the weight's scale, times the row's). For the LM head's
 * 32 x 262,144 logits the torch ops (a conversion, two in-place products, then casts to the compute dtype and back)
 * made five passes over 33 MB: 51 ms of a 250 ms batch-32 decode step, 1 thread. */
void rl_scale_int32(const int32_t *acc, int64_t m, int64_t n, const float *scale, const float *row_scale, float *out,
                    int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) out[i * n + j] = (float)acc[i * n + j] * scale[j] * row_scale[i];
}

/* idx[i] = the first column of row i of x [m, n] (fp32 or bf16, rows contiguous) holding the row's largest value,
 * a NaN counting as the largest (the first NaN), as torch.argmax: a greedy decode step's token of each row.
 * torch's took 0.4-0.7 ms a row of Gemma 3's 262,144 logits (22 ms a batch-32 step at 1 thread); a row is 1 MB,
 * which one core reads in 0.1 ms. AVX2 intrinsics (8 lanes) on either kind of CPU: the pass is the memory's. */
void rl_argmax_rows(const void *x, int x_bf16, int64_t m, int64_t n, int64_t *idx, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        const void *row = (const char *)x + (size_t)(i * n) * (x_bf16 ? 2 : 4);
        int dtype = x_bf16 ? RL_BF16 : RL_FP32;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 v = load8(row, x_bf16, j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, v);
        }
        float lanes[8], best;
        _mm256_storeu_ps(lanes, top);
        best = lanes[0];
        for (int l = 1; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (int64_t t = j; t < n; t++) {
            float v = load_float(row, dtype, t);
            if (v != v) any_nan = 1;
            if (v > best) best = v;
        }
        int64_t at = -1;
        __m256 want = _mm256_set1_ps(best);
        for (j = 0; at < 0 && j + 8 <= n; j += 8) {
            __m256 v = load8(row, x_bf16, j);
            int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
            if (hit) at = j + __builtin_ctz((unsigned)hit);
        }
        for (int64_t t = j; at < 0 && t < n; t++) {
            float v = load_float(row, dtype, t);
            if (any_nan ? v != v : v == best) at = t;
        }
        idx[i] = at < 0 ? 0 : at;
    }
}

/* Rows of x [m, k] (fp32 or bf16, rows contiguous) as symmetric int8 with one fp32 scale each, exactly as
 * int8act.quantize_activations computes them in torch ops: scale = max(max |x|, 1e-30) / 127, codes =
 * round-half-even(x * (1 / scale)) in fp32, the columns k .. width - 1 zero. A row holding a NaN or an
 * infinity gets a NaN scale (and zero codes), so that the product's output is not finite, as torch's would be.
 * torch's chain (abs, amax, the casts, clamp, divide, reciprocal, multiply, round, the int8 cast, the padding)
 * was 90 us a call for a batch-32 step's rows, 127 calls a step. */
void rl_quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t width, int8_t *q, float *scale,
                      int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        const void *row = (const char *)x + (size_t)(i * k) * (x_bf16 ? 2 : 4);
        int dtype = x_bf16 ? RL_BF16 : RL_FP32;
        const __m256 sign = _mm256_set1_ps(-0.f), huge = _mm256_set1_ps(3.4028234663852886e38f);
        __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= k; j += 8) {
            __m256 a = _mm256_andnot_ps(sign, load8(row, x_bf16, j));
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, huge, _CMP_NLE_UQ));  /* NaN or infinity */
            top = _mm256_max_ps(top, a);
        }
        float lanes[8], most = 0.f;
        _mm256_storeu_ps(lanes, top);
        for (int l = 0; l < 8; l++) most = lanes[l] > most ? lanes[l] : most;
        int finite = _mm256_movemask_ps(bad) == 0;
        for (int64_t t = j; t < k; t++) {
            float a = fabsf(load_float(row, dtype, t));
            finite &= a <= 3.4028234663852886e38f;
            most = a > most ? a : most;
        }
        int8_t *out = q + i * width;
        if (!finite) {
            scale[i] = NAN;
            memset(out, 0, (size_t)width);
            continue;
        }
        float s = (most > 1e-30f ? most : 1e-30f) / 127.0f, inv = 1.0f / s;
        scale[i] = s;
        const __m256 by = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= k; j += 8) {
            __m256 v = _mm256_round_ps(_mm256_mul_ps(load8(row, x_bf16, j), by), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i ints = _mm256_cvtps_epi32(v);
            __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
            _mm_storel_epi64((__m128i *)(out + j), _mm_packs_epi16(words, words));
        }
        for (int64_t t = j; t < k; t++) out[t] = (int8_t)nearbyintf((load_float(row, dtype, t)) * inv);
        memset(out + k, 0, (size_t)(width - k));
    }
}

/* Whether this build has rl_int8_mm's body (AVX512-VNNI). */
int rl_int8_mm_available(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The sums of four vectors' 16 lanes. */
static inline __m128i hsum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i v[4] = {a, b, c, d};
    __m256i h[4];
    for (int i = 0; i < 4; i++) h[i] = _mm256_add_epi32(_mm512_castsi512_si256(v[i]), _mm512_extracti64x4_epi64(v[i], 1));
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
#endif

/* c [m, n] int32 = a [m, k] @ w[:n, :k]^T over int8 codes (a's rows k apart, w's ldw apart; k a multiple of 64),
 * exactly: the integer sums of torch._int_mm, for a decode step's few rows, whose weights oneDNN's s8s8s32 GEMM
 * (torch._int_mm's) reads at 4-5 GB/s (Gemma 3 270M's 262,144 x 640 head at 8 and 32 rows on a Sapphire
 * Rapids core: 32-39 ms a step). AVX512-VNNI multiplies unsigned by signed bytes, so the activations are
 * offset by 128 and 128 times each weight row's sum taken back off (one more product per weight vector).
 * Returns 0, -1 when the offset rows could not be allocated, or -2 where this build has no VNNI body. */
int rl_int8_mm(const int8_t *a, int64_t m, int64_t k, const int8_t *w, int64_t ldw, int64_t n, int32_t *c,
               int threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    uint8_t *au = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    if (au == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) au[i] = (uint8_t)(a[i] ^ 0x80); /* a + 128 as an unsigned byte */
    int64_t tiles = (n + RT - 1) / RT;
    const __m512i ones = _mm512_set1_epi8(1);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t r0 = t * RT;
        int64_t nr = n - r0 < RT ? n - r0 : RT;
        const int8_t *wr[RT];
        for (int r = 0; r < RT; r++) wr[r] = w + (r0 + (r < nr ? r : 0)) * ldw;
        int32_t offset[RT];
        for (int64_t i0 = 0; i0 < m; i0 += MT) {
            int64_t mi = m - i0 < MT ? m - i0 : MT;
            __m512i acc[MT][RT], sums[RT];
            for (int r = 0; r < RT; r++) {
                sums[r] = _mm512_setzero_si512();
                for (int i = 0; i < MT; i++) acc[i][r] = _mm512_setzero_si512();
            }
            for (int64_t j = 0; j < k; j += 64) {
                __m512i wv[RT];
                _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT, _MM_HINT_T0);
                for (int r = 0; r < RT; r++) wv[r] = _mm512_loadu_si512(wr[r] + j);
                if (i0 == 0)
                    for (int r = 0; r < RT; r++) sums[r] = _mm512_dpbusd_epi32(sums[r], ones, wv[r]);
                for (int i = 0; i < MT; i++) {
                    if (i < mi) {
                        __m512i av = _mm512_loadu_si512(au + (i0 + i) * k + j);
                        for (int r = 0; r < RT; r++) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], av, wv[r]);
                    }
                }
            }
            if (i0 == 0) {
                int32_t s[4];
                _mm_storeu_si128((__m128i *)s, hsum4_epi32(sums[0], sums[1], sums[2], sums[3]));
                for (int r = 0; r < RT; r++) offset[r] = 128 * s[r];
            }
            for (int64_t i = 0; i < mi; i++) {
                int32_t s[4];
                _mm_storeu_si128((__m128i *)s, hsum4_epi32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
                for (int64_t r = 0; r < nr; r++) c[(i0 + i) * n + r0 + r] = s[r] - offset[r];
            }
        }
    }
    free(au);
    return 0;
#else
    (void)a, (void)m, (void)k, (void)w, (void)ldw, (void)n, (void)c, (void)threads;
    return -2;
#endif
}
