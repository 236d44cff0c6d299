/* Causal flash attention of bf16 queries over a bf16 paged pool with bf16 products, for
 * the builds with AVX512-BF16: cpu_prefill.c's prompts and chunks over a cached prefix,
 * and cpu_step.c's sequences of several new tokens in a fused step (fa_task alone).
 *
 * cpu_prefill.c's fp32 path widens K and V and multiply-adds in fp32 (~93 GFLOP/s, a
 * quarter of a 512-token prompt of the default model on a 2-core Zen 4); torch's CPU
 * flash attention (oneDNN's bf16 GEMMs between its own softmax passes) ran a 512-token
 * prompt at ~1.3 ms a layer on 2 cores (Xeon), a quarter of the whole prefill. Here the
 * two products of each block run on AMX tiles (flash_amx.h) where the CPU has them and
 * the OS grants them, else on AVX512-BF16's dot products (vdpbf16ps: 16 lanes, each
 * adding two bf16 products to an fp32 sum), and only the online softmax runs on
 * AVX-512. A task is one KV head and up to FA_QB query tokens for the G query heads that
 * share it: its rows, 16 to a tile (one query head, 16 consecutive tokens), meet each
 * block of FA_KB keys, packed once for all of them:
 *
 *   S = Q K^T    q as it is (bf16 pairs of d); K^T as bf16 pairs (row p holds d = 2p,
 *                2p + 1 of 16 keys)
 *   P = online softmax of S * scale, causal; on tiles rounded to bf16 (as torch's bf16
 *                attention rounds its probabilities before their product with V), on dot
 *                products as two bf16 parts (16 bits)
 *   O = O * alpha + P V    P as bf16 pairs of keys; V as bf16 pairs (row p holds keys
 *                2p, 2p + 1 of 16 d)
 *
 * Products are exact in fp32 and sums fp32, so the only roundings beyond fp32's are
 * P's (8 bits on tiles, 16 on dot products) and the output's. Head sizes that are a
 * multiple of 64 take the tiles, of 32 the dot products; the rest keep the fp32 path.
 */
#ifndef ACTORLM_FLASH_H
#define ACTORLM_FLASH_H
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define FA_QB 128 /* query tokens a task, at most: the more, the fewer times a block is packed */
/* keys a block: the running sums rescale, and each row's max and sum reduce across lanes,
   once a block. 64 keys spent ~25% of a 512-token prompt's attention in those; 256 took
   its 30 layers from ~16 to ~12 ms, and a 64-token chunk over 1,100 cached keys from
   ~9.2 to ~6.7 ms (2-core Xeon, 2026-12-03) */
#define FA_KB 256

typedef struct {
    uint16_t *q;   /* [rows, D]: the task's queries, each head's tokens padded to 16s */
    uint32_t *kt;  /* [D / 2, FA_KB]: K^T as bf16 pairs */
    uint32_t *vp;  /* [FA_KB / 2, D]: V as bf16 pairs of keys */
    float *s;      /* [rows, W], W = max(FA_KB, D): a block's scores, then P V */
    uint16_t *p;   /* [rows, FA_KB]: the block's probabilities, rounded to bf16 */
    uint16_t *plo; /* [rows, FA_KB]: what that rounding left, rounded (dot products) */
    float *alpha;  /* [rows]: the block's rescale of the running sums */
    float *o;      /* [rows, D]: running outputs */
    float *m, *l;  /* [rows]: running max (base 2, scaled) and sum */
    int64_t *seen; /* [FA_QB]: keys of the block each token sees, up to */
    int64_t *from; /* [FA_QB]: the first of them (a sliding window's; else 0) */
    int64_t w;     /* W */
} fa_scratch;

#define FA_ROUND(x) (((x) + 63) / 64 * 64)

/* The scratch of a task of G heads of size D, carved from buf (NULL: just its size). */
static size_t fa_carve(char *buf, int64_t G, int64_t D, fa_scratch *sc) {
    const size_t rows = (size_t)(G * FA_QB), w = (size_t)(D > FA_KB ? D : FA_KB);
    const size_t sizes[] = {rows * D * 2,     (size_t)D / 2 * FA_KB * 4, (size_t)FA_KB / 2 * D * 4,
                            rows * w * 4,     rows * FA_KB * 2,          rows * FA_KB * 2,
                            rows * 4,         rows * D * 4,              rows * 4,
                            rows * 4,         FA_QB * 8,                 FA_QB * 8};
    void **parts[] = {(void **)&sc->q,     (void **)&sc->kt, (void **)&sc->vp, (void **)&sc->s,
                      (void **)&sc->p,     (void **)&sc->plo, (void **)&sc->alpha,
                      (void **)&sc->o,     (void **)&sc->m,  (void **)&sc->l,
                      (void **)&sc->seen, (void **)&sc->from};
    size_t at = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (buf) *parts[i] = buf + at;
        at += FA_ROUND(sizes[i]);
    }
    sc->w = (int64_t)w;
    return at;
}

/* The scratch: a buffer per thread that grows as needed and is kept (a task of 128
   tokens of the default model's 3 query heads a KV head takes ~300 KiB, which a fresh
   allocation a call would fault in page by page) */
static __thread void *fa_buf;
static __thread size_t fa_buf_bytes;

/* 2^x for x <= 0 (below -126: 2^-126), 16 at a time: 2^n * 2^f with n = round(x), the
   degree-5 Taylor polynomial of 2^f on |f| <= 1/2 (relative error ~2e-6, far below the
   bf16 rounding the probabilities take next) */
static inline __m512 fa_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.3333558e-3f), _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* r[i][j] <- r[j][i]: a 16 x 16 transpose of dwords */
static inline void fa_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane now holds a 4 x 4 block in place; move the blocks */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* Keys [k0, k0 + nk) of a KV head into the B layouts (zeros past nk: their
   probabilities are 0, and 0 * 0 stays 0 where garbage could be a NaN). */
static void fa_pack(const uint16_t *kh, const uint16_t *vh, const int64_t *pages, int64_t ps,
                    int64_t k0, int64_t nk, int64_t D, uint32_t *kt, uint32_t *vp) {
    const int64_t half = D / 2;
    int64_t row[FA_KB]; /* each key's row offset in its head's K and V, -1 past nk */
    for (int64_t j = 0; j < FA_KB; j++) {
        const int64_t pos = k0 + j;
        row[j] = j < nk ? (pages[pos / ps] * ps + pos % ps) * D : -1;
    }
    const __m512i zero = _mm512_setzero_si512();
    /* K^T: 16 keys by 16 dwords (32 of D) at a time, transposed in registers */
    for (int64_t j0 = 0; j0 < FA_KB; j0 += 16)
        for (int64_t p0 = 0; p0 < half; p0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = row[j0 + j] < 0 ? zero : _mm512_loadu_si512((const void *)(kh + row[j0 + j] + 2 * p0));
            fa_transpose16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512((void *)(kt + (p0 + p) * FA_KB + j0), r[p]);
        }
    for (int64_t j = 0; j < FA_KB; j += 2) {
        uint32_t *dst = vp + (j / 2) * D;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i a = row[j] < 0 ? zero
                : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vh + row[j] + d)));
            const __m512i b = row[j + 1] < 0 ? zero
                : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vh + row[j + 1] + d)));
            _mm512_storeu_si512((void *)(dst + d), _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* The online softmax of a tile's rows in base 2 (scores times scale * log2(e), m in
   those units), in passes over its 16 rows so that their chains overlap: each row's new
   max, every row's rescale factor at once, then the probabilities (rounded to bf16 for
   their product with V; with `lo` also what the rounding left, rounded again) and their
   sums. Row i sees keys [from[i], seen[i]) (seen 0: none; it keeps its state, alpha 1,
   as m starts at -FLT_MAX rather than -inf). */
static void fa_softmax(const fa_scratch *sc, int64_t t, const int64_t *seen,
                       const int64_t *from, int64_t most, float scale, int lo) {
    const int64_t groups = (most + 15) / 16, chunks = (most + 31) / 32, r0 = t * 16;
    const float c2 = scale * 1.44269504088896341f;
    float mnew[16], sums[16];
    __mmask16 live[16][FA_KB / 16];
    for (int64_t r = 0; r < 16; r++) {
        const float *sr = sc->s + (r0 + r) * sc->w;
        __m512 mx = _mm512_set1_ps(-FLT_MAX);
        for (int c = 0; c < FA_KB / 16; c++) {
            const int64_t n = seen[r] - c * 16, f = from[r] - c * 16;
            const __mmask16 below = f >= 16 ? 0xffff : f > 0 ? (__mmask16)((1u << f) - 1) : 0;
            live[r][c] = (n >= 16 ? 0xffff : n > 0 ? (__mmask16)((1u << n) - 1) : 0) & ~below;
        }
        for (int c = 0; c < groups; c++)
            mx = _mm512_mask_max_ps(mx, live[r][c], mx, _mm512_loadu_ps(sr + c * 16));
        const float top = _mm512_reduce_max_ps(mx) * c2, m = sc->m[r0 + r];
        mnew[r] = seen[r] && top > m ? top : m;
    }
    const __m512 mv16 = _mm512_loadu_ps(mnew);
    _mm512_storeu_ps(sc->alpha + r0, fa_exp2(_mm512_sub_ps(_mm512_loadu_ps(sc->m + r0), mv16)));
    _mm512_storeu_ps(sc->m + r0, mv16);
    const __m512 cv = _mm512_set1_ps(c2);
    for (int64_t r = 0; r < 16; r++) {
        const float *sr = sc->s + (r0 + r) * sc->w;
        uint16_t *pr = sc->p + (r0 + r) * FA_KB, *lr = sc->plo + (r0 + r) * FA_KB;
        const __m512 mv = _mm512_set1_ps(mnew[r]);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 2 * chunks; c += 2) {
            const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(sr + c * 16), cv, mv);
            const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(sr + c * 16 + 16), cv, mv);
            const __m512 e0 = _mm512_maskz_mov_ps(live[r][c], lo ? fa_exp2(x0) : exp2v_bf16(x0));
            const __m512 e1 = _mm512_maskz_mov_ps(live[r][c + 1], lo ? fa_exp2(x1) : exp2v_bf16(x1));
            sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
            const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
            _mm512_storeu_si512((void *)(pr + c * 16), hi);
            if (lo) { /* e - hi, exact in fp32, rounded: hi + lo holds 16 bits of e */
                const __m512 h0 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16);
                const __m512 h1 = (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16);
                const __m512bh l = _mm512_cvtne2ps_pbh(_mm512_sub_ps(e1, h1), _mm512_sub_ps(e0, h0));
                _mm512_storeu_si512((void *)(lr + c * 16), (__m512i)l);
            }
        }
        sums[r] = _mm512_reduce_add_ps(sum);
    }
    const __m512 l = _mm512_loadu_ps(sc->l + r0), a = _mm512_loadu_ps(sc->alpha + r0);
    _mm512_storeu_ps(sc->l + r0, _mm512_fmadd_ps(l, a, _mm512_loadu_ps(sums)));
}

/* o = o * alpha + s, for a tile's rows */
static void fa_accumulate(const fa_scratch *sc, int64_t t, int64_t D) {
    for (int64_t r = t * 16; r < t * 16 + 16; r++) {
        const __m512 a = _mm512_set1_ps(sc->alpha[r]);
        float *o = sc->o + r * D;
        const float *pv = sc->s + r * sc->w;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), a, _mm512_loadu_ps(pv + d)));
    }
}

/* The products on dot products, 4 rows of a tile by NV vectors of 16 columns at a time:
   out[r][16 v + i] = sum over n pairs c of (a[r][2c], a[r][2c + 1]) . b[c][16 v + i],
   plus the same of a2 where there is one (a second bf16 part of a), a's rows `as` bf16
   apart, b's rows of pairs `bs` dwords apart, out's rows w apart. 16 accumulators; each
   load of b serves 4 rows. */
static inline __attribute__((always_inline)) void fa_dot_block(
    const uint16_t *a, const uint16_t *a2, int64_t as, const uint32_t *b, int64_t bs, int64_t n,
    float *out, int64_t w, const int NV) {
    __m512 acc[4][4];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i / 4][i % 4] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c++) {
        __m512bh bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) bv[v] = (__m512bh)_mm512_loadu_si512((const void *)(b + c * bs + v * 16));
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(a + r * as + 2 * c));
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, bv[v]);
            if (a2) {
                const __m512bh x2 = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(a2 + r * as + 2 * c));
#pragma GCC unroll 4
                for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x2, bv[v]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + r * w + v * 16, acc[r][v]);
}

/* A tile's 16 rows against `cols` columns (a multiple of 32): out = (a + a2) b, n pairs
   deep (inlined into each caller, so that whether there is an a2 is known there) */
static inline __attribute__((always_inline)) void fa_dot(const uint16_t *a, const uint16_t *a2, int64_t as, const uint32_t *b,
                   int64_t bs, int64_t n, int64_t cols, float *out, int64_t w) {
    const int64_t vecs = cols / 16;
    for (int64_t r0 = 0; r0 < 16; r0 += 4) {
        const uint16_t *ar = a + r0 * as, *ar2 = a2 ? a2 + r0 * as : NULL;
        for (int64_t v0 = 0; v0 < vecs; v0 += 4) {
            if (vecs - v0 >= 4)
                fa_dot_block(ar, ar2, as, b + v0 * 16, bs, n, out + r0 * w + v0 * 16, w, 4);
            else
                fa_dot_block(ar, ar2, as, b + v0 * 16, bs, n, out + r0 * w + v0 * 16, w, 2);
        }
    }
}

/* s[tile] = q K^T, for the keys the softmax reads (32 at a time): K^T's rows hold pairs
   of d. q and K are bf16 as they are, so every product is exact. */
static void fa_scores_dp(const fa_scratch *sc, int64_t t, int64_t most, int64_t D) {
    fa_dot(sc->q + t * 16 * D, NULL, D, sc->kt, FA_KB, D / 2, (most + 31) / 32 * 32,
           sc->s + t * 16 * sc->w, sc->w);
}

/* s[tile] = P V, over the keys the softmax wrote (32 at a time): V's rows hold pairs of
   keys. P as two bf16 parts (its rounding and what that left), so the products carry 16
   bits of P where the tiles' carry 8: rounded to bf16 alone, P flipped the default
   model's first answer to a question (two logits 0.02 apart where fp32 attention put
   them 0.24 apart; with both 0.21). Twice these products cost no time a 512-token
   prefill shows (320-325 ms, 2-core Zen 4). */
static void fa_values_dp(const fa_scratch *sc, int64_t t, int64_t most, int64_t D) {
    fa_dot(sc->p + t * 16 * FA_KB, sc->plo + t * 16 * FA_KB, FA_KB, sc->vp, D,
           (most + 31) / 32 * 16, D, sc->s + t * 16 * sc->w, sc->w);
}

#if defined(__AMX_BF16__)
#include "flash_amx.h"
#else /* no tiles in this build: fa_tiles is 0, so the tiles' products are never called */
#define fa_scores_amx fa_scores_dp
#define fa_values_amx fa_values_dp
#endif

/* Whether a task of head size D runs its products on AMX tiles: the build and the CPU
   have them, the OS granted them, and D is a multiple of 64 */
static inline int fa_tiles(int64_t D) {
#if defined(__AMX_BF16__)
    return D % 64 == 0 && amx_ready();
#else
    (void)D;
    return 0;
#endif
}

/* A thread's tile configuration before its tasks, and its release after */
static inline void fa_tiles_on(int tiles) {
#if defined(__AMX_BF16__)
    if (tiles) amx_configure_tiles(6);
#else
    (void)tiles;
#endif
}

static inline void fa_tiles_off(int tiles) {
#if defined(__AMX_BF16__)
    if (tiles) _tile_release();
#else
    (void)tiles;
#endif
}

/* The four passes of a block over the task's live tiles of 16 rows (tile t: rows
   [16 t, 16 t + 16), one head's 16 consecutive tokens), each pass over every tile before
   the next, so that no tile's result is read right after it was stored. most[t]: the
   keys its last row sees (the most of its rows); keys past it are skipped a tile (16:
   scores) or two (32: products with V) at a time. */

/* One task: KV head h (its K and V at kh, vh), tokens [t0, t1) of the n new ones; the
   products on AMX tiles (`tiles`, configured by the caller) or dot products. q: bf16,
   or with q_f32 fp32 rows, rounded to bf16 as they are gathered. window > 0: each token
   sees its own last `window` keys alone (the blocks before the first token's window are
   skipped); cap > 0: the scaled scores become cap * tanh(s / cap) (Gemma 2). */
static void fa_task(const void *q, int q_f32, int64_t q_row, const uint16_t *kh,
                    const uint16_t *vh, const int64_t *pages, int64_t start, int64_t t0,
                    int64_t t1, int64_t h, int64_t G, int64_t D, int64_t ps, float scale,
                    int64_t window, float cap, uint16_t *out, int64_t out_row,
                    const fa_scratch *sc, const int tiles) {
    const int64_t nq = t1 - t0, per = (nq + 15) / 16, padded = per * 16, rtiles = G * per;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < padded; i++) {
            uint16_t *dst = sc->q + (g * padded + i) * D;
            const int64_t at = (t0 + i) * q_row + (h * G + g) * D;
            if (i >= nq)
                memset(dst, 0, (size_t)D * 2);
            else if (q_f32) /* D is whole pairs of vectors: D % 32 == 0 */
                for (int64_t d = 0; d < D; d += 32) {
                    const float *src = (const float *)q + at + d;
                    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
                    _mm512_storeu_si512((void *)(dst + d), (__m512i)v);
                }
            else
                memcpy(dst, (const uint16_t *)q + at, (size_t)D * 2);
        }
    for (int64_t r = 0; r < rtiles * 16; r++) sc->m[r] = -FLT_MAX, sc->l[r] = 0.f;
    memset(sc->o, 0, sizeof(float) * (size_t)(rtiles * 16 * D));

    const int64_t keys = start + t1; /* the last token sees this many */
    const int64_t first = window > 0 && start + t0 >= window ? start + t0 - window + 1 : 0;
    for (int64_t k0 = first / FA_KB * FA_KB; k0 < keys; k0 += FA_KB) {
        const int64_t nk = keys - k0 < FA_KB ? keys - k0 : FA_KB;
        for (int64_t i = 0; i < padded; i++) { /* causal: token i sees positions <= its own */
            const int64_t qpos = start + t0 + i;
            int64_t hi = i >= nq || k0 > qpos ? 0 : qpos - k0 + 1 < nk ? qpos - k0 + 1 : nk;
            int64_t lo = window > 0 && qpos - window + 1 > k0 ? qpos - window + 1 - k0 : 0;
            if (lo >= hi) lo = hi = 0; /* its window begins past this block */
            sc->seen[i] = hi, sc->from[i] = lo;
        }
        fa_pack(kh, vh, pages, ps, k0, nk, D, sc->kt, sc->vp);
        /* a tile's most is its rows' most (its last real token's, where no window ends
           its view of the block sooner); tiles with none are in the block's past */
        int64_t most[FA_QB / 16];
        for (int64_t j = 0; j < per; j++) {
            most[j] = 0;
            for (int64_t i = j * 16; i < (j + 1) * 16; i++)
                most[j] = sc->seen[i] > most[j] ? sc->seen[i] : most[j];
        }
        for (int64_t t = 0; t < rtiles; t++)
            if (most[t % per]) (tiles ? fa_scores_amx : fa_scores_dp)(sc, t, most[t % per], D);
        if (cap > 0.f) /* s * scale capped: s becomes (cap / scale) tanh(s / (cap / scale)) */
            for (int64_t t = 0; t < rtiles; t++)
                for (int64_t r = 0; most[t % per] && r < 16; r++)
                    att_softcap(sc->s + (t * 16 + r) * sc->w, most[t % per], cap / scale);
        for (int64_t t = 0; t < rtiles; t++)
            if (most[t % per])
                fa_softmax(sc, t, sc->seen + (t % per) * 16, sc->from + (t % per) * 16,
                           most[t % per], scale, !tiles);
        for (int64_t t = 0; t < rtiles; t++)
            if (most[t % per]) (tiles ? fa_values_amx : fa_values_dp)(sc, t, most[t % per], D);
        for (int64_t t = 0; t < rtiles; t++)
            if (most[t % per]) fa_accumulate(sc, t, D);
    }
    for (int64_t r = 0; r < rtiles * 16; r++) {
        const int64_t g = r / padded, i = r % padded;
        if (i >= nq) continue;
        const __m512 inv = _mm512_set1_ps(1.f / sc->l[r]);
        uint16_t *dst = out + (t0 + i) * out_row + (h * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sc->o + r * D + d), inv);
            _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* actorlm_paged_prefill's arguments, all bf16; 0, or -1 (nothing written) where the
   scratch could not be had or the head size is not a multiple of 32. */
static int fa_prefill(const uint16_t *q, int64_t q_row, const uint16_t *k, const uint16_t *v,
                      int64_t num_pages, const int64_t *pages, int64_t start, int64_t n,
                      int64_t Hkv, int64_t G, int64_t D, int64_t ps, float scale, uint16_t *out,
                      int64_t out_row, int threads) {
    if (D % 32) return -1;
    const int tiles = fa_tiles(D);
    const int64_t head = num_pages * ps * D;
    /* tasks of FA_QB tokens, or fewer where that leaves under 4 a thread (down to 32) */
    int64_t qb = FA_QB;
    while (qb > 32 && G * qb > 512) qb /= 2; /* a task's rows' scratch stays in L2 */
    while (qb > 32 && (n + qb - 1) / qb * Hkv < 4 * threads) qb /= 2;
    const int64_t blocks = (n + qb - 1) / qb, tasks = blocks * Hkv;
    fa_scratch none;
    const size_t bytes = fa_carve(NULL, G, D, &none);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        char *buf = grow_buffer(&fa_buf, &fa_buf_bytes, bytes);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            fa_scratch sc;
            fa_carve(buf, G, D, &sc);
            fa_tiles_on(tiles);
            /* latest blocks first: they see the most keys (causal), so the tail balances */
#pragma omp for schedule(dynamic, 1)
            for (int64_t tsk = 0; tsk < tasks; tsk++) {
                const int64_t b = blocks - 1 - tsk / Hkv, h = tsk % Hkv;
                const int64_t t0 = b * qb, t1 = t0 + qb < n ? t0 + qb : n;
                fa_task(q, 0, q_row, k + h * head, v + h * head, pages, start, t0, t1, h, G, D, ps,
                        scale, 0, 0.f, out, out_row, &sc, tiles);
            }
            fa_tiles_off(tiles);
        }
    }
    return failed ? -1 : 0;
}

#endif
