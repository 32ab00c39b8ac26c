/* Products of many rows (a batched decode step: 8 to a few hundred) over int8 and int4 codes on the CPU, with
 * fp32 activations, for CPUs without native bf16 (the AVX2 kind: gemv.matmul_available), and the few-row int4
 * pass (rl_int4_gemv) beside them.
 *
 * There torch has two ways, both slow at these sizes: its fused int4 kernel rounds the activations to bf16 and
 * costs 0.35-0.4 ms a row for a 4096 x 1024 matrix (13 ms at 32 rows), and the dense way writes the whole
 * matrix out in fp32 every pass (6.4 ms to dequantize that matrix, then 2 ms to multiply). Here the weights are
 * made fp32 a small tile at a time into a buffer that stays in the cache, and every row of the call is
 * multiplied by the tile before the next is made: each weight is read and converted once per call, and the
 * FMAs run from the cache. The dequantized values are exactly the dense way's (dequantize_int4_into: (q - 8)
 * times the scale, plus the zero, each op rounded in fp32; int8: the codes, the scale applied to the output),
 * so the products are the dense GEMM's up to the order of the fp32 sums.
 *
 * AVX2 and FMA intrinsics only (8 lanes), so one body serves both kinds of CPU (an AVX512 CPU runs it as is).
 */
#include <stdlib.h>

#include "floats.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "gemm.c needs AVX2 and FMA (gemv.py compiles it only where the CPU has them)"
#endif

/* Activation rows a tile of FMAs takes at once, against 16 weight rows (12 running sums and the operands they need:
 * the 16 registers AVX2 has). */
#define MT 6
/* Input columns made fp32 at a time: a 64-row int4 block's 256 columns are 64 KB (in L2 on either kind of CPU), a
 * 16-row int8 tile's 16 KB (in L1). */
#define KC 256
#define BLOCK 64

/* acc [mi, 16] (+)= xs [mi, kc] @ wt [kc, 16]: xs rows ldx apart, wt's columns (16 weight rows each) ldw apart, acc
 * rows ldacc apart; first: acc starts from zero. 12 running sums (6 rows x 2 vectors), the two weight vectors of a
 * column loaded once for the 6 rows and each activation broadcast once for both. */
static inline __attribute__((always_inline)) void tile(int mi, const float *xs, int64_t ldx, const float *wt,
                                                       int64_t ldw, int64_t kc, float *acc, int64_t ldacc, int first) {
    __m256 s[MT][2];
    for (int i = 0; i < mi; i++)
        for (int h = 0; h < 2; h++) s[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * ldacc + h * 8);
    for (int64_t c = 0; c < kc; c++) {
        __m256 w0 = _mm256_load_ps(wt + c * ldw), w1 = _mm256_load_ps(wt + c * ldw + 8);
        for (int i = 0; i < mi; i++) {
            __m256 x = _mm256_broadcast_ss(xs + i * ldx + c);
            s[i][0] = _mm256_fmadd_ps(x, w0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(x, w1, s[i][1]);
        }
    }
    for (int i = 0; i < mi; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + i * ldacc + h * 8, s[i][h]);
}

/* Every row of xs [m, kc] times one tile wt [kc, 16], into acc (as tile()), MT rows at a time. */
static void tiles(int64_t m, const float *xs, int64_t ldx, const float *wt, int64_t ldw, int64_t kc, float *acc,
                  int64_t ldacc, int first) {
    for (int64_t i0 = 0; i0 < m; i0 += MT) {
        const float *x = xs + i0 * ldx;
        float *a = acc + i0 * ldacc;
        switch (m - i0 < MT ? m - i0 : MT) {
        case 6: tile(6, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        case 5: tile(5, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        case 4: tile(4, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        case 3: tile(3, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        case 2: tile(2, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        default: tile(1, x, ldx, wt, ldw, kc, a, ldacc, first); break;
        }
    }
}

/* Columns c0 .. c0 + kc - 1 of one 64-row block of int4 codes as fp32, column-major: wt[c][r] for row r. The
 * stored layout (quant.quantize_int4) keeps a block's column c in 32 bytes, byte r holding row r in its low
 * nibble and row r + 32 in its high one; sz [kp / group, np, 2] holds each row's bf16 scale and zero per group. */
static void dequantize_block(const uint8_t *block, const uint16_t *sz, int64_t np, int64_t row0, int64_t group,
                             int64_t c0, int64_t kc, float *wt) {
    float scale[BLOCK] __attribute__((aligned(32))), zero[BLOCK] __attribute__((aligned(32)));
    const __m256i nibble = _mm256_set1_epi8(15), eight = _mm256_set1_epi32(8);
    int64_t g = -1;
    for (int64_t c = c0; c < c0 + kc; c++) {
        if (c / group != g) {
            g = c / group;
            for (int r = 0; r < BLOCK; r++) {
                scale[r] = bf16_to_float(sz[(g * np + row0 + r) * 2]);
                zero[r] = bf16_to_float(sz[(g * np + row0 + r) * 2 + 1]);
            }
        }
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + c * 32));
        __m256i halves[2] = {_mm256_and_si256(bytes, nibble), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
        float *out = wt + (c - c0) * BLOCK;
        for (int h = 0; h < 2; h++) {
            __m128i lo = _mm256_castsi256_si128(halves[h]), hi = _mm256_extracti128_si256(halves[h], 1);
            __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int p = 0; p < 4; p++) {
                int r = h * 32 + p * 8;
                __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(part[p]), eight));
                q = _mm256_mul_ps(q, _mm256_load_ps(scale + r));
                _mm256_store_ps(out + r, _mm256_add_ps(q, _mm256_load_ps(zero + r)));
            }
        }
    }
}

/* Rows 0 .. m - 1 of acc [m, width] (its first nr columns) into columns r0 .. r0 + nr - 1 of y [m, ldy]. */
static void store_rows(const float *acc, int64_t m, int64_t width, void *y, int y_bf16, int64_t ldy, int64_t r0,
                       int64_t nr) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t r = 0; r < nr; r++)
            store_float(y, y_bf16 ? RL_BF16 : RL_FP32, i * ldy + r0 + r, acc[i * width + r]);
}

/* y [m, n] (fp32, or bf16 where y_bf16) = stage_rows(x) @ W^T, W the int4 matrix of codes [np, kp / 2] (the stored
 * layout) and sz (bf16 scales and zeros, groups of `group` columns); x [m, kx] fp32 or bf16, zero-padded to kp.
 * Returns 0, or -1 when a buffer could not be allocated. */
int rl_int4_gemm(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t kp, const uint8_t *codes,
                 const uint16_t *sz, int64_t np, int64_t group, void *y, int y_bf16, int64_t n, int threads) {
    float *xs = aligned_alloc(64, (size_t)((m * kp * sizeof(float) + 63) / 64 * 64));
    if (xs == NULL) return -1;
    stage_rows(x, x_bf16, m, kx, kp, 0, xs);
    int failed = 0;
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        float *wt = aligned_alloc(64, KC * BLOCK * sizeof(float));
        float *acc = aligned_alloc(64, (size_t)((m * BLOCK * sizeof(float) + 63) / 64 * 64));
        if (wt == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (wt == NULL || acc == NULL) continue;
            const uint8_t *block = codes + b * kp * 32;
            for (int64_t c0 = 0; c0 < kp; c0 += KC) {
                int64_t kc = kp - c0 < KC ? kp - c0 : KC;
                dequantize_block(block, sz, np, b * BLOCK, group, c0, kc, wt);
                for (int h = 0; h < BLOCK / 16; h++)
                    tiles(m, xs + c0, kp, wt + h * 16, BLOCK, kc, acc + h * 16, BLOCK, c0 == 0);
            }
            int64_t r0 = b * BLOCK, nr = n - r0 < BLOCK ? n - r0 : BLOCK;
            store_rows(acc, m, BLOCK, y, y_bf16, n, r0, nr);
        }
        free(wt);
        free(acc);
    }
    free(xs);
    return failed ? -1 : 0;
}

/* Transposes the 8 x 8 floats of r (row i: r[i]) in place. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* Columns c0 .. c0 + kc - 1 (kc a multiple of 8) of 16 int8 weight rows (w[r]: row r's codes) as fp32, column-major:
 * wt[c][r], 8 rows x 8 columns widened and transposed at a time. The same columns of the next tile's rows (next,
 * NULL for none) are prefetched: read 8 bytes of 16 rows at a time, a matrix larger than the cache (the LM head)
 * otherwise comes from memory at a fraction of its speed. */
static void widen_tile(const int8_t *const w[16], const int8_t *next, int64_t ldq, int64_t c0, int64_t kc, float *wt) {
    for (int r = 0; next != NULL && r < 16; r++)
        for (int64_t c = c0; c < c0 + kc; c += 64) _mm_prefetch((const char *)next + r * ldq + c, _MM_HINT_T0);
    for (int half = 0; half < 2; half++)
        for (int64_t c = c0; c < c0 + kc; c += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w[half * 8 + i] + c))));
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_store_ps(wt + (c - c0 + j) * 16 + half * 8, r[j]);
        }
}

/* y [m, n] (fp32, or bf16 where y_bf16) = stage_rows(x) @ (q * scale)^T over q int8 [n, ldq] (k columns used, k a
 * multiple of 8 and of rotation), scale bf16 [n]: gemv.c's product, for many rows. Returns 0, or -1 when a buffer
 * could not be allocated. */
int rl_int8_gemm(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t k, int64_t rotation, const int8_t *q,
                 int64_t ldq, const uint16_t *scale, void *y, int y_bf16, int64_t n, int threads) {
    float *xs = aligned_alloc(64, (size_t)((m * k * sizeof(float) + 63) / 64 * 64));
    if (xs == NULL) return -1;
    stage_rows(x, x_bf16, m, kx, k, rotation, xs);
    int failed = 0;
    int64_t count = (n + 15) / 16;
#pragma omp parallel num_threads(threads)
    {
        float *wt = aligned_alloc(64, KC * 16 * sizeof(float));
        float *acc = aligned_alloc(64, (size_t)((m * 16 * sizeof(float) + 63) / 64 * 64));
        if (wt == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < count; t++) {
            if (wt == NULL || acc == NULL) continue;
            int64_t r0 = t * 16, nr = n - r0 < 16 ? n - r0 : 16;
            const int8_t *w[16];
            for (int r = 0; r < 16; r++) w[r] = q + (r0 + (r < nr ? r : nr - 1)) * ldq;  /* a short tile repeats a row */
            for (int64_t c0 = 0; c0 < k; c0 += KC) {
                int64_t kc = k - c0 < KC ? k - c0 : KC;
                widen_tile(w, t + 1 < count && nr == 16 && n - r0 >= 32 ? w[0] + 16 * ldq : NULL, ldq, c0, kc, wt);
                tiles(m, xs + c0, k, wt, 16, kc, acc, 16, c0 == 0);
            }
            float s[16];
            for (int64_t r = 0; r < nr; r++) s[r] = bf16_to_float(scale[r0 + r]);
            for (int64_t i = 0; i < m; i++)
                for (int64_t r = 0; r < nr; r++) acc[i * 16 + r] *= s[r];
            store_rows(acc, m, 16, y, y_bf16, n, r0, nr);
        }
        free(wt);
        free(acc);
    }
    free(xs);
    return failed ? -1 : 0;
}

/* y [m, n] = stage_rows(x) @ W^T over an int4 matrix as stored (rl_int4_gemm's operands) for a few rows (a decode
 * step at batch 1 to 7): the codes are read once, widened in registers and multiplied unscaled, and each group's sum
 * is scaled once: sum_c x[c] * ((q[c] - 8) * s + z) = s * sum_c x[c] * q[c] + (z - 8 s) * sum_c x[c]. A pass over
 * the codes, like gemv.c's over int8 ones; torch's AVX2 int4 kernel wanted the rows cast to bf16 and back, padded
 * and sliced, five small ops a call. Rows are taken two at a time (8 running sums over 32 weight rows, the four
 * code vectors and a broadcast: the 16 registers AVX2 has), a block's codes staying in the cache for the next two.
 * Returns 0, or -1 when a buffer could not be allocated. */
int rl_int4_gemv(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t kp, const uint8_t *codes,
                 const uint16_t *sz, int64_t np, int64_t group, void *y, int y_bf16, int64_t n, int threads) {
    int64_t groups = kp / group;
    float *xs = aligned_alloc(64, (size_t)(((m * kp + m * groups) * sizeof(float) + 63) / 64 * 64));
    if (xs == NULL) return -1;
    stage_rows(x, x_bf16, m, kx, kp, 0, xs);
    float *xsum = xs + m * kp; /* [m, groups]: each row's sum over each group's columns */
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.f;
            for (int64_t c = g * group; c < (g + 1) * group; c++) t += xs[i * kp + c];
            xsum[i * groups + g] = t;
        }
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    const __m256i nibble = _mm256_set1_epi8(15), high = _mm256_set1_epi32((int)0xffff0000);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = codes + b * kp * 32;
        float out[8][BLOCK] __attribute__((aligned(32)));  /* up to 7 rows (FUSED calls are few-row) */
        for (int h = 0; h < 2; h++) {  /* rows 0-31 of the block (low nibbles), then 32-63 (high) */
            for (int64_t i0 = 0; i0 < m; i0 += 2) {
                int two = m - i0 >= 2;
                __m256 total[2][4];
                for (int i = 0; i < 2; i++)
                    for (int v = 0; v < 4; v++) total[i][v] = _mm256_setzero_ps();
                for (int64_t g = 0; g < groups; g++) {
                    __m256 s[2][4];
                    for (int i = 0; i < 2; i++)
                        for (int v = 0; v < 4; v++) s[i][v] = _mm256_setzero_ps();
                    for (int64_t c = g * group; c < (g + 1) * group; c++) {
                        __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + c * 32));
                        __m256i q = h ? _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)
                                      : _mm256_and_si256(bytes, nibble);
                        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                        __m256 w[4] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
                        __m256 x0 = _mm256_broadcast_ss(xs + i0 * kp + c);
                        for (int v = 0; v < 4; v++) s[0][v] = _mm256_fmadd_ps(x0, w[v], s[0][v]);
                        if (two) {
                            __m256 x1 = _mm256_broadcast_ss(xs + (i0 + 1) * kp + c);
                            for (int v = 0; v < 4; v++) s[1][v] = _mm256_fmadd_ps(x1, w[v], s[1][v]);
                        }
                    }
                    /* This group's scale and zero for the 32 rows: bf16 pairs (scale, zero) -> fp32. */
                    const uint16_t *pairs = sz + (g * np + b * BLOCK + h * 32) * 2;
                    for (int v = 0; v < 4; v++) {
                        __m256i both = _mm256_loadu_si256((const __m256i *)(pairs + v * 16));
                        __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
                        __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(both, high));
                        __m256 offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, zero);  /* z - 8 s */
                        for (int i = 0; i < 1 + two; i++) {
                            __m256 sum = _mm256_set1_ps(xsum[(i0 + i) * groups + g]);
                            total[i][v] = _mm256_fmadd_ps(scale, s[i][v], _mm256_fmadd_ps(offset, sum, total[i][v]));
                        }
                    }
                }
                for (int i = 0; i < 1 + two; i++)
                    for (int v = 0; v < 4; v++) _mm256_store_ps(out[i0 + i] + h * 32 + v * 8, total[i][v]);
            }
        }
        int64_t r0 = b * BLOCK, nr = n - r0 < BLOCK ? n - r0 : BLOCK;
        store_rows(&out[0][0], m, BLOCK, y, y_bf16, n, r0, nr);
    }
    free(xs);
    return 0;
}
