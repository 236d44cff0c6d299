/* y[M, N] = x[M, K] @ W^T for W in GGUF's 32-wide block formats, fp32 activations.
 *
 *   Q4_1: w = q * d + m, q in 0..15;   Q8_0: w = q * d, q in -127..127;
 *
 * with d (and m) fp32 per block of 32 weights along K. The weights are stored
 * interleaved by 8 output rows (a "group"), so one vector holds the same k of 8
 * rows: group g, block b is at (g * K/32 + b), its scales are 8 floats (one per
 * row) and its codes, for each k, 8 bytes (Q8_0), or for each pair of k 8 bytes
 * whose low nibbles are k and high nibbles k + 1 (Q4_1).
 *
 * For each k a group's 8 weights expand to fp32 once and meet each row of x as a
 * broadcast multiply-add into that row's 8 outputs (an outer product, as fbgemm
 * does for fp16), so a decode step reads 4.5 (Q4_1) or 8.5 (Q8_0) bits a weight
 * instead of fp16's 16 and the arithmetic is fp32 on the file's exact values.
 * Groups split over OpenMP threads.
 *
 * Built by actorlm/gpu/native.py; gpu/qgemm.py packs the weights.
 */
#include <stdint.h>
#include "simd.h"

#define QK 32
#define MT_MAX 8 /* rows of x a tile: 8 accumulators */

#if defined(__AVX2__)
#include <immintrin.h>
/* 8 bytes to 8 int32 lanes */
static inline v8i widen_u8(const uint8_t *p) {
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline v8i widen_s8(const int8_t *p) {
    return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#else /* portable: correct, not fast (the gguf method needs fbgemm, an x86 build, anyway) */
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
#endif

/* Rows [0, MT) of x against group g. With few rows each row gets 2 or 4
   accumulators (8 in all), so the chains of dependent multiply-adds stay short. */
static inline __attribute__((always_inline)) void tile(
    const int q4, const float *x, int64_t xs, const uint8_t *q, const float *d, const float *mn,
    int64_t nb, int64_t g, float *y, int64_t ys, int64_t N, const int MT) {
    const int acc_n = MT <= 2 ? 4 : MT <= 4 ? 2 : 1;
    v8f acc[MT_MAX]; /* row r's a-th at r * acc_n + a: at most 8, all in registers */
#pragma GCC unroll 8
    for (int i = 0; i < MT_MAX; i++) acc[i] = (v8f){0};
    for (int64_t b = 0; b < nb; b++) {
        const int64_t blk = g * nb + b;
        const v8f dv = *(const v8f *)(d + blk * 8);
        const float *xb = x + b * QK;
        if (q4) {
            const v8f mv = *(const v8f *)(mn + blk * 8);
            const uint8_t *qb = q + blk * 128;
            for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 2
                for (int j = 0; j < 4; j += 2) { /* k + j and k + j + 1 share 8 bytes */
                    const v8i v = widen_u8(qb + (k + j) * 4);
                    const v8f w0 = __builtin_convertvector(v & 15, v8f) * dv + mv;
                    const v8f w1 = __builtin_convertvector(v >> 4, v8f) * dv + mv;
#pragma GCC unroll 8
                    for (int r = 0; r < MT; r++) {
                        acc[r * acc_n + j % acc_n] += xb[r * xs + k + j] * w0;
                        acc[r * acc_n + (j + 1) % acc_n] += xb[r * xs + k + j + 1] * w1;
                    }
                }
            }
        } else {
            const int8_t *qb = (const int8_t *)q + blk * 256;
            for (int k = 0; k < QK; k += 4) {
#pragma GCC unroll 4
                for (int j = 0; j < 4; j++) {
                    const v8f w = __builtin_convertvector(widen_s8(qb + (k + j) * 8), v8f) * dv;
#pragma GCC unroll 8
                    for (int r = 0; r < MT; r++) acc[r * acc_n + j % acc_n] += xb[r * xs + k + j] * w;
                }
            }
        }
    }
    const int64_t n0 = g * 8;
#pragma GCC unroll 8
    for (int r = 0; r < MT; r++) {
        v8f s = acc[r * acc_n];
#pragma GCC unroll 4
        for (int a = 1; a < acc_n; a++) s += acc[r * acc_n + a];
        float *yr = y + r * ys + n0;
        if (n0 + 8 <= N)
            *(v8f *)yr = s;
        else
            for (int64_t n = 0; n < N - n0; n++) yr[n] = s[n];
    }
}

static inline __attribute__((always_inline)) void gemm(
    const int q4, const float *x, int64_t M, int64_t xs, const uint8_t *q, const float *d,
    const float *mn, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    const int64_t nb = K / QK, groups = (N + 7) / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t m0 = 0; m0 < M; m0 += MT_MAX) {
            const float *xm = x + m0 * xs;
            float *ym = y + m0 * ys;
            switch (M - m0 < MT_MAX ? M - m0 : MT_MAX) {
#define TILE(k) \
    case k: tile(q4, xm, xs, q, d, mn, nb, g, ym, ys, N, k); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
#undef TILE
            }
        }
    }
}

void actorlm_gemm_q4_1(const float *x, int64_t M, int64_t xs, const uint8_t *q, const float *d,
                       const float *m, int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemm(1, x, M, xs, q, d, m, N, K, y, ys, threads);
}

void actorlm_gemm_q8_0(const float *x, int64_t M, int64_t xs, const int8_t *q, const float *d,
                       int64_t N, int64_t K, float *y, int64_t ys, int threads) {
    gemm(0, x, M, xs, (const uint8_t *)q, d, NULL, N, K, y, ys, threads);
}
