/* int8 x int8 products over weights packed in VNNI order (AVX512-VNNI without AMX: Zen 4, Ice Lake, Cascade Lake).
 *
 * A row-major weight row meets an activation row in one vector of 16 partial sums, which a horizontal sum reduces at
 * the end of each tile: at a decode step's widths (640 for Gemma 3 270M's head) those sums cost a quarter of the
 * product. Packed, a 64-byte vector holds 16 weight rows' 4 consecutive codes (rl_vnni_pack), so vpdpbusd of an
 * activation row's 4 codes (broadcast) against it adds into 16 outputs at once, and the sums are the outputs: no
 * reduction. Zen 4 core, 1 thread, ms, row-major (gemv.c's vnni_rows) against packed: the 262,144 x 640 head at 1 /
 * 8 / 32 / 128 rows 11.7 / 18.8 / 50.9 / 198 against 10.8 / 14.7 / 36.6 / 132 (8.6 and 32.3 at 1 and 32 rows with
 * the fetch into L2); 2048 x 640 at 32 rows 0.46 against 0.22, 640 x 2048 0.24 against 0.20.
 *
 * VNNI multiplies unsigned by signed bytes, so the activations come offset by 128 (gemv.c's au) and 128 times each
 * weight row's sum, kept beside the packed codes, is taken back off: the same integers as torch._int_mm. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vectors.h"

/* Weight rows a packed group holds (a vector's int32 lanes) and the input codes each holds of a row. */
#define GROUP 16
#define QUAD 4

/* w [n, k] (rows ldw apart, k a multiple of QUAD) into p: per group of GROUP rows (the last zero-padded), per QUAD
 * columns, the GROUP rows' QUAD codes, so a group is k x GROUP contiguous bytes; and offset [n] = 128 x each row's
 * sum of codes. p may be w itself where ldw is k (packed in place, a group at a time). Returns 0, or -1 when a group's
 * staging buffer could not be allocated. */
int rl_vnni_pack(const int8_t *w, int64_t ldw, int64_t n, int64_t k, int8_t *p, int32_t *offset) {
    int8_t *rows = malloc((size_t)(GROUP * k));
    if (rows == NULL) return -1;
    for (int64_t g = 0; g * GROUP < n; g++) {
        int64_t real = n - g * GROUP < GROUP ? n - g * GROUP : GROUP;
        memset(rows, 0, (size_t)(GROUP * k));
        for (int64_t l = 0; l < real; l++) {
            const int8_t *row = w + (g * GROUP + l) * ldw;
            int32_t sum = 0;
            for (int64_t j = 0; j < k; j++) sum += row[j];
            offset[g * GROUP + l] = 128 * sum;
            memcpy(rows + l * k, row, (size_t)k);
        }
        int8_t *out = p + g * GROUP * k;
        for (int64_t q = 0; q < k / QUAD; q++)
            for (int l = 0; l < GROUP; l++) memcpy(out + (q * GROUP + l) * QUAD, rows + l * k + q * QUAD, QUAD);
    }
    free(rows);
    return 0;
}

/* The codes of rows ids[0..count) of a packed matrix (k wide) back in row order, into out [count, k]. */
void rl_vnni_rows(const int8_t *p, int64_t k, const int64_t *ids, int64_t count, int8_t *out) {
    for (int64_t i = 0; i < count; i++) {
        const int8_t *group = p + ids[i] / GROUP * GROUP * k;
        int64_t l = ids[i] % GROUP;
        for (int64_t q = 0; q < k / QUAD; q++) memcpy(out + i * k + q * QUAD, group + (q * GROUP + l) * QUAD, QUAD);
    }
}

/* The bytes of this CPU's largest cache of level 3 or more, as Linux tells them (sysconf's answer was ten times a
 * Zen 4 VM's 32 MB L3); 32 MB where it does not. An fp32 output of half of it or more (a batch's logits) is stored past
 * the caches (stream): beside the weights and the KV cache passing through, it does not stay in them until it is
 * read, and a plain store reads each line from memory before it writes it (Zen 4, 1 thread, the 262,144 x 640 head's
 * logits at 32 rows, 32 MiB: 33.6 -> 28.5 ms; a batch-32 decode step 79.4 -> 75.3 ms, 46.8 -> 44.5 at 2 threads; at
 * 16 rows, 16 MiB, the step unchanged, 38.5 -> 38.6). */
static int64_t largest_cache = 32 << 20;
/* One number from /sys/devices/system/cpu/cpu0/cache/index<i>/<name>, or 0. */
static long cache_fact(int i, const char *name) {
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", i, name);
    FILE *f = fopen(path, "r");
    long value = 0;
    if (f != NULL && fscanf(f, "%ld", &value) != 1) value = 0;
    if (f != NULL) fclose(f);
    return value;
}
/* largest_cache from /sys (a VM that tells of its L1 and L2 alone keeps the 32 MB). */
static void __attribute__((constructor)) find_largest_cache(void) {
    int64_t most = 0;
    for (int i = 0; i < 8; i++) {
        int64_t bytes = (int64_t)cache_fact(i, "size") * 1024; /* "32768K": the number is in KB */
        if (cache_fact(i, "level") >= 3 && bytes > most) most = bytes;
    }
    if (most > 0) largest_cache = most;
}

/* Sets the output bytes past which fp32 products are streamed to `bytes` (where >= 0; the tests stream small ones);
 * returns the bound before. */
int64_t rl_vnni_stream_bytes(int64_t bytes) {
    int64_t before = largest_cache;
    if (bytes >= 0) largest_cache = bytes;
    return before;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Activation rows a tile takes at once and the groups it meets them with: 24 running sums, 3 weight vectors and a
 * broadcast of the 32 registers. Zen 4, 1 thread, 32 rows, ms: the head 32.3 against 32.6 for 6 x 4, 34.4 for 5 x 5,
 * 35.6 for 4 x 6; 1536 x 640 0.162 against 0.181 (6 x 4), 2048 x 640 0.214 against 0.205. */
#define ROWS 8
#define GROUPS 3
/* The first tiles of a block, at most, that share the fetch of the next block's weights (rl_vnni_block): spread over
 * 4 of a 32-row block's tiles the fetch ended as the block did, and the next block's first loads waited for its last
 * lines (Zen 4, 1 thread, the head at 16 / 32 rows: 16.9 / 32.4 ms with 4, 15.2 / 30.6 with 2). */
#define FETCHING_TILES 2

/* The sums of rows i0..i0+mi of au (k wide) against the groups gp (ng of them real: a short block repeats its last),
 * their offsets taken off, stored to c [m, n] at column col0 (int32, or with scale fp32 as gemv.c's store_sum
 * computes it, streamed past the caches where `stream` and a whole group's 64 bytes are aligned; where bf16 is not
 * NULL, those values rounded to bf16 into bf16 [m, n] instead); ahead: how far past each group's bytes to fetch
 * meanwhile (the next block's), or 0: every `every` steps (a constant at each call) one line of each group, from
 * line `from` on. */
static inline __attribute__((always_inline)) void packed_tile(const uint8_t *au, int64_t k, int64_t i0, int mi,
                                                              const int8_t *const *gp, int ng, int64_t ahead,
                                                              int64_t from, int every, int stream,
                                                              const int32_t *offset, void *c, int64_t n, int64_t col0,
                                                              const float *scale, const float *row_scale,
                                                              uint16_t *bf16) {
    __m512i acc[ROWS][GROUPS];
    for (int i = 0; i < ROWS; i++)
        for (int r = 0; r < GROUPS; r++) acc[i][r] = _mm512_setzero_si512();
    const uint8_t *a0 = au + i0 * k;
    /* `every` steps (k / QUAD is a multiple of 16) after each fetch, not a test of q at every step: the test cost 3-7 %
     * of products bound by their multiplies (Zen 4, 1 thread: 2048 x 2048 at 512 rows 11.1 -> 10.3 ms, 4096 x 640 at
     * 32 rows 0.43 -> 0.41) */
    for (int64_t q0 = 0; q0 < k / QUAD; q0 += every) {
        if (ahead)
            for (int r = 0; r < GROUPS; r++) _mm_prefetch((const char *)(gp[r] + ahead + (from + q0 / every) * 64), _MM_HINT_T1);
        for (int64_t q = q0; q < q0 + every; q++) {
            __m512i wv[GROUPS];
            for (int r = 0; r < GROUPS; r++) wv[r] = _mm512_loadu_si512(gp[r] + q * 64);
            for (int i = 0; i < ROWS; i++) {
                if (i < mi) {
                    int32_t codes;
                    memcpy(&codes, a0 + i * k + q * QUAD, sizeof codes);
                    __m512i av = _mm512_set1_epi32(codes);
                    for (int r = 0; r < GROUPS; r++) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], av, wv[r]);
                }
            }
        }
    }
    for (int r = 0; r < ng; r++) {
        int64_t col = col0 + GROUP * r;
        __mmask16 real = n - col >= GROUP ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col)) - 1);
        __m512i off = _mm512_maskz_loadu_epi32(real, offset + col);
        __m512 by_col = scale == NULL ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(real, scale + col);
        for (int i = 0; i < mi; i++) {
            __m512i sums = _mm512_sub_epi32(acc[i][r], off);
            int64_t at = (i0 + i) * n + col;
            if (scale == NULL) {
                _mm512_mask_storeu_epi32((int32_t *)c + at, real, sums);
                continue;
            }
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), by_col), _mm512_set1_ps(row_scale[i0 + i]));
            if (bf16 != NULL) { /* rounded as torch rounds (vbf16_upper; not vcvtneps2bf16, which flushes subnormals) */
                _mm512_mask_cvtepi32_storeu_epi16(bf16 + at, real, vshr32(vbf16_upper(v), 16));
                continue;
            }
            if (stream && real == 0xFFFF && ((uintptr_t)((float *)c + at) & 63) == 0)
                _mm512_stream_ps((float *)c + at, v);
            else
                _mm512_mask_storeu_ps((float *)c + at, real, v);
        }
    }
}

/* Blocks of GROUPS groups a packed product of n outputs has (the unit rl_vnni_block takes). */
int64_t rl_vnni_blocks(int64_t n) { return ((n + GROUP - 1) / GROUP + GROUPS - 1) / GROUPS; }

/* Block b of c [m, n] = a @ w^T over the packed codes p (rl_vnni_pack, k wide) of n rows with their offsets, from au
 * (the activation codes + 128, [m, k]): every row against the block's GROUPS groups, each block's weights fetched
 * into L2 while its rows meet the one before (Zen 4, 1 thread, the head at 1 / 32 rows: 8.6 / 32.3 ms; into L1,
 * 10.0 / 36.7, where the two blocks and a batch's activation codes do not fit; 4 KB ahead in each group at 1 row
 * 12.7). The fetches are spread over the block's first tiles (up to FETCHING_TILES) at an even pace, not issued
 * during its first tile alone: a burst of them queued behind the memory and stalled that tile's loads while the later
 * tiles fetched nothing (Emerald Rapids VM, 1 thread, the head at 16 / 24 / 32 rows: 16.6 / 21.0 / 25.5 -> 14.0 /
 * 18.4 / 20.2 ms, 4 tiles fetching at 32 rows; 2 threads, 16 / 32 rows: 9.1 / 20.0 -> 7.9 / 16.2; 1 row and
 * prefill shapes unchanged; FETCHING_TILES went to 2 later, on a Zen 4, not measured again on that Xeon). Spread
 * over all of a prefill's hundreds of rows, with a count in each tile's loop, they cost 5-8 % of a product bound by
 * its multiplies (2048 x 2048 x 5120); the pace a constant at each call (packed_tile's loop), they cost nothing
 * measured. scale NULL: the int32 sums, else fp32 as gemv.c's store_sum computes them; bf16 non-NULL (with scale):
 * those rounded to bf16 into bf16 [m, n] instead, c untouched. */
void rl_vnni_block(const uint8_t *au, int64_t m, int64_t k, const int8_t *p, int64_t n, const int32_t *offset,
                   int64_t b, void *c, const float *scale, const float *row_scale, uint16_t *bf16) {
    int64_t groups = (n + GROUP - 1) / GROUP, g0 = b * GROUPS, gstride = k * GROUP;
    int ng = groups - g0 < GROUPS ? (int)(groups - g0) : GROUPS;
    const int8_t *gp[GROUPS];
    for (int r = 0; r < GROUPS; r++) gp[r] = p + (g0 + (r < ng ? r : ng - 1)) * gstride;
    int64_t ahead = g0 + 2 * GROUPS <= groups ? GROUPS * gstride : 0; /* the next block, where it is whole */
    /* a group's 64-byte lines (k / QUAD, a multiple of 16: k is of 64) shared by the first 1 or FETCHING_TILES tiles,
     * each fetching its share at an even pace */
    int64_t lines = k / QUAD, tiles = (m + ROWS - 1) / ROWS;
    int stream = scale != NULL && bf16 == NULL && 2 * m * n * (int64_t)sizeof(float) >= largest_cache;
    for (int64_t i0 = 0, t = 0; i0 < m; i0 += ROWS, t++) {
        int mi = m - i0 < ROWS ? (int)(m - i0) : ROWS;
        /* ng and the fetch's pace constants at each call: the inlined tile compiled once for each */
        if (ng == GROUPS && tiles == 1)
            packed_tile(au, k, i0, mi, gp, GROUPS, ahead, 0, 1, stream, offset, c, n, g0 * GROUP, scale, row_scale, bf16);
        else if (ng == GROUPS && t < FETCHING_TILES)
            packed_tile(au, k, i0, mi, gp, GROUPS, ahead, t * lines / FETCHING_TILES, FETCHING_TILES, stream, offset, c, n,
                        g0 * GROUP, scale, row_scale, bf16);
        else /* the tiles after them, and a short last block: nothing to fetch */
            packed_tile(au, k, i0, mi, gp, ng, 0, 0, 1, stream, offset, c, n, g0 * GROUP, scale, row_scale, bf16);
    }
    if (stream) _mm_sfence(); /* the streamed stores ordered before whatever reads the output next */
}
#endif
