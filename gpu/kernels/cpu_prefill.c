/* Causal attention of one sequence's new tokens (a prompt, or a chunk extending a cached
 * prefix) over the paged pool, flash style: fp32 arithmetic, q/out and K/V in fp32 or
 * bf16.
 *
 * torch's CPU flash attention runs a bf16 prompt of 512 tokens at ~30 GFLOP/s on one
 * core (~40% of a bf16 prefill of the default model). Here (flash_f32.h) a task is one
 * KV head and up to 64 query tokens, for all G query heads that share the KV head (GQA
 * reads K and V once for them), their rows along the vector lanes; an online softmax
 * keeps each row's running max, sum and output. The new tokens' K and V are already in
 * the pool (KVPool.write runs first), so a prompt and an extension are the same case:
 * token t (at position start + t) sees positions [0, start + t].
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
#include "flash_f32.h"
#include "simd.h"
#if defined(__AVX512BF16__)
#include "flash.h"
#endif

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
    if (D % 16 || D > FF_DMAX) return -1;
#if defined(__AVX512BF16__)
    if (q_bf16 && kv_bf16 && out_bf16 &&
        fa_prefill(q, q_row, k, v, num_pages, pages, start, n, Hkv, G, D, page_size, scale, out,
                   out_row, threads) == 0)
        return 0;
#endif
    const int64_t head_bytes = num_pages * page_size * D * (kv_bf16 ? 2 : 4);
    /* tasks of ff_tokens(G) tokens, or fewer where that leaves under 4 a thread */
    int64_t qb = ff_tokens(G);
    while (qb > 16 && (n + qb - 1) / qb * Hkv < 4 * threads) qb /= 2;
    const int64_t blocks = (n + qb - 1) / qb, tasks = blocks * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        ff_scratch sc;
        if (ff_scratch_for(G, D, &sc)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* latest blocks first: they see the most keys (causal), so the tail balances */
#pragma omp for schedule(dynamic, 1)
        for (int64_t tsk = 0; tsk < tasks; tsk++) {
            if (failed) continue;
            const int64_t b = blocks - 1 - tsk / Hkv, h = tsk % Hkv;
            const int64_t t0 = b * qb, t1 = t0 + qb < n ? t0 + qb : n;
            ff_task(q, (int)q_bf16, q_row, (const char *)k + h * head_bytes,
                    (const char *)v + h * head_bytes, (int)kv_bf16, pages, page_size, start, t0,
                    t1, h, G, D, scale, 0, 0.f, out, (int)out_bf16, out_row, &sc);
        }
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
