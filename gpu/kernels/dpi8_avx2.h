/* dpi8.h's int8 rows for the builds without AVX512-VNNI (avx2, avx512): the same
 * quantization of x (per 32 values, scale max|x| / 127, nearest even) and the same
 * exact integer block sums, on AVX2's byte products (vpmaddubsw: an unsigned byte
 * times a signed one, pairs summed to 16 bits; 32 products an instruction against an
 * fp32 FMA's 8). Included by gemv.h.
 *
 * Q4_1's codes (0..15) are the unsigned side: a lane's 4 codes of one column come from
 * two 16-byte rows of nibbles, as bytes k, k + 2, k + 1, k + 3, so x is stored in that
 * order too. Their pair sums (at most 2 * 15 * 127) add up over the block's 8 groups
 * of 4 k in 16 bits (at most 30,480) before one vpmaddwd widens them. Q8_0's codes
 * are signed: their magnitudes are the unsigned side and x takes their signs
 * (vpsignb, llama.cpp's way; pair sums at most 2 * 127 * 127), widened every group.
 * Columns go 8 at a time (half a group), up to I8_ROWS rows of x a pass.
 */
#ifndef ACTORLM_DPI8_AVX2_H
#define ACTORLM_DPI8_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include "simd.h"

#define I8_ROWS 4 /* rows of x a pass: 2 accumulators a row of 16 registers */

/* 8 values of x from element i on, as fp32: x fp32, or bf16 widened */
static inline __m256 i8_load8(const void *x, int64_t i, const int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

/* Row r's blocks quantized: qx [M][K] (each 4 bytes as k, k + 2, k + 1, k + 3 when
   `q4`), their scales dx [M][K/32] and dx * sum_k qx (sx). x is fp32, or bf16 where
   `bf16`; xs its row stride in elements. */
static void i8_quantize_rows(const void *x, const int bf16, int64_t M, int64_t xs, int64_t K,
                             int8_t *qx, float *dx, float *sx, const int q4) {
    const int64_t nb = K / QK;
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lanes */
    const __m256i swap = _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                          0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = r * xs + b * QK;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = i8_load8(x, at + 8 * i, bf16);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h), d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s = _mm_hadd_epi32(s, s);
            s = _mm_hadd_epi32(s, s);
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            bytes = _mm256_permutevar8x32_epi32(bytes, order);
            if (q4) bytes = _mm256_shuffle_epi8(bytes, swap);
            _mm256_storeu_si256((__m256i *)(qx + r * K + b * QK), bytes);
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * (float)_mm_cvtsi128_si32(s);
        }
}

/* M rows of x quantized as L's int8 passes read them */
static inline void i8_quantize(const lin_t *L, const void *x, const int bf16, int64_t M,
                               int64_t xs, int8_t *qx, float *dx, float *sx) {
    i8_quantize_rows(x, bf16, M, xs, L->k, qx, dx, sx, L->kind == LIN_Q4_1);
}

static inline __m256i i8_x4(const int8_t *p) { return _mm256_set1_epi32(*(const int32_t *)p); }

/* Rows [0, R) of x against half h (columns 8h .. 8h + 7) of group g, all its blocks:
   y [R][8 columns] written (w of them). */
static inline __attribute__((always_inline)) void i8_half_pass(
    const int q4, const uint8_t *q, const uint16_t *d, const uint16_t *mn, int64_t nb, int64_t g,
    const int h, const int8_t *qx, const float *dx, const float *sx, int64_t K, float *y,
    int64_t ys, int64_t w, const int R) {
    const __m256i nib = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
    __m256 a[I8_ROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        __m256i s[I8_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        if (q4) {
            const uint8_t *qb = q + blk * 16 * GROUP;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) { /* k 4j .. 4j + 3: pairs 2j and 2j + 1 */
                const __m128i A = _mm_loadu_si128((const __m128i *)(qb + 32 * j));
                const __m128i B = _mm_loadu_si128((const __m128i *)(qb + 32 * j + 16));
                const __m256i v = _mm256_cvtepu16_epi32(h ? _mm_unpackhi_epi8(A, B) : _mm_unpacklo_epi8(A, B));
                const __m256i wv = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), nib);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wv, i8_x4(qx + r * K + b * QK + 4 * j)));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) s[r] = _mm256_madd_epi16(s[r], ones);
        } else {
            const int8_t *qb = (const int8_t *)q + blk * QK * GROUP;
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) { /* k 4j .. 4j + 3, a 16-byte row each */
                const __m128i *row = (const __m128i *)(qb + 4 * j * GROUP);
                const __m128i r0 = _mm_loadu_si128(row), r1 = _mm_loadu_si128(row + 1);
                const __m128i r2 = _mm_loadu_si128(row + 2), r3 = _mm_loadu_si128(row + 3);
                const __m128i t01 = h ? _mm_unpackhi_epi8(r0, r1) : _mm_unpacklo_epi8(r0, r1);
                const __m128i t23 = h ? _mm_unpackhi_epi8(r2, r3) : _mm_unpacklo_epi8(r2, r3);
                const __m256i wv = _mm256_set_m128i(_mm_unpackhi_epi16(t01, t23), _mm_unpacklo_epi16(t01, t23));
                const __m256i mag = _mm256_abs_epi8(wv);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i xv = _mm256_sign_epi8(i8_x4(qx + r * K + b * QK + 4 * j), wv);
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xv), ones));
                }
            }
        }
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + blk * GROUP + 8 * h)));
        const __m256 mv = q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + blk * GROUP + 8 * h)))
                             : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * nb + b]));
            a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), scale, a[r]);
            if (q4) a[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx[r * nb + b]), a[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (w == 8) {
            _mm256_storeu_ps(y + r * ys, a[r]);
        } else {
            float t[8];
            _mm256_storeu_ps(t, a[r]);
            for (int64_t n = 0; n < w; n++) y[r * ys + n] = t[n];
        }
    }
}

/* Groups [g0, g1) of a block weight, all M rows of x as i8_quantize left them. */
static void i8_blocks_cols_q(const lin_t *L, const int8_t *qx, const float *dx, const float *sx,
                             int64_t M, int64_t g0, int64_t g1, float *y, int64_t ys) {
    const int q4 = L->kind == LIN_Q4_1;
    const uint8_t *q = (const uint8_t *)L->w;
    const int64_t K = L->k, nb = K / QK, N = L->n;
    const int64_t rows = even_part(M, I8_ROWS);
    for (int64_t g = g0; g < g1; g++)
        for (int h = 0; h < 2; h++) {
            const int64_t n0 = g * GROUP + 8 * h, w = N - n0 < 8 ? N - n0 : 8;
            if (w <= 0) break;
            for (int64_t m0 = 0; m0 < M; m0 += rows) {
                const int64_t R = M - m0 < rows ? M - m0 : rows;
                const int8_t *xr = qx + m0 * K;
                const float *dr = dx + m0 * nb, *sr = sx + m0 * nb;
                float *yr = y + m0 * ys + n0;
                switch (R * 4 + q4 * 2 + h) {
#define PASS(k, a, b) \
    case k * 4 + a * 2 + b: i8_half_pass(a, q, L->d, L->m, nb, g, b, xr, dr, sr, K, yr, ys, w, k); break;
#define PASSES(k) PASS(k, 0, 0) PASS(k, 0, 1) PASS(k, 1, 0) PASS(k, 1, 1)
                    PASSES(1) PASSES(2) PASSES(3) PASSES(4)
#undef PASSES
#undef PASS
                }
            }
        }
}

#endif
