/* Decode attention over bf16 pages with AVX512-BF16's dot products (vdpbf16ps: each
 * fp32 lane adds two bf16 products), for the builds that have them; included by
 * attend.h, which takes this path for bf16 pools with D % 32 == 0 and G <= 16.
 *
 * Scores: 16 keys of a page at a time. Their rows are read as bf16 pairs and turned
 * (a 16 x 16 transpose of 32-bit pairs) so lane j holds key j; each query head then
 * meets them with its own pairs broadcast, 16 keys' sums of products a dot product:
 * no widening of K and no reduction across lanes. q rounds to bf16 once (a bf16
 * model's q is bf16 already; the fused step's fp32 q rounds here, as torch's bf16
 * attention rounds it).
 *
 * Values: two keys' rows interleaved as bf16 pairs (the d order that leaves is undone
 * once at the end), against each head's two probabilities rounded to bf16, as torch's
 * bf16 attention rounds its probabilities before multiplying by V. The softmax itself
 * (max, exp, sum) stays fp32 in attend.h.
 */
#ifndef ACTORLM_ATTEND_DP_H
#define ACTORLM_ATTEND_DP_H
#include <immintrin.h>
#include <stdint.h>

#define ATT_DP_MAX_G 16

/* scores[g * len + t] = scale * q_g . k_t for the `len` keys of `table` */
static void att_dp_scores(const float *q, const uint16_t *k, const uint16_t *v,
                          const int64_t *table, int64_t len, int64_t G, int64_t D,
                          int64_t page_size, float scale, float *scores) {
    const int64_t nc = D / 32, half = D / 2;
    uint32_t qp[ATT_DP_MAX_G * 128];
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nc; c++) {
            const float *p = q + g * D + c * 32;
            _mm512_storeu_si512((void *)(qp + g * half + c * 16),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
        }
    const int64_t page_elems = page_size * D;
    if (page_size < len) { /* the second page (the loop fetches two ahead) */
        const char *second = (const char *)(k + table[1] * page_elems);
        for (int64_t i = 0; i < page_elems * 2; i += 64) __builtin_prefetch(second + i, 0, 2);
    }
    for (int64_t t0 = 0; t0 < len; t0 += page_size) {
        const uint16_t *kp = k + table[t0 / page_size] * page_elems;
        const int64_t in_page = len - t0 < page_size ? len - t0 : page_size;
        { /* K two pages ahead, beyond the prefetcher's reach, and this page's V for the
             values' pass after the softmax */
            const char *vp = (const char *)(v + table[t0 / page_size] * page_elems);
            for (int64_t i = 0; i < page_elems * 2; i += 64) __builtin_prefetch(vp + i, 0, 1);
            if (t0 + 2 * page_size < len) {
                const char *next = (const char *)(k + table[t0 / page_size + 2] * page_elems);
                for (int64_t i = 0; i < page_elems * 2; i += 64) __builtin_prefetch(next + i, 0, 2);
            }
        }
        for (int64_t i0 = 0; i0 < in_page; i0 += 16) {
            const int64_t n = in_page - i0 < 16 ? in_page - i0 : 16;
            __m512 s[ATT_DP_MAX_G];
            for (int64_t g = 0; g < G; g++) s[g] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nc; c++) {
                __m512i r[16];
#pragma GCC unroll 16
                for (int j = 0; j < 16; j++)
                    r[j] = j < n ? _mm512_loadu_si512((const void *)(kp + (i0 + j) * D + c * 32))
                                 : _mm512_setzero_si512();
                tr16_dwords(r);
                for (int64_t g = 0; g < G; g++) {
                    /* four chains of dependent dot products, not one of 16 */
                    const uint32_t *qg = qp + g * half + c * 16;
                    __m512 a[4] = {s[g], _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
                    for (int p = 0; p < 16; p++)
                        a[p % 4] = _mm512_dpbf16_ps(a[p % 4], (__m512bh)r[p],
                                                    (__m512bh)_mm512_set1_epi32((int)qg[p]));
                    s[g] = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
                }
            }
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            for (int64_t g = 0; g < G; g++)
                _mm512_mask_storeu_ps(scores + g * len + t0 + i0, m, _mm512_mul_ps(s[g], _mm512_set1_ps(scale)));
        }
    }
}

/* One head's 16 keys (n of them real) into its accumulators a[2 * NC], which stay in
   registers for the page: 2 * NC independent chains of at most 8 dot products. */
static inline __attribute__((always_inline)) void att_dp_weigh(__m512 *ag, const __m512i *vp,
                                                               const uint32_t *pp, int64_t pairs,
                                                               const int NC) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int j = 0; j < 2 * NC; j++) a[j] = ag[j];
    for (int64_t i = 0; i < pairs; i++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[i]);
#pragma GCC unroll 16
        for (int j = 0; j < 2 * NC; j++) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)vp[i * 2 * NC + j], w);
    }
#pragma GCC unroll 16
    for (int j = 0; j < 2 * NC; j++) ag[j] = a[j];
}

/* acc[g * D + d] = sum_t p[g * len + t] v_t[d] (p the unnormalised probabilities) */
static void att_dp_values(const float *p, const uint16_t *v, const int64_t *table, int64_t len,
                          int64_t G, int64_t D, int64_t page_size, float *acc) {
    const int64_t nc = D / 32;
    /* per head, per 32 d: the lanes of (lo, hi) after interleaving two rows */
    __m512 a[ATT_DP_MAX_G * 16];
    for (int64_t i = 0; i < G * 2 * nc; i++) a[i] = _mm512_setzero_ps();
    const int64_t page_elems = page_size * D;
    __m512i vp[8 * 16]; /* 8 pairs of keys, 2 * nc vectors each */
    for (int64_t t0 = 0; t0 < len; t0 += page_size) {
        const uint16_t *pg = v + table[t0 / page_size] * page_elems;
        const int64_t in_page = len - t0 < page_size ? len - t0 : page_size;
        for (int64_t i0 = 0; i0 < in_page; i0 += 16) {
            const int64_t n = in_page - i0 < 16 ? in_page - i0 : 16, pairs = (n + 1) / 2;
            for (int64_t i = 0; i < pairs; i++) {
                const int64_t j0 = 2 * i, j1 = 2 * i + 1;
                for (int64_t c = 0; c < nc; c++) {
                    const __m512i x0 = _mm512_loadu_si512((const void *)(pg + (i0 + j0) * D + c * 32));
                    const __m512i x1 = j1 < n ? _mm512_loadu_si512((const void *)(pg + (i0 + j1) * D + c * 32))
                                              : _mm512_setzero_si512();
                    vp[i * 2 * nc + 2 * c] = _mm512_unpacklo_epi16(x0, x1);
                    vp[i * 2 * nc + 2 * c + 1] = _mm512_unpackhi_epi16(x0, x1);
                }
            }
            const __mmask16 m = (__mmask16)((1u << n) - 1);
            for (int64_t g = 0; g < G; g++) {
                /* 16 probabilities as 8 bf16 pairs (keys past n weigh 0) */
                const __m256bh pb = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + g * len + t0 + i0));
                uint32_t pp[8];
                _mm256_storeu_si256((__m256i *)pp, (__m256i)pb);
                __m512 *ag = a + g * 2 * nc;
                switch (nc) {
                    case 1: att_dp_weigh(ag, vp, pp, pairs, 1); break;
                    case 2: att_dp_weigh(ag, vp, pp, pairs, 2); break;
                    case 3: att_dp_weigh(ag, vp, pp, pairs, 3); break;
                    case 4: att_dp_weigh(ag, vp, pp, pairs, 4); break;
                    case 5: att_dp_weigh(ag, vp, pp, pairs, 5); break;
                    case 6: att_dp_weigh(ag, vp, pp, pairs, 6); break;
                    case 7: att_dp_weigh(ag, vp, pp, pairs, 7); break;
                    default: att_dp_weigh(ag, vp, pp, pairs, 8); break;
                }
            }
        }
    }
    /* lane 4L + e of lo holds d = 32c + 8L + e, of hi d = 32c + 8L + 4 + e */
    for (int64_t g = 0; g < G; g++)
        for (int64_t c = 0; c < nc; c++) {
            float lo[16], hi[16];
            _mm512_storeu_ps(lo, a[g * 2 * nc + 2 * c]);
            _mm512_storeu_ps(hi, a[g * 2 * nc + 2 * c + 1]);
            float *o = acc + g * D + c * 32;
            for (int L = 0; L < 4; L++)
                for (int e = 0; e < 4; e++) o[8 * L + e] = lo[4 * L + e], o[8 * L + 4 + e] = hi[4 * L + e];
        }
}

#endif
