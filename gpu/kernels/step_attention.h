/* The fused step's attention, for each layer's (sequence, KV head) tasks: how the team
 * shares them, a decode row over its pages (attend.h), long contexts of few such tasks in
 * parts of their keys, a sequence's rows together on bf16 products (flash.h), and cascade
 * attention over pages several rows share. Included by
 * cpu_step.c after its model types, row helpers and the team's share(), which it uses.
 */
#ifndef ACTORLM_STEP_ATTENTION_H
#define ACTORLM_STEP_ATTENTION_H

/* The attention tasks [lo, hi) of thread t among nt: task b * Hkv + h is sequence b's KV
   head h, the ranges contiguous and of about equal cost, a task's tokens attended to
   (those after skip[b], when skip) plus ATT_TASK_BASE (its RoPE, KV store and set-up).
   A task goes to the thread its middle falls in. share() by count would give one thread
   the batch's long contexts where they sit together (the oldest requests). */
#define ATT_TASK_BASE 32
static void share_tasks(const int64_t *seq_lens, const int64_t *skip, int64_t B, int64_t Hkv,
                        int t, int nt, int64_t *lo, int64_t *hi) {
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++)
        total += (seq_lens[b] - (skip ? skip[b] : 0) + ATT_TASK_BASE) * Hkv;
    const int64_t from = total * t / nt, to = total * (t + 1) / nt;
    int64_t cum = 0;
    *lo = *hi = B * Hkv;
    for (int64_t i = 0, found = 0; i < B * Hkv; i++) {
        const int64_t b = i / Hkv, c = seq_lens[b] - (skip ? skip[b] : 0) + ATT_TASK_BASE;
        const int64_t mid = cum + c / 2;
        if (!found && mid >= from) *lo = i, found = 1;
        if (mid >= to) {
            *hi = i;
            break;
        }
        cum += c;
    }
}

/* Layer l's K (kv 0) or V (kv 1) pages of KV head h: [num_pages, page_size, head_dim] */
static inline char *kv_head(const model_t *M, int64_t l, int kv, int64_t h) {
    const int64_t head_elems = M->num_pages * M->page_size * M->head_dim;
    return (char *)M->kv + ((l * 2 + kv) * M->kv_heads + h) * head_elems * (M->kv_bf16 ? 2 : 4);
}

/* attend_kv over bf16 or fp32 pages (kh, vh: one KV head's), each dtype its own
   instantiation */
static void attend_pages(int64_t kv_bf16, const float *q, const void *kh, const void *vh,
                         const int64_t *pages, int64_t len, int64_t rows, int64_t D,
                         int64_t page_size, float scale, int64_t start, float cap, float *scores,
                         float *acc, float *out, float *ml) {
    if (kv_bf16)
        attend_kv(1, q, kh, vh, pages, len, rows, D, page_size, scale, start, cap, scores, acc, out, ml);
    else
        attend_kv(0, q, kh, vh, pages, len, rows, D, page_size, scale, start, cap, scores, acc, out, ml);
}

/* `rows` query rows q [rows, D] (rotated) over `len` tokens of `pages` in KV head h of
   layer l: one sequence's G heads, or the rows of several sequences over the pages they
   share (cascade). ml: NULL, or the parts' merge (attend_kv). */
static void attend_rows(const model_t *M, int64_t l, int64_t h, const float *q, int64_t rows,
                        const int64_t *pages, int64_t len, float *scores, float *acc, float *out,
                        float *ml) {
    const int64_t W = M->layers[l].window, ps = M->page_size;
    int64_t start = 0;
    if (W > 0 && len > W) { /* the window's keys: from its first page, those before masked */
        const int64_t first = len - W;
        pages += first / ps;
        len -= first / ps * ps;
        start = first % ps;
    }
    attend_pages(M->kv_bf16, q, kv_head(M, l, 0, h), kv_head(M, l, 1, h), pages, len, rows,
                 M->head_dim, ps, (float)M->scale, start, (float)M->softcap, scores, acc, out, ml);
}

/* The G query heads of KV head h (rotated, in qkv's row b) over seq_len tokens */
static void attend_task(const model_t *M, int64_t l, int64_t b, int64_t h, const float *qkv,
                        int64_t qkv_n, const int64_t *pages, int64_t seq_len, float *scores,
                        float *acc, float *out) {
    const int64_t G = M->heads / M->kv_heads;
    attend_rows(M, l, h, qkv + b * qkv_n + h * G * M->head_dim, G, pages, seq_len, scores, acc,
                out, NULL);
}

/* Sequence b's KV head h in layer l: rotate its q heads and k, store k and v at the new
   token's slot, then (out not NULL) attend over seq_len tokens, or with `skip` > 0 over
   those after its first `skip` (pages it shares with other rows: a part, into out and
   ml, that the shared part is merged with later). */
static void attention_task(const model_t *M, int64_t l, int64_t b, int64_t h, float *qkv,
                           int64_t qkv_n, const float *cos_t, const float *sin_t, int64_t slot,
                           const int64_t *pages, int64_t seq_len, float *scores, float *acc,
                           float *out, int64_t skip, float *ml) {
    const int64_t D = M->head_dim, G = M->heads / M->kv_heads, half = M->rot_half;
    const int64_t H = M->heads, Hkv = M->kv_heads;
    float *row = qkv + b * qkv_n;
    float *q = row + h * G * D, *k = row + (H + h) * D, *v = row + (H + Hkv + h) * D;
    const float *c = cos_t + b * half, *s = sin_t + b * half;
    const layer_t *L = &M->layers[l];
    if (L->q_norm) { /* in place, a head a row */
        norm_rows(q, L->q_norm, q, G, D, (float)M->eps);
        norm_rows(k, L->k_norm, k, 1, D, (float)M->eps);
    }
    for (int64_t g = 0; g < G; g++) rope_head(q + g * D, c, s, half);
    rope_head(k, c, s, half);
    const int64_t esize = M->kv_bf16 ? 2 : 4;
    store_row(kv_head(M, l, 0, h) + slot * D * esize, (int)M->kv_bf16, k, D);
    store_row(kv_head(M, l, 1, h) + slot * D * esize, (int)M->kv_bf16, v, D);
    if (out == NULL) return;
    if (skip)
        attend_rows(M, l, h, q, G, pages + skip / M->page_size, seq_len - skip, scores, acc, out, ml);
    else
        attend_task(M, l, b, h, qkv, qkv_n, pages, seq_len, scores, acc, out);
}

/* Query rows a cascade chunk attends with at once: the AMX and dot-product paths'
   widest (attend_amx.h, attend_dp.h) */
#define CASCADE_ROWS 16

/* One cascade chunk of KV head kh / vh: the G query heads of sequences rows[0 .. n)
   (row b's at q + b * qs, rotated) over the `shared` tokens of `pages` they all begin
   with, gathered into cq and attended at once into co and cml, then merged into each
   row's own part (its output at out + b * os, its ml at ml + b * ms) as its output. */
static void cascade_rows(int64_t kv_bf16, const void *kh, const void *vh, const float *q,
                         int64_t qs, const int64_t *rows, int64_t n, const int64_t *pages,
                         int64_t shared, int64_t G, int64_t D, int64_t page_size, float scale,
                         float cap, float *scores, float *acc, float *cq, float *co, float *cml,
                         float *out, int64_t os, float *ml, int64_t ms) {
    const int64_t GD = G * D;
    for (int64_t j = 0; j < n; j++)
        memcpy(cq + j * GD, q + rows[j] * qs, sizeof(float) * (size_t)GD);
    attend_pages(kv_bf16, cq, kh, vh, pages, shared, n * G, D, page_size, scale, 0, cap, scores,
                 acc, co, cml);
    for (int64_t j = 0; j < n; j++) {
        float *o = out + rows[j] * os;
        att_merge(o, ml + rows[j] * ms, co + j * GD, cml + j * G * 2, G, D, o);
    }
}

/* Whether the cascade's arguments are what the kernels assume (kernels/step.py's
   Cascade makes them so): chunks of at most `most` query rows, each row's shared tokens
   whole pages before its last token, the same for a chunk's rows. */
static int cascade_ok(const int64_t *row_shared, const int64_t *chunk_ptr,
                      const int64_t *chunk_rows, int64_t n_chunks, const int64_t *seq_lens,
                      int64_t B, int64_t G, int64_t most, int64_t page_size) {
    for (int64_t i = 0; i < n_chunks; i++) {
        const int64_t n = chunk_ptr[i + 1] - chunk_ptr[i], *rows = chunk_rows + chunk_ptr[i];
        if (n < 1 || n * G > most) return 0;
        for (int64_t j = 0; j < n; j++) {
            const int64_t b = rows[j], shared = b >= 0 && b < B ? row_shared[b] : -1;
            if (shared <= 0 || shared % page_size || shared >= seq_lens[b] ||
                shared != row_shared[rows[0]])
                return 0;
        }
    }
    return 1;
}

/* The fused step's cascade chunk i (chunk_rows[chunk_ptr[i] ..]) in KV head h of layer l */
static void cascade_task(const model_t *M, int64_t l, int64_t h, const float *qkv, int64_t qkv_n,
                         const int64_t *rows, int64_t n, const int64_t *pages, int64_t shared,
                         float *scores, float *acc, float *cq, float *co, float *cml, float *attn,
                         float *ml_rows) {
    const int64_t D = M->head_dim, H = M->heads, G = H / M->kv_heads;
    cascade_rows(M->kv_bf16, kv_head(M, l, 0, h), kv_head(M, l, 1, h), qkv + h * G * D, qkv_n,
                 rows, n, pages, shared, G, D, M->page_size, (float)M->scale, (float)M->softcap,
                 scores, acc, cq, co, cml, attn + h * G * D, H * D, ml_rows + h * G * 2, H * 2);
}

/* A decode step of few (sequence, KV head) tasks left threads idle while the others
   attended: the default model's 3 KV heads on 2 threads gave one thread two. A step of
   fewer than ATT_SPLIT_TASKS such tasks splits each long context's keys into parts of
   whole pages, enough for about ATT_SPLIT_TASKS tasks in all but ATT_PART_KEYS keys or
   more each, that the threads claim one at a time, then merges each task's parts in
   order. The parts follow the batch alone, so the bits do not depend on the threads
   (the team's size changes as it is measured). Every part costs a call (~1 us): two
   decodes' 6 tasks, which 2 threads share evenly already, ran 3-9% slower in 2-5 parts
   each over 1,100-3,000 tokens (2-core AMX Xeon). */
#define ATT_SPLIT_TASKS 6
#define ATT_PART_KEYS 512

/* The parts of a context of len tokens in a step of `tasks` (sequence, KV head) tasks */
static inline int64_t att_parts(int64_t len, int64_t tasks) {
    if (tasks >= ATT_SPLIT_TASKS) return 1;
    const int64_t want = (ATT_SPLIT_TASKS + tasks - 1) / tasks, most = len / ATT_PART_KEYS;
    const int64_t p = want < most ? want : most;
    return p < 2 ? 1 : p;
}

/* The tokens [*a, *c) of part j of a context of len tokens in `parts`; *a a page's first */
static inline void att_part_range(int64_t len, int64_t page_size, int64_t j, int64_t parts,
                                  int64_t *a, int64_t *c) {
    const int64_t np = (len + page_size - 1) / page_size;
    const int64_t e = np * (j + 1) / parts * page_size;
    *a = np * j / parts * page_size;
    *c = e < len ? e : len;
}

/* out [G, D] = the softmax over a context's keys from its `parts` parts' unnormalised
   sums (part j's at o + j * G * D) and ml (attend_kv's, at ml + j * 2 * G), merged in
   order */
static void att_merge_parts(const float *o, const float *ml, int64_t parts, int64_t G,
                            int64_t D, float *out) {
    for (int64_t g = 0; g < G; g++) {
        const float *mg = ml + 2 * g; /* part j's m and l at mg[j * 2 * G], mg[j * 2 * G + 1] */
        float m = mg[0], sum = 0.f, w[ATT_SPLIT_TASKS];
        for (int64_t j = 1; j < parts; j++) m = mg[j * 2 * G] > m ? mg[j * 2 * G] : m;
        for (int64_t j = 0; j < parts; j++) {
            w[j] = expf(mg[j * 2 * G] - m);
            sum += mg[j * 2 * G + 1] * w[j];
        }
        for (int64_t j = 0; j < parts; j++) w[j] /= sum;
        for (int64_t d = 0; d < D; d++) {
            float v = 0.f;
            for (int64_t j = 0; j < parts; j++) v += o[(j * G + g) * D + d] * w[j];
            out[g * D + d] = v;
        }
    }
}

/* Task k of the n_parts (sequence, KV head, part) tasks of a step of B sequences
   (sequence b's Hkv * att_parts in order, a head's parts together) in layer l: a part
   into its place in part_o and part_ml, or a context of one part straight into attn */
static void att_part_task(const model_t *M, int64_t l, int64_t k, int64_t B, const float *qkv,
                          int64_t qkv_n, const int64_t *pages, int64_t table_stride,
                          const int64_t *seq_lens, float *scores, float *acc, float *part_o,
                          float *part_ml, float *attn) {
    const int64_t D = M->head_dim, H = M->heads, Hkv = M->kv_heads, G = H / Hkv;
    int64_t b = 0, first = 0;
    while (first + Hkv * att_parts(seq_lens[b], B * Hkv) <= k)
        first += Hkv * att_parts(seq_lens[b++], B * Hkv);
    const int64_t parts = att_parts(seq_lens[b], B * Hkv);
    const int64_t h = (k - first) / parts, j = (k - first) % parts;
    const int64_t *table = pages + b * table_stride;
    if (parts == 1) {
        float *out = attn + b * H * D + h * G * D;
        attend_task(M, l, b, h, qkv, qkv_n, table, seq_lens[b], scores, acc, out);
        return;
    }
    int64_t a, c;
    att_part_range(seq_lens[b], M->page_size, j, parts, &a, &c);
    attend_rows(M, l, h, qkv + b * qkv_n + h * G * D, G, table + a / M->page_size, c - a, scores,
                acc, part_o + k * G * D, part_ml + k * 2 * G);
}

/* Sequence b's KV head h (of B sequences): its parts merged into attn (nothing where it
   had one part) */
static void att_merge_task(const model_t *M, int64_t b, int64_t h, int64_t B,
                           const int64_t *seq_lens, const float *part_o, const float *part_ml,
                           float *attn) {
    const int64_t D = M->head_dim, H = M->heads, Hkv = M->kv_heads, G = H / Hkv;
    const int64_t parts = att_parts(seq_lens[b], B * Hkv);
    if (parts == 1) return;
    int64_t k = h * parts;
    for (int64_t i = 0; i < b; i++) k += Hkv * att_parts(seq_lens[i], B * Hkv);
    float *out = attn + b * H * D + h * G * D;
    att_merge_parts(part_o + k * G * D, part_ml + k * 2 * G, parts, G, D, out);
}

/* Fewer rows of a sequence attend a row at a time: the packing of K and V costs more
   than their re-reads (AMX: 2 / 4 new tokens over 1,104 cached: 10.4 / 11.8 ms a step
   on tiles, 8.6 / 10.9 a row at a time; level at 8) */
#define FLASH_MIN_ROWS 8

/* A sequence of this many rows or more attends in a part per thread: at the default
   model's 3 KV heads and 2 threads a sequence alone left a thread idle a third of the
   time (56 rows over 1,104 cached tokens) */
#define FLASH_SPLIT_ROWS 32

/* The parts sequence i's rows (it ends at row head_rows[i]) attend in, over nt threads */
static inline int64_t seq_parts(const int64_t *head_rows, int64_t i, int nt) {
    const int64_t n = head_rows[i] + 1 - (i ? head_rows[i - 1] + 1 : 0);
    return n >= FLASH_SPLIT_ROWS ? nt : 1;
}

/* A tile of 16 of a sequence's n new rows (the first at position `start`) costs the keys
   its last row sees, and TILE_KEYS more for its own work (its queries, its output) */
#define TILE_KEYS 64
static inline int64_t tile_cost(int64_t n, int64_t start, int64_t t) {
    return TILE_KEYS + start + (16 * (t + 1) < n ? 16 * (t + 1) : n);
}

/* Where part `part` of `parts` of a sequence's n new rows begins: at the tile boundary
   nearest an equal share of the tiles' costs. A fresh prompt's later rows see more
   keys, so they go in shorter parts: halves by count left the second thread ~2.6x the
   first's work on a 256-token prompt. A row's sums do not depend on its tile's others. */
static int64_t part_row(int64_t n, int64_t start, int64_t part, int64_t parts) {
    if (part <= 0) return 0;
    if (part >= parts) return n;
    const int64_t tiles = (n + 15) / 16;
    int64_t total = 0, done = 0;
    for (int64_t t = 0; t < tiles; t++) total += tile_cost(n, start, t);
    const int64_t target = total * part / parts;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t next = done + tile_cost(n, start, t);
        if (next > target) {
            const int64_t row = 16 * (target - done < next - target ? t : t + 1);
            return row < n ? row : n;
        }
        done = next;
    }
    return n;
}

/* Rows r0 .. r0 + n of one sequence (new tokens at positions start ..) for KV head h,
   together: K and V are read once a block for all the rows, where attend_task reads them
   once a row. Over a bf16 pool in the builds with AVX512-BF16, on bf16 products as
   prompts run (flash.h; q rounded to bf16 as it gathers it; o16: the thread's scratch
   of n * G * D), else in fp32 (flash_f32.h). The outputs into attn (fp32, or NULL: the
   bf16 products alone) and attn_b (bf16, or NULL), rows H * D apart. 0, or -1 (nothing
   written: no scratch, or a head size neither takes). */
static int flash_rows(const model_t *M, int64_t l, int64_t r0, int64_t n, int64_t h,
                      const float *qkv, int64_t qkv_n, const int64_t *pages, int64_t start,
                      uint16_t *o16, float *attn, uint16_t *attn_b) {
    const int64_t D = M->head_dim, G = M->heads / M->kv_heads;
    const int64_t GD = G * D, HD = M->heads * D;
#if defined(__AVX512BF16__)
    if (M->kv_bf16 && D % 32 == 0) {
        fa_scratch sc;
        char *buf = grow_buffer(&fa_buf, &fa_buf_bytes, fa_carve(NULL, G, D, &sc));
        if (buf == NULL) return -1;
        fa_carve(buf, G, D, &sc);
        const uint16_t *kh = (const uint16_t *)kv_head(M, l, 0, h);
        const uint16_t *vh = (const uint16_t *)kv_head(M, l, 1, h);
        const int tiles = fa_tiles(D);
        fa_tiles_on(tiles);
        for (int64_t t0 = 0; t0 < n; t0 += FA_QB)
            fa_task(qkv + r0 * qkv_n + h * GD, 1, qkv_n, kh, vh, pages, start, t0,
                    t0 + FA_QB < n ? t0 + FA_QB : n, 0, G, D, M->page_size, (float)M->scale,
                    M->layers[l].window, (float)M->softcap, o16, GD, &sc, tiles);
        fa_tiles_off(tiles);
        for (int64_t t = 0; t < n; t++) {
            float *o = attn ? attn + (r0 + t) * HD + h * GD : NULL; /* NULL: bf16 alone */
            for (int64_t j = 0; o && j < GD; j++) o[j] = bf16_f32(o16[t * GD + j]);
            if (attn_b) memcpy(attn_b + (r0 + t) * HD + h * GD, o16 + t * GD, (size_t)GD * 2);
        }
        return 0;
    }
#else
    (void)o16;
#endif
    ff_scratch sc;
    if (D % FF_KU || D > FF_DMAX || ff_scratch_for(G, D, &sc)) return -1;
    /* fp32 rows where attn is had, else the bf16 rows straight */
    void *out = attn ? (void *)(attn + r0 * HD) : (void *)(attn_b + r0 * HD);
    const int64_t qb = ff_tokens(G);
    for (int64_t t0 = 0; t0 < n; t0 += qb)
        ff_task(qkv + r0 * qkv_n, 0, qkv_n, kv_head(M, l, 0, h), kv_head(M, l, 1, h),
                (int)M->kv_bf16, pages, M->page_size, start, t0, t0 + qb < n ? t0 + qb : n,
                h, G, D, (float)M->scale, M->layers[l].window, (float)M->softcap, out, !attn,
                HD, &sc);
    for (int64_t t = 0; attn && attn_b && t < n; t++)
        for (int64_t j = 0; j < GD; j++)
            attn_b[(r0 + t) * HD + h * GD + j] = f32_bf16(attn[(r0 + t) * HD + h * GD + j]);
    return 0;
}

#endif
