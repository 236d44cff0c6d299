/* Block weights (gemv.h's Q4_1 and Q8_0 layout) against many rows of bf16 activations
 * with AVX512-BF16's dot product (vdpbf16ps: 16 lanes, each adding two bf16 products
 * to an fp32 sum), for the builds that have it; included by gemv.h.
 *
 * gemv.h's tiles expand each block to fp32 for every 8 rows of x and multiply-add in
 * fp32: at a batch of 32 a block expands four times and every product is an fp32 FMA.
 * Here a block's codes expand once per group of 16 output columns, to bf16 pairs in an
 * L1 buffer, and every row of x (up to 12 a pass, 24 accumulators) meets them at two
 * products an instruction. The codes themselves (0..15, or -127..127) are exact in
 * bf16, so the block's sum over its 32 k is exact in the weights:
 *
 *   y[r, n] += d[n] * sum_k q[k, n] x[r, k]  (+ m[n] * sum_k x[r, k] for Q4_1)
 *
 * with x rounded to bf16 once a call (round to nearest even, as torch's bf16 is). The
 * only rounding beyond fp32's is then x's, which a bf16 model's forward rounds too;
 * a linear opts in with lin_t's `act_bf16` (kernels/step.py sets it in the fused step
 * of a bf16 model), and takes this path for Q4_1 from one row on, for Q8_0 from
 * DP_MIN_ROWS rows.
 *
 * Q4_1 codes expand in registers, 8 rows of x a pass at most, each pass expanding
 * them again (dp_q4_pass): on a 2-core Zen 4 that beat expanding once into an L1
 * buffer and reading it back at every row count measured (1.55x at one row, 1.25x at
 * 8, 1.08x at 32; one 3072x576 linear from memory, one thread), and beats the fp32
 * tiles from one row on. Q8_0 codes take 6 operations to expand: they go through the
 * buffer (dp_expand, shared with amx.h), from DP_MIN_ROWS rows.
 *
 * Scratch (x as bf16, its block sums, Q8_0's rows' accumulators) lives in a buffer per
 * thread that grows as needed and is kept, so a call allocates nothing in steady state.
 */
#ifndef ACTORLM_DPBF16_H
#define ACTORLM_DPBF16_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"

#define DP_MIN_ROWS 5 /* Q8_0: fewer rows keep gemv.h's fp32 tiles (4% faster at 4 rows; a decode step, 2-core Zen 4) */
#define DP_Q4_ROWS 8 /* rows of x a pass over Q4_1 codes expanded in registers */
#define DP_ROWS 12  /* rows of x a pass: 2 accumulators a row in 32 registers */
#define DP_CHUNK 16 /* blocks of a group expanded at a time: 16 KiB, in L1 */

static __thread void *dp_scratch;
static __thread size_t dp_scratch_bytes;

static void *dp_buffer(size_t bytes) { return grow_buffer(&dp_scratch, &dp_scratch_bytes, bytes); }

/* Row r's x (fp32, K a multiple of 32) as bf16 pairs, and for Q4_1 each block's sum of
   the rounded values. */
static void dp_round_rows(const float *x, int64_t M, int64_t xs, int64_t K, uint16_t *xb,
                          float *sx) {
    const __m512bh ones = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.f), _mm512_set1_ps(1.f));
    for (int64_t r = 0; r < M; r++)
        for (int64_t k = 0; k < K; k += QK) {
            const float *p = x + r * xs + k;
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            _mm512_storeu_si512((void *)(xb + r * K + k), (__m512i)v);
            if (sx) /* products by 1 are exact: the sum of the bf16 values, in fp32 */
                sx[r * (K / QK) + k / QK] =
                    _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), v, ones));
        }
}

/* lo and hi rounded to bf16 and interleaved lane by lane: 32-bit lane n holds (lo[n],
   hi[n]), a B tile's row of pairs */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* The bf16 values 0..15, twice: a table for _mm512_permutexvar_epi16 */
static inline __m512i dp_q4_table(void) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    return (__m512i)_mm512_cvtne2ps_pbh(iota, iota);
}

/* A pair of Q4_1 codes of 16 columns (16 bytes: k in the low nibble, k + 1 in the high)
   as bf16 pairs, column n's in 32-bit lane n: the nibbles moved to the low bits of the
   lane's two halves index the table. */
static inline __attribute__((always_inline)) __m512i dp_q4_pair(const uint8_t *p, __m512i table) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    /* bits 0-3 from v, the rest from v << 12 (bits 16-19 the high nibble; the table
       reads the low 5 bits of each half, and bit 4 of both is 0) */
    const __m512i idx =
        _mm512_ternarylogic_epi32(_mm512_set1_epi32(15), v, _mm512_slli_epi32(v, 12), 0xCA);
    return _mm512_permutexvar_epi16(idx, table);
}

/* Blocks [b0, b0 + nbc) of group g as bf16 pairs: for block b and pair p (codes k = 2p
   and 2p + 1 of the 16 columns), one vector whose 32-bit lane n holds column n's two. */
static inline void dp_expand(const int q4, const uint8_t *q, const uint16_t *d,
                             const uint16_t *mn, int64_t nb, int64_t g, int64_t b0, int64_t nbc,
                             __m512i *wb) {
    if (q4) {
        const __m512i table = dp_q4_table();
        for (int64_t b = 0; b < nbc; b++) {
            dp_prefetch(1, q, d, mn, (g + 1) * nb + b0 + b);
            const uint8_t *qb = q + (g * nb + b0 + b) * 16 * GROUP;
            for (int p = 0; p < 16; p++) wb[b * 16 + p] = dp_q4_pair(qb + p * GROUP, table);
        }
    } else {
        /* two rows of 16 codes to fp32, to bf16 (exact), interleaved lane by lane */
        for (int64_t b = 0; b < nbc; b++) {
            dp_prefetch(0, q, d, mn, (g + 1) * nb + b0 + b);
            const int8_t *qb = (const int8_t *)q + (g * nb + b0 + b) * QK * GROUP;
            for (int p = 0; p < 16; p++) {
                const __m512 lo = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 2 * p * GROUP))));
                const __m512 hi = _mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + (2 * p + 1) * GROUP))));
                wb[b * 16 + p] = bf16_pairs(lo, hi);
            }
        }
    }
}

/* Rows [0, R) of a pass over Q8_0 blocks [b0, b0 + nbc) of group g, expanded in wb:
   acc [R][16] fp32 in and out, xb at the pass's first row. */
static inline __attribute__((always_inline)) void dp_pass(const __m512i *wb, const uint16_t *xb,
                                                          int64_t K, const uint16_t *d, int64_t nb,
                                                          int64_t g, int64_t b0, int64_t nbc,
                                                          float *acc, const int R) {
    __m512 a[DP_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) a[r] = _mm512_loadu_ps(acc + r * GROUP);
    for (int64_t b = 0; b < nbc; b++) {
        const int64_t blk = g * nb + b0 + b, k0 = (b0 + b) * QK;
        __m512 s[DP_ROWS];
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) s[r] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int p = 0; p < 16; p++) {
            const __m512bh w = (__m512bh)wb[b * 16 + p];
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) {
                const __m512i xp = _mm512_set1_epi32(*(const int32_t *)(xb + r * K + k0 + 2 * p));
                s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)xp, w);
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(s[r], dv, a[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) _mm512_storeu_ps(acc + r * GROUP, a[r]);
}

/* Rows [0, R) (R <= DP_Q4_ROWS) of x against group g of a Q4_1 weight, all its blocks,
   each pair of codes expanded in registers and met by every row: y [R][16 columns]
   written (w of them). A row gets 4 accumulators a block (2 for 2-3 rows), so at
   least 4 chains of dot products are in flight. */
static inline __attribute__((always_inline)) void dp_q4_pass(
    const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t nb, int64_t g,
    const uint16_t *xb, const float *sx, int64_t K, float *y, int64_t ys, int64_t w, const int R) {
    const int AN = R == 1 ? 4 : R <= 3 ? 2 : 1;
    const __m512i table = dp_q4_table();
    __m512 a[DP_Q4_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        dp_prefetch(1, q, d, mn, blk + nb);
        const uint8_t *qb = q + blk * 16 * GROUP;
        __m512 s[DP_Q4_ROWS][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int i = 0; i < AN; i++) s[r][i] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) {
            const __m512bh wv = (__m512bh)dp_q4_pair(qb + p * GROUP, table);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512i xp = _mm512_set1_epi32(*(const int32_t *)(xb + r * K + b * QK + 2 * p));
                s[r][p % AN] = _mm512_dpbf16_ps(s[r][p % AN], (__m512bh)xp, wv);
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + blk * GROUP)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 t = s[r][0];
#pragma GCC unroll 4
            for (int i = 1; i < AN; i++) t = _mm512_add_ps(t, s[r][i]);
            a[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * nb + b]), _mm512_fmadd_ps(t, dv, a[r]));
        }
    }
    const __mmask16 lanes = (__mmask16)((1u << w) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ys, lanes, a[r]);
}

/* Groups [g0, g1) of a block weight, all M rows of x; 0, or -1 when the scratch could
   not be had (the caller then takes gemv.h's tiles). */
static int dp_blocks_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t g0,
                          int64_t g1, float *y, int64_t ys) {
    const int q4 = L->kind == LIN_Q4_1;
    const uint8_t *q = (const uint8_t *)L->w;
    const uint16_t *d = L->d, *mn = L->m;
    const int64_t K = L->k, nb = K / QK, N = L->n;
    const size_t xb_bytes = ((size_t)(M * K) * 2 + 63) / 64 * 64;
    const size_t sx_bytes = q4 ? ((size_t)(M * nb) * 4 + 63) / 64 * 64 : 0;
    char *buf = dp_buffer(xb_bytes + sx_bytes + (q4 ? 0 : (size_t)M * GROUP * 4));
    if (buf == NULL) return -1;
    uint16_t *xb = (uint16_t *)buf;
    float *sx = q4 ? (float *)(buf + xb_bytes) : NULL, *acc = (float *)(buf + xb_bytes + sx_bytes);
    dp_round_rows(x, M, xs, K, xb, sx);
    if (q4) { /* passes of equal size, at most DP_Q4_ROWS rows: 12 rows as 6 + 6 */
        const int64_t rows = even_part(M, DP_Q4_ROWS);
        for (int64_t g = g0; g < g1; g++) {
            const int64_t n0 = g * GROUP, w = N - n0 < GROUP ? N - n0 : GROUP;
            for (int64_t m0 = 0; m0 < M; m0 += rows) {
                const int64_t R = M - m0 < rows ? M - m0 : rows;
                const uint16_t *xr = xb + m0 * K;
                const float *sr = sx + m0 * nb;
                float *yr = y + m0 * ys + n0;
                switch (R) {
#define PASS(k) \
    case k: dp_q4_pass(q, d, mn, nb, g, xr, sr, K, yr, ys, w, k); break;
                    PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
                }
            }
        }
        return 0;
    }
    /* Q8_0: passes of equal size, at most DP_ROWS rows: 32 rows as 11 + 11 + 10 */
    const int64_t rows = even_part(M, DP_ROWS), per = even_part(nb, DP_CHUNK);
    __m512i wb[DP_CHUNK * 16];
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t i = 0; i < M * GROUP; i++) acc[i] = 0.f;
        for (int64_t b0 = 0; b0 < nb; b0 += per) {
            const int64_t nbc = nb - b0 < per ? nb - b0 : per;
            dp_expand(0, q, d, mn, nb, g, b0, nbc, wb);
            for (int64_t m0 = 0; m0 < M; m0 += rows) {
                const int64_t R = M - m0 < rows ? M - m0 : rows;
                const uint16_t *xr = xb + m0 * K;
                float *ar = acc + m0 * GROUP;
#define PASS(k) \
    case k: dp_pass(wb, xr, K, d, nb, g, b0, nbc, ar, k); break;
                switch (R) {
                    PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6)
                    PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12)
                }
#undef PASS
            }
        }
        const int64_t n0 = g * GROUP, w = N - n0 < GROUP ? N - n0 : GROUP;
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < w; n++) y[r * ys + n0 + n] = acc[r * GROUP + n];
    }
    return 0;
}

#endif
