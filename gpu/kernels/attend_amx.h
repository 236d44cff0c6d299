/* Decode attention over bf16 pages on AMX tiles, for the builds that have them; included
 * by attend.h, which takes this path for bf16 pools with D % 64 == 0, G <= 16 and pages
 * of a multiple of 16 tokens, where the OS grants the tiles.
 *
 * attend_dp.h's dot products turn each 16 keys' rows around (a 16 x 16 transpose) so
 * that a lane holds a key; at batch 32 that and the dot products cost a decode step of
 * the default model more than its linears. Here neither product moves K:
 *
 *   S^T = K q^T   A: 16 keys of a page as they lie (32 of D a tile), B: q^T as bf16
 *                 pairs (packed once a call; the G heads are its columns), C: 16 keys
 *                 by G columns, each head's read off into its scores row (permutes for
 *                 G <= 4, a gather above: 16 columns and a gather each cost a step of
 *                 32 decodes ~5% of its attention, bench/attention.py)
 *   O   = P V     A: P, each head's probabilities rounded to bf16 (its rows; the tiles
 *                 are configured G rows high), B: two keys' rows interleaved as pairs
 *                 (the d order that leaves is undone at the end, as attend_dp.h does),
 *                 C: 4 tiles of 16 d that stay in the tiles over the whole context
 *
 * The softmax between them stays fp32 in attend.h, over the whole context as before, so
 * P V needs no rescaling and sums in the tiles; its exp is exp_sum_bf16's, exact to
 * bf16's precision, as P rounds to bf16 next. The roundings are attend_dp.h's: q and P
 * to bf16, products exact, sums fp32.
 */
#ifndef ACTORLM_ATTEND_AMX_H
#define ACTORLM_ATTEND_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "amx_state.h"
#include "simd.h"

/* P's rows (bf16, each padded with zeros to a multiple of 32 keys): a buffer per thread
   that grows as needed and is kept */
static __thread void *att_amx_p;
static __thread size_t att_amx_p_bytes;

/* Tiles 0-3: O (G rows), 4: P (G rows), 5: q^T (G columns), 6: 16 keys or V's pairs,
   7: S^T (16 keys by G columns). */
static void att_amx_configure(int64_t G) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = t < 5 ? (uint8_t)G : 16;
    c.colsb[5] = c.colsb[7] = (uint16_t)(4 * G);
    amx_load_config(&c);
}

/* Whether this call can take the tiles (and, when it can, their configuration loaded). */
static inline int att_amx_ready(int64_t len, int64_t G, int64_t D, int64_t page_size) {
    if (D % 64 || D > 256 || G > 16 || page_size % 16 || !amx_ready()) return 0;
    const size_t bytes = (size_t)(G * ((len + 31) / 32 * 32)) * 2;
    if (grow_buffer(&att_amx_p, &att_amx_p_bytes, bytes) == NULL) return 0;
    att_amx_configure(G);
    return 1;
}

/* Lane i of head g's column of S^T (st: [16 keys][G], rows of G floats): st[i * G + g]
   (rows: i * G in lane i), by permutes of the rows where G <= 4 (a gather of 16 cost as
   much as the block's products), gathered above */
static inline __m512 att_amx_column(const float *st, __m512i rows, int64_t G, int64_t g) {
    if (G == 1) return _mm512_loadu_ps(st);
    const __m512i idx = _mm512_add_epi32(rows, _mm512_set1_epi32((int)g));
    if (G > 4) return _mm512_i32gather_ps(idx, st, 4);
    const __m512 lo = _mm512_permutex2var_ps(_mm512_loadu_ps(st), idx, _mm512_loadu_ps(st + 16));
    if (G == 2) return lo;
    const __mmask16 high = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(32));
    const __m512i idx_hi = _mm512_sub_epi32(idx, _mm512_set1_epi32(32));
    const __m512 hi = G == 3 ? _mm512_permutexvar_ps(idx_hi, _mm512_loadu_ps(st + 32))
                             : _mm512_permutex2var_ps(_mm512_loadu_ps(st + 32), idx_hi, _mm512_loadu_ps(st + 48));
    return _mm512_mask_mov_ps(lo, high, hi);
}

/* scores[g * len + t] = scale * q_g . k_t for the `len` keys of `table` (v: only fetched
   ahead, for att_amx_values) */
static void att_amx_scores(const float *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *table, int64_t len,
                           int64_t G, int64_t D, int64_t page_size, float scale, float *scores) {
    uint32_t qt[8 * 256] __attribute__((aligned(64))); /* [D / 32][16 pairs][G heads] */
    float st[256] __attribute__((aligned(64)));        /* [16 keys][G heads] */
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < D / 32; c++) {
            uint32_t pairs[16];
            const float *p = q + g * D + c * 32;
            _mm512_storeu_si512((void *)pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
            for (int i = 0; i < 16; i++) qt[(c * 16 + i) * G + g] = pairs[i];
        }
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)G));
    const int64_t page_bytes = page_size * D * 2;
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const uint16_t *kp = k + (table[t0 / page_size] * page_size + t0 % page_size) * D;
        if (t0 % page_size == 0) { /* K two pages ahead, and this page's V for P V */
            const char *vp = (const char *)(v + table[t0 / page_size] * page_size * D);
            for (int64_t i = 0; i < page_bytes; i += 64) __builtin_prefetch(vp + i, 0, 1);
            if (t0 + 2 * page_size < len) {
                const char *next = (const char *)(k + table[t0 / page_size + 2] * page_size * D);
                for (int64_t i = 0; i < page_bytes; i += 64) __builtin_prefetch(next + i, 0, 2);
            }
        }
        _tile_zero(7);
        for (int64_t c = 0; c < D / 32; c++) {
            AMX_LOADD(6, kp + c * 32, D * 2);
            AMX_LOADD(5, qt + c * 16 * G, 4 * G);
            _tile_dpbf16ps(7, 6, 5);
        }
        _tile_stored(7, st, 4 * G);
        const int64_t n = len - t0 < 16 ? len - t0 : 16; /* rows past len: not stored */
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        for (int64_t g = 0; g < G; g++)
            _mm512_mask_storeu_ps(scores + g * len + t0, m, _mm512_mul_ps(att_amx_column(st, rows, G, g), sv));
    }
}

/* acc[g * D + d] = sum_t p[g * len + t] v_t[d] (p the unnormalised probabilities) */
static void att_amx_values(const float *p, const uint16_t *v, const int64_t *table, int64_t len,
                           int64_t G, int64_t D, int64_t page_size, float *acc) {
    const int64_t lp = (len + 31) / 32 * 32;
    uint16_t *pb = (uint16_t *)att_amx_p;
    for (int64_t g = 0; g < G; g++)
        for (int64_t t = 0; t < lp; t += 16) { /* zeros past len */
            const int64_t n = len - t < 0 ? 0 : len - t < 16 ? len - t : 16;
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            _mm256_storeu_si256((__m256i *)(pb + g * lp + t),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + g * len + t)));
        }
    __m512i vb[4][16]; /* B tiles: [lo/hi of two 32-d chunks][16 key pairs] */
    float ob[16 * 64] __attribute__((aligned(64)));
    for (int64_t e0 = 0; e0 < D; e0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j0 = 0; j0 < lp; j0 += 32) {
            for (int64_t i = 0; i < 16; i++) { /* keys j0 + 2i and j0 + 2i + 1 (one page) */
                const int64_t t = j0 + 2 * i;
                const uint16_t *r0 = t < len ? v + (table[t / page_size] * page_size + t % page_size) * D + e0 : NULL;
                for (int c = 0; c < 2; c++) {
                    const __m512i x0 = r0 ? _mm512_loadu_si512((const void *)(r0 + c * 32)) : _mm512_setzero_si512();
                    const __m512i x1 = t + 1 < len ? _mm512_loadu_si512((const void *)(r0 + D + c * 32)) : _mm512_setzero_si512();
                    vb[2 * c][i] = _mm512_unpacklo_epi16(x0, x1);
                    vb[2 * c + 1][i] = _mm512_unpackhi_epi16(x0, x1);
                }
            }
            AMX_LOADD(4, pb + j0, lp * 2);
            AMX_LOADD(6, vb[0], 64);
            _tile_dpbf16ps(0, 4, 6);
            AMX_LOADD(6, vb[1], 64);
            _tile_dpbf16ps(1, 4, 6);
            AMX_LOADD(6, vb[2], 64);
            _tile_dpbf16ps(2, 4, 6);
            AMX_LOADD(6, vb[3], 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, ob, 256);
        _tile_stored(1, ob + 16, 256);
        _tile_stored(2, ob + 32, 256);
        _tile_stored(3, ob + 48, 256);
        /* tile 2c + h, lane 4L + e: d = e0 + 32c + 8L + 4h + e */
        for (int64_t g = 0; g < G; g++)
            for (int s = 0; s < 4; s++)
                for (int L = 0; L < 4; L++)
                    for (int e = 0; e < 4; e++)
                        acc[g * D + e0 + 32 * (s / 2) + 8 * L + 4 * (s % 2) + e] = ob[g * 64 + s * 16 + 4 * L + e];
    }
}

#endif
