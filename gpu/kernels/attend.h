/* Decode attention of one (sequence, KV head) over the paged pool, K and V in fp32 or
 * bf16 (widened as read), q and the output fp32: the shape of cpu_decode.c's kernel
 * (scores 8 keys at a time with one transpose-add tree, softmax over the whole
 * context, then the weighted sum of values page by page with the accumulators in
 * registers), for the two KV dtypes (bf16 pages widened once a page when several query
 * heads share them). Used by cpu_step.c (the fused decode step,
 * either dtype) and by its actorlm_paged_decode_kv (the cpu attention backend's
 * decodes over a bf16 pool). The backend's decodes may start inside the first page
 * (a sliding window: the keys before `start` are masked) and soft-cap the scaled
 * scores (Gemma 2: cap * tanh(s / cap)); the fused step passes neither. Builds with
 * AVX512-BF16 take bf16 pages through attend_dp.h's dot products instead, and builds
 * with AMX through attend_amx.h's tiles.
 */
#ifndef ACTORLM_ATTEND_H
#define ACTORLM_ATTEND_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#if defined(__AVX512BF16__)
#include "attend_dp.h"
#endif
#if defined(__AMX_BF16__)
#include "attend_amx.h"
#endif

static inline __attribute__((always_inline)) v8f kv_load8(const int bf16, const void *p,
                                                          int64_t off) {
    if (bf16) return (v8f)(__builtin_convertvector(*(const v8h *)((const uint16_t *)p + off), v8u) << 16);
    return *(const v8f *)((const float *)p + off);
}
static inline __attribute__((always_inline)) float kv_at(const int bf16, const void *p,
                                                         int64_t off) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[off]) : ((const float *)p)[off];
}

/* dst[0..n) = the bf16 values src[0..n) in fp32 (n % 8 == 0) */
static inline void att_widen(float *dst, const uint16_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) *(v8f *)(dst + i) = kv_load8(1, src, i);
}

static inline v8f att_pairs(v8f a, v8f b) { /* [a0+a1, b0+b1, a2+a3, b2+b3, ...] */
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
static inline v8f att_quads(v8f a, v8f b) {
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
/* s[j] = q . k_j for the 8 key rows from element `off` of k (D % 8 == 0) */
static inline __attribute__((always_inline)) v8f att_dot8(const int bf16, const float *q,
                                                          const void *k, int64_t off,
                                                          int64_t D) {
    v8f a[8] = {{0}};
    for (int64_t d = 0; d < D; d += 8) {
        const v8f qv = *(const v8f *)(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] += qv * kv_load8(bf16, k, off + j * D + d);
    }
    const v8f lo = att_quads(att_pairs(a[0], a[1]), att_pairs(a[2], a[3]));
    const v8f hi = att_quads(att_pairs(a[4], a[5]), att_pairs(a[6], a[7]));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}
static inline __attribute__((always_inline)) float att_dot(const int bf16, const float *q,
                                                           const void *k, int64_t off,
                                                           int64_t D) {
    float s = 0.f;
    for (int64_t d = 0; d < D; d++) s += q[d] * kv_at(bf16, k, off + d);
    return s;
}

/* acc[0, 8W) += sum_i s[i] * v[off + i * D .. + 8W) over n rows, in registers */
static inline __attribute__((always_inline)) void att_weigh(const int bf16, float *acc,
                                                            const float *s, const void *v,
                                                            int64_t off, int64_t n, int64_t D,
                                                            const int W) {
    v8f a[8];
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) a[j] = *(const v8f *)(acc + 8 * j);
    for (int64_t i = 0; i < n; i++) {
        const float si = s[i];
#pragma GCC unroll 8
        for (int j = 0; j < W; j++) a[j] += si * kv_load8(bf16, v, off + i * D + 8 * j);
    }
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) *(v8f *)(acc + 8 * j) = a[j];
}

/* q [G, D] against `len` tokens whose pages are `table`; k and v point at this head's
   [num_pages, page_size, D]. Keys before `start` (< page_size) are masked out; `cap` > 0
   soft-caps the scores. scores [G, len] and acc [G, D] are the caller's scratch;
   out [G, D]. With `ml` (not NULL) the result is a part of a longer context, to be merged
   with the other parts (att_merge): out gets the unnormalised sum of exp(s - m) v and
   ml[2g], ml[2g + 1] row g's m (its largest score) and sum of exp(s - m). */
static inline __attribute__((always_inline)) void attend_kv(
    const int bf16, const float *q, const void *k, const void *v, const int64_t *table,
    int64_t len, int64_t G, int64_t D, int64_t page_size, float scale, int64_t start,
    float cap, float *scores, float *acc, float *out, float *ml) {
    const int64_t page_elems = page_size * D;
    const int vec = D % 8 == 0;
    const int64_t esize = bf16 ? 2 : 4;
#if defined(__AMX_BF16__)
    /* bf16 pages on AMX tiles (attend_amx.h) */
    const int amx = bf16 && att_amx_ready(len, G, D, page_size);
    if (amx) att_amx_scores(q, (const uint16_t *)k, (const uint16_t *)v, table, len, G, D, page_size, scale, scores);
#else
    const int amx = 0;
#endif
#if defined(__AVX512BF16__)
    /* or on the bf16 dot products (attend_dp.h) */
    const int dp = bf16 && !amx && D % 32 == 0 && D <= 256 && G <= ATT_DP_MAX_G;
    if (dp) att_dp_scores(q, (const uint16_t *)k, (const uint16_t *)v, table, len, G, D, page_size, scale, scores);
#else
    const int dp = 0;
#endif
    const int fast = amx || dp; /* the generic loops below are skipped */
    /* bf16 pages shared by G > 1 query heads: widened once into `page` (a page of fp32,
       in L1), not once a head (the widening cost as much as the multiply-adds) */
    const int wide = bf16 && vec && G > 1 && !fast;
    float page[wide ? page_elems : 1] __attribute__((aligned(32)));
    for (int64_t t0 = 0; t0 < len && !fast; t0 += page_size) {
        const int64_t off = table[t0 / page_size] * page_elems;
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        if (t0 + page_size < len) { /* the next page of K, beyond the prefetcher's reach */
            const char *next = (const char *)k + table[t0 / page_size + 1] * page_elems * esize;
            for (int64_t i = 0; i < page_elems * esize; i += 64) __builtin_prefetch(next + i, 0, 2);
        }
        if (wide) { /* the page's keys widened once for all G heads */
            att_widen(page, (const uint16_t *)k + off, n * D);
            for (int64_t g = 0; g < G; g++) {
                float *sg = scores + g * len + t0;
                int64_t i = 0;
                for (; i + 8 <= n; i += 8) *(v8f *)(sg + i) = att_dot8(0, q + g * D, page, i * D, D) * scale;
                for (; i < n; i++) sg[i] = att_dot(0, q + g * D, page, i * D, D) * scale;
            }
            continue;
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * len + t0;
            int64_t i = 0;
            if (vec)
                for (; i + 8 <= n; i += 8)
                    *(v8f *)(sg + i) = att_dot8(bf16, q + g * D, k, off + i * D, D) * scale;
            for (; i < n; i++) sg[i] = att_dot(bf16, q + g * D, k, off + i * D, D) * scale;
        }
    }
    float inv_sum[G];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * len;
        if (cap > 0.f) att_softcap(sg + start, len - start, cap);
        const float m = max_of(sg + start, len - start, -INFINITY);
#if defined(__AVX512F__)
        /* the fast paths round the probabilities to bf16 next: exp to bf16's precision
           (the full-precision exp was a quarter of the AMX path's arithmetic at 32
           decodes over 300 tokens; bench/attention.py's hot column 5.1-5.6 -> 3.8 ms) */
        const float sum = fast ? exp_sum_bf16(sg + start, len - start, m)
                               : exp_sum(sg + start, len - start, m);
#else
        const float sum = exp_sum(sg + start, len - start, m);
#endif
        inv_sum[g] = ml ? 1.f : 1.f / sum;
        if (ml) ml[2 * g] = m, ml[2 * g + 1] = sum;
        memset(sg, 0, sizeof(float) * (size_t)start); /* masked keys weigh nothing */
    }
#if defined(__AMX_BF16__)
    if (amx) {
        att_amx_values(scores, (const uint16_t *)v, table, len, G, D, page_size, acc);
        _tile_release();
    }
#endif
#if defined(__AVX512BF16__)
    if (dp) att_dp_values(scores, (const uint16_t *)v, table, len, G, D, page_size, acc);
#endif
    if (!fast) memset(acc, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t t0 = 0; t0 < len && !fast; t0 += page_size) {
        const int64_t off = table[t0 / page_size] * page_elems;
        const int64_t n = len - t0 < page_size ? len - t0 : page_size;
        const void *vp = v;
        int vbf16 = bf16;
        int64_t voff = off;
        if (wide) { /* the page's values widened once for all G heads */
            att_widen(page, (const uint16_t *)v + off, n * D);
            vp = page, vbf16 = 0, voff = 0;
        }
        for (int64_t g = 0; g < G; g++) {
            const float *sg = scores + g * len + t0;
            float *ag = acc + g * D;
            if (!vec) {
                for (int64_t i = 0; i < n; i++)
                    for (int64_t d = 0; d < D; d++) ag[d] += sg[i] * kv_at(bf16, v, off + i * D + d);
                continue;
            }
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                switch ((D - d0 < 64 ? D - d0 : 64) / 8) {
#define WEIGH(w) \
    case w: att_weigh(vbf16, ag + d0, sg, vp, voff + d0, n, D, w); break;
                    WEIGH(1) WEIGH(2) WEIGH(3) WEIGH(4) WEIGH(5) WEIGH(6) WEIGH(7) WEIGH(8)
#undef WEIGH
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv_sum[g];
}

/* out [G, D] = the attention over the keys of two parts of one context, from each part's
   unnormalised sums (a, b [G, D]) and its ml (attend_kv's): the softmax over the whole */
static inline void att_merge(const float *a, const float *ml_a, const float *b, const float *ml_b,
                             int64_t G, int64_t D, float *out) {
    for (int64_t g = 0; g < G; g++) {
        const float ma = ml_a[2 * g], mb = ml_b[2 * g];
        const float m = ma > mb ? ma : mb, ea = expf(ma - m), eb = expf(mb - m);
        const float inv = 1.f / (ml_a[2 * g + 1] * ea + ml_b[2 * g + 1] * eb);
        const float wa = ea * inv, wb = eb * inv;
        for (int64_t d = 0; d < D; d++) out[g * D + d] = a[g * D + d] * wa + b[g * D + d] * wb;
    }
}

#endif
