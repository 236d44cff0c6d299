/* One linear layer, y[M, N] = x[M, K] @ W^T (+ bias), for small M: the kernels of
 * gemv.h (GGUF blocks, or dense fp32/bf16/fp16 rows) over OpenMP threads, x and y in
 * fp32 or bf16 (widened to fp32 before, or quantized straight to int8 rows, rounded
 * after: the arithmetic is the same either way, so a bf16 model decodes at the fp32
 * model's speed).
 *
 * Built by actorlm/gpu/kernels/native.py; gpu/kernels/qgemm.py packs the weights.
 */
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include "gemv.h"

/* n bf16 values widened to fp32, and back (rounding to nearest even) */
static void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) *(vf *)(dst + i) = load_bf16(src + i);
    for (; i < n; i++) dst[i] = bf16_f32(src[i]);
}
static void narrow_bf16(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + VW <= n; i += VW) store_bf16(dst + i, *(const vf *)(src + i));
    for (; i < n; i++) dst[i] = f32_bf16(src[i]);
}

/* Staging kept between calls, a buffer per thread, given back above STAGE_KEEP bytes:
   the calling thread's for the fp32 result of bf16 outputs, and each thread's own for
   bf16 rows widened to fp32. Allocated anew, a prompt's 1.2 MB buffers faulted their
   pages in at every call; widened once and shared, the rows one thread wrote reached
   the other a cache line at a time (576x576 at 512 rows, two threads: 1.12 ms against
   0.64 for fp32 rows; each thread widening its own copy costs it ~40 us). */
#define STAGE_KEEP ((size_t)64 << 20)
static __thread void *y_stage, *x_stage;
static __thread size_t y_stage_bytes, x_stage_bytes;

/* Block weights on int8 rows (act_int8): the rows quantized once a call, each thread
   its share straight from fp32 or bf16 into this buffer (the calling thread's), which
   every thread then reads, where lin_cols alone has each thread widen bf16 rows and
   quantize all of them (the default model's four linears of a layer at 512 bf16 rows,
   two threads of a 2-core Zen 4: 7.62 -> 7.32 ms, the same bits). */
static __thread void *q_stage;
static __thread size_t q_stage_bytes;

static void stage_trim(void **buf, size_t *bytes) {
    if (*bytes > STAGE_KEEP) { /* a rare large call: give it back */
        free(*buf);
        *buf = NULL, *bytes = 0;
    }
}

/* Returns 0, or -1 when the bf16 staging buffers could not be allocated. */
int actorlm_linear(const lin_t *L, const void *x, int64_t x_bf16, int64_t M, int64_t xs, void *y,
                   int64_t y_bf16, int64_t ys, int threads) {
    const int64_t N = L->n, K = L->k;
    if (M == 0 || N == 0) return 0;
    float *ybuf = y_bf16 ? grow_buffer(&y_stage, &y_stage_bytes, (size_t)(M * N) * 4) : NULL;
    if (y_bf16 && ybuf == NULL) return -1;
    float *yf = y_bf16 ? ybuf : (float *)y;
    const int64_t yfs = y_bf16 ? N : ys;
    int failed = 0;
    /* waking the pool costs more than a small layer's work on one thread */
    const int nt = N * K * M < 65536 ? 1 : threads;
    int8_t *qx = NULL;
#if defined(ACTORLM_INT8)
    float *dx = NULL, *sx = NULL;
    if (i8_first(L, M) && i8_scratch_in(&q_stage, &q_stage_bytes, M, K, &qx, &dx, &sx)) qx = NULL;
#endif
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t c0, c1;
        lin_part(N, t, T, &c0, &c1);
        if (qx != NULL) { /* the same branch on every thread: each meets the barrier */
#if defined(ACTORLM_INT8)
            const int64_t r0 = M * t / T, r1 = M * (t + 1) / T, nb = K / QK;
            const char *xr = (const char *)x + r0 * xs * (x_bf16 ? 2 : 4);
            i8_quantize(L, xr, (int)x_bf16, r1 - r0, xs, qx + r0 * K, dx + r0 * nb, sx + r0 * nb);
#pragma omp barrier
            i8_cols_q(L, qx, dx, sx, M, c0, c1, yf, yfs);
#endif
        } else {
            const float *xf = (const float *)x;
            int64_t xfs = xs;
            if (x_bf16) {
                float *xbuf = grow_buffer(&x_stage, &x_stage_bytes, (size_t)(M * K) * 4);
                if (xbuf != NULL)
                    for (int64_t r = 0; r < M; r++) widen_bf16((const uint16_t *)x + r * xs, xbuf + r * K, K);
                xf = xbuf, xfs = K;
            }
            if (xf == NULL)
                failed = 1;
            else
                lin_cols(L, xf, M, xfs, c0, c1, yf, yfs);
            stage_trim(&x_stage, &x_stage_bytes);
        }
        if (!failed && y_bf16 && c1 > c0)
            for (int64_t r = 0; r < M; r++)
                narrow_bf16(ybuf + r * N + c0, (uint16_t *)y + r * ys + c0, c1 - c0);
    }
    stage_trim(&y_stage, &y_stage_bytes);
    stage_trim(&q_stage, &q_stage_bytes);
    return failed ? -1 : 0;
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

/* L's weight rounded to bf16 as amx.h's B tiles, into out: [ceil(n / 16)][k / 32][16 x 16
   dwords], block b of group g as amx_expand writes it (out 64-byte aligned). 0, or -1
   where this build has no tiles or k is not whole blocks. */
int actorlm_amx_tiles(const lin_t *L, uint32_t *out, int threads) {
#if defined(__AMX_BF16__)
    if (L->k % QK || (L->kind != LIN_BF16 && L->kind != LIN_Q4_1 && L->kind != LIN_Q8_0)) return -1;
    const int64_t groups = (L->n + GROUP - 1) / GROUP, nb = L->k / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++) amx_expand(L, g, b, (__m512i *)out + (g * nb + b) * 16);
    return 0;
#else
    (void)L, (void)out, (void)threads;
    return -1;
#endif
}

/* 1 where this build quantizes the rows of linears with act_int8 to int8 (dpi8.h). */
int actorlm_int8_ready(void) {
#if defined(ACTORLM_INT8)
    return 1;
#else
    return 0;
#endif
}
