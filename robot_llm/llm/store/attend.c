/* Decode-step attention on the CPU: one new query position per row over the keys and values of the cache,
 * read where and as they are stored (bf16 or fp32, or int8 codes with an fp16 scale per row, position and head;
 * any row/position/head strides), the masked keys skipped. An int8 key's score is its codes' dot product with the
 * query times its scale, an int8 value's weight its probability times its scale: the dequantized cache's products
 * in another order of fp32 roundings, at half a bf16 cache's bytes.
 *
 * torch's fused attention takes 150-190 us a layer for one row of Gemma 3 270M (4 query heads on one KV
 * head, 256 wide, 600 keys: 0.6 MB of bf16 keys and values, which one core reads in 60 us), and its eager
 * form (two matmuls and a softmax) as much at batch 32. Here each work item is one row's KV head with its
 * query heads (every key read once for all of them) or, with fewer such items than threads, a part of its
 * keys (a row at batch 1 still spreads over the threads), the parts merged after. Scores, softmax and the
 * weighted sum are fp32; the output is rounded once to the query's dtype. A fully masked row comes out zero,
 * as torch's fused kernel's.
 *
 * At batch 32 a step's caches (18 layers x 32 rows x 512 keys) are larger than the CPU's caches, so the
 * kernel must compute faster than the memory delivers: the AVX512 body where the compiler may use it, the
 * scores of four keys reduced together (a sum of one vector's lanes costs half a key's products), the
 * exponentials eight or sixteen at a time, and the values weighed a block of keys at a time that stays in L1
 * while every column of the head dimension passes over it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KB 4 /* keys scored together */
#define CW 4 /* value vectors (of VL columns) weighed together */
/* The sums of four vectors' lanes. */
static inline __m128 hsum4(vf a, vf b, vf c, vf d) {
    __m256 h[4];
    vf v[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++)
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i]), 1)));
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
/* 2 x VL bf16 values from p as two fp32 vectors, the lanes in unpacked_column()'s order. */
static inline void vunpack(const uint16_t *p, vf *lo, vf *hi) {
    __m512i raw = _mm512_loadu_si512(p), z = _mm512_setzero_si512();
    *lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, raw));
    *hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, raw));
}
/* The keys' bf16 dot products (DOT, AVX512-BF16). */
#if defined(__AVX512BF16__)
#define DOT 1
#define DOT_SERVES(q_dtype, kv_dtype, hd) ((q_dtype) == RL_BF16 && (kv_dtype) == RL_BF16 && (hd) % 32 == 0)
#endif
#else
#define KB 2
#define CW 2
static inline __m128 hsum4(vf a, vf b, vf c, vf d) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
static inline void vunpack(const uint16_t *p, vf *lo, vf *hi) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, raw));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, raw));
}
#endif

#ifndef DOT
#define DOT 0
#define DOT_SERVES(q_dtype, kv_dtype, hd) 0
#endif

/* An int8 cache multiplied in integers (KEYS_INT8, weigh_int8): the keys' codes widened to int16 against the query
 * as int16 codes (one scale a head), the values' codes against the probabilities as int16 codes, pairs of int16
 * products summed into int32 lanes (vpdpwssd, or vpmaddwd and an add): one instruction for 2 x VL products, where
 * widening the codes to fp32 took two for VL values before their FMAs, which left an int8 cache slower to attend
 * than a bf16 one of twice its bytes. IW int16 values a vector. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
typedef __m512i vint;
#define IW 32
static inline vint vint_zero(void) { return _mm512_setzero_si512(); }
static inline vint widen_codes(const void *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline vint load_int16(const int16_t *p) { return _mm512_loadu_si512(p); }
static inline vf int_floats(vint v) { return _mm512_cvtepi32_ps(v); }
static inline vint bcast_pair(int32_t p) { return _mm512_set1_epi32(p); }
#if defined(__AVX512VNNI__)
static inline vint dot16(vint acc, vint a, vint b) { return _mm512_dpwssd_epi32(acc, a, b); }
#else
static inline vint dot16(vint acc, vint a, vint b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
/* The value codes of keys x and y, columns j .. j + 63, as four vectors of (x, y) int16 pairs: vpunpck interleaves
 * within 128-bit lanes, so w[c] holds columns 32 (c / 2) + 8 (c % 2) + 16 (e / 8) + e % 8 (weighed_column). */
static inline void value_pairs(const int8_t *x, const int8_t *y, vint w[4]) {
    __m512i a = _mm512_loadu_si512(x), b = _mm512_loadu_si512(y);
    __m512i lo = _mm512_unpacklo_epi8(a, b), hi = _mm512_unpackhi_epi8(a, b);
    w[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
    w[1] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
    w[2] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
    w[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
}
static inline int64_t weighed_column(int64_t j) {
    int64_t d = j % 64;
    return j - d + 16 * (2 * (d / 32) + d % 16 / 8) + 8 * (d % 32 / 16) + d % 8;
}
#else
typedef __m256i vint;
#define IW 16
static inline vint vint_zero(void) { return _mm256_setzero_si256(); }
static inline vint widen_codes(const void *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline vint load_int16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vf int_floats(vint v) { return _mm256_cvtepi32_ps(v); }
static inline vint bcast_pair(int32_t p) { return _mm256_set1_epi32(p); }
static inline vint dot16(vint acc, vint a, vint b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
/* As the AVX512 body's, columns j .. j + 31: here w[c] holds columns 8c .. 8c + 7, in order. */
static inline void value_pairs(const int8_t *x, const int8_t *y, vint w[4]) {
    __m256i a = _mm256_loadu_si256((const __m256i *)x), b = _mm256_loadu_si256((const __m256i *)y);
    __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
    w[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo));
    w[1] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi));
    w[2] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1));
    w[3] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1));
}
static inline int64_t weighed_column(int64_t j) { return j; }
#endif
/* Columns a pass of weigh_int8 takes: four vectors of IW / 2 int32 sums. */
#define INT8_COLUMNS (2 * IW)
/* The int16 codes' bound: a block of KBLK keys' products (at most 32767 x 127 each) stays within int32. */
#define INT16_LEVELS 32767
/* Where the integer products serve an int8 cache: whole passes of weigh_int8's columns. */
#define INT8_SERVES(kv_dtype, hd) ((kv_dtype) == RL_INT8 && (hd) % INT8_COLUMNS == 0)

/* How score_block reads the keys: widened VL at a time, by bf16 dot products (DOT_SERVES), by vunpack, or as int8
 * codes against int16 ones (INT8_SERVES). */
enum { KEYS_WIDENED, KEYS_DOT, KEYS_PAIRED, KEYS_INT8 };

/* Where a bf16 cache is widened by vunpack, keys and values (two unpacks for 2 x VL values, against two widenings
 * and two shifts, the shifts on the FMAs' ports: a batch-32 step's 18 layers of 512 keys, 1 thread, AVX2 body,
 * 44.3 -> 37.5 ms with the weights broadcast from memory, weigh_block), which leaves each block of 2 x VL columns in
 * unpacked_column()'s order: the query is stored in it, and the output read back from it. Whole blocks of the
 * weighing's CW x VL columns. */
#define PAIRS_SERVE(kv_dtype, hd) ((kv_dtype) == RL_BF16 && (hd) % (CW * VL) == 0)

/* Where column j of a block of 2 x VL lies once unpacked: unpacklo takes the first four of each 128-bit lane's
 * eight, unpackhi the last four, the lanes in order. */
static inline int64_t unpacked_column(int64_t j) {
    int64_t block = j / (2 * VL) * (2 * VL), e = j % (2 * VL), lane = e / 8, r = e % 8;
    return block + (r < 4 ? lane * 4 + r : VL + lane * 4 + r - 4);
}

/* Bytes of one element of a cache stored in `dtype`. */
static inline size_t element_size(int dtype) { return dtype == RL_BF16 ? 2 : dtype == RL_INT8 ? 1 : 4; }

/* The scale of an int8 cache's position `s` (fp16, positions `stride` elements apart); 1 for a float cache. */
static inline float scale_at(const uint16_t *scales, int64_t stride, int32_t s) {
    return scales == NULL ? 1.f : _cvtsh_ss(scales[(int64_t)s * stride]);
}

/* Query heads handled together: every key and value vector loaded once for HB heads' products. */
#define HB 4
/* Keys whose values are weighed together: 32 bf16 rows of 256 are 16 KB, in L1 for every column block. */
#define KBLK 32
/* Keys ahead of the ones being scored whose rows are fetched meanwhile (the memory's latency is a few keys'
 * products). */
#define PREFETCH_KEYS 24
/* Where the keys and values fetched ahead go: L2 (prefetcht1). Each is read once, and fetched into L1 (prefetcht0)
 * they held the L1's few miss buffers while they came from memory: a batch-32 step's layer of 576 bf16 keys, caches
 * cold, took 2.7-3.4 ms at 1 thread and 1.6 at 2 on a Zen 4 EPYC, 1.35-1.6 and 0.9 with prefetcht1 (int8 cache:
 * 1.3-1.8 and 0.9-1.0, against 1.05-1.1 and 0.5-0.75). */
#define AHEAD _MM_HINT_T1

/* scores[h * S + i] = (q_h . k[live[i]]) * scale for NB heads, KB keys at a time (int8 keys: times each key's
 * own scale from kscales, kstride apart, too); `mode` KEYS_WIDENED: q fp32 [NB, hd]; KEYS_PAIRED: the same with
 * each block of 2 x VL columns in unpacked_column()'s order, as vunpack widens the bf16 keys; KEYS_DOT (DOT_SERVES):
 * the query's own bf16 [NB, hd] multiplied by the bf16 keys as they are, 32 products an instruction (exact
 * products, summed in fp32 as the FMAs do, but in pairs and with subnormals flushed); KEYS_INT8 (INT8_SERVES): q as
 * int16 codes [NB, hd] with one scale a head (qscale), against the int8 keys' codes, the sums exact in int32. */
static inline __attribute__((always_inline)) void score_block(const void *q, int nb, int64_t hd, const char *keys,
                                                              int64_t stride, int dtype, const uint16_t *kscales,
                                                              int64_t kstride, const int32_t *live, int64_t count,
                                                              float scale, const float *qscale, float *scores,
                                                              int64_t S, int mode) {
    size_t esize = element_size(dtype);
    for (int64_t i = 0; i < count; i += KB) {
        int64_t kn = count - i < KB ? count - i : KB;
        const void *key[KB];
        const char *ahead[KB];  /* the keys PREFETCH_KEYS on, fetched while these are scored */
        for (int c = 0; c < KB; c++) {
            key[c] = keys + (size_t)live[i + (c < kn ? c : 0)] * stride;
            int64_t next = i + PREFETCH_KEYS + c < count ? i + PREFETCH_KEYS + c : count - 1;
            ahead[c] = keys + (size_t)live[next] * stride;
        }
        vf acc[HB * KB];
        for (int a = 0; a < HB * KB; a++) acc[a] = vzero();
#if DOT
        for (int64_t j = 0; mode == KEYS_DOT && j < hd; j += 32) {
            __m512i kv[KB];
            for (int c = 0; c < KB; c++) {
                _mm_prefetch(ahead[c] + j * 2, AHEAD);
                kv[c] = _mm512_loadu_si512((const uint16_t *)key[c] + j);
            }
            for (int h = 0; h < nb; h++) {
                __m512bh qv = (__m512bh)_mm512_loadu_si512((const uint16_t *)q + h * hd + j);
                for (int c = 0; c < KB; c++) acc[h * KB + c] = _mm512_dpbf16_ps(acc[h * KB + c], qv, (__m512bh)kv[c]);
            }
        }
#endif
        for (int64_t j = 0; mode == KEYS_PAIRED && j < hd; j += 2 * VL) {
            for (int c = 0; c < KB; c++) _mm_prefetch(ahead[c] + j * 2, AHEAD);
            vf lo[KB], hi[KB];
            for (int c = 0; c < KB; c++) vunpack((const uint16_t *)key[c] + j, &lo[c], &hi[c]);
            for (int h = 0; h < nb; h++) {
                const float *qh = (const float *)q + h * hd;
                vf lo_q = vload(qh, RL_FP32, j, VL), hi_q = vload(qh, RL_FP32, j + VL, VL);
                for (int c = 0; c < KB; c++) acc[h * KB + c] = vfma(hi_q, hi[c], vfma(lo_q, lo[c], acc[h * KB + c]));
            }
        }
        if (mode == KEYS_INT8) {
            vint sums[HB * KB];
            for (int a = 0; a < HB * KB; a++) sums[a] = vint_zero();
            for (int64_t j = 0; j < hd; j += IW) {
                vint kv[KB];
                for (int c = 0; c < KB; c++) {
                    if (j % 64 == 0) _mm_prefetch(ahead[c] + j, AHEAD);
                    kv[c] = widen_codes((const int8_t *)key[c] + j);
                }
                for (int h = 0; h < nb; h++) {
                    vint qv = load_int16((const int16_t *)q + h * hd + j);
                    for (int c = 0; c < KB; c++) sums[h * KB + c] = dot16(sums[h * KB + c], qv, kv[c]);
                }
            }
            for (int a = 0; a < nb * KB; a++) acc[a] = int_floats(sums[a]);
        }
        for (int64_t j = 0; mode == KEYS_WIDENED && j < hd; j += VL) {
            int64_t n = hd - j < VL ? hd - j : VL;
            for (int c = 0; c < KB; c++) _mm_prefetch(ahead[c] + j * esize, AHEAD);
            vf kv[KB];
            for (int c = 0; c < KB; c++) kv[c] = vload(key[c], dtype, j, n);
            for (int h = 0; h < nb; h++) {
                vf qv = vload((const float *)q + h * hd, RL_FP32, j, n);
                for (int c = 0; c < KB; c++) acc[h * KB + c] = vfma(qv, kv[c], acc[h * KB + c]);
            }
        }
        /* Unrolled whole, so that every acc[] index is a constant: gcc 12 otherwise kept the array on the stack and
         * stored all 16 running sums every step of the products' loop (AVX512 body, fp32 query over a bf16 cache,
         * batch 32, 576 keys, 1 thread, Ice Lake: 2.70 -> 2.55 ms a layer). */
#pragma GCC unroll 16
        for (int a = 0; a < nb * KB; a += 4) {
            float sums[4];
            _mm_storeu_ps(sums, hsum4(acc[a], acc[a + 1], acc[a + 2], acc[a + 3]));
            for (int b = 0; b < 4; b++) {
                int h = (a + b) / KB, c = (a + b) % KB;
                if (h < nb && c < kn)
                    scores[h * S + i + c] = sums[b] * scale_at(kscales, kstride, live[i + c]) * scale *
                                            (qscale == NULL ? 1.f : qscale[h]);
            }
        }
    }
}

/* out_h = sum_i p[h * S + i] * v[live[i]] for NB heads (fp32 [NB, hd]; for int8 values p already holds each value's
 * scale): KBLK keys at a time, and over each block CW vectors of columns at a time, the running sums kept in out
 * between blocks. With `pairs` (PAIRS_SERVE) the values are widened by vunpack, and out is in unpacked_column()'s
 * order. Each weight is broadcast from memory (a load, where p times a scale was a multiply and a shuffle on the
 * FMAs' ports: 24.8 -> 20.5 ms for this pass of a batch-32 step's 18 layers of 512 keys, 1 thread, AVX2 body, with
 * vunpack). */
static inline __attribute__((always_inline)) void weigh_block(const float *p, int nb, int64_t hd, const char *values,
                                                              int64_t stride, int dtype, const int32_t *live,
                                                              int64_t count, float *out, int64_t S, int pairs) {
    size_t esize = pairs ? 2 : element_size(dtype); /* a constant where pairs: the prefetches unrolled */
    if (count == 0) {
        memset(out, 0, (size_t)(nb * hd) * sizeof(float));
        return;
    }
    for (int64_t i0 = 0; i0 < count; i0 += KBLK) {
        int64_t i1 = count - i0 < KBLK ? count : i0 + KBLK;
        for (int64_t j = 0; j < hd; j += CW * VL) {
            int64_t n[CW];
            for (int c = 0; c < CW; c++) {
                int64_t left = hd - j - c * VL;
                n[c] = left < 0 ? 0 : left < VL ? left : VL;
            }
            vf acc[HB][CW];
            for (int h = 0; h < nb; h++)
                for (int c = 0; c < CW; c++)
                    acc[h][c] = i0 == 0 || n[c] == 0 ? vzero() : vload(out + h * hd, RL_FP32, j + c * VL, n[c]);
            for (int64_t i = i0; i < i1; i++) {
                const char *value = values + (size_t)live[i] * stride;
                if (i + KBLK < count) {  /* the same columns of the next block's key, for its pass */
                    const char *next = values + (size_t)live[i + KBLK] * stride + j * esize;
                    for (size_t at = 0; at < CW * VL * esize; at += 64) _mm_prefetch(next + at, AHEAD);
                }
                vf v[CW];
                if (pairs)
                    for (int c = 0; c < CW; c += 2) vunpack((const uint16_t *)value + j + c * VL, &v[c], &v[c + 1]);
                else
                    for (int c = 0; c < CW; c++) v[c] = n[c] ? vload(value, dtype, j + c * VL, n[c]) : vzero();
                for (int h = 0; h < nb; h++) {
                    vf w = vset(p[h * S + i]);  /* a broadcast from memory: no multiply, no shuffle */
                    for (int c = 0; c < CW; c++) acc[h][c] = vfma(w, v[c], acc[h][c]);
                }
            }
            for (int h = 0; h < nb; h++)
                for (int c = 0; c < CW; c++)
                    if (n[c]) vstore(out + h * hd + j + c * VL, acc[h][c], n[c]);
        }
    }
}

/* weigh_block's sums over an int8 cache's values (INT8_SERVES) in integers: pc [NB][count rounded up to even] the
 * probabilities times the values' scales as int16 codes, a pair of keys' codes one int32 (the first key's in the
 * low half), with one scale a head (pscale); each pair of value rows widened to (x, y) int16 pairs (value_pairs),
 * their products with the pair's codes summed in int32 over a block of KBLK keys, the block's sums added in fp32
 * to out (fp32 [NB, hd], columns in weighed_column()'s order) and out times pscale at the end. */
static inline __attribute__((always_inline)) void weigh_int8(const int32_t *pc, const float *pscale, int nb,
                                                             int64_t hd, const char *values, int64_t stride,
                                                             const int32_t *live, int64_t count, float *out,
                                                             int64_t P) {
    for (int64_t h = 0; h < nb * hd; h++) out[h] = 0.f;
    for (int64_t i0 = 0; i0 < count; i0 += KBLK) {
        int64_t i1 = count - i0 < KBLK ? count : i0 + KBLK;
        for (int64_t j = 0; j < hd; j += INT8_COLUMNS) {
            vint acc[HB][4];
            for (int h = 0; h < nb; h++)
                for (int c = 0; c < 4; c++) acc[h][c] = vint_zero();
            for (int64_t i = i0; i < i1; i += 2) {
                const int8_t *x = (const int8_t *)(values + (size_t)live[i] * stride) + j;
                /* an odd last key pairs with itself, its partner's code 0 */
                const int8_t *y = i + 1 < count ? (const int8_t *)(values + (size_t)live[i + 1] * stride) + j : x;
                if (i + KBLK < count) { /* the same columns of the next block's pair, for its pass */
                    _mm_prefetch((const char *)(values + (size_t)live[i + KBLK] * stride) + j, AHEAD);
                    if (i + KBLK + 1 < count)
                        _mm_prefetch((const char *)(values + (size_t)live[i + KBLK + 1] * stride) + j, AHEAD);
                }
                vint w[4];
                value_pairs(x, y, w);
                for (int h = 0; h < nb; h++) {
                    vint pv = bcast_pair(pc[h * P + i / 2]);
                    for (int c = 0; c < 4; c++) acc[h][c] = dot16(acc[h][c], w[c], pv);
                }
            }
            for (int h = 0; h < nb; h++)
                for (int c = 0; c < 4; c++) {
                    float *to = out + h * hd + j + c * (IW / 2);
                    vstore(to, vadd(vload(to, RL_FP32, 0, IW / 2), int_floats(acc[h][c])), IW / 2);
                }
        }
    }
    for (int h = 0; h < nb; h++) {
        vf times = vset(pscale[h]);
        for (int64_t j = 0; j < hd; j += VL) vstore(out + h * hd + j, vmul(vload(out + h * hd, RL_FP32, j, VL), times), VL);
    }
}

/* VL fp32 lanes (n of them) rounded to nearest even as int16, saturated, stored. */
static inline void store_int16(int16_t *p, vf v, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm256_mask_storeu_epi16(p, first(n), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(v)));
#else
    __m256i i = _mm256_cvtps_epi32(v);
    int16_t lanes[8];
    _mm_storeu_si128((__m128i *)lanes, _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
    memcpy(p, lanes, (size_t)n * sizeof(int16_t));
#endif
}

/* k <= VL fp32 values from row + i, the lanes past k zero (the AVX2 body's vload reads whole vectors). */
static inline vf load_part(const float *row, int64_t i, int64_t k) {
    if (k == VL) return vload(row, RL_FP32, i, VL);
    float part[VL] = {0};
    memcpy(part, row + i, (size_t)k * sizeof(float));
    return vload(part, RL_FP32, 0, VL);
}

/* Each of `group` heads' codes as int16 within -INT16_LEVELS..INT16_LEVELS times one scale a head, rounded to nearest
 * even: from x [group, n] (fp32, rows `ld` apart) into codes [group, n] (pairs: [group, P] int32, a pair of
 * consecutive values an int32, the odd last one paired with 0) and scales [group]. A head holding a NaN or an
 * infinity gets a NaN scale (and codes 0), so that what it multiplies comes out NaN as it would in floats. */
static void int16_codes(const float *x, int64_t group, int64_t n, int64_t ld, int pairs, int64_t P, void *codes,
                        float *scales) {
    const vi magnitude = vset32(0x7fffffff);
    for (int64_t h = 0; h < group; h++) {
        const float *row = x + h * ld;
        vf top = vzero(), bad = vzero(); /* bad: x * 0 summed, NaN where any x is not finite */
        for (int64_t i = 0; i < n; i += VL) {
            vf v = load_part(row, i, n - i < VL ? n - i : VL);
            top = vmax(top, vfloats(vand32(vbits(v), magnitude)));
            bad = vfma(v, vzero(), bad);
        }
        float most = vhmax(top), step = most / INT16_LEVELS;
        int finite = isfinite(vhsum(bad));
        scales[h] = finite ? step : NAN;
        vf by = vset(finite && step > 0.f ? 1.f / step : 0.f);
        int16_t *c16 = (int16_t *)codes + h * (pairs ? 2 * P : n);
        for (int64_t i = 0; i < n; i += VL) {
            int64_t k = n - i < VL ? n - i : VL;
            if (finite)
                store_int16(c16 + i, vmul(load_part(row, i, k), by), k);
            else
                memset(c16 + i, 0, (size_t)k * sizeof(int16_t));
        }
        if (pairs && n % 2) c16[n] = 0;
    }
}

/* The softmax of each head's scores over its `count` live keys, in place (every key masked: nothing to do); with
 * `stats` (a part of the keys), left unnormalized: each head's largest score and its sum of exponentials go to
 * stats[2h], stats[2h + 1] for merge_parts. */
static void softmax_rows(float *scores, int64_t nb, int64_t S, int64_t count, float softcap, float *stats) {
    for (int64_t h = 0; h < nb; h++) {
        float *row = scores + h * S;
        if (softcap > 0.f)
            for (int64_t i = 0; i < count; i++) row[i] = tanhf(row[i] / softcap) * softcap;
        int64_t i = 0;
        vf top = vset(-INFINITY);
        for (; i + VL <= count; i += VL) top = vmax(top, vload(row, RL_FP32, i, VL));
        float most = vhmax(top);
        for (; i < count; i++) most = row[i] > most ? row[i] : most;
        vf sum = vzero(), base = vset(most);
        for (i = 0; i + VL <= count; i += VL) {
            vf e = vexp(vsub(vload(row, RL_FP32, i, VL), base));
            vstore(row + i, e, VL);
            sum = vadd(sum, e);
        }
        float total = vhsum(sum);
        for (; i < count; i++) total += row[i] = expf(row[i] - most);
        if (stats != NULL) {
            stats[2 * h] = count ? most : -INFINITY;
            stats[2 * h + 1] = count ? total : 0.f;
            continue;
        }
        float inv = count ? 1.f / total : 0.f;
        vf scale = vset(inv);
        for (i = 0; i + VL <= count; i += VL) vstore(row + i, vmul(vload(row, RL_FP32, i, VL), scale), VL);
        for (; i < count; i++) row[i] *= inv;
    }
}

/* The blocks with their head count a constant, so that the running sums stay in registers. */
#define BY_HEADS(call, nb, ...)                                           \
    switch (nb) {                                                         \
        case 1: call(__VA_ARGS__, 1); break;                              \
        case 2: call(__VA_ARGS__, 2); break;                              \
        case 3: call(__VA_ARGS__, 3); break;                              \
        default: call(__VA_ARGS__, 4); break;                             \
    }

static void scores_for(const void *q, int64_t hd, const char *keys, int64_t stride, int dtype, const uint16_t *ks,
                       int64_t kstride, const int32_t *live, int64_t count, float scale, const float *qscale,
                       float *scores, int64_t S, int64_t nb, int mode) {
#define SCORE(q, hd, keys, stride, dtype, ks, kstride, live, count, scale, qscale, scores, S, mode, n) \
    score_block(q, n, hd, keys, stride, dtype, ks, kstride, live, count, scale, qscale, scores, S, mode)
    if (mode == KEYS_DOT) {
        BY_HEADS(SCORE, nb, q, hd, keys, stride, dtype, ks, kstride, live, count, scale, NULL, scores, S, KEYS_DOT)
    } else if (mode == KEYS_PAIRED) {
        BY_HEADS(SCORE, nb, q, hd, keys, stride, dtype, ks, kstride, live, count, scale, NULL, scores, S, KEYS_PAIRED)
    } else if (mode == KEYS_INT8) {
        BY_HEADS(SCORE, nb, q, hd, keys, stride, dtype, ks, kstride, live, count, scale, qscale, scores, S, KEYS_INT8)
    } else {
        BY_HEADS(SCORE, nb, q, hd, keys, stride, dtype, ks, kstride, live, count, scale, NULL, scores, S, KEYS_WIDENED)
    }
}

#define WEIGH_INT8(pc, pscale, hd, values, stride, live, count, out, P, n) \
    weigh_int8(pc, pscale, n, hd, values, stride, live, count, out, P)

static void weights_for(const float *p, int64_t hd, const char *values, int64_t stride, int dtype,
                        const int32_t *live, int64_t count, float *out, int64_t S, int64_t nb, int pairs) {
#define WEIGH(p, hd, values, stride, dtype, live, count, out, S, mode, n) \
    weigh_block(p, n, hd, values, stride, dtype, live, count, out, S, mode)
    if (pairs) {
        BY_HEADS(WEIGH, nb, p, hd, values, stride, dtype, live, count, out, S, 1)
    } else {
        BY_HEADS(WEIGH, nb, p, hd, values, stride, dtype, live, count, out, S, 0)
    }
}

/* The softmax-weighted sums of `parts` parts of the same keys, each unnormalized with its own largest score
 * (acc [parts, group, hd], stats [parts, group, 2]), into out [group, hd]: every part rescaled to the largest of
 * all and divided by the common sum (every key masked: zeros). */
static void merge_parts(const float *acc, const float *stats, int64_t parts, int64_t group, int64_t hd, float *out) {
    for (int64_t h = 0; h < group; h++) {
        float most = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < parts; c++) most = stats[(c * group + h) * 2] > most ? stats[(c * group + h) * 2] : most;
        for (int64_t j = 0; j < hd; j++) out[h * hd + j] = 0.f;
        if (most == -INFINITY) continue;
        for (int64_t c = 0; c < parts; c++) {
            const float *st = stats + (c * group + h) * 2;
            if (st[0] == -INFINITY) continue;
            float w = expf(st[0] - most);
            total += w * st[1];
            for (int64_t j = 0; j < hd; j++) out[h * hd + j] += w * acc[(c * group + h) * hd + j];
        }
        float inv = 1.f / total;
        for (int64_t j = 0; j < hd; j++) out[h * hd + j] *= inv;
    }
}

/* The order of the weighing's output columns: as they are, unpacked_column()'s (vunpack), weighed_column()'s. */
enum { COLUMNS_IN_ORDER, COLUMNS_UNPACKED, COLUMNS_WEIGHED };

/* `group` heads' outputs acc [group, hd] (columns in `order`) into out at element `at`, in q's dtype. */
static void write_heads(void *out, int q_dtype, const float *acc, int64_t at, int64_t group, int64_t hd, int order) {
    if (order == COLUMNS_UNPACKED) { /* whole blocks of 2 x VL (PAIRS_SERVE), each block's order a constant */
        for (int64_t j0 = 0; j0 < group * hd; j0 += 2 * VL)
#pragma GCC unroll 64
            for (int64_t e = 0; e < 2 * VL; e++) store_float(out, q_dtype, at + j0 + e, acc[j0 + unpacked_column(e)]);
        return;
    }
    for (int64_t h = 0; h < group; h++)
        for (int64_t j = 0; j < hd; j++)
            store_float(out, q_dtype, at + h * hd + j, acc[h * hd + (order == COLUMNS_WEIGHED ? weighed_column(j) : j)]);
}

/* q [B, n_heads, hd] (q_dtype, contiguous); k, v [B, S, kv_heads, hd] at element strides (sb, ss, sh), the
 * head dimension contiguous (kv_dtype); for int8 codes, ks, vs their fp16 scales [B, S, kv_heads] at element strides
 * (tb, ts, th) (NULL for a float cache); mask [B, S] bool at byte strides (mb, ms), true where forbidden;
 * query head h uses KV head h / (n_heads / kv_heads). out [B, n_heads * hd] in q_dtype. softcap 0: none, else
 * scores are tanh(s / softcap) * softcap after the scale. Returns 0, or -1 when a work buffer could not be had. */
int rl_decode_attention(const void *q, int q_dtype, int64_t B, int64_t n_heads, int64_t kv_heads, int64_t hd,
                        const void *k, const void *v, int kv_dtype, int64_t sb, int64_t ss, int64_t sh,
                        const uint16_t *ks, const uint16_t *vs, int64_t tb, int64_t ts, int64_t th,
                        const uint8_t *mask, int64_t mb, int64_t ms, int64_t S, float scale, float softcap, void *out,
                        int threads) {
    int64_t group = n_heads / kv_heads;
    /* Fewer (row, KV head) pairs than threads (batch 1): each pair's live keys are split into parts, one a work
     * item with all the pair's query heads, merged afterwards (every key read once, by one thread), instead of one
     * query head an item (each thread reading every key). */
    int64_t parts = B * kv_heads < threads ? threads / (B * kv_heads) : 1;
    int64_t items = B * kv_heads * parts;
    size_t esize = element_size(kv_dtype);
    int pairs = PAIRS_SERVE(kv_dtype, hd), ints = INT8_SERVES(kv_dtype, hd) && ks != NULL && vs != NULL;
    int mode = DOT_SERVES(q_dtype, kv_dtype, hd) ? KEYS_DOT : pairs ? KEYS_PAIRED : ints ? KEYS_INT8 : KEYS_WIDENED;
    int order = pairs ? COLUMNS_UNPACKED : ints ? COLUMNS_WEIGHED : COLUMNS_IN_ORDER;
    int64_t P = (S + 1) / 2; /* int32 pairs of a head's probability codes (ints) */
    int failed = 0;
    /* With parts: each item's unnormalized outputs [group, hd] and its heads' (largest score, sum) pairs. */
    float *part_acc = parts > 1 ? malloc((size_t)(items * group * hd) * sizeof(float)) : NULL;
    float *part_stats = parts > 1 ? malloc((size_t)(items * group * 2) * sizeof(float)) : NULL;
    if (parts > 1 && (part_acc == NULL || part_stats == NULL)) failed = 1;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Per thread: the item's queries, their scores (then probabilities) over the live keys, their outputs,
         * and the live keys' positions. */
        float *qs = malloc((size_t)(group * (hd + S + hd)) * sizeof(float));
        int32_t *live = malloc((size_t)S * sizeof(int32_t));
        /* ints: the query's int16 codes [group, hd], the probabilities' pairs [group, P], and each one's scales */
        int32_t *codes = ints ? malloc((size_t)(group * (hd / 2 + P)) * sizeof(int32_t)) : NULL;
        float *code_scales = ints ? malloc((size_t)(2 * group) * sizeof(float)) : NULL;
        if (qs == NULL || live == NULL || (ints && (codes == NULL || code_scales == NULL))) failed = 1;
        int ready = qs != NULL && live != NULL && (parts == 1 || (part_acc != NULL && part_stats != NULL)) &&
                    (!ints || (codes != NULL && code_scales != NULL));
        int16_t *q16 = (int16_t *)codes;
        int32_t *pc = codes == NULL ? NULL : codes + group * hd / 2;
        float *qscale = code_scales, *pscale = code_scales == NULL ? NULL : code_scales + group;
        /* items as threads come free: a night's rows differ in live keys, and a thread can fall behind */
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            if (!ready) continue;
            int64_t pair = it / parts, part = it % parts, b = pair / kv_heads, g = pair % kv_heads, h0 = g * group;
            float *scores = qs + group * hd, *acc = parts > 1 ? part_acc + it * group * hd : scores + group * S;
            /* The item's queries, in unpacked_column()'s order where vunpack widens the keys: a block of 2 x VL at a
             * time (PAIRS_SERVE: whole blocks), so that the order is a constant and not reckoned per value (with
             * write_heads', ~10 % of a batch-32 layer's attention with the caches in L2) */
            const int64_t q0 = (b * n_heads + h0) * hd;
            if (mode == KEYS_PAIRED)
                for (int64_t j0 = 0; j0 < group * hd; j0 += 2 * VL)
#pragma GCC unroll 64
                    for (int64_t e = 0; e < 2 * VL; e++)
                        qs[j0 + unpacked_column(e)] = load_float(q, q_dtype, q0 + j0 + e);
            else
                for (int64_t j = 0; j < group * hd; j++) qs[j] = load_float(q, q_dtype, q0 + j);
            const char *kb = (const char *)k + (size_t)(b * sb + g * sh) * esize;
            const char *vb = (const char *)v + (size_t)(b * sb + g * sh) * esize;
            const uint16_t *ksb = ks == NULL ? NULL : ks + b * tb + g * th;
            const uint16_t *vsb = vs == NULL ? NULL : vs + b * tb + g * th;
            int64_t count = 0;
            for (int64_t s = 0; s < S; s++)
                if (!mask[b * mb + s * ms]) live[count++] = (int32_t)s;
            int64_t first = count * part / parts, last = count * (part + 1) / parts; /* this item's live keys */
            const int32_t *mine = live + first;
            count = last - first;
            const uint16_t *qb = (const uint16_t *)q + (b * n_heads + h0) * hd;  /* the bf16 query, where KEYS_DOT */
            if (ints) int16_codes(qs, group, hd, hd, 0, 0, q16, qscale);
            for (int64_t h = 0; h < group; h += HB) {
                const void *qh = mode == KEYS_DOT ? (const void *)(qb + h * hd) : ints ? (const void *)(q16 + h * hd)
                                                                                     : (const void *)(qs + h * hd);
                scores_for(qh, hd, kb, ss * esize, kv_dtype, ksb, ts, mine, count, scale, ints ? qscale + h : NULL,
                           scores + h * S, S, group - h < HB ? group - h : HB, mode);
            }
            softmax_rows(scores, group, S, count, softcap, parts > 1 ? part_stats + it * group * 2 : NULL);
            if (vsb != NULL) /* an int8 value's scale taken into its probability once, not once per column block */
                for (int64_t i = 0; i < count; i++) {
                    float by = scale_at(vsb, ts, mine[i]);
                    for (int64_t h = 0; h < group; h++) scores[h * S + i] *= by;
                }
            if (ints) int16_codes(scores, group, count, S, 1, P, pc, pscale);
            for (int64_t h = 0; h < group; h += HB) {
                int64_t nb = group - h < HB ? group - h : HB;
                if (ints) {
                    BY_HEADS(WEIGH_INT8, nb, pc + h * P, pscale + h, hd, vb, ss * esize, mine, count, acc + h * hd, P)
                } else {
                    weights_for(scores + h * S, hd, vb, ss * esize, kv_dtype, mine, count, acc + h * hd, S, nb, pairs);
                }
            }
            if (parts == 1) write_heads(out, q_dtype, acc, (b * n_heads + h0) * hd, group, hd, order);
        }
        if (parts > 1) {  /* after the parts' loop and its barrier */
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < B * kv_heads; pair++) {
                if (!ready) continue;
                merge_parts(part_acc + pair * parts * group * hd, part_stats + pair * parts * group * 2, parts, group,
                            hd, qs);
                int64_t b = pair / kv_heads, g = pair % kv_heads;
                write_heads(out, q_dtype, qs, (b * n_heads + g * group) * hd, group, hd, order);
            }
        }
        free(live);
        free(qs);
        free(codes);
        free(code_scales);
    }
    free(part_acc);
    free(part_stats);
    return failed ? -1 : 0;
}
