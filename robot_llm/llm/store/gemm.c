/* Products of many rows (a batched decode step: 8 to a few hundred) over int8 and int4 codes on the CPU, with
 * fp32 activations, for CPUs whose int8 x int8 GEMM is not exact (no VNNI: the AVX2 kind, int8act.py).
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

/* Activation rows a tile of FMAs holds at once: 6 rows x 16 weights of int4, 4 x 3 of int8 (12 sums each, with
 * the operands they need, the 16 registers AVX2 has). */
#define M4 6
#define M8 4
#define R8 3
/* int4: input columns dequantized per tile (64 rows x 256 fp32: 64 KB, in L2 on every CPU of either kind). */
#define KC 256
#define BLOCK 64

static inline __attribute__((always_inline)) void int4_tile(int mi, const float *xs, int64_t kp, const float *wt,
                                                            int64_t kc, float *acc, int first) {
    /* acc [mi, 16] (+)= xs [mi, kc] (row stride kp) @ wt [kc, 16] (column stride BLOCK) */
    __m256 s[M4][2];
    for (int i = 0; i < mi; i++)
        for (int h = 0; h < 2; h++) s[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + i * 16 + h * 8);
    for (int64_t c = 0; c < kc; c++) {
        __m256 w0 = _mm256_load_ps(wt + c * BLOCK), w1 = _mm256_load_ps(wt + c * BLOCK + 8);
        for (int i = 0; i < mi; i++) {
            __m256 x = _mm256_broadcast_ss(xs + i * kp + c);
            s[i][0] = _mm256_fmadd_ps(x, w0, s[i][0]);
            s[i][1] = _mm256_fmadd_ps(x, w1, s[i][1]);
        }
    }
    for (int i = 0; i < mi; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(acc + i * 16 + h * 8, s[i][h]);
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

static void store_rows(const float *acc, int64_t mi, int64_t width, void *y, int y_bf16, int64_t ldy, int64_t i0,
                       int64_t r0, int64_t nr) {
    for (int64_t i = 0; i < mi; i++)
        for (int64_t r = 0; r < nr; r++) {
            int64_t at = (i0 + i) * ldy + r0 + r;
            if (y_bf16)
                ((uint16_t *)y)[at] = float_to_bf16(acc[i * width + r]);
            else
                ((float *)y)[at] = acc[i * width + r];
        }
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
                    for (int64_t i0 = 0; i0 < m; i0 += M4) {
                        int64_t mi = m - i0 < M4 ? m - i0 : M4;
                        float *tile = acc + i0 * BLOCK + h * 16;  /* rows i0.., stride BLOCK: see below */
                        float part[M4 * 16] __attribute__((aligned(32)));
                        for (int64_t i = 0; i < mi && c0; i++)
                            for (int r = 0; r < 16; r++) part[i * 16 + r] = tile[i * BLOCK + r];
                        const float *xi = xs + i0 * kp + c0;
                        const float *w = wt + h * 16;
                        switch (mi) {
                        case 6: int4_tile(6, xi, kp, w, kc, part, c0 == 0); break;
                        case 5: int4_tile(5, xi, kp, w, kc, part, c0 == 0); break;
                        case 4: int4_tile(4, xi, kp, w, kc, part, c0 == 0); break;
                        case 3: int4_tile(3, xi, kp, w, kc, part, c0 == 0); break;
                        case 2: int4_tile(2, xi, kp, w, kc, part, c0 == 0); break;
                        default: int4_tile(1, xi, kp, w, kc, part, c0 == 0); break;
                        }
                        for (int64_t i = 0; i < mi; i++)
                            for (int r = 0; r < 16; r++) tile[i * BLOCK + r] = part[i * 16 + r];
                    }
            }
            int64_t r0 = b * BLOCK, nr = n - r0 < BLOCK ? n - r0 : BLOCK;
            store_rows(acc, m, BLOCK, y, y_bf16, n, 0, r0, nr);
        }
        free(wt);
        free(acc);
    }
    free(xs);
    return failed ? -1 : 0;
}

static inline __attribute__((always_inline)) void int8_tile(int mi, const float *xs, int64_t k, const float *wb,
                                                            float *out) {
    /* out [mi, R8] = xs [mi, k] @ wb [R8, k]^T (rows of both contiguous, stride k) */
    __m256 s[M8][R8];
    for (int i = 0; i < mi; i++)
        for (int r = 0; r < R8; r++) s[i][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < k; j += 8) {
        __m256 w[R8];
        for (int r = 0; r < R8; r++) w[r] = _mm256_load_ps(wb + r * k + j);
        for (int i = 0; i < mi; i++) {
            __m256 x = _mm256_load_ps(xs + i * k + j);
            for (int r = 0; r < R8; r++) s[i][r] = _mm256_fmadd_ps(x, w[r], s[i][r]);
        }
    }
    for (int i = 0; i < mi; i++)
        for (int r = 0; r < R8; r++) out[i * R8 + r] = hsum8(s[i][r]);
}

/* y [m, n] (fp32, or bf16 where y_bf16) = stage_rows(x) @ (q * scale)^T over q int8 [n, ldq] (k columns used, k a
 * multiple of 8 and of rotation), scale bf16 [n]: gemv.c's product, for many rows. Returns 0, or -1 when a buffer
 * could not be allocated. */
int rl_int8_gemm(const void *x, int x_bf16, int64_t m, int64_t kx, int64_t k, int64_t rotation, const int8_t *q,
                 int64_t ldq, const uint16_t *scale, void *y, int y_bf16, int64_t n, int threads) {
    /* Staged rows and a widened weight tile 32-byte aligned: k is a multiple of 8. */
    float *xs = aligned_alloc(64, (size_t)((m * k * sizeof(float) + 63) / 64 * 64));
    if (xs == NULL) return -1;
    stage_rows(x, x_bf16, m, kx, k, rotation, xs);
    int failed = 0;
    int64_t tiles = (n + R8 - 1) / R8;
#pragma omp parallel num_threads(threads)
    {
        float *wb = aligned_alloc(64, (size_t)((R8 * k * sizeof(float) + 63) / 64 * 64));
        if (wb == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (wb == NULL) continue;
            int64_t r0 = t * R8, nr = n - r0 < R8 ? n - r0 : R8;
            for (int r = 0; r < R8; r++) {  /* a short tile repeats its last row */
                const int8_t *w = q + (r0 + (r < nr ? r : nr - 1)) * ldq;
                for (int64_t j = 0; j < k; j += 8)
                    _mm256_store_ps(wb + r * k + j,
                                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + j)))));
            }
            float s[R8];
            for (int64_t r = 0; r < nr; r++) s[r] = bf16_to_float(scale[r0 + r]);
            for (int64_t i0 = 0; i0 < m; i0 += M8) {
                int64_t mi = m - i0 < M8 ? m - i0 : M8;
                float part[M8 * R8];
                const float *xi = xs + i0 * k;
                switch (mi) {
                case 4: int8_tile(4, xi, k, wb, part); break;
                case 3: int8_tile(3, xi, k, wb, part); break;
                case 2: int8_tile(2, xi, k, wb, part); break;
                default: int8_tile(1, xi, k, wb, part); break;
                }
                for (int64_t i = 0; i < mi; i++)
                    for (int64_t r = 0; r < R8; r++) part[i * R8 + r] *= r < nr ? s[r] : 0.f;
                store_rows(part, mi, R8, y, y_bf16, n, i0, r0, nr);
            }
        }
        free(wb);
    }
    free(xs);
    return failed ? -1 : 0;
}
