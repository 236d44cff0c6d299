/* One projection's LoRA deltas for rows of one slot, y += (x A^T) B^T, over the adapter slots
 * as the worker's pool keeps them on the CPU (gpu/lora/pool.py, rank-major): slot s's
 * rank-j row of A is a + (j * slots + s) * k, of B (the scaling folded in) b + (j *
 * slots + s) * n; past a slot's rank both are zero and never read. Weights fp32 or
 * bf16, activations fp32.
 *
 * A row's delta is a few thousand multiply-adds against weights that stay in L1/L2
 * while the rows of one slot pass (a step groups its rows by slot), LORA_MB rows at a
 * time; torch spends more on dispatching its index_select/bmm chain than on the
 * arithmetic.
 * Included by cpu_lora.c (one projection per call, the model's torch path) and
 * cpu_step.c (inside the fused decode step).
 */
#ifndef ACTORLM_LORA_H
#define ACTORLM_LORA_H
#include <stdint.h>
#include "simd.h"

#define LORA_MAX_RANK 256 /* the largest rank a token's shrink keeps on the stack */

typedef struct {
    const void *a, *b;     /* one layer's [R, slots, k] and [R, slots, n] */
    const int32_t *ranks;  /* [slots]: each slot's rank for this projection (0: none) */
    int64_t k, n, slots, bf16;
} lora_t;

static inline int64_t lora_rank(const lora_t *L, int64_t slot) {
    return slot < 0 || L->a == 0 ? 0 : L->ranks[slot];
}

static inline __attribute__((always_inline)) vf lora_load(const void *w, int bf16, int64_t i) {
    return bf16 ? load_bf16((const uint16_t *)w + i) : *(const vf *)((const float *)w + i);
}

static inline float lora_at(const void *w, int bf16, int64_t i) {
    return bf16 ? bf16_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#define LORA_RB 4 /* ranks a shrink pass computes together: independent accumulators */
#define LORA_CB 4 /* output vectors an expand pass computes together */

/* Several rows of one slot at once (a prompt's rows, or a slot's rows of a decode step):
   each weight vector loaded (and widened) once serves LORA_MB rows, so a pass is
   LORA_MB * 4 independent multiply-adds per 4 + LORA_MB loads, where a row at a time is
   4 per 8. u row m is u + m * us; x and y rows m are x + m * xs and y + m * ys. */
#if VW == 16
#define LORA_MB 4 /* 16 accumulators of 32 registers */
#else
#define LORA_MB 2 /* 8 of 16 */
#endif

static inline __attribute__((always_inline)) void lora_shrink_rows_t(
    const lora_t *L, int64_t slot, const float *x, int64_t xs, float *u, int64_t us,
    const int mb, const int bf16) {
    const int64_t r = L->ranks[slot], k = L->k, esize = bf16 ? 2 : 4;
    const int64_t rank_step = L->slots * k * esize;
    const char *a0 = (const char *)L->a + slot * k * esize;
    int64_t j = 0;
    for (; j + LORA_RB <= r; j += LORA_RB) {
        const char *row = a0 + j * rank_step;
        vf acc[LORA_MB][LORA_RB] = {{{0}}};
        int64_t i = 0;
        for (; i + VW <= k; i += VW) {
            vf xv[LORA_MB];
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) xv[m] = *(const vf *)(x + m * xs + i);
#pragma GCC unroll 4
            for (int q = 0; q < LORA_RB; q++) {
                const vf av = lora_load(row + q * rank_step, bf16, i);
#pragma GCC unroll 4
                for (int m = 0; m < mb; m++) acc[m][q] += av * xv[m];
            }
        }
        for (int m = 0; m < mb; m++)
            for (int q = 0; q < LORA_RB; q++) {
                float s = hsumv(acc[m][q]);
                for (int64_t t = i; t < k; t++) s += lora_at(row + q * rank_step, bf16, t) * x[m * xs + t];
                u[m * us + j + q] = s;
            }
    }
    for (int m = 0; j < r && m < mb; m++) { /* the last ranks, a row at a time */
        for (int64_t jj = j; jj < r; jj++) {
            const char *row = a0 + jj * rank_step;
            vf acc = {0};
            int64_t i = 0;
            for (; i + VW <= k; i += VW) acc += lora_load(row, bf16, i) * *(const vf *)(x + m * xs + i);
            float s = hsumv(acc);
            for (; i < k; i++) s += lora_at(row, bf16, i) * x[m * xs + i];
            u[m * us + jj] = s;
        }
    }
}

static inline __attribute__((always_inline)) void lora_expand_rows_t(
    const lora_t *L, int64_t slot, const float *u, int64_t us, float *y, int64_t ys, int64_t c0,
    int64_t c1, const int mb, const int bf16) {
    const int64_t r = L->ranks[slot], n = L->n, esize = bf16 ? 2 : 4, w = c1 - c0;
    const char *b0 = (const char *)L->b + (slot * n + c0) * esize;
    const int64_t rank_step = L->slots * n * esize;
    int64_t i = 0;
    for (; i + LORA_CB * VW <= w; i += LORA_CB * VW) {
        vf acc[LORA_MB][LORA_CB];
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++)
#pragma GCC unroll 4
            for (int q = 0; q < LORA_CB; q++) acc[m][q] = *(const vf *)(y + m * ys + i + q * VW);
        for (int64_t j = 0; j < r; j++) {
            const char *row = b0 + j * rank_step;
            vf bv[LORA_CB];
#pragma GCC unroll 4
            for (int q = 0; q < LORA_CB; q++) bv[q] = lora_load(row, bf16, i + q * VW);
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) {
                const float um = u[m * us + j];
#pragma GCC unroll 4
                for (int q = 0; q < LORA_CB; q++) acc[m][q] += um * bv[q];
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++)
#pragma GCC unroll 4
            for (int q = 0; q < LORA_CB; q++) *(vf *)(y + m * ys + i + q * VW) = acc[m][q];
    }
    for (int m = 0; i < w && m < mb; m++) { /* the last columns, a row at a time */
        const float *um = u + m * us;
        float *ym = y + m * ys;
        int64_t c = i;
        for (; c + VW <= w; c += VW) {
            vf acc = *(const vf *)(ym + c);
            for (int64_t j = 0; j < r; j++) acc += um[j] * lora_load(b0 + j * rank_step, bf16, c);
            *(vf *)(ym + c) = acc;
        }
        for (; c < w; c++) {
            float acc = ym[c];
            for (int64_t j = 0; j < r; j++) acc += um[j] * lora_at(b0 + j * rank_step, bf16, c);
            ym[c] = acc;
        }
    }
}

/* mb (1 <= mb <= LORA_MB) rows of one slot: a copy for each mb and weight dtype, so
   the loops over rows unroll and the inner loops do not branch */
#if LORA_MB == 4
#define LORA_SWITCH(CALL)                                                               \
    switch (L->bf16 * 8 + mb) {                                                        \
        case 1: CALL(1, 0); break;                                                     \
        case 2: CALL(2, 0); break;                                                     \
        case 3: CALL(3, 0); break;                                                     \
        case 4: CALL(4, 0); break;                                                     \
        case 9: CALL(1, 1); break;                                                     \
        case 10: CALL(2, 1); break;                                                    \
        case 11: CALL(3, 1); break;                                                    \
        case 12: CALL(4, 1); break;                                                    \
    }
#else
#define LORA_SWITCH(CALL)                                                               \
    switch (L->bf16 * 8 + mb) {                                                        \
        case 1: CALL(1, 0); break;                                                     \
        case 2: CALL(2, 0); break;                                                     \
        case 9: CALL(1, 1); break;                                                     \
        case 10: CALL(2, 1); break;                                                    \
    }
#endif

/* u[m * us + j] = x[m * xs:] . A[j, slot] for rows m < mb, j < the slot's rank */
static inline void lora_shrink_rows(const lora_t *L, int64_t slot, const float *x, int64_t xs,
                                    float *u, int64_t us, int mb) {
#define SHRINK(MB, BF) lora_shrink_rows_t(L, slot, x, xs, u, us, MB, BF)
    LORA_SWITCH(SHRINK)
#undef SHRINK
}

/* y[m * ys:][0, c1 - c0) += u[m * us:] B[:, slot, c0:c1) for rows m < mb (y at column c0) */
static inline void lora_expand_rows(const lora_t *L, int64_t slot, const float *u, int64_t us,
                                    float *y, int64_t ys, int64_t c0, int64_t c1, int mb) {
#define EXPAND(MB, BF) lora_expand_rows_t(L, slot, u, us, y, ys, c0, c1, MB, BF)
    LORA_SWITCH(EXPAND)
#undef EXPAND
}
#undef LORA_SWITCH

/* The end of the block of rows from b: at most LORA_MB rows of b's slot, before hi */
static inline int64_t lora_block_end(const int32_t *row_slots, int64_t b, int64_t hi) {
    int64_t e = b + 1;
    while (e < hi && e - b < LORA_MB && row_slots[e] == row_slots[b]) e++;
    return e;
}

/* Rows m < mb of x (stride xs) and y (stride ys, pointing at column c0), all of slot
   `slot`: y[m][c0:c1) += delta of x[m] (both fp32). */
static inline void lora_rows(const lora_t *L, int64_t slot, const float *x, int64_t xs, float *y,
                             int64_t ys, int64_t c0, int64_t c1, int mb) {
    if (lora_rank(L, slot) == 0) return;
    float u[LORA_MB * LORA_MAX_RANK];
    lora_shrink_rows(L, slot, x, xs, u, LORA_MAX_RANK, mb);
    lora_expand_rows(L, slot, u, LORA_MAX_RANK, y, ys, c0, c1, mb);
}

#endif
