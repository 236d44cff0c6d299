/* Causal attention of one sequence's new tokens (a prompt, or a chunk extending a cached
 * prefix) over the paged pool, flash style: fp32 arithmetic, q/out and K/V in fp32 or
 * bf16.
 *
 * torch's CPU flash attention runs a bf16 prompt of 512 tokens at ~30 GFLOP/s on one
 * core (~40% of a bf16 prefill of the default model). Here a task is one KV head and
 * QB query tokens, for all G query heads that share the KV head (GQA reads K and V
 * once for them): each block of KB keys is widened to fp32 once (K transposed, so a
 * score row is broadcast multiply-adds over D, no horizontal sums) and serves the task's
 * G * QB rows; an online softmax keeps each row's running max, sum and output. The new
 * tokens' K and V are already in the pool (KVPool.write runs first), so a prompt and an
 * extension are the same case: token t (at position start + t) sees positions
 * [0, start + t].
 *
 * Builds with AVX512-BF16 run bf16 prompts (all of q, the pool and out bf16) through
 * flash.h's bf16 products instead: on AMX tiles where the CPU has them, else on its
 * dot products (a 512-token prompt of the default model, 2-core Zen 4: the whole
 * prefill from ~400 to ~320 ms, its attention ~4x faster).
 *
 * Built by actorlm/gpu/kernels/native.py; gpu/kernels/attention.py binds it and the
 * cpu attention backend calls it.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#if defined(__AVX512BF16__)
#include "flash.h"
#endif

#define QB 64   /* query tokens a task: K's transpose serves G * QB rows */
#define KB 64   /* keys a block */
#define DMAX 256

static inline float at(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* s[0, KB) = q . kt[:, j] for one row: D broadcast multiply-adds into KB / VW vectors */
static inline void score_row(const float *q, const float *kt, int64_t D, float *s) {
    vf acc[KB / VW];
#pragma GCC unroll 8
    for (int j = 0; j < KB / VW; j++) acc[j] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        const float qd = q[d];
#pragma GCC unroll 8
        for (int j = 0; j < KB / VW; j++) acc[j] += qd * *(const vf *)(kt + d * KB + j * VW);
    }
#pragma GCC unroll 8
    for (int j = 0; j < KB / VW; j++) *(vf *)(s + j * VW) = acc[j];
}

/* s0, s1 for two rows at once: each load of kt serves both (the avx512 build: 8 of its
   32 registers) */
static inline void score_rows2(const float *q0, const float *q1, const float *kt, int64_t D,
                               float *s0, float *s1) {
    vf a[KB / VW], b[KB / VW];
#pragma GCC unroll 8
    for (int j = 0; j < KB / VW; j++) a[j] = b[j] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        const float x0 = q0[d], x1 = q1[d];
#pragma GCC unroll 8
        for (int j = 0; j < KB / VW; j++) {
            const vf kv = *(const vf *)(kt + d * KB + j * VW);
            a[j] += x0 * kv;
            b[j] += x1 * kv;
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < KB / VW; j++) {
        *(vf *)(s0 + j * VW) = a[j];
        *(vf *)(s1 + j * VW) = b[j];
    }
}

/* o[0, D) = o * alpha + sum_j p[j] * v[j], n keys */
static inline void weigh_row(float *o, float alpha, const float *p, const float *v, int64_t n,
                             int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 4 * VW) {
        const int w = (int)((D - d0) / VW < 4 ? (D - d0) / VW : 4);
        vf a[4];
        for (int c = 0; c < w; c++) a[c] = *(const vf *)(o + d0 + c * VW) * alpha;
        for (int64_t j = 0; j < n; j++) {
            const float pj = p[j];
            for (int c = 0; c < w; c++) a[c] += pj * *(const vf *)(v + j * D + d0 + c * VW);
        }
        for (int c = 0; c < w; c++) *(vf *)(o + d0 + c * VW) = a[c];
    }
}

/* One task: KV head h, tokens [t0, t1). scratch: kt [D, KB], vb [KB, D], qf/o [R, D],
   s [2, KB], m/l [R], R = G * QB. */
static void task(const void *q, int64_t q_row, int q_bf16, const char *kh, const char *vh,
                 int kv_bf16, const int64_t *pages, int64_t start, int64_t t0, int64_t t1,
                 int64_t h, int64_t G, int64_t D, int64_t ps, float scale, void *out,
                 int64_t out_row, int out_bf16, float *scratch) {
    const int64_t nq = t1 - t0, esize = kv_bf16 ? 2 : 4;
    float *kt = scratch, *vb = kt + DMAX * KB, *s = vb + KB * DMAX, *qf = s + 2 * KB;
    float *o = qf + G * QB * DMAX, *m = o + G * QB * DMAX, *l = m + G * QB;
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i, base = (t0 + i) * q_row + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) qf[r * D + d] = at(q, q_bf16, base + d) * scale;
            memset(o + r * D, 0, sizeof(float) * (size_t)D);
            m[r] = -INFINITY;
            l[r] = 0.f;
        }
    const int64_t keys = start + t1; /* the last token sees this many */
    for (int64_t k0 = 0; k0 < keys; k0 += KB) {
        const int64_t nk = keys - k0 < KB ? keys - k0 : KB;
        for (int64_t j = 0; j < KB; j++) {
            if (j >= nk) { /* past the end: zero keys, masked below */
                for (int64_t d = 0; d < D; d++) kt[d * KB + j] = 0.f;
                continue;
            }
            const int64_t pos = k0 + j, slot = pages[pos / ps] * ps + pos % ps;
            const char *kr = kh + slot * D * esize, *vr = vh + slot * D * esize;
            for (int64_t d = 0; d < D; d++) {
                kt[d * KB + j] = at(kr, kv_bf16, d);
                vb[j * D + d] = at(vr, kv_bf16, d);
            }
        }
        /* rows r = g * nq + i: token t0 + i, query head h * G + g; two at a time in the
           avx512 build, one in the others (whose 16 registers two rows would overflow) */
        int two = 0;
        for (int64_t r = 0; r < G * nq; r += 1 + two) {
            two = VW == 16 && r + 1 < G * nq;
            int64_t seen[2];
            for (int u = 0; u < 1 + two; u++) {
                const int64_t qpos = start + t0 + (r + u) % nq;
                seen[u] = k0 > qpos ? 0 : qpos - k0 + 1 < nk ? qpos - k0 + 1 : nk;
            }
            if (!seen[0] && (!two || !seen[1])) continue; /* the block is in their future */
            if (two)
                score_rows2(qf + r * D, qf + (r + 1) * D, kt, D, s, s + KB);
            else
                score_row(qf + r * D, kt, D, s);
            for (int u = 0; u < 1 + two; u++) {
                if (!seen[u]) continue;
                float *su = s + u * KB;
                const int64_t ru = r + u;
                const float mx = max_of(su, seen[u], m[ru]);
                const float alpha = expf(m[ru] - mx); /* exp(-inf) = 0 on the first block */
                l[ru] = l[ru] * alpha + exp_sum(su, seen[u], mx);
                m[ru] = mx;
                weigh_row(o + ru * D, alpha, su, vb, seen[u], D);
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < nq; i++) {
            const int64_t r = g * nq + i, base = (t0 + i) * out_row + (h * G + g) * D;
            const float inv = 1.f / l[r];
            for (int64_t d = 0; d < D; d++) {
                const float val = o[r * D + d] * inv;
                if (out_bf16)
                    ((uint16_t *)out)[base + d] = f32_bf16(val);
                else
                    ((float *)out)[base + d] = val;
            }
        }
}

/*
 * q     [n, H, D] at q + t * q_row + head * D (head = kv_head * G + g), fp32 or bf16
 * k, v  [Hkv, num_pages, page_size, D] contiguous: this layer's pool, fp32 or bf16
 * pages the sequence's page ids; token t of the n new ones sits at position start + t
 * out   [n, H * D] rows out_row apart, fp32 or bf16
 * Returns 0, or -1 (nothing written) for a head size the kernel does not take or
 * scratch it could not allocate.
 */
int actorlm_paged_prefill(const void *q, int64_t q_row, int64_t q_bf16, const void *k,
                          const void *v, int64_t kv_bf16, int64_t num_pages, const int64_t *pages,
                          int64_t start, int64_t n, int64_t Hkv, int64_t G, int64_t D,
                          int64_t page_size, float scale, void *out, int64_t out_row,
                          int64_t out_bf16, int threads) {
    if (D % 16 || D > DMAX) return -1;
#if defined(__AVX512BF16__)
    if (q_bf16 && kv_bf16 && out_bf16 &&
        fa_prefill(q, q_row, k, v, num_pages, pages, start, n, Hkv, G, D, page_size, scale, out,
                   out_row, threads) == 0)
        return 0;
#endif
    const int64_t head_bytes = num_pages * page_size * D * (kv_bf16 ? 2 : 4);
    const int64_t blocks = (n + QB - 1) / QB, tasks = blocks * Hkv;
    const size_t floats = (size_t)(2 * DMAX * KB + 2 * KB + 2 * G * QB * DMAX + 2 * G * QB);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* latest blocks first: they see the most keys (causal), so the tail balances */
#pragma omp for schedule(dynamic, 1)
        for (int64_t tsk = 0; tsk < tasks; tsk++) {
            if (scratch == NULL) continue;
            const int64_t b = blocks - 1 - tsk / Hkv, h = tsk % Hkv;
            const int64_t t0 = b * QB, t1 = t0 + QB < n ? t0 + QB : n;
            task(q, q_row, (int)q_bf16, (const char *)k + h * head_bytes,
                 (const char *)v + h * head_bytes, (int)kv_bf16, pages, start, t0, t1, h, G, D,
                 page_size, scale, out, out_row, (int)out_bf16, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* 1 where this build runs bf16 prompts of head sizes that are multiples of 64 on AMX
   tiles (flash.h, flash_amx.h: the CPU has them and the kernel granted their state), else 0. */
int actorlm_prefill_tiles(void) {
#if defined(__AMX_BF16__)
    return amx_ready();
#else
    return 0;
#endif
}
