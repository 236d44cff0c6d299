/* One projection's LoRA delta for one token, y += (x A^T) B^T, over the adapter slots
 * as the worker's pool keeps them on the CPU (gpu/lora/pool.py, rank-major): slot s's
 * rank-j row of A is a + (j * slots + s) * k, of B (the scaling folded in) b + (j *
 * slots + s) * n; past a slot's rank both are zero and never read. Weights fp32 or
 * bf16, activations fp32.
 *
 * At decode sizes a token's delta is a few thousand multiply-adds against weights
 * that stay in L1/L2 while the rows of one slot pass (the batch is grouped by slot);
 * torch spends more on dispatching its index_select/bmm chain than on the arithmetic.
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

/* u[j] = x . A[j, slot] for j < rank, LORA_RB ranks a pass over x (one dot product at
   a time would wait on each multiply-add's latency) */
static inline __attribute__((always_inline)) void lora_shrink_t(const lora_t *L, int64_t slot,
                                                                const float *x, float *u,
                                                                const int bf16) {
    const int64_t r = L->ranks[slot], k = L->k, esize = bf16 ? 2 : 4;
    const int64_t rank_step = L->slots * k * esize;
    const char *a0 = (const char *)L->a + slot * k * esize;
    int64_t j = 0;
    for (; j + LORA_RB <= r; j += LORA_RB) {
        const char *row = a0 + j * rank_step;
        vf acc[LORA_RB] = {{0}};
        int64_t i = 0;
        for (; i + VW <= k; i += VW) {
            const vf xv = *(const vf *)(x + i);
#pragma GCC unroll 4
            for (int q = 0; q < LORA_RB; q++) acc[q] += lora_load(row + q * rank_step, bf16, i) * xv;
        }
        for (int q = 0; q < LORA_RB; q++) {
            float s = hsumv(acc[q]);
            for (int64_t t = i; t < k; t++) s += lora_at(row + q * rank_step, bf16, t) * x[t];
            u[j + q] = s;
        }
    }
    for (; j < r; j++) {
        const char *row = a0 + j * rank_step;
        vf acc = {0};
        int64_t i = 0;
        for (; i + VW <= k; i += VW) acc += lora_load(row, bf16, i) * *(const vf *)(x + i);
        float s = hsumv(acc);
        for (; i < k; i++) s += lora_at(row, bf16, i) * x[i];
        u[j] = s;
    }
}

/* y[i] += sum_j u[j] B[j, slot, c0 + i] for i < c1 - c0 (y points at column c0),
   LORA_CB vectors of y a pass over the ranks */
static inline __attribute__((always_inline)) void lora_expand_t(const lora_t *L, int64_t slot,
                                                                const float *u, float *y,
                                                                int64_t c0, int64_t c1,
                                                                const int bf16) {
    const int64_t r = L->ranks[slot], n = L->n, esize = bf16 ? 2 : 4, w = c1 - c0;
    const char *b0 = (const char *)L->b + (slot * n + c0) * esize;
    const int64_t rank_step = L->slots * n * esize;
    int64_t i = 0;
    for (; i + LORA_CB * VW <= w; i += LORA_CB * VW) {
        vf acc[LORA_CB];
#pragma GCC unroll 4
        for (int q = 0; q < LORA_CB; q++) acc[q] = *(const vf *)(y + i + q * VW);
        for (int64_t j = 0; j < r; j++) {
            const char *row = b0 + j * rank_step;
#pragma GCC unroll 4
            for (int q = 0; q < LORA_CB; q++) acc[q] += u[j] * lora_load(row, bf16, i + q * VW);
        }
#pragma GCC unroll 4
        for (int q = 0; q < LORA_CB; q++) *(vf *)(y + i + q * VW) = acc[q];
    }
    for (; i + VW <= w; i += VW) {
        vf acc = *(const vf *)(y + i);
        for (int64_t j = 0; j < r; j++) acc += u[j] * lora_load(b0 + j * rank_step, bf16, i);
        *(vf *)(y + i) = acc;
    }
    for (; i < w; i++) {
        float acc = y[i];
        for (int64_t j = 0; j < r; j++) acc += u[j] * lora_at(b0 + j * rank_step, bf16, i);
        y[i] = acc;
    }
}

/* (the weights' dtype a constant in each copy: no branch in the inner loops) */
static inline void lora_shrink(const lora_t *L, int64_t slot, const float *x, float *u) {
    if (L->bf16)
        lora_shrink_t(L, slot, x, u, 1);
    else
        lora_shrink_t(L, slot, x, u, 0);
}

static inline void lora_expand(const lora_t *L, int64_t slot, const float *u, float *y,
                               int64_t c0, int64_t c1) {
    if (L->bf16)
        lora_expand_t(L, slot, u, y, c0, c1, 1);
    else
        lora_expand_t(L, slot, u, y, c0, c1, 0);
}

/* A whole token: y[c0:c1) += delta of x (both fp32; y points at column c0). */
static inline void lora_token(const lora_t *L, int64_t slot, const float *x, float *y,
                              int64_t c0, int64_t c1) {
    if (lora_rank(L, slot) == 0) return;
    float u[LORA_MAX_RANK];
    lora_shrink(L, slot, x, u);
    lora_expand(L, slot, u, y, c0, c1);
}

#endif
