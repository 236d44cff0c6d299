/* Linear layers against 5 or more rows of bf16 activations on AMX tiles (Sapphire
 * Rapids and later), for the builds that have them: GGUF block weights, and dense bf16
 * weights (amx_dense_cols, below). Included by gemv.h after dpbf16.h, whose rounding of
 * x and expansion of the codes the block path shares.
 *
 * dpbf16.h expands a block's codes for 16 output columns into 16 vectors of bf16 pairs:
 * exactly AMX's B tile for k = 32, n = 16 (row p holds each column's codes 2p and
 * 2p + 1). A tile of 16 rows of x (32 bf16 each, the same block's k) is the A tile,
 * so one TDPBF16PS gives every row's per-block sum for 16 columns at once, exact in
 * the codes as dpbf16.h's dot products are:
 *
 *   part[b][r, n] = sum_k q[k, n] x[r, k]   (one block b, fp32 sums of exact products)
 *
 * The tiles only accumulate within a block: each block's sums are stored and scaled
 * by the block's own d (and m times x's block sum for Q4_1) with AVX-512, a chunk of
 * blocks at a time so a row's accumulator stays in a register across the chunk.
 * Rows are padded to whole tiles of 16 with zeros.
 *
 * From AMX_DQ_MIN_ROWS rows (long extensions, large decode batches) that per-block
 * store and scaling outweighs a block's expansion, and amx_expanded_cols expands the
 * weights themselves instead, w = q d (+ m) rounded to bf16 as a bf16 model's
 * dequantized weights are (its forward's oneDNN GEMMs use the same values), so the
 * tiles sum over all of K and a group's sums are stored once. A dense bf16 weight takes
 * the same kernel from AMX_DENSE_EXPAND_MIN_ROWS rows, its rows' bf16 pairs transposed
 * into the B tiles (dense_expand); fewer rows load its rows as A tiles as they lie
 * (amx_dense_cols), with no transpose. Where the weight was written as those B tiles
 * once (lin_t's `tiles`: cpu_qgemm.c's actorlm_amx_tiles, the fused step's layers),
 * amx_tiles_cols loads them as they lie instead, its loops blocked for L1 and L2, and
 * amx_silu_cols meets a gate/up pair in the tiles' epilogue as SiLU-and-multiply.
 *
 * Linux hands out AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM,
 * once a process); where it refuses, amx_blocks_cols returns -1 and the caller takes
 * dpbf16.h's dot products. The tile configuration is per thread and other libraries
 * on the same threads (oneDNN) load their own, so each call loads it and releases the
 * tiles when done.
 */
#ifndef ACTORLM_AMX_H
#define ACTORLM_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "amx_state.h"

#define AMX_MIN_ROWS 5 /* fewer rows: gemv.h's fp32 tiles (equal at 4, 1.2x at 8) */
/* more rows: the weights rounded to bf16 first (amx_expanded_cols), whose cost is one
   expansion a call where the blocks' grows with the rows. Default model, two cores:
   ffn_up / attn_q alone and warm 0.062 / 0.027 -> 0.049 / 0.023 ms at 32 rows, 0.100 /
   0.035 -> 0.066 / 0.029 at 40, where the blocks' row tiles pad 40 rows to 48
   (bench/qgemm.py); the fused decode step (bench/forward.py, context 256) level at 29-31
   rows, 6-8% slower at 28, 1-9% faster at 32 and 5-12% at 36 and 40 */
#define AMX_DQ_MIN_ROWS 32
/* more rows: a weight written as tiles (lin_t's `tiles`) read as they lie instead of
   expanded from its codes: 2 bytes a weight from memory where the codes are ~0.56, so
   only where enough rows share each tile (from 17 rows: level with 41, 2026-12-06) */
#define AMX_TILES_MIN_ROWS 41
/* The rows from which this thread's calls read the tiles: AMX_TILES_MIN_ROWS, or more
   for a step that sets it (cpu_step.c's `tiles_from`): tiles that have left the cache
   cost their 2 bytes a weight from memory, where the codes cost ~0.56 */
static __thread int64_t amx_tiles_from = AMX_TILES_MIN_ROWS;
/* a dense bf16 weight through amx_expanded_cols (a 1536 x 576 weight, two cores: 0.047 /
   0.069 / 0.110 / 0.222 ms at 32 / 64 / 117 / 256 rows against amx_dense_cols' 0.054 /
   0.114 / 0.203 / 0.459; 0.046 against 0.032 at 24) */
#define AMX_DENSE_EXPAND_MIN_ROWS 32
#define AMX_CHUNK 8    /* blocks a pass: their B tiles (8 KiB) and sums in L1 */
/* Tiles 0-1: sums (C), 2-3: rows of x (A), 4: a block's codes (B); each 16 x 64 bytes. */
static void amx_configure(void) { amx_configure_tiles(5); }

/* amx_configure for amx_blocks_cols' M rows of x: up to 32 rows the tiles of x and of
   sums hold the rows there are, not zeros to a whole 16 (the same sums). Thirty Q4_1
   linears from L3, bf16 rows, two threads of the 2-core AMX Xeon, 16-row tiles against
   these: 3072x576 at 5 / 12 / 20 / 24 rows 0.071 / 0.072 / 0.113 / 0.123 -> 0.061 /
   0.068 / 0.105 / 0.115 ms, 576x1536 0.041 / 0.048 / 0.066 / 0.071 -> 0.036 / 0.044 /
   0.051 / 0.056; 8, 16 and 32 rows level. */
static void amx_configure_rows(int64_t M) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int64_t first = M < 16 ? M : 16, second = M > 16 && M < 32 ? M - 16 : 16;
    for (int t = 0; t < 5; t++) c.colsb[t] = 64, c.rows[t] = 16;
    c.rows[0] = c.rows[2] = (uint8_t)first;
    c.rows[1] = c.rows[3] = (uint8_t)second;
    amx_load_config(&c);
}

/* Groups [g0, g1) of a block weight, all M rows of x; 0, or -1 when AMX or the
   scratch could not be had (the caller then takes the dot products). */
static int amx_blocks_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t g0,
                           int64_t g1, float *y, int64_t ys) {
    if (!amx_ready()) return -1;
    const int q4 = L->kind == LIN_Q4_1;
    const uint8_t *q = (const uint8_t *)L->w;
    const uint16_t *d = L->d, *mn = L->m;
    const int64_t K = L->k, nb = K / QK, N = L->n;
    const int64_t Mp = M <= 32 ? M : (M + 15) / 16 * 16; /* rows the tiles hold */
    const size_t xb_bytes = ((size_t)(Mp * K) * 2 + 63) / 64 * 64;
    const size_t sx_bytes = q4 ? ((size_t)(M * nb) * 4 + 63) / 64 * 64 : 0;
    const size_t part_bytes = (size_t)AMX_CHUNK * Mp * GROUP * 4;
    char *buf = dp_buffer(xb_bytes + sx_bytes + part_bytes + (size_t)M * GROUP * 4);
    if (buf == NULL) return -1;
    uint16_t *xb = (uint16_t *)buf;
    float *sx = q4 ? (float *)(buf + xb_bytes) : NULL;
    float *part = (float *)(buf + xb_bytes + sx_bytes), *acc = part + AMX_CHUNK * Mp * GROUP;
    dp_round_rows(x, M, xs, K, xb, sx);
    memset(xb + M * K, 0, (size_t)((Mp - M) * K) * 2);
    const int64_t chunks = (nb + AMX_CHUNK - 1) / AMX_CHUNK, per = (nb + chunks - 1) / chunks;
    const int64_t xstride = K * 2;
    __m512i wb[AMX_CHUNK * 16];
    __m512 dv[AMX_CHUNK], mv[AMX_CHUNK];
    amx_configure_rows(M);
    for (int64_t g = g0; g < g1; g++) {
        for (int64_t b0 = 0; b0 < nb; b0 += per) {
            const int64_t nbc = nb - b0 < per ? nb - b0 : per;
            dp_expand(q4, q, d, mn, nb, g, b0, nbc, wb);
            for (int64_t b = 0; b < nbc; b++) {
                const uint16_t *xa = xb + (b0 + b) * QK;
                float *pb = part + b * Mp * GROUP;
                AMX_LOADD(4, wb + b * 16, 64);
                for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                    _tile_zero(0);
                    AMX_LOADD(2, xa + m0 * K, xstride);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_stored(0, pb + m0 * GROUP, 64);
                    if (m0 + 16 < Mp) {
                        _tile_zero(1);
                        AMX_LOADD(3, xa + (m0 + 16) * K, xstride);
                        _tile_dpbf16ps(1, 3, 4);
                        _tile_stored(1, pb + (m0 + 16) * GROUP, 64);
                    }
                }
                const int64_t blk = g * nb + b0 + b;
                dv[b] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
                if (q4) mv[b] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + blk * GROUP)));
            }
            /* each row's block sums, scaled, into its accumulator */
            for (int64_t r = 0; r < M; r++) {
                __m512 a = b0 ? _mm512_loadu_ps(acc + r * GROUP) : _mm512_setzero_ps();
                const float *sr = q4 ? sx + r * nb + b0 : NULL;
                for (int64_t b = 0; b < nbc; b++) {
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(part + (b * Mp + r) * GROUP), dv[b], a);
                    if (q4) a = _mm512_fmadd_ps(mv[b], _mm512_set1_ps(sr[b]), a);
                }
                _mm512_storeu_ps(acc + r * GROUP, a);
            }
        }
        const int64_t n0 = g * GROUP, w = N - n0 < GROUP ? N - n0 : GROUP;
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < w; n++) y[r * ys + n0 + n] = acc[r * GROUP + n];
    }
    _tile_release();
    return 0;
}

/* Block b of group g as AMX's B tile of bf16 weights, w = q d (+ m), each rounded to
   bf16 (round to nearest even, as a bf16 model's dequantized weights are): pair p of
   column n (k = 2p, 2p + 1) in 32-bit lane n of vector p (dpbf16.h's bf16_pairs). */
static inline void dq_expand(const int q4, const uint8_t *q, const uint16_t *d,
                             const uint16_t *mn, int64_t blk, __m512i *wb) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + blk * GROUP)));
    if (q4) {
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + blk * GROUP)));
        const __m512i lo4 = _mm512_set1_epi32(15);
        const uint8_t *qb = q + blk * 16 * GROUP;
        for (int p = 0; p < 16; p++) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qb + p * GROUP)));
            const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, lo4)), dv, mv);
            const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, mv);
            wb[p] = bf16_pairs(lo, hi);
        }
    } else {
        const int8_t *qb = (const int8_t *)q + blk * QK * GROUP;
        for (int p = 0; p < 16; p++) {
            const __m128i c0 = _mm_loadu_si128((const __m128i *)(qb + 2 * p * GROUP));
            const __m128i c1 = _mm_loadu_si128((const __m128i *)(qb + (2 * p + 1) * GROUP));
            const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0)), dv);
            const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1)), dv);
            wb[p] = bf16_pairs(lo, hi);
        }
    }
}

/* Columns 16 g .. 16 g + 15, k 32 b .. 32 b + 31 of a dense bf16 weight [N, K] as AMX's B
   tile (the layout dq_expand writes): each row's 32 values are 16 bf16 pairs, so the tile
   is the 16 x 16 transpose of those pairs (columns past N are zeros). */
static inline void dense_expand(const uint16_t *w, int64_t N, int64_t K, int64_t g, int64_t b,
                                __m512i *wb) {
    __m512i r[16];
    for (int j = 0; j < 16; j++) {
        const int64_t n = g * GROUP + j;
        r[j] = n < N ? _mm512_loadu_si512((const void *)(w + n * K + b * QK))
                     : _mm512_setzero_si512();
    }
    tr16_dwords(r);
    for (int p = 0; p < 16; p++) wb[p] = r[p];
}

/* Block b of group g of a block or dense bf16 weight as AMX's B tile */
static inline void amx_expand(const lin_t *L, int64_t g, int64_t b, __m512i *wb) {
    if (L->kind == LIN_BF16)
        dense_expand((const uint16_t *)L->w, L->n, L->k, g, b, wb);
    else {
        const int64_t nb = L->k / QK, blk = g * nb + b;
        /* the pair after next: amx_expanded_cols expands a pair while the one before runs */
        if (blk + 2 * nb < (L->n + GROUP - 1) / GROUP * nb)
            dp_prefetch(L->kind == LIN_Q4_1, (const uint8_t *)L->w, L->d, L->m, blk + 2 * nb);
        dq_expand(L->kind == LIN_Q4_1, (const uint8_t *)L->w, L->d, L->m, blk, wb);
    }
}

/* x rounded to bf16 once for several calls over the same rows (cpu_step.c's claimed
   column chunks): the rows it was rounded from and the copy, padded with zero rows to
   whole tiles. amx_expanded_cols reads the copy for those very rows instead of rounding
   them again; amx_round_forget before x changes. The copy is this thread's own
   (amx_round_once) or one the caller made (amx_round_given: the team's, its rows
   rounded by the thread that wrote them). */
static __thread const float *amx_xr_src;
static __thread int64_t amx_xr_rows, amx_xr_k;
static __thread const uint16_t *amx_xr_copy;
static __thread void *amx_xr_buf;
static __thread size_t amx_xr_bytes;

static inline void amx_round_given(const float *x, int64_t M, int64_t K, const uint16_t *xb) {
    amx_xr_src = x, amx_xr_rows = M, amx_xr_k = K, amx_xr_copy = xb;
}

static int amx_round_once(const float *x, int64_t M, int64_t K) {
    const int64_t T = (M + 15) / 16;
    uint16_t *xb = grow_buffer(&amx_xr_buf, &amx_xr_bytes, (size_t)(T * 16 * K) * 2);
    if (xb == NULL) return -1;
    dp_round_rows(x, M, K, K, xb, NULL);
    memset(xb + M * K, 0, (size_t)((T * 16 - M) * K) * 2);
    amx_round_given(x, M, K, xb);
    return 0;
}

static inline void amx_round_forget(void) { amx_xr_src = NULL; }

/* One block's four products (tiles 0-3: C, 4 and 6: rows of x, 5 and 7: weights): the
   16 rows at xa (and the 16 after, K apart, where `rows2`) by the B tile at w0 (and at
   w1 where `two`) */
static inline __attribute__((always_inline)) void amx_block_2x2(const uint16_t *xa, int64_t K,
                                                              const __m512i *w0,
                                                              const __m512i *w1, int rows2,
                                                              int two) {
    AMX_LOADD(5, w0, 64);
    AMX_LOADD(4, xa, K * 2);
    _tile_dpbf16ps(0, 4, 5);
    if (rows2) {
        AMX_LOADD(6, xa + 16 * K, K * 2);
        _tile_dpbf16ps(1, 6, 5);
    }
    if (two) {
        AMX_LOADD(7, w1, 64);
        _tile_dpbf16ps(2, 4, 7);
        if (rows2) _tile_dpbf16ps(3, 6, 7);
    }
}

/* C tiles 0-3 (rows 16 t0 .., groups g and g + 1 where `two`, the second tile of rows
   where `rows2`) into y: whole tiles straight, a part tile (the last rows or columns)
   through cb */
static inline void amx_store_pair(int64_t g, int64_t t0, int two, int rows2, int64_t M,
                                  int64_t N, float *y, int64_t ys, float *cb) {
    const int64_t n0 = g * GROUP, r0 = t0 * 16;
    if (two && rows2 && r0 + 32 <= M && n0 + 2 * GROUP <= N) {
        float *y0 = y + r0 * ys + n0;
        _tile_stored(0, y0, ys * 4);
        _tile_stored(1, y0 + 16 * ys, ys * 4);
        _tile_stored(2, y0 + GROUP, ys * 4);
        _tile_stored(3, y0 + 16 * ys + GROUP, ys * 4);
        return;
    }
    _tile_stored(0, cb, 64);
    _tile_stored(1, cb + 256, 64);
    _tile_stored(2, cb + 512, 64);
    _tile_stored(3, cb + 768, 64);
    for (int64_t i = 0; i < 1 + two; i++) {
        const int64_t n0 = (g + i) * GROUP, w = N - n0 < GROUP ? N - n0 : GROUP;
        for (int64_t r = r0; r < M && r < r0 + 32; r++) {
            const float *c = cb + i * 512 + (r - r0) * GROUP;
            for (int64_t n = 0; n < w; n++) y[r * ys + n0 + n] = c[n];
        }
    }
}

/* amx_tiles_cols' SiLU epilogue: the pair of a step is gate group g and up group
   g + up (the same columns of act), and the pair's sums meet as act = silu(gate) * up
   (tanh-GELU where `gelu`: Gemma) in registers, written to act (fp32, where given) and
   act_b (bf16), rows `lda` apart: no [rows, columns] gate and up go through memory and
   back. */
typedef struct {
    int64_t up;      /* groups from a gate group to its up group (intermediate / 16) */
    float *act;      /* [M, lda] fp32, or NULL */
    uint16_t *act_b; /* [M, lda] bf16 */
    int64_t lda;
    int gelu;
} amx_silu_t;

/* amx_expanded_cols over L->tiles (the weight written as B tiles once): nothing to
 * expand, so the loops block for the caches as a GEMM does:
 *   rows    in blocks whose A tiles fit AMX_ROW_BLOCK_BYTES (L2), each block against
 *           every pair of groups of the call (a claimed chunk, whose tiles stay in L2
 *           across the blocks);
 *   k       a pair's blocks in slices of at most AMX_B_SLICE_BYTES of B tiles (L1),
 *           each slice against every row of the block, the sums parked in `part`
 *           between slices: B from L1 and A from L2, where a whole pair's B (36 KiB
 *           at K = 576) and a row pair's A evicted each other and both came from L2
 *           (3072 x 576 at 512 rows, B held in L1 ran 1.45x);
 *   memory  the first row block streams the tiles in, the next pair's prefetched into
 *           L2 while a pair's products run.
 * Groups [g0, g1) into y (rows ys apart), or with `silu` act's groups [g0, g1).
 * part: amx_tiles_part(K) bytes. */
#define AMX_ROW_BLOCK_BYTES (512 << 10)
#define AMX_B_SLICE_BYTES (20 << 10)

static inline int64_t amx_row_block(int64_t K) {
    const int64_t rb = AMX_ROW_BLOCK_BYTES / (16 * K * 2) / 2 * 2;
    return rb < 2 ? 2 : rb;
}

static inline size_t amx_tiles_part(int64_t K) { return (size_t)amx_row_block(K) / 2 * 4096; }

/* The scratch a call over tiles takes for M rows of K: the rows rounded (where the
   caller gave none), the parked sums, a pair of C tiles */
static inline size_t amx_tiles_bytes(int64_t M, int64_t K) {
    return ((size_t)((M + 15) / 16 * 16 * K) * 2 + 63) / 64 * 64 + amx_tiles_part(K) + 4 * 1024;
}

/* L2 prefetches of the lines [p, end), `per` a call */
static inline void amx_prefetch_some(const char **p, const char *end, int64_t per) {
    for (int64_t l = 0; l < per && *p < end; l++, *p += 64) _mm_prefetch(*p, _MM_HINT_T1);
}

/* C tiles 0-3 (rows 16 t0 .. 16 t0 + 31 of gate, then of up, 16 columns from group g)
   as silu(gate) * up into act and act_b */
static inline void amx_silu_store(const amx_silu_t *sl, int64_t g, int64_t t0, int64_t M,
                                  float *cb) {
    _tile_stored(0, cb, 64);
    _tile_stored(1, cb + 256, 64);
    _tile_stored(2, cb + 512, 64);
    _tile_stored(3, cb + 768, 64);
    const int64_t n0 = g * GROUP;
    for (int64_t r = 0; r < 32 && t0 * 16 + r < M; r++) {
        const int64_t row = t0 * 16 + r;
        const vf gate = *(const vf *)(cb + r * 16);
        const vf v = (sl->gelu ? geluv(gate) : siluv(gate)) * *(const vf *)(cb + 512 + r * 16);
        if (sl->act) *(vf *)(sl->act + row * sl->lda + n0) = v;
        store_bf16(sl->act_b + row * sl->lda + n0, v);
    }
}

static void amx_tiles_cols(const lin_t *L, const uint16_t *xb, int64_t M, int64_t g0,
                           int64_t g1, float *y, int64_t ys, float *cb, float *part,
                           const amx_silu_t *silu) {
    const int64_t K = L->k, nb = K / QK, N = L->n, T = (M + 15) / 16;
    const __m512i *tiles = (const __m512i *)L->tiles; /* [groups][nb][16 vectors] */
    const int64_t rb = amx_row_block(K), step = silu ? 1 : 2, up = silu ? silu->up : 1;
    const int64_t slices = (nb * 2048 + AMX_B_SLICE_BYTES - 1) / AMX_B_SLICE_BYTES;
    const int64_t kc = (nb + slices - 1) / slices;
    const char *pf0 = (const char *)(tiles + g0 * nb * 16); /* the first pair's tiles */
    const char *pf1 = silu || g0 + 1 < g1 ? (const char *)(tiles + (g0 + up) * nb * 16) : NULL;
    amx_prefetch_some(&pf0, pf0 + nb * 1024, nb * 16);
    amx_prefetch_some(&pf1, pf1 ? pf1 + nb * 1024 : NULL, nb * 16);
    amx_configure_tiles(8); /* 0-3: C, 4 and 6: rows of x, 5 and 7: weights */
    for (int64_t tb = 0; tb < T; tb += rb) {
        const int64_t te = tb + rb < T ? tb + rb : T;
        for (int64_t g = g0; g < g1; g += step) {
            const int two = silu || g + 1 < g1;
            const __m512i *w0 = tiles + g * nb * 16, *w1 = tiles + (g + up) * nb * 16;
            /* the next pair's tiles, a few lines a block of the first row block */
            const int64_t gn = g + step, nn = tb || gn >= g1 ? 0 : silu || gn + 1 < g1 ? 2 : 1;
            const char *pa = nn ? (const char *)(tiles + gn * nb * 16) : NULL;
            const char *pb = nn == 2 ? (const char *)(tiles + (gn + up) * nb * 16) : NULL;
            const char *ea = pa ? pa + nb * 1024 : NULL, *eb = pb ? pb + nb * 1024 : NULL;
            const int64_t steps = (te - tb + 1) / 2 * nb;
            const int64_t per = (nn * nb * 16 + steps - 1) / steps;
            for (int64_t k0 = 0; k0 < nb; k0 += kc) {
                const int64_t k1 = k0 + kc < nb ? k0 + kc : nb;
                for (int64_t t0 = tb; t0 < te; t0 += 2) {
                    const int rows2 = t0 + 1 < T;
                    float *pp = part + (t0 - tb) / 2 * 1024;
                    if (k0 == 0) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                    } else {
                        _tile_loadd(0, pp, 64);
                        _tile_loadd(1, pp + 256, 64);
                        _tile_loadd(2, pp + 512, 64);
                        _tile_loadd(3, pp + 768, 64);
                    }
                    const uint16_t *xa = xb + t0 * 16 * K;
                    for (int64_t b = k0; b < k1; b++) {
                        amx_block_2x2(xa + b * QK, K, w0 + b * 16, w1 + b * 16, rows2, two);
                        amx_prefetch_some(&pa, ea, per);
                        amx_prefetch_some(&pb, eb, per);
                    }
                    if (k1 < nb) {
                        _tile_stored(0, pp, 64);
                        _tile_stored(1, pp + 256, 64);
                        _tile_stored(2, pp + 512, 64);
                        _tile_stored(3, pp + 768, 64);
                    } else if (silu) {
                        amx_silu_store(silu, g, t0, M, cb);
                    } else {
                        amx_store_pair(g, t0, two, rows2, M, N, y, ys, cb);
                    }
                }
            }
        }
    }
    _tile_release();
}

/* x's M rows in bf16, padded with zero rows to whole tiles: the caller's copy where it
   made one for these rows (amx_round_given / amx_round_once), else rounded into buf */
static const uint16_t *amx_rows_bf16(const float *x, int64_t M, int64_t xs, int64_t K,
                                     uint16_t *buf) {
    if (x == amx_xr_src && M == amx_xr_rows && K == amx_xr_k && xs == K) return amx_xr_copy;
    dp_round_rows(x, M, xs, K, buf, NULL);
    memset(buf + M * K, 0, (size_t)(((M + 15) / 16 * 16 - M) * K) * 2);
    return buf;
}

/* Groups [g0, g1) of a block weight (or a dense bf16 one) against all M rows of x with
   each weight rounded to bf16 first: the tiles then sum over all of K (a block's scale
   is in its weights), so a group's C tiles are stored once, not once a block. Two groups
   and two tiles of rows at a time (C tiles 0-3), so a block's tile of weights and a tile
   of rows each serve two products: four loads for four products. The next two groups'
   weights are expanded between the products of this pair's first rows (the vector
   units work while the tiles do), and whole C tiles are stored straight into y (the
   ffn_up of the default model, two cores: 117 / 256 / 512 rows 0.111 / 0.220 / 0.434
   ms, were 0.143 / 0.270 / 0.54). 0, or -1 (no AMX or scratch). */
static int amx_expanded_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t g0,
                             int64_t g1, float *y, int64_t ys) {
    if (!amx_ready()) return -1;
    const int64_t K = L->k, nb = K / QK, N = L->n, T = (M + 15) / 16;
    const size_t xb_bytes = ((size_t)(T * 16 * K) * 2 + 63) / 64 * 64;
    /* the expansion's two pairs of B tiles, or amx_tiles_cols' parked sums */
    const int tiles = L->tiles && (L->kind == LIN_BF16 || M >= amx_tiles_from);
    const size_t wbs_bytes = tiles ? amx_tiles_part(K) : (size_t)nb * 4096;
    char *buf = dp_buffer(xb_bytes + wbs_bytes + 4 * 1024);
    if (buf == NULL) return -1;
    const uint16_t *xb = amx_rows_bf16(x, M, xs, K, (uint16_t *)buf);
    /* two groups' B tiles, a block each, twice: the next pair's are expanded while the
       tiles work on this pair's first rows */
    __m512i *wbs = (__m512i *)(buf + xb_bytes);
    float *cb = (float *)(buf + xb_bytes + wbs_bytes);
    if (tiles) {
        amx_tiles_cols(L, xb, M, g0, g1, y, ys, cb, (float *)wbs, NULL);
        return 0;
    }
    for (int64_t i = 0; i < 2 && g0 + i < g1; i++)
        for (int64_t b = 0; b < nb; b++) amx_expand(L, g0 + i, b, wbs + (i * nb + b) * 16);
    amx_configure_tiles(8); /* 0-3: C, 4 and 6: rows of x, 5 and 7: weights */
    for (int64_t g = g0; g < g1; g += 2) {
        const int two = g + 1 < g1;
        const int64_t half = (g - g0) / 2 % 2; /* this pair's half of wbs */
        const __m512i *wb = wbs + half * nb * 32;
        __m512i *wn = wbs + (1 - half) * nb * 32;
        const int64_t next = g1 - (g + 2) < 2 ? g1 - (g + 2) : 2; /* the next pair's groups */
        for (int64_t t0 = 0; t0 < T; t0 += 2) {
            const int rows2 = t0 + 1 < T;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t *xa = xb + t0 * 16 * K;
            for (int64_t b = 0; b < nb; b++) {
                amx_block_2x2(xa + b * QK, K, wb + b * 16, wb + (nb + b) * 16, rows2, two);
                if (t0 == 0)
                    for (int64_t i = 0; i < next; i++)
                        amx_expand(L, g + 2 + i, b, wn + (i * nb + b) * 16);
            }
            amx_store_pair(g, t0, two, rows2, M, N, y, ys, cb);
        }
    }
    _tile_release();
    return 0;
}

/* act[:, c0:c1] = silu(x W_gate^T) * (x W_up^T) (act_b: its bf16 copy; act NULL: that
   alone) for a gate_up weight [gate | up] of `inter` rows each that has its tiles, c0
   and c1 whole groups, all M rows of x (ldact: act's row stride). 0, or -1 (no tiles,
   AMX or scratch: the caller computes gate and up as it would without). */
static int amx_silu_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t inter,
                         int64_t c0, int64_t c1, float *act, uint16_t *act_b, int64_t ldact,
                         int gelu) {
    if (!L->tiles || inter % GROUP || c0 % GROUP || c1 % GROUP || !amx_ready()) return -1;
    const int64_t K = L->k, T = (M + 15) / 16;
    const size_t xb_bytes = ((size_t)(T * 16 * K) * 2 + 63) / 64 * 64, part = amx_tiles_part(K);
    char *buf = dp_buffer(amx_tiles_bytes(M, K));
    if (buf == NULL) return -1;
    const uint16_t *xb = amx_rows_bf16(x, M, xs, K, (uint16_t *)buf);
    const amx_silu_t sl = {inter / GROUP, act, act_b, ldact, gelu};
    amx_tiles_cols(L, xb, M, c0 / GROUP, c1 / GROUP, NULL, 0, (float *)(buf + xb_bytes + part),
                   (float *)(buf + xb_bytes), &sl);
    return 0;
}

/* Columns [c0, c1) of a dense bf16 weight [N, K] (K % 32 == 0), all M rows of x: here
   the weight's rows are the A tiles as they lie in memory (a part group copied out
   with zero rows after it), and x, rounded to bf16 once a call, the B tiles (x^T as
   bf16 pairs: pair p of row r at [p][r]), so a tile sums over all of K before it is
   stored (y^T, 16 columns by 16 rows). 0, or -1 when AMX or the scratch could not be
   had. */
static int amx_dense_cols(const lin_t *L, const float *x, int64_t M, int64_t xs, int64_t c0,
                          int64_t c1, float *y, int64_t ys) {
    if (!amx_ready()) return -1;
    const int64_t K = L->k, nk = K / QK, T = (M + 15) / 16;
    const size_t xv_bytes = (size_t)(T * nk) * 1024, tail_bytes = (size_t)(GROUP * K) * 2;
    char *buf = dp_buffer(xv_bytes + tail_bytes + 2 * 1024);
    if (buf == NULL) return -1;
    uint32_t *xv = (uint32_t *)buf; /* [T][nk][16 pairs][16 rows] */
    uint16_t *tail = (uint16_t *)(buf + xv_bytes);
    float *cb = (float *)(buf + xv_bytes + tail_bytes);
    memset(xv, 0, xv_bytes);
    const __m512i at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    for (int64_t r = 0; r < M; r++)
        for (int64_t kc = 0; kc < nk; kc++) {
            const float *p = x + r * xs + kc * QK;
            const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            _mm512_i32scatter_epi32(xv + ((r / 16) * nk + kc) * 256 + r % 16, at, v, 4);
        }
    const uint16_t *w = (const uint16_t *)L->w;
    const int64_t wstride = K * 2;
    amx_configure();
    for (int64_t n0 = c0; n0 < c1; n0 += GROUP) {
        const int64_t cols = c1 - n0 < GROUP ? c1 - n0 : GROUP;
        const uint16_t *wn = w + n0 * K;
        if (cols < GROUP) {
            memcpy(tail, wn, (size_t)(cols * K) * 2);
            memset(tail + cols * K, 0, (size_t)((GROUP - cols) * K) * 2);
            wn = tail;
        }
        for (int64_t t0 = 0; t0 < T; t0 += 2) {
            const int two = t0 + 1 < T;
            const uint32_t *x0 = xv + t0 * nk * 256, *x1 = x0 + nk * 256;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t kc = 0; kc < nk; kc++) {
                AMX_LOADD(2, wn + kc * QK, wstride);
                AMX_LOADD(3, x0 + kc * 256, 64);
                _tile_dpbf16ps(0, 2, 3);
                if (two) {
                    AMX_LOADD(4, x1 + kc * 256, 64);
                    _tile_dpbf16ps(1, 2, 4);
                }
            }
            _tile_stored(0, cb, 64);
            _tile_stored(1, cb + 256, 64);
            for (int64_t t = 0; t < 1 + two; t++) {
                const int64_t r0 = (t0 + t) * 16, rows = M - r0 < 16 ? M - r0 : 16;
                for (int64_t n = 0; n < cols; n++)
                    for (int64_t r = 0; r < rows; r++) y[(r0 + r) * ys + n0 + n] = cb[t * 256 + n * 16 + r];
            }
        }
    }
    _tile_release();
    return 0;
}

#endif
