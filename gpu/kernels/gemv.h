/* y[M, N] = x[M, K] @ W^T + bias for small M (decode), fp32 arithmetic, over one
 * weight in any of the formats the linear methods keep (a `lin_t`):
 *
 *   LIN_F32, LIN_BF16, LIN_F16: W row-major [N, K]; each row meets up to MR rows of
 *     x as dot products, every weight widened to fp32 once as it is read;
 *   LIN_Q4_1 (w = q * d + m, q in 0..15), LIN_Q8_0 (w = q * d, q in -127..127): GGUF's
 *     32-wide blocks with fp16 d (and m), interleaved by 16 output rows (a "group"),
 *     so one vector holds the same k of 16 rows (two vectors on AVX2). Group g, block
 *     b is at (g * K/32 + b): 16 scales (and 16 minimums), then for each k 16 bytes
 *     (Q8_0), or for each pair of k 16 bytes whose low nibbles are k and high nibbles
 *     k + 1 (Q4_1). A group's blocks follow one another, so the weight reads as one
 *     stream. For each k a group's weights expand to fp32 once and meet each row of x
 *     as a broadcast multiply-add (an outer product, as fbgemm does for fp16): a
 *     decode step reads 5 (Q4_1) or 8.5 (Q8_0) bits a weight and computes with the
 *     file's exact values. The avx512 build expands all 16 rows at once, the avx2
 *     build 8 (each half of a group in turn, the second from L1), lane by lane in the
 *     same order: their results are equal bit for bit.
 *
 * Where the linear allows x to be quantized to int8 (`act_int8`), the builds with
 * AVX512-VNNI and VBMI take every row count through dpi8.h's int8 dot products, the
 * other AVX2 builds through dpi8_avx2.h's byte products; the AMX build takes bf16
 * rows from I8_AMX_MIN_ROWS on its tiles instead.
 * Builds with AVX512-BF16 take Q4_1 weights at any row count and Q8_0 weights at 5
 * rows or more through dpbf16.h's bf16 dot products instead, where the linear allows x
 * to round to bf16 (`act_bf16`), and builds with AMX take both from 5 rows through
 * amx.h's tiles over the same expanded blocks (from 41 rows, over the weights rounded
 * to bf16).
 *
 * `lin_cols` computes a range of output columns on the calling thread; the caller
 * splits the columns over threads (`lin_part`). Included by cpu_qgemm.c (one linear
 * per call, from Python) and cpu_step.c (a whole decode step per call).
 */
#ifndef ACTORLM_GEMV_H
#define ACTORLM_GEMV_H
#include <stdint.h>
#include "simd.h"

#define QK 32
#define MT_MAX 8 /* rows of x a block tile: 8 accumulators */

enum { LIN_F32 = 0, LIN_BF16 = 1, LIN_F16 = 2, LIN_Q4_1 = 3, LIN_Q8_0 = 4 };

typedef struct {
    int64_t kind, n, k;
    const void *w;         /* dense: [n, k] row-major; blocks: the codes */
    const uint16_t *d, *m; /* blocks: fp16 scales [n/16, k/32, 16], minimums (Q4_1) */
    const float *bias;  /* [n] fp32, or NULL */
    int64_t act_bf16;   /* x may be rounded to bf16 (a bf16 model; dpbf16.h) */
    int64_t act_int8;   /* blocks: x may be quantized to int8 (`gguf_a8`; dpi8.h) */
    /* the weight rounded to bf16 as AMX's B tiles, written once (actorlm_amx_tiles), or
       NULL: amx.h's amx_expanded_cols loads them as they lie instead of expanding the
       blocks (or transposing the dense rows) at every call */
    const uint32_t *tiles;
} lin_t;

#if defined(__AVX2__)
/* 8 bytes to 8 int32 lanes; 8 halves to 8 floats */
static inline v8i widen_u8(const uint8_t *p) {
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline v8i widen_s8(const int8_t *p) {
    return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline v8f half8(const uint16_t *p) {
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#else /* portable: correct, not fast */
static inline v8i widen_u8(const uint8_t *p) {
    v8i v;
    for (int i = 0; i < 8; i++) v[i] = p[i];
    return v;
}
static inline v8i widen_s8(const int8_t *p) {
    v8i v;
    for (int i = 0; i < 8; i++) v[i] = p[i];
    return v;
}
static inline v8f half8(const uint16_t *p) {
    v8f v;
    for (int i = 0; i < 8; i++) v[i] = f16_f32(p[i]);
    return v;
}
#endif

#define GROUP 16 /* output rows interleaved in a block weight */

/* The columns [c0, c1) of part `part` of `parts`, in whole groups. */
static inline void lin_part(int64_t n, int part, int parts, int64_t *c0, int64_t *c1) {
    const int64_t units = (n + GROUP - 1) / GROUP;
    const int64_t u0 = units * part / parts, u1 = units * (part + 1) / parts;
    *c0 = u0 * GROUP < n ? u0 * GROUP : n;
    *c1 = u1 * GROUP < n ? u1 * GROUP : n;
}

/* Rows [0, MT) of x against halves [h0, h0 + NH) (8 rows each) of group g. With few
   rows each row gets 2 or 4 accumulators a half (8 in all), so the chains of dependent
   multiply-adds stay short; one row takes both halves in one pass (8 accumulators),
   more rows one half at a time (the second from L1). */
static inline __attribute__((always_inline)) void tile8(
    const int q4, const float *x, int64_t xs, const uint8_t *q, const uint16_t *d,
    const uint16_t *mn, int64_t nb, int64_t g, const int h0, const int NH, float *y, int64_t ys,
    int64_t N, const int MT) {
    const int acc_n = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    v8f acc[2][MT_MAX]; /* half h, row r's a-th at [h][r * acc_n + a] */
#pragma GCC unroll 2
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
        for (int i = 0; i < MT_MAX; i++) acc[h][i] = (v8f){0};
    const int64_t qbytes = q4 ? 16 * GROUP : QK * GROUP; /* codes a block */
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        if (h0) { /* the first half pulled this group into L1: meanwhile fetch the next */
            const char *next = (const char *)q + (blk + nb) * qbytes;
            for (int64_t i = 0; i < qbytes; i += 64) __builtin_prefetch(next + i, 0, 3);
            __builtin_prefetch(d + (blk + nb) * GROUP, 0, 3);
            if (q4) __builtin_prefetch(mn + (blk + nb) * GROUP, 0, 3);
        }
        const float *xb = x + b * QK;
#pragma GCC unroll 2
        for (int h = 0; h < NH; h++) {
            const int64_t lane0 = (h0 + h) * 8;
            const v8f dv = half8(d + blk * GROUP + lane0);
            if (q4) {
                const v8f mv = half8(mn + blk * GROUP + lane0);
                const uint8_t *qb = q + blk * 16 * GROUP + lane0;
                for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 2
                    for (int j = 0; j < 4; j += 2) { /* k + j and k + j + 1 share a byte */
                        const v8i v = widen_u8(qb + (k + j) / 2 * GROUP);
                        const v8f w0 = __builtin_convertvector(v & 15, v8f) * dv + mv;
                        const v8f w1 = __builtin_convertvector(v >> 4, v8f) * dv + mv;
#pragma GCC unroll 8
                        for (int r = 0; r < MT; r++) {
                            acc[h][r * acc_n + j % acc_n] += xb[r * xs + k + j] * w0;
                            acc[h][r * acc_n + (j + 1) % acc_n] += xb[r * xs + k + j + 1] * w1;
                        }
                    }
                }
            } else {
                const int8_t *qb = (const int8_t *)q + blk * QK * GROUP + lane0;
                for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 4
                    for (int j = 0; j < 4; j++) {
                        const v8f w =
                            __builtin_convertvector(widen_s8(qb + (k + j) * GROUP), v8f) * dv;
#pragma GCC unroll 8
                        for (int r = 0; r < MT; r++) acc[h][r * acc_n + j % acc_n] += xb[r * xs + k + j] * w;
                    }
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int h = 0; h < NH; h++) {
        const int64_t n0 = g * GROUP + (h0 + h) * 8;
        if (n0 >= N) break;
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++) {
            v8f s = acc[h][r * acc_n];
#pragma GCC unroll 4
            for (int a = 1; a < acc_n; a++) s += acc[h][r * acc_n + a];
            float *yr = y + r * ys + n0;
            if (n0 + 8 <= N)
                *(v8f *)yr = s;
            else
                for (int64_t n = 0; n < N - n0; n++) yr[n] = s[n];
        }
    }
}

#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

/* tile8 over both halves of group g at once, lane for lane the same operations. */
static inline __attribute__((always_inline)) void tile16(
    const int q4, const float *x, int64_t xs, const uint8_t *q, const uint16_t *d,
    const uint16_t *mn, int64_t nb, int64_t g, float *y, int64_t ys, int64_t N, const int MT) {
    const int acc_n = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    v16f acc[MT_MAX];
#pragma GCC unroll 8
    for (int i = 0; i < MT_MAX; i++) acc[i] = (v16f){0};
    const int64_t qbytes = q4 ? 16 * GROUP : QK * GROUP;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        { /* the next group, one group ahead of the hardware prefetcher */
            const char *next = (const char *)q + (blk + nb) * qbytes;
            for (int64_t i = 0; i < qbytes; i += 64) __builtin_prefetch(next + i, 0, 3);
            __builtin_prefetch(d + (blk + nb) * GROUP, 0, 3);
            if (q4) __builtin_prefetch(mn + (blk + nb) * GROUP, 0, 3);
        }
        const v16f dv = (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
        const float *xb = x + b * QK;
        if (q4) {
            const v16f mv =
                (v16f)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + blk * GROUP)));
            const uint8_t *qb = q + blk * 16 * GROUP;
            for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 2
                for (int j = 0; j < 4; j += 2) {
                    const v16i v = (v16i)_mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(qb + (k + j) / 2 * GROUP)));
                    const v16f w0 = __builtin_convertvector(v & 15, v16f) * dv + mv;
                    const v16f w1 = __builtin_convertvector(v >> 4, v16f) * dv + mv;
#pragma GCC unroll 8
                    for (int r = 0; r < MT; r++) {
                        acc[r * acc_n + j % acc_n] += xb[r * xs + k + j] * w0;
                        acc[r * acc_n + (j + 1) % acc_n] += xb[r * xs + k + j + 1] * w1;
                    }
                }
            }
        } else {
            const int8_t *qb = (const int8_t *)q + blk * QK * GROUP;
            for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const v16i v = (v16i)_mm512_cvtepi8_epi32(
                        _mm_loadu_si128((const __m128i *)(qb + (k + j) * GROUP)));
                    const v16f w = __builtin_convertvector(v, v16f) * dv;
#pragma GCC unroll 8
                    for (int r = 0; r < MT; r++) acc[r * acc_n + j % acc_n] += xb[r * xs + k + j] * w;
                }
            }
        }
    }
    const int64_t n0 = g * GROUP;
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++) {
        v16f s = acc[r * acc_n];
#pragma GCC unroll 4
        for (int a = 1; a < acc_n; a++) s += acc[r * acc_n + a];
        float *yr = y + r * ys + n0;
        if (n0 + 16 <= N)
            *(v16f *)yr = s;
        else
            for (int64_t n = 0; n < N - n0; n++) yr[n] = s[n];
    }
}
#endif

/* The next group's block `blk + nb` (codes, scales, minimums) on its way to the caches
   while this one expands (dpbf16.h's and dpi8.h's dot products): one group ahead of the
   hardware prefetcher, as the tiles above fetch. Without it a weight streamed from
   memory ran the bf16 dot products no faster than the fp32 tiles at 8 rows (2-core Zen
   4: 143 against 158 us a 3072x576 Q4_1 linear, 114 us from cache). */
static inline void dp_prefetch(const int q4, const uint8_t *q, const uint16_t *d,
                               const uint16_t *mn, int64_t next) {
    const int64_t qbytes = q4 ? 16 * GROUP : QK * GROUP;
    const char *c = (const char *)q + next * qbytes;
    for (int64_t i = 0; i < qbytes; i += 64) __builtin_prefetch(c + i, 0, 3);
    __builtin_prefetch(d + next * GROUP, 0, 3);
    if (q4) __builtin_prefetch(mn + next * GROUP, 0, 3);
}

#if defined(__AVX512BF16__)
#include "dpbf16.h"
#endif
#if defined(__AMX_BF16__)
#include "amx.h"
#endif
#if defined(__AVX2__)
/* Scratch for x quantized to int8 (dpi8.h, dpi8_avx2.h), in *have (grown to fit): the
   codes qx [M][K], then their scales dx and sums sx [M][K/32]; 0, or -1 when it could
   not be had. i8_scratch_for: the calling thread's own. */
static int i8_scratch_in(void **have, size_t *have_bytes, int64_t M, int64_t K, int8_t **qx,
                         float **dx, float **sx) {
    const size_t qx_bytes = ((size_t)(M * K) + 63) / 64 * 64, s_bytes = (size_t)(M * (K / QK)) * 4;
    char *buf = grow_buffer(have, have_bytes, qx_bytes + 2 * s_bytes);
    if (buf == NULL) return -1;
    *qx = (int8_t *)buf, *dx = (float *)(buf + qx_bytes), *sx = *dx + M * (K / QK);
    return 0;
}
static __thread void *i8_scratch;
static __thread size_t i8_scratch_bytes;
static int i8_scratch_for(int64_t M, int64_t K, int8_t **qx, float **dx, float **sx) {
    return i8_scratch_in(&i8_scratch, &i8_scratch_bytes, M, K, qx, dx, sx);
}
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define ACTORLM_INT8 1
#include "dpi8.h"
#elif defined(__AVX2__)
#define ACTORLM_INT8 1
#include "dpi8_avx2.h"
#endif
/* int8 rows (bf16 ones, `act_bf16` too) go to AMX tiles from this many: one linear
   from memory, two threads of a 2-core AMX Xeon (bench/qgemm.py, 2026-12-05):
   Q4_1 3072x576 int8 ahead at 8 rows (0.025 against 0.031 ms), the tiles from 10
   (0.029 against 0.033) to 512 (2.3x); the Q8_0 49152x576 head level at 24 rows */
#define I8_AMX_MIN_ROWS(kind) ((kind) == LIN_Q8_0 ? 25 : 9)

/* y[:, c0:c1] += the bias, where L has one */
static inline void add_bias(const lin_t *L, int64_t M, int64_t c0, int64_t c1, float *y, int64_t ys) {
    if (L->bias)
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = c0; c < c1; c++) y[r * ys + c] += L->bias[c];
}

#if defined(ACTORLM_INT8)
/* Whether blocks_cols takes M rows of L to the int8 dot products first (the AMX build
   tries its tiles first for bf16 rows from I8_AMX_MIN_ROWS). */
static inline int i8_first(const lin_t *L, int64_t M) {
    if (!L->act_int8 || M <= 0 || (L->kind != LIN_Q4_1 && L->kind != LIN_Q8_0)) return 0;
#if defined(__AMX_BF16__)
    if (L->act_bf16 && M >= I8_AMX_MIN_ROWS(L->kind)) return 0;
#endif
    return 1;
}

/* Columns [c0, c1) (c0 a group's first) of a block weight, bias added, all M rows of x
   as i8_quantize left them */
static void i8_cols_q(const lin_t *L, const int8_t *qx, const float *dx, const float *sx,
                      int64_t M, int64_t c0, int64_t c1, float *y, int64_t ys) {
    if (c1 <= c0) return;
    i8_blocks_cols_q(L, qx, dx, sx, M, c0 / GROUP, (c1 + GROUP - 1) / GROUP, y, ys);
    add_bias(L, M, c0, c1, y, ys);
}

/* Groups [g0, g1) of a block weight, all M rows of fp32 x quantized on this thread into
   its scratch; 0, or -1 when the scratch could not be had (the caller then takes
   another path). */
static int i8_blocks_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t g0,
                          int64_t g1, float *y, int64_t ys) {
    int8_t *qx;
    float *dx, *sx;
    if (i8_scratch_for(M, L->k, &qx, &dx, &sx)) return -1;
    i8_quantize(L, x, 0, M, xs, qx, dx, sx);
    i8_blocks_cols_q(L, qx, dx, sx, M, g0, g1, y, ys);
    return 0;
}
#endif

/* Groups [g0, g1) of a block weight, all M rows of x. */
static void blocks_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t g0,
                        int64_t g1, float *y, int64_t ys) {
#if defined(__AMX_BF16__)
    /* AMX tiles (Sapphire Rapids, two cores: ~3x the dot products at 16-32 rows); from
       AMX_DQ_MIN_ROWS rows over weights rounded to bf16 (amx.h). Rows that may also be
       quantized to int8 take the tiles only from I8_AMX_MIN_ROWS: fewer, the int8 dot
       products are faster. */
    const int64_t amx_rows = L->act_int8 ? I8_AMX_MIN_ROWS(L->kind) : AMX_MIN_ROWS;
    if (L->act_bf16 && M >= AMX_DQ_MIN_ROWS && M >= amx_rows &&
        amx_expanded_cols(L, x, M, xs, g0, g1, y, ys) == 0)
        return;
    if (L->act_bf16 && M >= amx_rows && amx_blocks_cols(L, x, M, xs, g0, g1, y, ys) == 0) return;
#endif
#if defined(ACTORLM_INT8)
    /* int8 dot products at any other row count (one 3072x576 linear from memory, one
       thread of a 2-core Zen 4: Q4_1 1.4x the bf16 dot products at one row, 1.5-1.7x at
       2-64; Q8_0 1.7-2.4x) */
    if (L->act_int8 && M > 0 && i8_blocks_cols(L, x, M, xs, g0, g1, y, ys) == 0) return;
#endif
#if defined(__AVX512BF16__)
    /* bf16 dot products (one 3072x576 Q4_1 linear from memory, one thread of a 2-core
       Zen 4: 1.55x the fp32 tiles at one row, 1.3x at 8); the AMX build keeps the tiles
       below AMX_MIN_ROWS, not measured against the dot products on a Xeon */
#if defined(__AMX_BF16__)
    const int dp_rows = DP_MIN_ROWS;
#else
    const int dp_rows = L->kind == LIN_Q4_1 ? 1 : DP_MIN_ROWS;
#endif
    if (L->act_bf16 && M >= dp_rows && dp_blocks_cols(L, x, M, xs, g0, g1, y, ys) == 0) return;
#endif
    const int q4 = L->kind == LIN_Q4_1;
    const uint8_t *q = (const uint8_t *)L->w;
    const uint16_t *d = (const uint16_t *)L->d, *mn = (const uint16_t *)L->m;
    const int64_t nb = L->k / QK, N = L->n;
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const float *xm = x + m0 * xs;
            float *ym = y + m0 * ys;
            const int64_t mt = M - m0 < MT_MAX ? M - m0 : MT_MAX;
#if defined(__AVX512F__)
            switch (mt) {
#define TILE(k) \
    case k: tile16(q4, xm, xs, q, d, mn, nb, g, ym, ys, N, k); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
            }
#else
            if (mt == 1) {
                tile8(q4, xm, xs, q, d, mn, nb, g, 0, 2, ym, ys, N, 1);
                continue;
            }
            for (int h = 0; h < 2 && g * GROUP + h * 8 < N; h++) {
                switch (mt) {
#define TILE(k) \
    case k: \
        if (h) tile8(q4, xm, xs, q, d, mn, nb, g, 1, 1, ym, ys, N, k); \
        else tile8(q4, xm, xs, q, d, mn, nb, g, 0, 1, ym, ys, N, k); \
        break;
                    TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
                }
            }
#endif
        }
    }
}

/* A dense weight's row i, elements [j, j + VW), as fp32. */
static inline __attribute__((always_inline)) vf dense_load(const int kind, const void *w,
                                                           int64_t off) {
    if (kind == LIN_BF16) return load_bf16((const uint16_t *)w + off);
    if (kind == LIN_F16) return load_f16((const uint16_t *)w + off);
    return *(const vf *)((const float *)w + off);
}
static inline __attribute__((always_inline)) float dense_at(const int kind, const void *w,
                                                            int64_t off) {
    if (kind == LIN_BF16) return bf16_f32(((const uint16_t *)w)[off]);
    if (kind == LIN_F16) return f16_f32(((const uint16_t *)w)[off]);
    return ((const float *)w)[off];
}

#if VW == 16
#define MR 4 /* rows of x a dense tile: NR * MR accumulators of 32 registers */
#else
#define MR 2 /* of 16 registers */
#endif
#define NR 4

/* Output rows [n0, n0 + nr) against x rows [0, mr): nr * mr dot products over K. */
static inline __attribute__((always_inline)) void dense_tile(const int kind, const void *w,
                                                             int64_t K, const float *x, int64_t xs,
                                                             int64_t n0, float *y, int64_t ys,
                                                             const int nr, const int mr) {
    vf acc[NR][MR];
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++)
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) acc[i][r] = (vf){0};
    int64_t k = 0;
    const int esize = kind == LIN_F32 ? 4 : 2;
    for (; k + VW <= K; k += VW) {
#pragma GCC unroll 4
        for (int i = 0; i < nr; i++) {
            /* the next tile's rows at this column: nr short streams defeat the
               hardware prefetcher, so ask for them one tile ahead */
            if ((k * esize) % 64 == 0)
                __builtin_prefetch((const char *)w + ((n0 + nr + i) * K + k) * esize, 0, 3);
            const vf wv = dense_load(kind, w, (n0 + i) * K + k);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) acc[i][r] += wv * *(const vf *)(x + r * xs + k);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < nr; i++) {
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            float s = hsumv(acc[i][r]);
            for (int64_t t = k; t < K; t++) s += dense_at(kind, w, (n0 + i) * K + t) * x[r * xs + t];
            y[r * ys + n0 + i] = s;
        }
    }
}

static inline __attribute__((always_inline)) void dense_cols_kind(
    const int kind, const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t c0, int64_t c1,
    float *y, int64_t ys) {
    const int64_t K = L->k;
    for (int64_t n = c0; n < c1; n += NR) {
        const int nr = c1 - n < NR ? (int)(c1 - n) : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = M - m0 < MR ? (int)(M - m0) : MR;
            const float *xm = x + m0 * xs;
            float *ym = y + m0 * ys;
            switch (nr * 8 + mr) { /* one specialised tile per shape */
#define T(a, b) \
    case a * 8 + b: dense_tile(kind, L->w, K, xm, xs, n, ym, ys, a, b); break;
                T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(1, 2) T(2, 2) T(3, 2) T(4, 2)
#if MR == 4
                T(1, 3) T(2, 3) T(3, 3) T(4, 3) T(1, 4) T(2, 4) T(3, 4) T(4, 4)
#endif
#undef T
            }
        }
    }
}

/* y[:, c0:c1] = (x @ W^T + bias)[:, c0:c1] on this thread. For block weights c0 is a
   multiple of GROUP and c1 one too, or N. */
static void lin_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t c0,
                     int64_t c1, float *y, int64_t ys) {
    if (c1 <= c0) return;
    switch (L->kind) {
        case LIN_Q4_1:
        case LIN_Q8_0: blocks_cols(L, x, M, xs, c0 / GROUP, (c1 + GROUP - 1) / GROUP, y, ys); break;
        case LIN_BF16:
#if defined(__AMX_BF16__)
            /* whole groups of columns from AMX_DENSE_EXPAND_MIN_ROWS rows: the weight's
               pairs transposed into B tiles (amx.h) */
            if (L->act_bf16 && M >= AMX_DENSE_EXPAND_MIN_ROWS && L->k % QK == 0 &&
                c0 % GROUP == 0 && (c1 % GROUP == 0 || c1 == L->n) &&
                amx_expanded_cols(L, x, M, xs, c0 / GROUP, (c1 + GROUP - 1) / GROUP, y, ys) == 0)
                break;
            if (L->act_bf16 && M >= AMX_MIN_ROWS && L->k % QK == 0 &&
                amx_dense_cols(L, x, M, xs, c0, c1, y, ys) == 0)
                break;
#endif
            dense_cols_kind(LIN_BF16, L, x, M, xs, c0, c1, y, ys);
            break;
        case LIN_F16: dense_cols_kind(LIN_F16, L, x, M, xs, c0, c1, y, ys); break;
        default: dense_cols_kind(LIN_F32, L, x, M, xs, c0, c1, y, ys); break;
    }
    add_bias(L, M, c0, c1, y, ys);
}

#endif
