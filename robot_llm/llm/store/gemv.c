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
                    store_float(y, y_bf16 ? RL_BF16 : RL_FP32, (i0 + i) * n + r0 + r, v);
                }
        }
    }
    free(xs);
    return 0;
}

/* The epilogue of an int8 x int8 product: out [m, n] = (float)acc * scale[col] * row_scale[row], fp32 (or rounded
 * to bf16 where out_bf16), in one pass and in torch's order of ops (int32 -> fp32, times the weight's scale, times
 * the row's, then the cast). For the LM head's 32 x 262,144 logits the torch ops (a conversion, two in-place
 * products, then casts to the compute dtype and back) made five passes over 33 MB: 51 ms of a 250 ms batch-32 decode
 * step, 1 thread; a prefill's products, oneDNN's past our VNNI body's rows, spent a fifth of the prefill in theirs. */
void rl_scale_int32(const int32_t *acc, int64_t m, int64_t n, const float *scale, const float *row_scale, void *out,
                    int out_bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        if (out_bf16)
            for (int64_t j = 0; j < n; j++)
                ((uint16_t *)out)[i * n + j] = float_to_bf16((float)acc[i * n + j] * scale[j] * row_scale[i]);
        else
            for (int64_t j = 0; j < n; j++) ((float *)out)[i * n + j] = (float)acc[i * n + j] * scale[j] * row_scale[i];
    }
}

/* idx[i] = the first column of row i of x [m, n] (fp32 or bf16, rows contiguous) holding the row's largest value,
 * a NaN counting as the largest (the first NaN), as torch.argmax: a greedy decode step's token of each row.
 * torch's took 0.4-0.7 ms a row of Gemma 3's 262,144 logits (22 ms a batch-32 step at 1 thread); a row is 1 MB,
 * which one core reads in 0.1 ms. AVX2 intrinsics (8 lanes) on either kind of CPU, ACC running maxima: with one, each
 * 8 values waited on the last maximum (32 x 262,144 logits in the L3 cache, 2 threads: 0.89 -> 0.70 ms fp32,
 * 1.03 -> 0.55 bf16, Sapphire Rapids). */
#define ACC 4
void rl_argmax_rows(const void *x, int x_bf16, int64_t m, int64_t n, int64_t *idx, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < m; i++) {
        const void *row = (const char *)x + (size_t)(i * n) * (x_bf16 ? 2 : 4);
        int dtype = x_bf16 ? RL_BF16 : RL_FP32;
        __m256 tops[ACC], nans[ACC];
        for (int a = 0; a < ACC; a++) tops[a] = _mm256_set1_ps(-INFINITY), nans[a] = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 * ACC <= n; j += 8 * ACC)
            for (int a = 0; a < ACC; a++) {
                __m256 v = load8(row, x_bf16, j + 8 * a);
                nans[a] = _mm256_or_ps(nans[a], _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                tops[a] = _mm256_max_ps(tops[a], v);
            }
        __m256 top = tops[0], nan = nans[0];
        for (int a = 1; a < ACC; a++) top = _mm256_max_ps(top, tops[a]), nan = _mm256_or_ps(nan, nans[a]);
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

/* One row of n values (fp32 or bf16) as symmetric codes in -levels..levels with one fp32 scale, exactly as
 * int8act.quantize_activations computes it in torch ops: scale = max(max |x|, 1e-30) / levels, codes =
 * round-half-even(x * (1 / scale)) in fp32, the columns n .. width - 1 zero. A row holding a NaN or an infinity gets
 * a NaN scale (and zero codes), so that the product's output is not finite, as torch's would be. */
static void quantize_row(const void *row, int x_bf16, int64_t n, int64_t width, int levels, int8_t *out,
                         float *scale) {
    int dtype = x_bf16 ? RL_BF16 : RL_FP32;
    const __m256 sign = _mm256_set1_ps(-0.f), huge = _mm256_set1_ps(3.4028234663852886e38f);
    __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 a = _mm256_andnot_ps(sign, load8(row, x_bf16, j));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, huge, _CMP_NLE_UQ));  /* NaN or infinity */
        top = _mm256_max_ps(top, a);
    }
    float lanes[8], most = 0.f;
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) most = lanes[l] > most ? lanes[l] : most;
    int finite = _mm256_movemask_ps(bad) == 0;
    for (int64_t t = j; t < n; t++) {
        float a = fabsf(load_float(row, dtype, t));
        finite &= a <= 3.4028234663852886e38f;
        most = a > most ? a : most;
    }
    if (!finite) {
        *scale = NAN;
        memset(out, 0, (size_t)width);
        return;
    }
    float s = (most > 1e-30f ? most : 1e-30f) / (float)levels, inv = 1.0f / s;
    *scale = s;
    const __m256 by = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(load8(row, x_bf16, j), by), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i ints = _mm256_cvtps_epi32(v);
        __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
        _mm_storel_epi64((__m128i *)(out + j), _mm_packs_epi16(words, words));
    }
    for (int64_t t = j; t < n; t++) out[t] = (int8_t)nearbyintf((load_float(row, dtype, t)) * inv);
    memset(out + n, 0, (size_t)(width - n));
}

/* Rows of x [m, k] (fp32 or bf16, rows contiguous) as int8 rows [m, width] with one fp32 scale each (quantize_row).
 * rotation 0: the rows as they are, the torch chain's codes and scales to the bit. rotation > 0 (a power of two
 * dividing width): each row zero-padded to width and every run of `rotation` columns Hadamard-rotated in fp32 first
 * (stage_rows' fast transform, int8act.rotate's matrix), then quantized: what a rotated matrix multiplies. torch's
 * chain (the rotation as a matmul of the +-1 matrix, abs, amax, casts, clamp, divide, reciprocal, multiply, round,
 * the int8 cast, the padding) was 90 us a call for a batch-32 step's rows without the rotation, 127 calls a step;
 * its rotation alone 0.4 ms a batch-32 call on an AVX2 EPYC. Returns 0, or -1 when a row buffer was not allocated. */
int rl_quantize_rows(const void *x, int x_bf16, int64_t m, int64_t k, int64_t width, int64_t rotation, int levels,
                     int8_t *q, float *scale, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *staged = rotation ? aligned_alloc(64, (size_t)((width * sizeof(float) + 63) / 64 * 64)) : NULL;
        if (rotation && staged == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) {
            const void *row = (const char *)x + (size_t)(i * k) * (x_bf16 ? 2 : 4);
            if (!rotation) {
                quantize_row(row, x_bf16, k, width, levels, q + i * width, scale + i);
            } else if (staged != NULL) {
                stage_rows(row, x_bf16, 1, k, width, rotation, staged);
                quantize_row(staged, 0, width, width, levels, q + i * width, scale + i);
            }
        }
        free(staged);
    }
    return failed ? -1 : 0;
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* Whether Linux lets this process use the tiles' data (rl_amx_init). */
static int amx_ready = 0;
#endif
/* Rows of a call up to which rl_int8_mm runs the VNNI body even where the tiles are ready (doctor names it). */
#define VNNI_MAX_ROWS 4
int rl_vnni_max_rows(void) { return VNNI_MAX_ROWS; }

/* Which body of rl_int8_mm this build has: 3 AMX tiles (rl_amx_init said yes; else the VNNI body runs), 2
 * AVX512-VNNI, 1 AVX2 (exact for activation codes in -127..127, which rl_quantize_rows and
 * int8act.quantize_activations produce), 0 none. */
int rl_int8_mm_body(void) {
#if defined(RL_AMX)
    if (amx_ready) return 3;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#else
    return 1;
#endif
}

/* Ask Linux for the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA; Linux 5.16 on): a
 * thread that touches the tiles without it is killed. Once per process, before the first call; idempotent.
 * Returns 1 when rl_int8_mm now takes the tiles, 0 where it cannot (no AMX build, or the kernel said no). */
int rl_amx_init(void) {
#if defined(RL_AMX)
    if (!amx_ready) amx_ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_ready;
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
#else
/* The sums of four vectors' 8 lanes. */
static inline __m128i hsum4_epi32(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

/* Activation rows an AVX2 tile takes at once against RT weight rows: 8 running sums, the 4 rows' |w|, 2 activation
 * vectors, the ones and a product (the 16 registers AVX2 has). */
#define MT2 2
#endif

/* Weight rows a thread's block holds: its sums for every row of the call are buffered and written out together. */
#define NB 64
/* Activation rows that meet a block's tiles before the next rows do. */
#define MC 64

/* The value a product's sum is stored as: the int32 itself, or with scales (scale non-NULL) the fp32 the torch epilogue
 * computes, (float)sum * scale[col] * row_scale[row] in that order (int8act.int8_gemm). */
static inline void store_sum(void *c, int64_t at, int32_t sum, const float *scale, const float *row_scale, int64_t row,
                             int64_t col) {
    if (scale == NULL)
        ((int32_t *)c)[at] = sum;
    else
        ((float *)c)[at] = (float)sum * scale[col] * row_scale[row];
}

/* A block's buffered sums (buf [m, NB], nb of each row used) written out to columns b0.. of c [m, n] a row at a time:
 * written straight into c, a tile's few sums for each row land a row of c apart (n x 4 bytes), the same cache set in
 * every row, and evict each other (the head's 262,144 x 640 at 32 rows: 200 ms, not 120, on an AVX2 EPYC; at 8 rows
 * 41 against 13 ms on a Zen 4 core). */
static void flush_block(void *c, const int32_t *buf, int64_t m, int64_t n, int64_t b0, int64_t nb, const float *scale,
                        const float *row_scale) {
    for (int64_t i = 0; i < m; i++) {
        if (scale == NULL) {
            memcpy((int32_t *)c + i * n + b0, buf + i * NB, (size_t)nb * sizeof(int32_t));
            continue;
        }
        const __m256 by_row = _mm256_set1_ps(row_scale[i]);
        int64_t j = 0;
        for (; j + 8 <= nb; j += 8) { /* store_sum's ops, 8 at a time */
            __m256 v = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(buf + i * NB + j)));
            v = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_loadu_ps(scale + b0 + j)), by_row);
            _mm256_storeu_ps((float *)c + i * n + b0 + j, v);
        }
        for (; j < nb; j++) store_sum(c, i * n + b0 + j, buf[i * NB + j], scale, row_scale, i, b0 + j);
    }
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* Activation codes up to which the AVX2 body multiplies them by the weights offset to unsigned bytes (avx2_tile). */
#define NARROW_LEVELS 63

/* The sums of MT2 activation rows ar against RT weight rows wr over k columns, into out [MT2, RT]
 * (rows ldo apart); prefetch: fetch the weights PREFETCH bytes past the tile's first row meanwhile, the two lines a
 * step consumes where the rows are contiguous (with a longer row stride it fetches less far ahead), into L1, or into
 * L2 where `far` (a constant at each call: FAR_ROWS rows or more). Fetching only the next tile's rows (2.5 KB ahead
 * at k = 640) read Gemma 3 270M's head at one row at 9.5 GB/s on a Zen 4 core (17.7 ms, against 7.1 for the exact
 * few-row kernel, which reads 4 KB ahead).
 *
 * vpmaddubsw multiplies unsigned by signed bytes and sums each pair into a saturating int16. narrow (activation codes
 * within -NARROW_LEVELS..NARROW_LEVELS): the weights offset to unsigned (w + 128, one xor a vector, shared by the
 * tile's rows) meet the codes as they are, a pair at most 2 x 255 x 63 = 32,130, and each sum is 128 x its
 * activation row's sum too much (the caller takes it off). Else, as llama.cpp multiplies its blocks, each activation
 * vector is given the signs of the weights (vpsignb, once per activation row and weight row) and meets |w|: a pair
 * at most 2 x 128 x 127 = 32,512. The multiplies' two ports bound both: 26 of their ops a step of the tile against
 * 16 narrow (Gemma 3 270M's head at 32 rows, 1 thread, Sapphire Rapids as the AVX2 kind: 112-114 against 92 ms). */
static inline __attribute__((always_inline)) void avx2_tile(const int8_t *const *ar, const int8_t *const *wr,
                                                            int64_t k, int prefetch, int far, int narrow,
                                                            int32_t *out, int64_t ldo) {
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    __m256i acc[MT2][RT];
    for (int i = 0; i < MT2; i++)
        for (int r = 0; r < RT; r++) acc[i][r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < k; j += 32) {
        __m256i wu[RT]; /* w + 128 (narrow) or |w| */
        if (prefetch && far) {
            _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT, _MM_HINT_T1);
            _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT + 64, _MM_HINT_T1);
        } else if (prefetch) {
            _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT, _MM_HINT_T0);
            _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT + 64, _MM_HINT_T0);
        }
        for (int r = 0; r < RT; r++) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(wr[r] + j));
            wu[r] = narrow ? _mm256_xor_si256(wv, bias) : _mm256_abs_epi8(wv);
        }
        for (int i = 0; i < MT2; i++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(ar[i] + j));
            for (int r = 0; r < RT; r++) {
                __m256i b = narrow ? av : _mm256_sign_epi8(av, _mm256_loadu_si256((const __m256i *)(wr[r] + j)));
                acc[i][r] = _mm256_add_epi32(acc[i][r], _mm256_madd_epi16(_mm256_maddubs_epi16(wu[r], b), ones));
            }
        }
    }
    for (int i = 0; i < MT2; i++)
        _mm_storeu_si128((__m128i *)(out + i * ldo), hsum4_epi32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation rows c0..c1 of au (the codes + 128, k wide) against the RT weight rows wr (nr of them real) into out
 * [rows, NB] (its columns for this tile); the tile's first pass (row 0) also sums each weight row into offset and
 * fetches the next tile. */
static inline void vnni_rows(const uint8_t *au, int64_t k, int64_t c0, int64_t c1, const int8_t *const *wr, int64_t nr,
                             int32_t *out, int32_t *offset) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t i0 = c0; i0 < c1; i0 += MT) {
        int64_t mi = c1 - i0 < MT ? c1 - i0 : MT;
        int first = i0 == 0;
        __m512i acc[MT][RT], sums[RT];
        for (int r = 0; r < RT; r++) {
            sums[r] = _mm512_setzero_si512();
            for (int i = 0; i < MT; i++) acc[i][r] = _mm512_setzero_si512();
        }
        for (int64_t j = 0; j < k; j += 64) {
            __m512i wv[RT];
            /* Contiguous rows: the RT lines a step consumes, PREFETCH bytes ahead (one line a step, a quarter of
             * them, read the head at 5 GB/s) */
            if (first)
                for (int r = 0; r < RT; r++) _mm_prefetch((const char *)wr[0] + PREFETCH + j * RT + 64 * r, _MM_HINT_T0);
            for (int r = 0; r < RT; r++) wv[r] = _mm512_loadu_si512(wr[r] + j);
            if (first)
                for (int r = 0; r < RT; r++) sums[r] = _mm512_dpbusd_epi32(sums[r], ones, wv[r]);
            for (int i = 0; i < MT; i++) {
                if (i < mi) {
                    __m512i av = _mm512_loadu_si512(au + (i0 + i) * k + j);
                    for (int r = 0; r < RT; r++) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], av, wv[r]);
                }
            }
        }
        if (first) {
            int32_t s[4];
            _mm_storeu_si128((__m128i *)s, hsum4_epi32(sums[0], sums[1], sums[2], sums[3]));
            for (int r = 0; r < RT; r++) offset[r] = 128 * s[r];
        }
        for (int64_t i = 0; i < mi; i++) {
            int32_t s[4];
            _mm_storeu_si128((__m128i *)s, hsum4_epi32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
            for (int64_t r = 0; r < nr; r++) out[(i0 + i) * NB + r] = s[r] - offset[r];
        }
    }
}
#else
/* Rows from which the AVX2 tile fetches the next weights into L2, not L1: with a batch's rows the lines fetched 4 KB
 * ahead wait in L1 through every pair of rows of a tile and its successor, while the rows' codes pass through it too
 * (Zen 4, 1 thread, Gemma 3 270M's 262,144 x 640 head, ms, into L1 / L2: 32 rows 94.8 / 89.2, 16 rows 47.7 / 45.3, 8
 * rows 23.5 / 22.4; 4 rows 11.8 / 14.5, 2 rows 7.0 / 10.4, 1 row 6.6 / 10.2: a few rows use them within a pass;
 * a prefill's 512 rows by 2048 x 640, 640 x 2048 and 1024 x 640 unchanged, 1 and 2 threads). */
#define FAR_ROWS 8

/* Activation rows c0..c1 of a (k wide) against the RT weight rows wr into out [rows, NB], MT2 at a time; asum: each
 * row's sum of codes where they are narrow (avx2_tile), else NULL. */
static inline void avx2_rows(const int8_t *a, int64_t k, int64_t c0, int64_t c1, const int8_t *const *wr,
                             const int32_t *asum, int32_t *out) {
    int far = c1 - c0 >= FAR_ROWS;
    for (int64_t i0 = c0; i0 < c1; i0 += MT2) {
        /* A last single row runs as a pair with itself, both sums stored in its place (ldo 0): the one-row tile read
         * Gemma 3 270M's head at half the rate (a decode row on a Zen 4 core: 12.2-12.9 ms against 6.0-6.8 for two
         * rows) */
        int pair = c1 - i0 >= 2;
        const int8_t *ar[MT2] = {a + i0 * k, a + (pair ? i0 + 1 : i0) * k};
        int32_t *o = out + i0 * NB; /* the weights fetched on rows 0-1 */
        /* narrow and far as constants at each call: the inlined tile is compiled once for each, no test in its loop */
        if (asum == NULL && far)
            avx2_tile(ar, wr, k, i0 == 0, 1, 0, o, pair ? NB : 0);
        else if (asum == NULL)
            avx2_tile(ar, wr, k, i0 == 0, 0, 0, o, pair ? NB : 0);
        else if (far)
            avx2_tile(ar, wr, k, i0 == 0, 1, 1, o, pair ? NB : 0);
        else
            avx2_tile(ar, wr, k, i0 == 0, 0, 1, o, pair ? NB : 0);
        if (asum == NULL) continue;
        for (int i = 0; i < 1 + pair; i++)
            for (int r = 0; r < RT; r++) o[i * NB + r] -= 128 * asum[i0 + i];
    }
}
#endif

#if defined(RL_AMX)
/* AMX (Sapphire Rapids on): c = a @ w^T as w @ a^T tile by tile, so that the weights are the tiles' A operand, loaded
 * as stored (16 rows, 64 bytes each, ldw apart) with no repacking, and the activations, few and reused by every weight
 * row, are the B operand, packed once a call into the tiles' layout (ap: per 16 activation rows and 64 columns, a
 * 1 KB tile whose row r holds each activation row's bytes 4r..4r+3). tdpbssd multiplies signed by signed bytes into
 * int32 sums: torch._int_mm's integers. Each tile of sums (16 weight rows x 16 activation rows) is stored and written
 * transposed into the block's buffer. Tiles: 0-3 sums, 4-5 two weight tiles, 6-7 two activation tiles. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* a [m, k] as B tiles: ap [ceil(m / 16)][k / 64][16][64], rows past m zero (zeroed whole first: a decode row's
 * call wrote its 15 empty rows word by word, a third of a small matrix's call). */
static void amx_pack(const int8_t *a, int64_t m, int64_t k, int8_t *ap) {
    int64_t kb = k / 64, mt = (m + 15) / 16;
    if (m % 16) memset(ap + (mt - 1) * kb * 1024, 0, (size_t)(kb * 1024));
    for (int64_t row = 0; row < m; row++)
        for (int64_t b = 0; b < kb; b++) {
            int8_t *tile = ap + ((row / 16) * kb + b) * 1024 + (row % 16) * 4;
            for (int r = 0; r < 16; r++) memcpy(tile + r * 64, a + row * k + b * 64 + 4 * r, 4);
        }
}

/* The sums of weight tiles w0, w1 (16 rows each, ld0 and ld1 apart; w1 may repeat w0) against activation tiles t and
 * t + 1 (two: whether t + 1 is real) over kb blocks of 64 columns, stored as int32 [16][16] each into s[4] (w0 t,
 * w0 t+1, w1 t, w1 t+1). */
static inline void amx_tiles(const int8_t *w0, int64_t ld0, const int8_t *w1, int64_t ld1, const int8_t *ap, int64_t t,
                             int two, int64_t kb, int32_t s[4][256]) {
    const int8_t *b0 = ap + t * kb * 1024, *b1 = b0 + kb * 1024;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < kb; b++) {
        _tile_loadd(4, w0 + b * 64, ld0);
        _tile_loadd(5, w1 + b * 64, ld1);
        _tile_loadd(6, b0 + b * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
        if (two) {
            _tile_loadd(7, b1 + b * 1024, 64);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(3, 5, 7);
        }
    }
    _tile_stored(0, s[0], 64);
    _tile_stored(2, s[2], 64);
    if (two) {
        _tile_stored(1, s[1], 64);
        _tile_stored(3, s[3], 64);
    }
}

/* The columns of a 16 x 16 int32 tile (rows 64 bytes apart) as 16 vectors: col[i][r] = tile[r][i]. */
static inline void transpose16(const int32_t *tile, __m512i col[16]) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_si512(tile + 16 * i);
    for (int i = 0; i < 8; i++) { /* per 128-bit lane L: rows 2i, 2i+1 at columns 4L, 4L+1 / 4L+2, 4L+3 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* r[4g + j], lane L: rows 4g..4g+3 at column 4L + j */
        r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) { /* the 4 x 4 lanes of r[j], r[4 + j], r[8 + j], r[12 + j] transposed */
        __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        col[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        col[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        col[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        col[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

static int amx_mm(const int8_t *a, int64_t m, int64_t k, const int8_t *w, int64_t ldw, int64_t n, void *c,
                  const float *scale, const float *row_scale, int threads) {
    int64_t kb = k / 64, mt = (m + 15) / 16, blocks = (n + NB - 1) / NB;
    int8_t *ap = aligned_alloc(64, (size_t)(mt * kb * 1024));
    if (ap == NULL) return -1;
    amx_pack(a, m, k, ap);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int32_t *buf = aligned_alloc(64, (size_t)(mt * 16 * NB * sizeof(int32_t)));
        int8_t *tail = aligned_alloc(64, (size_t)(16 * k)); /* the last rows, when fewer than 16, zero-padded */
        int32_t (*s)[256] = aligned_alloc(64, 4 * 256 * sizeof(int32_t));
        if (buf == NULL || tail == NULL || s == NULL) failed = 1;
        if (!failed) amx_configure();
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (failed) continue;
            int64_t b0 = blk * NB, nb = n - b0 < NB ? n - b0 : NB;
            for (int64_t r0 = b0; r0 < b0 + nb; r0 += 32) {
                /* Weight tiles of 16 rows; a short last one is read from the zero-padded copy. */
                const int8_t *wt[2];
                int64_t ld[2], rows[2];
                for (int h = 0; h < 2; h++) {
                    int64_t first = r0 + 16 * h;
                    rows[h] = first >= b0 + nb ? 0 : (b0 + nb - first < 16 ? b0 + nb - first : 16);
                    wt[h] = w + first * ldw;
                    ld[h] = ldw;
                    if (rows[h] > 0 && rows[h] < 16) {
                        memset(tail, 0, (size_t)(16 * k));
                        for (int64_t r = 0; r < rows[h]; r++) memcpy(tail + r * k, w + (first + r) * ldw, (size_t)k);
                        wt[h] = tail;
                        ld[h] = k;
                    }
                }
                /* No software prefetch: the next tiles' lines fetched ahead (1-3 steps, into L1 or L2, at once or
                 * spread over the columns) left the head at 32 rows within 21-25 ms against 22-23 without. */
                if (rows[1] == 0) wt[1] = wt[0], ld[1] = ld[0];
                for (int64_t t = 0; t < mt; t += 2) {
                    int two = t + 1 < mt;
                    amx_tiles(wt[0], ld[0], wt[1], ld[1], ap, t, two, kb, s);
                    for (int h = 0; h < 2 && rows[h] > 0; h++)
                        for (int u = 0; u < 1 + two; u++) {
                            __m512i col[16];
                            transpose16(s[2 * h + u], col);
                            for (int64_t i = 0; i < 16 && (t + u) * 16 + i < m; i++)
                                _mm512_store_si512(buf + ((t + u) * 16 + i) * NB + r0 - b0 + 16 * h, col[i]);
                        }
                }
            }
            flush_block(c, buf, m, n, b0, nb, scale, row_scale);
        }
        if (!failed) _tile_release();
        free(buf);
        free(tail);
        free(s);
    }
    free(ap);
    return failed ? -1 : 0;
}
#endif

/* One matrix of a product of the same activations by several (int8_mm_many, rl_int8_linear): its codes w[:n, :k]
 * (rows ldw apart), its output c [m, n] and its scales (NULL: the int32 sums); offset non-NULL: the codes are packed
 * in VNNI order (vnni.c's rl_vnni_pack, ldw unused) and these are its rows' offsets; bf16 non-NULL (with scale): the
 * fp32 values rounded to bf16 into bf16 [m, n] as each block is done, by the thread that computed it (c scratch, which
 * packed codes' products do not touch: they round in registers). */
typedef struct {
    const int8_t *w;
    int64_t ldw, n;
    void *c;
    const float *scale;
    const int32_t *offset;
    uint16_t *bf16;
} matrix;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation bytes a packed product takes through every block at once (rows of k codes, at least 8 rows). */
#ifndef PACKED_CHUNK_BYTES
#define PACKED_CHUNK_BYTES 262144
#endif
int64_t rl_vnni_blocks(int64_t n);
void rl_vnni_block(const uint8_t *au, int64_t m, int64_t k, const int8_t *p, int64_t n, const int32_t *offset,
                   int64_t b, void *c, const float *scale, const float *row_scale, uint16_t *bf16);
#endif
/* The most matrices one call multiplies (q, k and v; gate and up), and the int64 that describe each to it. */
#define MAX_MATRICES 4
#define MATRIX_ARGS 6

/* c [m, n] = a [m, k] @ w[:n, :k]^T over int8 codes (a's rows k apart, w's ldw apart; k a multiple of 64) for each of
 * the `count` matrices of mats (at most MAX_MATRICES; their blocks shared among the threads as one matrix's), exactly:
 * the integer sums of torch._int_mm, as int32; or, with scale [n] and row_scale [m] (fp32), the fp32 values of its
 * epilogue (store_sum), without the int32 matrix (for the head's 32 x 262,144 logits a 33 MB pass and the page faults
 * of a fresh buffer each step).
 *
 * AVX512-VNNI (a decode step's few rows, whose weights oneDNN's s8s8s32 GEMM, torch._int_mm's, reads at 4-5 GB/s:
 * Gemma 3 270M's 262,144 x 640 head at 8 and 32 rows on a Sapphire Rapids core, 32-39 ms a step): VNNI multiplies
 * unsigned by signed bytes, so the activations are offset by 128 and 128 times each weight row's sum taken back off
 * (one more product per weight vector).
 *
 * AVX2 (any number of rows: on an AVX2 CPU torch 2.13's int8 GEMM is a fallback of 1-2 G ops/s, or oneDNN's, which
 * saturates full-range codes): avx2_tile's products (vpmaddubsw, pairs summed into int16) widened to int32 sums
 * (vpmaddwd by ones), exact for any weight code and activation codes within -levels..levels, levels at most 127 (a
 * code of -128 would lose its sign); from NARROW_LEVELS down in fewer instructions. On an AVX2 EPYC (Zen 3) core,
 * levels 127: 95-110 G ops/s from 8 rows, against 50-75 GFLOP/s for the fp32 GEMM at the same shapes.
 * Returns 0, or -1 when a buffer could not be allocated. */
static int int8_mm_many(const int8_t *a, int64_t m, int64_t k, const matrix *mats, int count, const float *row_scale,
                        int levels, int threads) {
#if defined(RL_AMX)
    /* Up to VNNI_MAX_ROWS rows (a decode step's) the VNNI body is the faster here: it fetches ahead and packs nothing
     * (Sapphire Rapids, 1 thread, the 126 matrices of Gemma 3 270M's layers at 1 / 4 / 6 rows: 9.2 / 10.8 / 12.7 ms
     * against the tiles' 10.9 / 11.2 / 11.0; its head at 1 row 13.4 against 14.0) */
    int rowwise = 1; /* none packed (gemv.py packs none where the tiles serve) */
    for (int j = 0; j < count; j++) rowwise &= mats[j].offset == NULL;
    if (amx_ready && m > VNNI_MAX_ROWS && rowwise) {
        int failed = 0;
        for (int j = 0; j < count && !failed; j++) {
            failed = amx_mm(a, m, k, mats[j].w, mats[j].ldw, mats[j].n, mats[j].c, mats[j].scale, row_scale, threads);
            if (!failed && mats[j].bf16 != NULL) round_columns(mats[j].c, mats[j].bf16, m, mats[j].n, 0, mats[j].n);
        }
        return failed;
    }
#endif
    int failed = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    uint8_t *au = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    if (au == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) au[i] = (uint8_t)(a[i] ^ 0x80); /* a + 128 as an unsigned byte */
    (void)levels; /* exact for every code */
#else
    int32_t *asum = NULL; /* each row's sum of codes, where they are narrow (avx2_tile) */
    if (levels <= NARROW_LEVELS) {
        if ((asum = malloc((size_t)m * sizeof(int32_t))) == NULL) return -1;
        for (int64_t i = 0; i < m; i++) {
            int32_t sum = 0;
            for (int64_t j = 0; j < k; j++) sum += a[i * k + j];
            asum[i] = sum;
        }
    }
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int32_t *buf = aligned_alloc(64, (size_t)(m * NB * sizeof(int32_t)));
        if (buf == NULL) failed = 1;
        /* Each matrix's blocks split among the threads as one matrix's, no barrier between the matrices: a thread goes
         * on to its share of the next. Shares that shrink as the blocks run out (guided), taken as a thread comes free:
         * with fixed halves a thread that fell behind (its core lent to the host, an interrupt) held the other idle at
         * the end (2 threads, a batch-32 step while the host was busy: one thread waiting in 12 % of the AVX2 kind's
         * samples, mostly at the head's end, 5.6 % of a Zen 4's; the step 0.95-0.98 of its time then, the same on a
         * quiet host); the first shares stay long and whole, so the next block's fetch still serves the thread that
         * fetched it (shares of a 64th of the blocks, or one, cost a batch-1 step 8 %). The matrix's fields as locals,
         * as one matrix's arguments were (read from the array in the loop, a 2048 x 640 matrix at 1 row took 10-20 %
         * longer). */
        for (int j = 0; j < count; j++) {
            const int8_t *const w = mats[j].w;
            const int64_t ldw = mats[j].ldw, n = mats[j].n, blocks = (n + NB - 1) / NB;
            void *const c = mats[j].c;
            const float *const scale = mats[j].scale;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            if (mats[j].offset != NULL) {
                /* a chunk of rows at a time meets every block: the chunk stays in L2 while the weights stream by (a
                 * prefill's thousands of rows would otherwise be read again from memory for each block) */
                const int64_t packed = rl_vnni_blocks(n), chunk = PACKED_CHUNK_BYTES / k < 8 ? 8 : PACKED_CHUNK_BYTES / k;
                for (int64_t c0 = 0; c0 < m; c0 += chunk) {
                    const int64_t rows = m - c0 < chunk ? m - c0 : chunk;
                    void *const cc = (char *)c + c0 * n * 4; /* int32 or fp32 */
                    const float *const rs = row_scale == NULL ? NULL : row_scale + c0;
                    uint16_t *const bf16 = mats[j].bf16 == NULL ? NULL : mats[j].bf16 + c0 * n;
#pragma omp for schedule(guided) nowait
                    for (int64_t b = 0; b < packed; b++)
                        rl_vnni_block(au + c0 * k, rows, k, w, n, mats[j].offset, b, cc, scale, rs, bf16);
                }
                continue;
            }
#else
            if (mats[j].offset != NULL) { /* packed only where VNNI is built (gemv.py) */
                failed = 1;
                continue;
            }
#endif
#pragma omp for schedule(guided) nowait
            for (int64_t b = 0; b < blocks; b++) {
                if (buf == NULL) continue;
                int64_t b0 = b * NB, nb = n - b0 < NB ? n - b0 : NB;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                int32_t offset[NB]; /* 128 times each weight row's sum, taken off its products with the offset codes */
#endif
                /* MC rows at a time meet the block's tiles: both stay in L2 at a prefill's thousands of rows */
                for (int64_t c0 = 0; c0 < m; c0 += MC) {
                    int64_t c1 = m - c0 < MC ? m : c0 + MC;
                    for (int64_t r0 = b0; r0 < b0 + nb; r0 += RT) {
                        int64_t nr = b0 + nb - r0 < RT ? b0 + nb - r0 : RT;
                        const int8_t *wr[RT];
                        for (int r = 0; r < RT; r++) wr[r] = w + (r0 + (r < nr ? r : 0)) * ldw;  /* a short tile repeats a row */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                        vnni_rows(au, k, c0, c1, wr, nr, buf + r0 - b0, offset + r0 - b0);
#else
                        avx2_rows(a, k, c0, c1, wr, asum, buf + r0 - b0);
#endif
                    }
                }
                flush_block(c, buf, m, n, b0, nb, scale, row_scale);
                if (mats[j].bf16 != NULL) round_columns(c, mats[j].bf16, m, n, b0, b0 + nb);
            }
        }
        free(buf);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    free(au);
#else
    free(asum);
#endif
    return failed ? -1 : 0;
}

/* int8_mm_many's product for one matrix (offset non-NULL: packed, as matrix says). */
int rl_int8_mm(const int8_t *a, int64_t m, int64_t k, const int8_t *w, int64_t ldw, int64_t n, void *c,
               const float *scale, const float *row_scale, const int32_t *offset, int levels, int threads) {
    const matrix one = {w, ldw, n, c, scale, offset, NULL};
    return int8_mm_many(a, m, k, &one, 1, row_scale, levels, threads);
}

/* y_j [m, n_j] (fp32, or bf16 where y_bf16) = x [m, k] @ (w_j * scale_j)^T with int8 activations, for each of the
 * `count` matrices of `mats` (at most MAX_MATRICES; MATRIX_ARGS int64 each: the codes' address, their row stride,
 * their rows n_j, the fp32 scales' address, y_j's address, and where the codes are packed (vnni.c) their offsets'
 * address, else 0), in one call: the rows quantized once as rl_quantize_rows does
 * (zero-padded to width, rotated by `rotation`), multiplied and scaled as rl_int8_mm does (the matrices' blocks
 * shared among the threads), then rounded to bf16 where y is: int8act.int8_dynamic_linear's values for each matrix.
 * A decode step's ~130 calls of a few rows each spent more in their torch glue (buffers, a cast to the compute
 * dtype) than in their products of the smaller matrices (a 1,024 x 640 one at 1 row, 1 thread: 43 us a call, 20 of
 * them the product); q, k and v (gate and up) meet one input, and in one call its rows are quantized and the
 * threads woken once, not three (two) times. Returns 0, or -1 when a buffer could not be allocated. */
int rl_int8_linear(const void *x, int x_bf16, int64_t m, int64_t k, int64_t width, int64_t rotation, int levels,
                   const int64_t *mats, int count, int y_bf16, int threads) {
    matrix each[MAX_MATRICES];
    int64_t outputs = 0;
    for (int j = 0; j < count; j++) outputs += mats[MATRIX_ARGS * j + 2];
    int8_t *q = malloc((size_t)(m * width));
    float *row_scale = malloc((size_t)m * sizeof(float));
    /* scratch: the fp32 products of row-major codes (packed ones round theirs in registers) */
    float *out = y_bf16 ? malloc((size_t)(m * outputs) * sizeof(float)) : NULL;
    int failed = count > MAX_MATRICES || q == NULL || row_scale == NULL || (y_bf16 && out == NULL);
    for (int64_t j = 0, at = 0; j < count && !failed; at += m * mats[MATRIX_ARGS * j + 2], j++) {
        const int64_t *arg = mats + MATRIX_ARGS * j;
        void *c = y_bf16 ? (void *)(out + at) : (void *)(intptr_t)arg[4];
        const int32_t *offset = (const int32_t *)(intptr_t)arg[5];
        uint16_t *bf16 = y_bf16 ? (uint16_t *)(intptr_t)arg[4] : NULL;
        each[j] = (matrix){(const int8_t *)(intptr_t)arg[0], arg[1], arg[2], c, (const float *)(intptr_t)arg[3], offset, bf16};
    }
    /* a row is quantized on one thread: more only wake threads for a few rows' microseconds */
    int quantizers = m < threads ? (int)m : threads;
    if (!failed) failed = rl_quantize_rows(x, x_bf16, m, k, width, rotation, levels, q, row_scale, quantizers);
    if (!failed) failed = int8_mm_many(q, m, width, each, count, row_scale, levels, threads);
    free(out);
    free(row_scale);
    free(q);
    return failed ? -1 : 0;
}

/* The activation codes' bound from which down rl_int8_mm takes its narrow body (NARROW_LEVELS), 0 where every bound
 * runs the same body (VNNI and AMX are exact for all codes at one cost). */
int rl_narrow_levels(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 0;
#else
    return NARROW_LEVELS;
#endif
}
