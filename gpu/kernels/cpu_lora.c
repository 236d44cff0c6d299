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

static void widen_row(const void *src, int bf16, float *dst, int64_t n) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_f32(((const uint16_t *)src)[i]);
    else
        for (int64_t i = 0; i < n; i++) dst[i] = ((const float *)src)[i];
}

/* x [rows, k] (row stride xs), y [rows, n] (row stride ys, unit column stride), both
   fp32 or both bf16 (act_bf16); the weights as lora_t says. Returns 0, or -1 when the
   rank is over LORA_MAX_RANK or scratch memory could not be allocated. */
int actorlm_lora_apply(const void *x, int64_t xs, void *y, int64_t ys, int64_t act_bf16,
                       int64_t rows, const int32_t *row_slots, const lora_t *L, int threads) {
    const int64_t esize = act_bf16 ? 2 : 4, k = L->k, n = L->n;
    int64_t work = 0;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t r = lora_rank(L, row_slots[t]);
        if (r > LORA_MAX_RANK) return -1;
        work += r * (k + n);
    }
    if (work == 0) return 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (work >= PAR_MIN_MACS)
    {
        float *buf = act_bf16 ? malloc(sizeof(float) * (size_t)(k + n)) : NULL;
        if (act_bf16 && buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            const int64_t slot = row_slots[t];
            if (lora_rank(L, slot) == 0 || (act_bf16 && buf == NULL)) continue;
            const char *xr = (const char *)x + t * xs * esize;
            char *yr = (char *)y + t * ys * esize;
            if (!act_bf16) {
                lora_token(L, slot, (const float *)xr, (float *)yr, 0, n);
                continue;
            }
            float *xf = buf, *yf = buf + k;
            widen_row(xr, 1, xf, k);
            widen_row(yr, 1, yf, n);
            lora_token(L, slot, xf, yf, 0, n);
            for (int64_t i = 0; i < n; i++) ((uint16_t *)yr)[i] = f32_bf16(yf[i]);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
