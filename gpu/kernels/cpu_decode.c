/* Decode attention straight from the paged KV pool, fp32, for x86 and ARM CPUs.
 *
 * One new query token per sequence. Work splits over (sequence, KV head); each
 * task reads its keys and values once, page by page where they lie (no gather
 * copy), and serves the G query heads that share that KV head (GQA) from the
 * same reads. Softmax runs over the whole context in two passes: scores, then
 * the weighted sum of values. Built by actorlm/gpu/native.py with -O3 and
 * OpenMP, whose runtime is the one PyTorch already loaded.
 *
 * GCC/Clang vector extensions (8 floats) keep the inner loops vectorized on any
 * target without intrinsics; head sizes that are not a multiple of 8 take the
 * scalar loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

static inline void prefetch(const float *p, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 2);
}

/* Eight scores at once: s[j] = q . k_j for the 8 consecutive key rows at k (D % 8
   == 0). Eight independent accumulators keep the multiply-adds in flight, and one
   transpose-and-add tree sums each one's lanes (eight horizontal sums cost more). */
static inline v8f pairs(v8f a, v8f b) { /* [a0+a1, b0+b1, a2+a3, b2+b3, ...] */
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
static inline v8f quads(v8f a, v8f b) { /* of two pairs(): 4 rows' halves summed */
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
static inline v8f dot8(const float *q, const float *k, int64_t D) {
    v8f a[8] = {{0}};
    for (int64_t d = 0; d < D; d += 8) {
        const v8f qv = *(const v8f *)(q + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] += qv * *(const v8f *)(k + j * D + d);
    }
    const v8f lo = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));
    const v8f hi = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* acc[0, 8W) += sum_i s[i] * v[i * D .. + 8W) over n rows of v, in registers. */
static inline __attribute__((always_inline)) void weigh(float *acc, const float *s,
                                                        const float *v, int64_t n, int64_t D,
                                                        const int W) {
    v8f a[8];
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) a[j] = *(const v8f *)(acc + 8 * j);
    for (int64_t i = 0; i < n; i++) {
        const float si = s[i];
#pragma GCC unroll 8
        for (int j = 0; j < W; j++) a[j] += si * *(const v8f *)(v + i * D + 8 * j);
    }
#pragma GCC unroll 8
    for (int j = 0; j < W; j++) *(v8f *)(acc + 8 * j) = a[j];
}

/* One (sequence, KV head): scores [G, len] is this thread's scratch, acc [G, D].
   Page by page, each query head's scores take 8 keys at a time and its weighted
   sum of values keeps up to 64 floats of acc in registers; a page of K and V
   stays in L1 while the G heads read it. */
static void attend(const float *q, const float *k, const float *v, const int64_t *table,
                   int64_t start, int64_t len, int64_t G, int64_t D, int64_t page_size,
                   float scale, float *scores, float *acc, float *out) {
    const int64_t page_floats = page_size * D;
    const int vec = D % 8 == 0;
    /* keys start..len-1 (a sliding window starts inside its first page); scores are
       indexed from start, the runs t0..t0+n stay within one page */
    const int64_t cnt = len - start;
    for (int64_t t0 = start, n; t0 < len; t0 += n) {
        const int64_t page = table[t0 / page_size], off = t0 % page_size;
        const float *kp = k + page * page_floats + off * D;
        n = len - t0 < page_size - off ? len - t0 : page_size - off;
        /* pages lie anywhere, beyond the hardware prefetcher's reach: ask for the
           next page of K, and this page of V for pass 2, before computing */
        if (t0 + n < len) prefetch(k + table[t0 / page_size + 1] * page_floats, page_floats);
        prefetch(v + page * page_floats + off * D, n * D);
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * cnt + (t0 - start);
            int64_t i = 0;
            if (vec)
                for (; i + 8 <= n; i += 8) *(v8f *)(sg + i) = dot8(q + g * D, kp + i * D, D) * scale;
            for (; i < n; i++) sg[i] = dot(q + g * D, kp + i * D, D) * scale;
        }
    }
    float inv_sum[G];
    for (int64_t g = 0; g < G; g++) {
        float *sg = scores + g * cnt;
        inv_sum[g] = 1.f / exp_sum(sg, cnt, max_of(sg, cnt, -INFINITY));
    }
    memset(acc, 0, sizeof(float) * (size_t)(G * D));
    for (int64_t t0 = start, n; t0 < len; t0 += n) {
        const int64_t off = t0 % page_size;
        const float *vp = v + table[t0 / page_size] * page_floats + off * D;
        n = len - t0 < page_size - off ? len - t0 : page_size - off;
        for (int64_t g = 0; g < G; g++) {
            const float *sg = scores + g * cnt + (t0 - start);
            float *ag = acc + g * D;
            if (!vec) {
                for (int64_t i = 0; i < n; i++) axpy(sg[i], vp + i * D, ag, D);
                continue;
            }
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                switch ((D - d0 < 64 ? D - d0 : 64) / 8) {
#define WEIGH(w) \
    case w: weigh(ag + d0, sg, vp + d0, n, D, w); break;
                    WEIGH(1) WEIGH(2) WEIGH(3) WEIGH(4) WEIGH(5) WEIGH(6) WEIGH(7) WEIGH(8)
#undef WEIGH
                }
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv_sum[g];
}

/*
 * q        [B, H, D] at q + b * q_stride_b + head * D (head = kv_head * G + g)
 * k, v     [Hkv, num_pages, page_size, D] contiguous: this layer's pool
 * pages    [B, table_stride] page ids; seq_lens [B] tokens to attend to (>= 1)
 * starts   [B] the first of them each sequence attends to (a sliding window), or NULL: 0
 * out      [B, H * D] contiguous
 * threads  OpenMP threads (torch's setting: worker threads do not inherit it)
 * Returns 0, or -1 when a thread could not allocate its scratch.
 */
int actorlm_paged_decode(const float *q, int64_t q_stride_b, const float *k, const float *v,
                         int64_t num_pages, const int64_t *pages, int64_t table_stride,
                         const int64_t *seq_lens, const int64_t *starts, float *out, int64_t B,
                         int64_t Hkv, int64_t G,
                         int64_t D, int64_t page_size, int64_t max_len, float scale,
                         int threads) {
    int failed = 0;
    const int64_t head_stride = num_pages * page_size * D;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len * G + 8));
        float *acc = malloc(sizeof(float) * (size_t)(G * D));
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* a (sequence, KV head) at a time to whichever thread is free: contexts differ
           (a batch's oldest requests sit together), and static halves left one thread
           the long ones (32 sequences, half over 600 tokens and half over 100, fp32:
           113 -> 93 ms a step through the model) */
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hkv; h++) {
                if (scores == NULL || acc == NULL) continue;
                attend(q + b * q_stride_b + h * G * D, k + h * head_stride, v + h * head_stride,
                       pages + b * table_stride, starts ? starts[b] : 0, seq_lens[b], G, D,
                       page_size, scale, scores, acc, out + (b * Hkv + h) * G * D);
            }
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
