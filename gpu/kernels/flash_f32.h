/* Causal attention of a sequence's new tokens over the paged pool in fp32 arithmetic, for
 * the pools and builds without bf16 products: cpu_prefill.c's prompts and chunks over a
 * cached prefix, and cpu_step.c's sequences of several new tokens in a fused step.
 *
 * A task is one KV head and up to FF_QB new tokens for the G query heads that share it:
 * its rows (token-major: row i * G + g is token i's head g) meet each block of FF_KB
 * keys, read once for all of them. The rows run along the vector lanes, every matrix
 * transposed so that rows come last:
 *
 *   S^T = K Q^T    each key's K[j][d] broadcast, multiply-added into the row vectors of
 *                  Q^T[d] (the queries transposed and scaled once a task)
 *   P^T = online softmax of S^T down its columns: a row's running max, sum and rescale
 *                  are lane-wise, with no sums or maxima across lanes; causal, and a
 *                  sliding window's start, by lane-wise compares of key and row positions
 *   O^T = O^T * alpha + V^T P^T    each V[j][d] broadcast into P^T[j]'s row vectors
 *
 * Both products are one shape of micro-kernel: FF_KU broadcasts by FF_RV row vectors of
 * sums held in registers over the reduction. K and V are read where they lie in an fp32
 * pool (a bf16 pool's block is widened into scratch first). The kernel it replaced
 * (each block of K transposed and V copied element by element, a row or two at a time
 * against it, a max and a sum across lanes a row each block) ran at ~50-65 GFLOP/s on a
 * 2-core Ice Lake, torch's fp32 SDPA over the gathered pages at ~30-55.
 */
#ifndef ACTORLM_FLASH_F32_H
#define ACTORLM_FLASH_F32_H
#include <float.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#define FF_QB 64    /* new tokens a task, at most */
#define FF_ROWS 256 /* its rows (G a token), at most: Q^T, O^T and S^T stay in L2 */
#define FF_KB 64    /* keys a block */
#define FF_DMAX 256
#define FF_KU 4 /* keys (scores) or head dims (values) a micro-kernel broadcasts */
#if VW == 16
#define FF_RV 4 /* row vectors it sums into: 16 of AVX-512's 32 registers */
#else
#define FF_RV 2 /* 8 of AVX2's 16 */
#endif

typedef struct {
    float *qt;             /* [D, rp]: queries, transposed and scaled */
    float *ot;             /* [D, rp]: running outputs, transposed */
    float *st;             /* [FF_KB, rp]: a block's scores, then probabilities */
    float *m, *l, *alpha;  /* [rp]: running max and sum, the block's rescale */
    int32_t *pos;          /* [rp]: each row's position (-1: padding) */
    float *kw, *vw;        /* [FF_KB, D]: a bf16 pool's block, widened */
    int64_t rp;            /* rows, padded to whole vectors */
} ff_scratch;

/* Tokens a task takes for G query heads a KV head */
static inline int64_t ff_tokens(int64_t G) {
    int64_t qb = FF_QB;
    while (qb > 8 && G * qb > FF_ROWS) qb /= 2;
    return qb;
}

/* Carves buf (NULL: only sizes it) for G and D; returns the bytes */
static size_t ff_carve(char *buf, int64_t G, int64_t D, ff_scratch *sc) {
    const int64_t rp = (G * ff_tokens(G) + VW - 1) / VW * VW;
    const size_t sizes[] = {sizeof(float) * (size_t)(D * rp), sizeof(float) * (size_t)(D * rp),
                            sizeof(float) * (size_t)(FF_KB * rp), sizeof(float) * (size_t)rp,
                            sizeof(float) * (size_t)rp, sizeof(float) * (size_t)rp,
                            sizeof(int32_t) * (size_t)rp, sizeof(float) * (size_t)(FF_KB * D),
                            sizeof(float) * (size_t)(FF_KB * D)};
    void **parts[] = {(void **)&sc->qt, (void **)&sc->ot, (void **)&sc->st, (void **)&sc->m,
                      (void **)&sc->l, (void **)&sc->alpha, (void **)&sc->pos,
                      (void **)&sc->kw, (void **)&sc->vw};
    size_t at = 0;
    for (int i = 0; i < 9; i++) {
        if (buf) *parts[i] = buf + at;
        at += (sizes[i] + 63) / 64 * 64;
    }
    sc->rp = rp;
    return at;
}

static __thread void *ff_buf;
static __thread size_t ff_buf_bytes;

/* The thread's scratch for G and D (a buffer kept and grown as needed), or -1 */
static inline int ff_scratch_for(int64_t G, int64_t D, ff_scratch *sc) {
    char *buf = grow_buffer(&ff_buf, &ff_buf_bytes, ff_carve(NULL, G, D, sc));
    if (buf == NULL) return -1;
    ff_carve(buf, G, D, sc);
    return 0;
}

static const float ff_zeros[FF_DMAX] __attribute__((aligned(64)));

/* st[u][0, nv * VW) = k[u] . qt[:, 0, nv * VW) for u < FF_KU: qt's row vectors loaded
   once a d for FF_KU keys */
static inline __attribute__((always_inline)) void ff_scores(const float *const *k,
                                                            const float *qt, int64_t rp,
                                                            int64_t D, const int nv,
                                                            float *st) {
    vf acc[FF_KU][FF_RV];
#pragma GCC unroll 4
    for (int u = 0; u < FF_KU; u++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[u][v] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf q[FF_RV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) q[v] = *(const vf *)(qt + d * rp + v * VW);
#pragma GCC unroll 4
        for (int u = 0; u < FF_KU; u++) {
            const float x = k[u][d];
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[u][v] += x * q[v];
        }
    }
#pragma GCC unroll 4
    for (int u = 0; u < FF_KU; u++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) *(vf *)(st + u * rp + v * VW) = acc[u][v];
}

/* ot[d + u][0, nv * VW) = ot * alpha + sum_j v[j][d + u] * st[j][..] for u < FF_KU, j < nk */
static inline __attribute__((always_inline)) void ff_values(const float *const *v, int64_t nk,
                                                            int64_t d, const float *st,
                                                            int64_t rp, const float *alpha,
                                                            const int nv, float *ot) {
    vf acc[FF_KU][FF_RV];
#pragma GCC unroll 4
    for (int u = 0; u < FF_KU; u++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++)
            acc[u][c] = *(const vf *)(ot + (d + u) * rp + c * VW) * *(const vf *)(alpha + c * VW);
    for (int64_t j = 0; j < nk; j++) {
        vf p[FF_RV];
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) p[c] = *(const vf *)(st + j * rp + c * VW);
        const float *vj = v[j] + d;
#pragma GCC unroll 4
        for (int u = 0; u < FF_KU; u++) {
            const float x = vj[u];
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) acc[u][c] += x * p[c];
        }
    }
#pragma GCC unroll 4
    for (int u = 0; u < FF_KU; u++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) *(vf *)(ot + (d + u) * rp + c * VW) = acc[u][c];
}

static inline vf ff_max(vf a, vf b) {
    const vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
}

/* s = cap * tanh(s / cap), tanh from exp of -2|x| (its domain) */
static inline vf ff_cap(vf s, float cap) {
    const vf x = s * (1.f / cap);
    const vi sign = (vi)x & INT32_MIN;
    const vf e = expv((vf)((vi)x | INT32_MIN) * 2.f);
    return (vf)((vi)((1.f - e) / (1.f + e)) | sign) * cap;
}

/* The block's online softmax of one row vector (column c of st): keys k0 .. k0 + nk,
   those a row does not see (past its position, or before its window) weigh 0. masked:
   0 where every lane sees every key of the block. */
static inline void ff_softmax(const ff_scratch *sc, int64_t c, int64_t k0, int64_t nk,
                              int64_t window, float cap, int masked) {
    const int64_t rp = sc->rp;
    float *st = sc->st + c;
    const vi pos = *(const vi *)(sc->pos + c);
    const vi lo = window > 0 ? pos - (int32_t)(window - 1) : (vi){0} + INT32_MIN;
    const vf m0 = *(const vf *)(sc->m + c);
    vf mx = m0;
    for (int64_t j = 0; j < nk; j++) {
        vf s = *(vf *)(st + j * rp);
        if (cap > 0.f) *(vf *)(st + j * rp) = s = ff_cap(s, cap);
        if (masked) {
            const vi key = (vi){0} + (int32_t)(k0 + j);
            const vi seen = (key <= pos) & (key >= lo);
            s = (vf)(((vi)s & seen) | ((vi)((vf){0} - FLT_MAX) & ~seen));
        }
        mx = ff_max(mx, s);
    }
    const vf alpha = expv(m0 - mx); /* m0 = -FLT_MAX, the first block: ~0 (o and l are 0) */
    vf sum = {0};
    for (int64_t j = 0; j < nk; j++) {
        vf e = expv(*(vf *)(st + j * rp) - mx);
        if (masked) {
            const vi key = (vi){0} + (int32_t)(k0 + j);
            e = (vf)((vi)e & ((key <= pos) & (key >= lo)));
        }
        *(vf *)(st + j * rp) = e;
        sum += e;
    }
    *(vf *)(sc->m + c) = mx;
    *(vf *)(sc->l + c) = *(vf *)(sc->l + c) * alpha + sum;
    *(vf *)(sc->alpha + c) = alpha;
}

/* The row-vector chunks [c0, c1) (whole vectors, columns of st) through fn(..., nv) */
#define FF_CHUNKS(c0, c1, call)                                     \
    for (int64_t c = (c0); c < (c1);) {                             \
        const int64_t left = ((c1) - c) / VW;                       \
        if (left >= FF_RV) { call(FF_RV); c += FF_RV * VW; }        \
        else if (FF_RV > 3 && left == 3) { call(3); c += 3 * VW; }  \
        else if (FF_RV > 2 && left == 2) { call(2); c += 2 * VW; }  \
        else { call(1); c += VW; }                                  \
    }

/* One task: KV head h (its K and V at kh, vh, [slots, D], fp32 or bf16), tokens
   [t0, t1) of the new ones (token t at position start + t; t1 - t0 <= ff_tokens(G)),
   query rows of G heads at q + t * q_row + (h * G + g) * D (fp32 or bf16, as out's).
   window > 0: a token sees its own last `window` keys alone; cap > 0: the scaled
   scores become cap * tanh(s / cap) (Gemma 2). sc: ff_scratch_for(G, D). */
static void ff_task(const void *q, int q_bf16, int64_t q_row, const void *kh, const void *vh,
                    int kv_bf16, const int64_t *pages, int64_t ps, int64_t start, int64_t t0,
                    int64_t t1, int64_t h, int64_t G, int64_t D, float scale, int64_t window,
                    float cap, void *out, int out_bf16, int64_t out_row, const ff_scratch *sc) {
    const int64_t nq = t1 - t0, rows = G * nq, rp = (rows + VW - 1) / VW * VW;
    for (int64_t r = 0; r < rp; r++) {
        const int64_t i = r / G, g = r % G;
        sc->pos[r] = r < rows ? (int32_t)(start + t0 + i) : -1;
        sc->m[r] = -FLT_MAX, sc->l[r] = 0.f;
        const int64_t at = (t0 + i) * q_row + (h * G + g) * D;
        for (int64_t d = 0; d < D; d++) {
            const float x = r >= rows ? 0.f
                            : q_bf16  ? bf16_f32(((const uint16_t *)q)[at + d])
                                      : ((const float *)q)[at + d];
            sc->qt[d * sc->rp + r] = x * scale;
        }
    }
    memset(sc->ot, 0, sizeof(float) * (size_t)(D * sc->rp));
    const int64_t RP = sc->rp, esize = kv_bf16 ? 2 : 4;
    const float *kp[FF_KB + FF_KU], *vp[FF_KB];
    const int64_t keys = start + t1; /* the last token sees this many */
    const int64_t first = window > 0 && start + t0 >= window ? start + t0 - window + 1 : 0;
    for (int64_t k0 = first / FF_KB * FF_KB; k0 < keys; k0 += FF_KB) {
        const int64_t nk = keys - k0 < FF_KB ? keys - k0 : FF_KB;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t p = k0 + j, slot = pages[p / ps] * ps + p % ps;
            const char *kr = (const char *)kh + slot * D * esize;
            const char *vr = (const char *)vh + slot * D * esize;
            if (kv_bf16) { /* widened once for all the rows */
                for (int64_t d = 0; d < D; d++) {
                    sc->kw[j * D + d] = bf16_f32(((const uint16_t *)kr)[d]);
                    sc->vw[j * D + d] = bf16_f32(((const uint16_t *)vr)[d]);
                }
                kp[j] = sc->kw + j * D, vp[j] = sc->vw + j * D;
            } else
                kp[j] = (const float *)kr, vp[j] = (const float *)vr;
        }
        for (int64_t j = nk; j < FF_KB + FF_KU; j++) kp[j] = ff_zeros;
        /* the row vectors that see some of the block: a range, positions rising along
           the rows (the later ones see its keys, a window's earlier ones their starts) */
        int64_t c0 = rp, c1 = 0, full = 1;
        for (int64_t c = 0; c < rp; c += VW) {
            const int64_t last = (c + VW < rows ? c + VW : rows) - 1;
            const int64_t pmin = sc->pos[c], pmax = sc->pos[last];
            const int live = k0 <= pmax && (window <= 0 || k0 + nk - 1 > pmin - window);
            if (!live) continue;
            c0 = c < c0 ? c : c0;
            c1 = c + VW;
            full &= k0 + nk - 1 <= pmin && (window <= 0 || k0 > pmax - window);
        }
        if (c0 >= c1) continue;
        const int64_t nkp = (nk + FF_KU - 1) / FF_KU * FF_KU;
#define FF_SCORE(nv)                                                          \
    for (int64_t j = 0; j < nkp; j += FF_KU)                                  \
        ff_scores(kp + j, sc->qt + c, RP, D, nv, sc->st + j * RP + c)
        FF_CHUNKS(c0, c1, FF_SCORE)
#undef FF_SCORE
        for (int64_t c = c0; c < c1; c += VW) ff_softmax(sc, c, k0, nk, window, cap, !full);
#define FF_VALUE(nv)                                                                     \
    for (int64_t d = 0; d < D; d += FF_KU)                                               \
        ff_values(vp, nk, d, sc->st + c, RP, sc->alpha + c, nv, sc->ot + c)
        FF_CHUNKS(c0, c1, FF_VALUE)
#undef FF_VALUE
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / G, g = r % G, at = (t0 + i) * out_row + (h * G + g) * D;
        const float inv = 1.f / sc->l[r];
        for (int64_t d = 0; d < D; d++) {
            const float x = sc->ot[d * RP + r] * inv;
            if (out_bf16)
                ((uint16_t *)out)[at + d] = f32_bf16(x);
            else
                ((float *)out)[at + d] = x;
        }
    }
}

#endif
