/* One linear layer, y[M, N] = x[M, K] @ W^T (+ bias), for small M: the kernels of
 * gemv.h (GGUF blocks, or dense fp32/bf16/fp16 rows) over OpenMP threads, x and y in
 * fp32 or bf16 (widened to fp32 before, rounded after: the arithmetic is fp32 either
 * way, so a bf16 model decodes at the fp32 model's speed).
 *
 * Built by actorlm/gpu/kernels/native.py; gpu/kernels/qgemm.py packs the weights.
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include "gemv.h"

/* Returns 0, or -1 when the bf16 staging buffers could not be allocated. */
int actorlm_linear(const lin_t *L, const void *x, int64_t x_bf16, int64_t M, int64_t xs, void *y,
                   int64_t y_bf16, int64_t ys, int threads) {
    const int64_t N = L->n, K = L->k;
    const float *xf = (const float *)x;
    float *yf = (float *)y, *xbuf = NULL, *ybuf = NULL;
    if (x_bf16) {
        xbuf = malloc(sizeof(float) * (size_t)(M * K));
        if (xbuf == NULL) return -1;
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) xbuf[r * K + k] = bf16_f32(((const uint16_t *)x)[r * xs + k]);
        xf = xbuf, xs = K;
    }
    if (y_bf16) {
        ybuf = malloc(sizeof(float) * (size_t)(M * N));
        if (ybuf == NULL) {
            free(xbuf);
            return -1;
        }
        yf = ybuf;
    }
    const int64_t yfs = y_bf16 ? N : ys;
    /* waking the pool costs more than a small layer's work on one thread */
    const int nt = N * K * M < 65536 ? 1 : threads;
#pragma omp parallel num_threads(nt)
    {
        int64_t c0, c1;
        lin_part(N, omp_get_thread_num(), omp_get_num_threads(), &c0, &c1);
        lin_cols(L, xf, M, xs, c0, c1, yf, yfs);
    }
    if (y_bf16)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) ((uint16_t *)y)[r * ys + n] = f32_bf16(ybuf[r * N + n]);
    free(xbuf);
    free(ybuf);
    return 0;
}

/* 1 where this build runs block and dense bf16 rows on AMX tiles (the CPU has them and
   the kernel granted their state), else 0. */
int actorlm_amx_ready(void) {
#if defined(__AMX_BF16__)
    return amx_ready();
#else
    return 0;
#endif
}
