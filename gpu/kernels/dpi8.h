/* Block weights (gemv.h's Q4_1 and Q8_0 layout) against rows of x quantized to int8,
 * with AVX512-VNNI's dot product (vpdpbusd: 16 lanes, each adding four products of an
 * unsigned and a signed byte to an int32 sum: 64 products an instruction, twice
 * vdpbf16ps's 32, at the same rate on a Zen 4 core: 3.66 G a second each). Included by
 * gemv.h in the builds with AVX512-VNNI and VBMI, for linears that opt in with lin_t's
 * `act_int8` (the `gguf_a8` linear method), at every row count.
 *
 * x is quantized as llama.cpp's CPU path quantizes it (Q8_0 activations): each row's
 * 32-wide block k0..k0+31 by its own scale, dx = max|x| / 127, q = round(x * (1 / dx)) in
 * -127..127 (nearest even). A block's product is then exact in integers:
 *
 *   y[r, n] += d[n] * dx[r] * sum_k q[k, n] qx[r, k]  (+ m[n] * dx[r] * sum_k qx[r, k], Q4_1)
 *
 * so the only rounding beyond fp32's is x's to int8 (at most dx / 2 an element, where
 * bf16's is 1/512 of the element itself: coarser for a block's small elements).
 *
 * Q4_1's codes (0..15) are the unsigned side: four 16-byte rows of codes (8 k of 16
 * columns) split into nibbles and interleave with one vpermi2b each into two vectors
 * whose lane n holds column n's 4 codes, met by x's 4 bytes broadcast. Q8_0's codes
 * (-127..127) are the signed side, so x rides as qx + 128 (unsigned) and each block
 * sum loses 128 * sum_k q[k, n], counted once a block for all rows (vpdpbusd of the
 * codes with ones). Up to I8_ROWS rows of x a pass meet the codes while they are in
 * registers; the group's codes stay in L1 for the next pass.
 */
#ifndef ACTORLM_DPI8_H
#define ACTORLM_DPI8_H
#include <immintrin.h>
#include <stdint.h>
#include "simd.h"

#define I8_ROWS 8 /* rows of x a pass: 2 accumulators a row (int32 and fp32) and spares */

/* 16 values of x from element i on, as fp32: x fp32, or bf16 widened */
static inline __m512 i8_load16(const void *x, int64_t i, const int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + i);
}

/* Row r's blocks quantized: qx [M][K] (signed, or + 128 unsigned when `u8`), their
   scales dx [M][K/32] and dx * sum_k qx (sx, the signed sums). x is fp32, or bf16 where
   `bf16`; xs its row stride in elements. */
static void i8_quantize_rows(const void *x, const int bf16, int64_t M, int64_t xs, int64_t K,
                             int8_t *qx, float *dx, float *sx, const int u8) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i = r * xs + b * QK;
            const __m512 v0 = i8_load16(x, i, bf16), v1 = i8_load16(x, i + 16, bf16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
            __m128i b0 = _mm512_cvtsepi32_epi8(q0), b1 = _mm512_cvtsepi32_epi8(q1);
            if (u8) {
                b0 = _mm_xor_si128(b0, _mm_set1_epi8((char)0x80));
                b1 = _mm_xor_si128(b1, _mm_set1_epi8((char)0x80));
            }
            _mm_storeu_si128((__m128i *)(qx + r * K + b * QK), b0);
            _mm_storeu_si128((__m128i *)(qx + r * K + b * QK + 16), b1);
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

/* M rows of x quantized as L's int8 passes read them */
static inline void i8_quantize(const lin_t *L, const void *x, const int bf16, int64_t M,
                               int64_t xs, int8_t *qx, float *dx, float *sx) {
    i8_quantize_rows(x, bf16, M, xs, L->k, qx, dx, sx, L->kind != LIN_Q4_1);
}

/* x's 4 bytes at p, in every lane */
static inline __m512i i8_x4(const int8_t *p) { return _mm512_set1_epi32(*(const int32_t *)p); }

/* Rows [0, R) of x against group g of a Q4_1 weight, all its blocks: y [R][16 columns]
   written (w of them). One row gets 4 int32 accumulators a block, 2-3 rows 2. */
static inline __attribute__((always_inline)) void i8_q4_pass(
    const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t nb, int64_t g,
    const int8_t *qx, const float *dx, const float *sx, int64_t K, float *y, int64_t ys,
    int64_t w, const int R) {
    const int AN = R == 1 ? 4 : R <= 3 ? 2 : 1;
    const __m512i low = _mm512_set1_epi8(15);
    /* byte 4n + j of the first vector: code k = j of column n, j even in lo's 16-byte row
       j / 2, odd in hi's (index 64 and up); the second vector: k = 4 + j */
    __m512i idx0, idx1;
    {
        uint8_t i0[64], i1[64];
        for (int n = 0; n < 16; n++)
            for (int j = 0; j < 4; j++) {
                i0[4 * n + j] = (uint8_t)((j & 1) * 64 + (j >> 1) * 16 + n);
                i1[4 * n + j] = (uint8_t)(i0[4 * n + j] + 32);
            }
        idx0 = _mm512_loadu_si512(i0), idx1 = _mm512_loadu_si512(i1);
    }
    __m512 a[I8_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        dp_prefetch(1, q, d, mn, blk + nb);
        const uint8_t *qb = q + blk * 16 * GROUP;
        __m512i s[I8_ROWS][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int i = 0; i < AN; i++) s[r][i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) { /* k 8h .. 8h + 7 */
            const __m512i v = _mm512_loadu_si512(qb + 64 * h);
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512i w0 = _mm512_permutex2var_epi8(lo, idx0, hi);
            const __m512i w1 = _mm512_permutex2var_epi8(lo, idx1, hi);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *xr = qx + r * K + b * QK + 8 * h;
                s[r][(2 * h) % AN] = _mm512_dpbusd_epi32(s[r][(2 * h) % AN], w0, i8_x4(xr));
                s[r][(2 * h + 1) % AN] = _mm512_dpbusd_epi32(s[r][(2 * h + 1) % AN], w1, i8_x4(xr + 4));
            }
        }
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + blk * GROUP)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512i t = s[r][0];
#pragma GCC unroll 4
            for (int i = 1; i < AN; i++) t = _mm512_add_epi32(t, s[r][i]);
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nb + b]));
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, a[r]);
            a[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[r * nb + b]), a[r]);
        }
    }
    const __mmask16 lanes = (__mmask16)((1u << w) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ys, lanes, a[r]);
}

/* The same over a Q8_0 weight, x as qx + 128: each block sum starts at -128 times the
   block's codes' sum, column by column. */
static inline __attribute__((always_inline)) void i8_q8_pass(
    const uint8_t *q, const uint16_t *d, int64_t nb, int64_t g, const int8_t *qx,
    const float *dx, int64_t K, float *y, int64_t ys, int64_t w, const int R) {
    const int AN = R == 1 ? 4 : R <= 3 ? 2 : 1;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i idx; /* byte 4n + j: code k = j of column n, in 16-byte row j */
    {
        uint8_t i0[64];
        for (int n = 0; n < 16; n++)
            for (int j = 0; j < 4; j++) i0[4 * n + j] = (uint8_t)(16 * j + n);
        idx = _mm512_loadu_si512(i0);
    }
    __m512 a[I8_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        dp_prefetch(0, q, d, NULL, blk + nb);
        const uint8_t *qb = q + blk * QK * GROUP;
        __m512i wsum = _mm512_setzero_si512();
        __m512i s[I8_ROWS][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int i = 0; i < AN; i++) s[r][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) { /* k 4c .. 4c + 3 */
            const __m512i wv = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(qb + 64 * c));
            wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                s[r][c % AN] = _mm512_dpbusd_epi32(s[r][c % AN], i8_x4(qx + r * K + b * QK + 4 * c), wv);
        }
        const __m512i base = _mm512_slli_epi32(wsum, 7);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512i t = _mm512_sub_epi32(s[r][0], base);
#pragma GCC unroll 4
            for (int i = 1; i < AN; i++) t = _mm512_add_epi32(t, s[r][i]);
            const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx[r * nb + b]));
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), scale, a[r]);
        }
    }
    const __mmask16 lanes = (__mmask16)((1u << w) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ys, lanes, a[r]);
}

/* Groups [g0, g1) of a block weight, all M rows of x as i8_quantize left them. */
static void i8_blocks_cols_q(const lin_t *L, const int8_t *qx, const float *dx, const float *sx,
                             int64_t M, int64_t g0, int64_t g1, float *y, int64_t ys) {
    const int q4 = L->kind == LIN_Q4_1;
    const uint8_t *q = (const uint8_t *)L->w;
    const int64_t K = L->k, nb = K / QK, N = L->n;
    const int64_t rows = even_part(M, I8_ROWS);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t n0 = g * GROUP, w = N - n0 < GROUP ? N - n0 : GROUP;
        for (int64_t m0 = 0; m0 < M; m0 += rows) {
            const int64_t R = M - m0 < rows ? M - m0 : rows;
            const int8_t *xr = qx + m0 * K;
            const float *dr = dx + m0 * nb, *sr = sx + m0 * nb;
            float *yr = y + m0 * ys + n0;
            if (q4) switch (R) {
#define PASS(k) \
    case k: i8_q4_pass(q, L->d, L->m, nb, g, xr, dr, sr, K, yr, ys, w, k); break;
                    PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
                }
            else switch (R) {
#define PASS(k) \
    case k: i8_q8_pass(q, L->d, nb, g, xr, dr, K, yr, ys, w, k); break;
                    PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
                }
        }
    }
}

#endif
