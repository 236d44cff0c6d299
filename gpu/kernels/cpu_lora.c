/* One projection's LoRA deltas over a batch, in place: y[t] += (x[t] A^T) B^T with the
 * weights of row t's adapter slot (row_slots[t]; < 0: a base-model row, left alone).
 *
 * Replaces the model path's chain of index_select, two bmm, index_select and add per
 * projection (~1,000 small torch ops a decode step with 8 adapters) with one call.
 * Activations fp32 or bf16 (the delta is summed in fp32 and y rounded once), weights
 * fp32 or bf16 in the pool's rank-major layout (lora.h). Rows split over OpenMP
 * threads only when there is enough work to pay for waking the pool. Built by
 * gpu/kernels/native.py; gpu/kernels/lora.py is the Python side.
 */
#include <stdint.h>
#include <stdlib.h>
#include "lora.h"

#define PAR_MIN_MACS (1 << 20) /* below this, one thread: waking the pool costs more */

static void widen_rows(const uint16_t *src, int64_t stride, int mb, float *dst, int64_t n) {
    for (int m = 0; m < mb; m++) {
        const uint16_t *s = src + m * stride;
        float *d = dst + m * n;
        int64_t i = 0;
        for (; i + VW <= n; i += VW) *(vf *)(d + i) = load_bf16(s + i);
        for (; i < n; i++) d[i] = bf16_f32(s[i]);
    }
}

static void narrow_rows(const float *src, int mb, int64_t n, uint16_t *dst, int64_t stride) {
    for (int m = 0; m < mb; m++) {
        const float *s = src + m * n;
        uint16_t *d = dst + m * stride;
        int64_t i = 0;
        for (; i + VW <= n; i += VW) store_bf16(d + i, *(const vf *)(s + i));
        for (; i < n; i++) d[i] = f32_bf16(s[i]);
    }
}

/* x [rows, k] (row stride xs), y [rows, n] (row stride ys, unit column stride), both
   fp32 or both bf16 (act_bf16); the weights as lora_t says. Runs of rows with the same
   slot (a step groups its rows by slot) go LORA_MB rows at a time (lora_rows). Returns
   0, or -1 when the rank is over LORA_MAX_RANK or scratch memory could not be allocated. */
int actorlm_lora_apply(const void *x, int64_t xs, void *y, int64_t ys, int64_t act_bf16,
                       int64_t rows, const int32_t *row_slots, const lora_t *L, int threads) {
    const int64_t esize = act_bf16 ? 2 : 4, k = L->k, n = L->n;
    int64_t work = 0, nblocks = 0;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(rows + 1));
    if (first == NULL) return -1;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t r = lora_rank(L, row_slots[t]);
        if (r > LORA_MAX_RANK) {
            free(first);
            return -1;
        }
        work += r * (k + n);
        if (r == 0) continue;
        /* a block: up to LORA_MB consecutive rows of one slot */
        const int64_t b = nblocks - 1;
        if (b < 0 || t - first[b] >= LORA_MB || row_slots[t - 1] != row_slots[t])
            first[nblocks++] = t;
    }
    first[nblocks] = rows;
    int failed = 0;
    if (work == 0) goto done;
#pragma omp parallel num_threads(threads) if (work >= PAR_MIN_MACS)
    {
        float *buf = act_bf16 ? malloc(sizeof(float) * (size_t)(LORA_MB * (k + n))) : NULL;
        if (act_bf16 && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; blk++) {
            const int64_t t0 = first[blk], slot = row_slots[t0];
            int mb = 1; /* the block's rows: up to the next block or the first other slot */
            while (t0 + mb < first[blk + 1] && row_slots[t0 + mb] == slot) mb++;
            const char *xr = (const char *)x + t0 * xs * esize;
            char *yr = (char *)y + t0 * ys * esize;
            if (!act_bf16) {
                lora_rows(L, slot, (const float *)xr, xs, (float *)yr, ys, 0, n, mb);
                continue;
            }
            if (buf == NULL) continue;
            float *xf = buf, *yf = buf + LORA_MB * k;
            widen_rows((const uint16_t *)xr, xs, mb, xf, k);
            widen_rows((const uint16_t *)yr, ys, mb, yf, n);
            lora_rows(L, slot, xf, k, yf, n, 0, n, mb);
            narrow_rows(yf, mb, n, (uint16_t *)yr, ys);
        }
        free(buf);
    }
done:
    free(first);
    return failed ? -1 : 0;
}
