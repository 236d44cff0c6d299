/* A whole decode step of a Llama-shaped model in one call: tokens in, logits out.
 *
 * At decode batch sizes a step in PyTorch is some 300 small kernel calls (norms,
 * GEMVs, RoPE, KV writes, attention), each a Python dispatch and an OpenMP fork/join
 * costing more than its arithmetic. Here the thread team forms once per step and
 * the phases of each layer are separated by barriers only:
 *
 *   qkv = norm(residual) @ Wqkv           (columns split over threads)
 *   per (row, KV head): RoPE on q and k (each head RMS-normed first where the model
 *                       norms them: Qwen3), k and v into the pool, attention (rows of
 *                                         one sequence: every row's k and v first)
 *   o = attn @ Wo;  residual += o         (every thread keeps its own copy of the
 *   act = silu(gate) * up                  residual rows and their norm: a few KiB,
 *   down = act @ Wdown; residual += down   cheaper than a barrier to share them; from
 *                                          CLAIM_MIN_ROWS rows the team shares them)
 *
 * Gemma's layers are the same with its extras, each a field of model_t / layer_t: the
 * embeddings scaled, the attention's and the MLP's outputs normed before the residual
 * takes them, tanh-GELU for SiLU, a sliding window a layer (each row attends to its own
 * last `window` keys; no cascade), two RoPE tables (Gemma 3's windowed layers turn by
 * their own base) and soft-capped scores and logits (Gemma 2).
 *
 * A sparse MoE layer (layer_t.router: Qwen3-MoE, Mixtral) takes the MLP's place:
 * moe_mlp (step_moe.h) routes each row, gathers the rows by expert and runs each expert
 * once. The attention tasks are step_attention.h's.
 *
 * Weights stay where the model keeps them, in whatever format its linear method chose
 * (gemv.h's lin_t: GGUF blocks, fp32/bf16/fp16 rows), KV in the pool's dtype (fp32 or
 * bf16); activations are fp32 throughout. gpu/kernels/step.py builds the model_t once
 * (the shape of a CUDA graph: Python describes the model once, not once a step).
 *
 * With LoRA adapters (model_t.lora, and a slot per row for the step), each projection
 * gets its rows' deltas (lora.h) where its output is made, without another barrier:
 * the shrinks of qkv, o and down split the rows over the team in the phase that makes
 * the base output, and the expands run in the phase after (qkv's in each attention
 * task, on its heads' columns; o's and down's on every thread's own residual rows);
 * gate and up, whose outputs meet SiLU as they are made, shrink on every thread.
 * Rows of one slot go through lora.h a block at a time (the worker groups them by slot).
 *
 * Decodes whose contexts begin in the same pages (a system prompt the prefix cache
 * shares) may attend in a cascade: each row over its own tokens first, then, after one
 * more barrier, a chunk of rows at once over the shared pages (attend.h's rows are then
 * several sequences' query heads), the two parts of each softmax merged (att_merge).
 * A step of few (sequence, KV head) tasks over long contexts (a lone decode of the
 * default model) stores every row's k and v first, then attends each context in parts
 * of its keys that the threads claim, merged after one more barrier (att_merge_parts).
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "argmax.h"
#include "attend.h"
#if defined(__AVX512BF16__)
#include "flash.h"
#endif
#include "flash_f32.h"
#include "gemv.h"
#include "lora.h"

typedef struct {
    lin_t qkv, o, gate_up, down;
    const float *in_norm, *post_norm; /* [hidden] fp32 */
    const float *q_norm, *k_norm;     /* [head_dim] fp32, or NULL: each q and k head's
                                         RMSNorm before RoPE (Qwen3, Gemma 3) */
    const float *attn_out_norm, *ffn_out_norm; /* [hidden] fp32, or NULL: the attention's
                                                  and the MLP's outputs normed before the
                                                  residual takes them (Gemma) */
    int64_t window; /* keys a row attends to, its own the last (a sliding window), or 0 */
    int64_t rope;   /* which of the step's cos/sin tables turns this layer's q and k */
    /* a sparse MoE in place of the dense MLP, or router NULL; gate_up and down are then
       its shared expert (Qwen2-MoE), whose output every row adds scaled by
       sigmoid(x . shared_gate), or unset */
    const float *router;   /* [num_experts, hidden] fp32 */
    const lin_t *experts;  /* [num_experts][2]: each expert's gate_up and down */
    int64_t num_experts, top_k, moe_inter;
    int64_t renorm;     /* the top k's weights scaled to sum to 1 (Mixtral, Qwen3-MoE) */
    int64_t route_bf16; /* the router's inputs, scores and weights rounded to bf16, as a
                           bf16 model's forward makes them */
    const float *shared_gate; /* [hidden] fp32, with a shared expert */
} layer_t;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    double eps, scale;
    const layer_t *layers;
    const void *embed; /* [vocab, hidden] */
    int64_t embed_bf16;
    const float *final_norm;
    lin_t head;
    void *kv; /* [layers, 2, kv_heads, num_pages, page_size, head_dim] */
    int64_t kv_bf16, num_pages, page_size;
    const lora_t *lora; /* [num_layers][LORA_N], or NULL: the model has no adapters */
    int64_t lora_rank;  /* the largest rank any slot may have */
    int64_t rot_half;   /* RoPE turns each head's first 2 rot_half values (head_dim / 2,
                           or fewer: partial rotary, Phi-4-mini) */
    double embed_scale;   /* the embeddings times this (rounded to bf16 again with bf16
                             embeddings, as the model's forward does), or 0 (Gemma) */
    double softcap;       /* scores cap * tanh(s / cap) before the softmax, or 0 (Gemma 2) */
    double final_softcap; /* the logits likewise, or 0 (Gemma 2) */
    int64_t act_gelu;     /* the MLP's gate through tanh-GELU, not SiLU (Gemma) */
    int64_t split_keys;   /* decodes of few tasks attend long contexts in parts (1), or not */
    int64_t tiles_from;   /* rows from which a block weight's tiles are read (0: amx.h's
                             AMX_TILES_MIN_ROWS); fewer expand its codes: the same bits */
} model_t;

enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_N };

/* y[b * ys:][0, c1 - c0) += row b's delta of projection L from its shrink (u + b * us),
   rows [lo, hi) that L adapts, a block of rows of one slot at a time */
static void lora_adds(const lora_t *L, const int32_t *row_slots, const float *u, int64_t us,
                      float *y, int64_t ys, int64_t c0, int64_t c1, int64_t lo, int64_t hi) {
    for (int64_t b = lo, e; b < hi; b = e) {
        e = lora_block_end(row_slots, b, hi);
        if (lora_rank(L, row_slots[b]))
            lora_expand_rows(L, row_slots[b], u + b * us, us, y + b * ys, ys, c0, c1, (int)(e - b));
    }
}

/* u[b * nm + i] (each R floats) = the shrink of x's row b by projection m0 + i, rows [lo, hi) */
static void lora_shrinks(const lora_t *LL, int m0, int nm, const int32_t *row_slots,
                         const float *x, int64_t xs, int64_t lo, int64_t hi, float *u, int64_t R) {
    for (int64_t b = lo, e; b < hi; b = e) {
        e = lora_block_end(row_slots, b, hi);
        for (int i = 0; i < nm; i++)
            if (lora_rank(&LL[m0 + i], row_slots[b]))
                lora_shrink_rows(&LL[m0 + i], row_slots[b], x + b * xs, xs, u + (b * nm + i) * R,
                                 nm * R, (int)(e - b));
    }
}

#define SILU_CHUNK 256 /* gate/up columns computed together: [B, 256] twice (in L1 to 8 rows) */

/* Row r's argmax from the threads' picks over their columns (part[u * stride]: thread
   u's, -1: it had none), in column order: the first NaN, else the first maximum */
static int64_t merge_picks(const float *x, const int64_t *part, int64_t stride, int nt) {
    int64_t best = -1;
    for (int u = 0; u < nt; u++) {
        const int64_t j = part[u * stride];
        if (j < 0) continue;
        if (x[j] != x[j]) return j;
        if (best < 0 || x[j] > x[best]) best = j;
    }
    return best < 0 ? 0 : best;
}

/* The team's barrier between phases: a spin on one shared counter, without PAUSE, then
   sched_yield. libgomp's barrier spins with PAUSE and then sleeps on a futex; in a VM
   the first makes the hypervisor deschedule the spinning vCPU (pause-loop exiting) and
   the second costs an inter-processor interrupt to wake it, each tens of microseconds
   against phases of a few (measured on a 2-vCPU KVM guest: a decode step at batch 1
   took 12-280 ms with libgomp's barrier, against 5 ms on one thread). */
typedef struct {
    _Atomic int64_t arrived; /* arrivals since the step began */
} team_t;

static void team_wait(team_t *team, int nt, int64_t *phase) {
    const int64_t target = ++*phase * nt;
    if (atomic_fetch_add_explicit(&team->arrived, 1, memory_order_acq_rel) + 1 == target) return;
    for (int64_t spins = 0; atomic_load_explicit(&team->arrived, memory_order_acquire) < target;)
        if (++spins % 4096 == 0) sched_yield(); /* the others lost their CPU: give it back */
}

/* o[r] = x[r] / rms(x[r]) * w, as cpu_ops.c's actorlm_rms_norm computes it */
static void norm_rows(const float *x, const float *w, float *o, int64_t rows, int64_t dim,
                      float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * dim;
        const float scale = 1.f / sqrtf(dot(src, src, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[r * dim + i] = src[i] * scale * w[i];
    }
}

#if defined(__AMX_BF16__)
/* n floats to bf16 as dp_round_rows rounds them (the same instruction: the same bits) */
static inline void rows_bf16(const float *x, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) store_bf16(o + i, *(const vf *)(x + i));
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(o + i, m, bf16_pack((vf)_mm512_maskz_loadu_ps(m, x + i)));
    }
}
#endif

static void add_rows(float *acc, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += x[i];
}

/* Rows [r0, r1) of res, each with its row of `add` added first where given, then
   norm_rows(res) into xn, and with xb their bf16 copy (AMX builds): a row at a time, so
   each is read from memory once (a 512-token prompt's adds and norms, all 30 layers of
   the default model: ~5.7 -> ~5.2 ms in passes over all the rows, 2-core AMX Xeon) */
static void norm_share(float *res, const float *add, const float *w, float *xn, uint16_t *xb,
                       int64_t r0, int64_t r1, int64_t dim, float eps) {
    for (int64_t r = r0; r < r1; r++) {
        if (add) add_rows(res + r * dim, add + r * dim, dim);
        norm_rows(res + r * dim, w, xn + r * dim, 1, dim, eps);
#if defined(__AMX_BF16__)
        if (xb) rows_bf16(xn + r * dim, xb + r * dim, dim);
#else
        (void)xb;
#endif
    }
}

/* Rows [r0, r1) of res, each plus its row of `add` normed by w first (Gemma's norms of
   the attention's and the MLP's outputs), a row at a time through tmp [dim]; with L (the
   projection's adapters) each row's delta from its shrink (u + r * R) added before the
   norm, as the model adds it to the projection's output */
static void add_normed(float *res, const float *add, const float *w, float *tmp, int64_t r0,
                       int64_t r1, int64_t dim, float eps, const lora_t *L,
                       const int32_t *row_slots, const float *u, int64_t R) {
    for (int64_t r = r0; r < r1; r++) {
        const float *src = add + r * dim;
        if (L && lora_rank(L, row_slots[r])) {
            memcpy(tmp, src, sizeof(float) * (size_t)dim);
            lora_expand_rows(L, row_slots[r], u + r * R, 0, tmp, 0, 0, dim, 1);
            src = tmp;
        }
        norm_rows(src, w, tmp, 1, dim, eps);
        add_rows(res + r * dim, tmp, dim);
    }
}

/* x[:half] <- x[:half] c - x[half:] s; x[half:] <- x[half:] c + x[:half] s */
static void rope_head(float *x, const float *c, const float *s, int64_t half) {
    float *b = x + half;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = b[i];
        x[i] = x1 * c[i] - x2 * s[i];
        b[i] = x2 * c[i] + x1 * s[i];
    }
}

static void store_row(void *dst, int bf16, const float *src, int64_t n) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_bf16(src[i]);
    else
        memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* This thread's share [lo, hi) of n tasks */
static inline void share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

#include "step_attention.h"

/* act[:, c0:c1] = silu(gate) * up, gate and up computed SILU_CHUNK columns at a time;
   with ll (this layer's adapters), each row's gate and up deltas from u_gu first; with
   act_b, act's bf16 copy beside it (AMX builds), and where the weight has its tiles
   act_b alone unless `act_read` (the fp32 rows are read next: the down projection has
   no tiles) */
static void gate_up_silu(const lin_t *L, const float *xn, int64_t B, int64_t hidden,
                         int64_t inter, int64_t c0, int64_t c1, float *tg, float *tu,
                         float *act, uint16_t *act_b, int act_read, int gelu, const lora_t *ll,
                         const int32_t *row_slots, const float *u_gu, int64_t R) {
#if defined(__AMX_BF16__)
    /* gate and up meet in the tiles' epilogue (amx.h; with the fp32 rows unwritten, the
       default model's gate/up and SiLU of a 512-token prompt ~30 -> ~23 ms, 2-core AMX
       Xeon) */
    if (!ll && act_b && L->act_bf16 && B >= AMX_TILES_MIN_ROWS &&
        amx_silu_cols(L, xn, B, hidden, inter, c0, c1, act_read ? act : NULL, act_b, inter, gelu) == 0)
        return;
#else
    (void)act_read;
#endif
    int8_t *qx = NULL;
#if defined(ACTORLM_INT8)
    /* int8 rows: xn quantized once for every chunk's gate and up columns, where each
       lin_cols quantized all of it again (a 256-token prompt of the default model in
       the avx512vnni build, fp32, on a 2-core Zen 4: 143.4 -> 138.6 ms) */
    float *dx = NULL, *sx = NULL;
    if (i8_first(L, B) && i8_scratch_for(B, hidden, &qx, &dx, &sx) == 0)
        i8_quantize(L, xn, 0, B, hidden, qx, dx, sx);
    else
        qx = NULL;
#endif
    for (int64_t c = c0; c < c1; c += SILU_CHUNK) {
        const int64_t w = c1 - c < SILU_CHUNK ? c1 - c : SILU_CHUNK;
        /* lin_cols writes y[r * ys + col]: point y so column c lands at tg[0] */
        if (qx != NULL) {
#if defined(ACTORLM_INT8)
            i8_cols_q(L, qx, dx, sx, B, c, c + w, tg - c, w);
            i8_cols_q(L, qx, dx, sx, B, inter + c, inter + c + w, tu - (inter + c), w);
#endif
        } else {
            lin_cols(L, xn, B, hidden, c, c + w, tg - c, w);
            lin_cols(L, xn, B, hidden, inter + c, inter + c + w, tu - (inter + c), w);
        }
        if (ll) {
            lora_adds(&ll[LORA_GATE], row_slots, u_gu, 2 * R, tg, w, c, c + w, 0, B);
            lora_adds(&ll[LORA_UP], row_slots, u_gu + R, 2 * R, tu, w, c, c + w, 0, B);
        }
        for (int64_t r = 0; r < B; r++) {
            const float *g = tg + r * w, *u = tu + r * w;
            float *o = act + r * inter + c;
            int64_t i = 0;
            if (gelu) {
                for (; i + VW <= w; i += VW) *(vf *)(o + i) = geluv(*(const vf *)(g + i)) * *(const vf *)(u + i);
                for (; i < w; i++) o[i] = gelu1(g[i]) * u[i];
            } else {
                for (; i + VW <= w; i += VW) *(vf *)(o + i) = siluv(*(const vf *)(g + i)) * *(const vf *)(u + i);
                for (; i < w; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
            }
#if defined(__AMX_BF16__)
            if (act_b) rows_bf16(o, act_b + r * inter + c, w);
#endif
        }
    }
}

#if defined(__AMX_BF16__)
/* From this many rows each linear's columns are claimed a chunk at a time from a
   counter the threads share, instead of split in fixed halves: the halves are equal
   work, but the threads are not equally fast (a vCPU the host or another actor takes
   time from: on the 2-core AMX Xeon one thread waited ~5 ms of a 256-token prompt's
   ~48 ms step at the barriers after the linears, and the step runs ~10% faster so at
   256 and 304 rows). Each chunk's call pays for expanding its first weights without
   the tiles to hide it, which the balance does not repay below: level at 128 and 192
   rows, 2-3% slower at 64 (decode at 1-8 rows, claimed so, ran 3-15% slower). */
#define CLAIM_MIN_ROWS 224
#endif

/* Columns a claim takes: about four chunks a thread, whole pairs of groups, `most` at most */
static inline int64_t claim_cols(int64_t n, int nt, int64_t most) {
    const int64_t c = (n + 4 * nt - 1) / (4 * nt);
    const int64_t pairs = (c + 2 * GROUP - 1) / (2 * GROUP) * (2 * GROUP);
    return pairs < most ? pairs : most;
}

/* The next `chunk` columns [*c0, *c1) of [0, n) from *next; 0 when none are left */
static inline int claim_next(_Atomic int64_t *next, int64_t chunk, int64_t n, int64_t *c0,
                             int64_t *c1) {
    const int64_t c = atomic_fetch_add_explicit(next, chunk, memory_order_relaxed);
    if (c >= n) return 0;
    *c0 = c, *c1 = c + chunk < n ? c + chunk : n;
    return 1;
}

/* Rounds x once for a thread's claims over it (amx.h), where the kernels take the copy;
   xb: the team's copy, rounded already (NULL: none) */
static inline void claims_begin(const float *x, const uint16_t *xb, int64_t B, int64_t K) {
#if defined(__AMX_BF16__)
    if (xb)
        amx_round_given(x, B, K, xb);
    else
        amx_round_once(x, B, K);
#else
    (void)x, (void)xb, (void)B, (void)K;
#endif
}

static inline void claims_end(void) {
#if defined(__AMX_BF16__)
    amx_round_forget();
#endif
}

/* Columns [0, n) of L for all B rows of x (xb: its bf16 copy, or NULL), in chunks
   claimed from *next */
static void lin_claim(const lin_t *L, const float *x, const uint16_t *xb, int64_t B, int64_t K,
                      int64_t n, float *y, int64_t ys, _Atomic int64_t *next, int nt) {
    const int64_t chunk = claim_cols(n, nt, n);
    claims_begin(x, xb, B, K);
    for (int64_t c0, c1; claim_next(next, chunk, n, &c0, &c1);) lin_cols(L, x, B, K, c0, c1, y, ys);
    claims_end();
}

/* Columns [0, n) of L for all B rows of x: claimed from *next (xb: x's bf16 copy, or
   NULL), or without next thread t's fixed part (one call, which rounds x itself) */
static void lin_team(const lin_t *L, const float *x, const uint16_t *xb, int64_t B, int64_t K,
                     int64_t n, float *y, int64_t ys, _Atomic int64_t *next, int t, int nt) {
    if (next) {
        lin_claim(L, x, xb, B, K, n, y, ys, next, nt);
        return;
    }
    int64_t c0, c1;
    lin_part(n, t, nt, &c0, &c1);
    lin_cols(L, x, B, K, c0, c1, y, ys);
}

#include "step_moe.h"

/*
 * tokens [B]; cos, sin [B, head_dim / 2] fp32 (each sequence's new position);
 * slots [B] flat KV slot of each new token; pages [B, table_stride] page ids;
 * seq_lens [B] tokens to attend to (the new one included); logits [B, vocab] fp32;
 * row_slots [B] each row's adapter slot (< 0: the base model), or NULL: no adapters.
 * Rows may be consecutive tokens of one sequence (a short prompt, or the new tokens
 * over a cached prefix): with `store_first` every row's K and V go to the pool before
 * any row attends (2: a sequence's rows attend together on bf16 products where the build has
 * them). head_rows [n_head] (ascending), or NULL: the rows that get logits [n_head,
 * vocab] (each sequence's last), or all B.
 * Cascade (decodes alone, store_first 0): row_shared [B] tokens at the start of each
 * row's context in pages it shares with other rows (whole pages; 0: none), and n_chunks
 * chunks of such rows, chunk i's rows chunk_rows[chunk_ptr[i] .. chunk_ptr[i + 1]) (at
 * most CASCADE_ROWS / G, each in one chunk, all with the same shared pages). Those pages
 * are read once a chunk instead of once a row: each row attends over its own tokens,
 * then each chunk's rows together over their shared ones, and the two parts merge.
 * picks [n_head], or NULL: each logits row's argmax (torch.argmax's: the first maximum,
 * or the first NaN), each thread's columns searched as the head makes them, in its
 * cache, and the threads' answers merged (what a greedy step samples, without the
 * sampler reading [B, vocab] fp32 that the other core wrote: at 32 rows ~0.9 ms of
 * a ~29 ms step, 2-core AMX Xeon).
 * Returns 0, or -1 when scratch memory could not be allocated.
 */
int actorlm_decode_step(const model_t *M, int64_t B, const int64_t *tokens, const float *cos_t,
                        const float *sin_t, const int64_t *slots, const int64_t *pages,
                        int64_t table_stride, const int64_t *seq_lens, int64_t max_len,
                        float *logits, const int32_t *row_slots, int64_t store_first,
                        const int64_t *head_rows, int64_t n_head, const int64_t *row_shared,
                        const int64_t *chunk_ptr, const int64_t *chunk_rows, int64_t n_chunks,
                        int64_t *picks, int threads) {
    const int64_t Hd = M->hidden, D = M->head_dim, H = M->heads, Hkv = M->kv_heads;
    const int64_t I = M->inter, G = H / Hkv;
    const int64_t qkv_n = (H + 2 * Hkv) * D;
    const float eps = (float)M->eps;
    const int64_t R = row_slots && M->lora ? M->lora_rank : 0; /* 0: no adapter this step */
    int windowed = 0; /* windows: no cascade */
    for (int64_t l = 0; l < M->num_layers; l++) windowed |= M->layers[l].window > 0;
    /* rows of one sequence attend together, as prompts do (step_attention.h's flash_rows) */
    const int flash = store_first == 2 && D % FF_KU == 0 && D <= FF_DMAX;
    if (R > LORA_MAX_RANK) return -1;
    const int64_t most = G < CASCADE_ROWS ? CASCADE_ROWS : G;
    if (store_first || windowed ||
        !cascade_ok(row_shared, chunk_ptr, chunk_rows, n_chunks, seq_lens, B, G, most, M->page_size))
        n_chunks = 0;
    /* decodes of few (sequence, KV head) tasks: long contexts in parts of their keys, the
       step's (sequence, KV head, part) tasks n_parts (0: none; step_attention.h) */
    int64_t n_parts = 0;
    if (M->split_keys && !store_first && !n_chunks && !windowed)
        for (int64_t b = 0; b < B; b++) n_parts += Hkv * att_parts(seq_lens[b], B * Hkv);
    if (n_parts == B * Hkv) n_parts = 0; /* no context in more than one part */
    /* query rows an attention call takes at most: a sequence's G, or a cascade chunk's */
    const int64_t SG = n_chunks ? most : G;
    /* shared between the threads: each phase's output (and the adapters' shrinks), then
       each thread's pick of each row over its columns */
    const size_t floats =
        (size_t)(B * (qkv_n + H * D + Hd + I + 5 * R + 2 * H) + n_parts * G * (D + 2) + 1) / 2 * 2;
    float *shared = malloc(sizeof(float) * floats + sizeof(int64_t) * (size_t)(threads * n_head));
    if (shared == NULL) return -1;
    int64_t *part_picks = (int64_t *)(shared + floats);
    float *qkv = shared, *attn = qkv + B * qkv_n, *lin_out = attn + B * H * D, *act = lin_out + B * Hd;
    float *u_qkv = act + B * I, *u_o = u_qkv + B * 3 * R, *u_down = u_o + B * R;
    float *ml_rows = u_down + B * R; /* [B, H, 2]: each row's own part, cascade rows */
    float *part_o = ml_rows + B * H * 2, *part_ml = part_o + n_parts * G * D; /* the parts' */
    int failed = 0;
    team_t team = {0};
    /* a counter a (layer, linear) of the claimed columns (NULL: fixed halves), and a
       counter a layer of the claimed attention tasks where sequences attend together or
       contexts in parts */
    _Atomic int64_t *claims = NULL, *att_next = NULL;
    if ((flash || n_parts) &&
        (att_next = calloc((size_t)M->num_layers, sizeof *att_next)) == NULL) {
        free(shared);
        return -1;
    }
    /* with claims, the residual rows, their norms and the bf16 copies the tiles read
       are the team's too, each thread making its share of the rows between two
       barriers, not every thread all of them (every thread adding, normalizing and
       rounding every row was ~15% of a step of 256-512 rows; alternated three times on
       the 2-core AMX Xeon, a 512-token prompt 92.4 -> 85.2 ms, 224 tokens beside 32
       decodes 63.8 -> 59.8, 256 alone level; from 41 rows, the extra barriers cost more
       than they save: 64 / 128 tokens 15.6 / 24.4 against 14.0 / 23.3 ms) */
    float *rows_res = NULL, *rows_xn = NULL;
    uint16_t *rows_xb = NULL, *rows_act = NULL, *rows_attn = NULL;
#if defined(CLAIM_MIN_ROWS)
    if (B >= CLAIM_MIN_ROWS && threads > 1) {
        const int64_t Bp = (B + 15) / 16 * 16; /* the copies' rows: whole tiles */
        const layer_t *L0 = &M->layers[0];
        claims = calloc((size_t)(M->num_layers * 4), sizeof *claims);
        rows_res = malloc(sizeof(float) * (size_t)(2 * B * Hd) +
                          sizeof(uint16_t) * (size_t)(Bp * (Hd + I + H * D)));
        if (claims == NULL || rows_res == NULL) {
            free(shared);
            free(att_next);
            free(claims);
            free(rows_res);
            return -1;
        }
        rows_xn = rows_res + B * Hd;
        uint16_t *copies = (uint16_t *)(rows_xn + B * Hd);
        memset(copies, 0, sizeof(uint16_t) * (size_t)(Bp * (Hd + I + H * D)));
        if (L0->qkv.act_bf16 || L0->gate_up.act_bf16) rows_xb = copies;
        if (L0->down.act_bf16) rows_act = copies + Bp * Hd;
        if (L0->o.act_bf16) rows_attn = copies + Bp * (Hd + I);
    }
#endif
    /* MoE layers' scratch: the team's pairs of rows and experts (moe_t), as many as the
       layer routing the most experts a row has */
    int64_t moe_k = 0, moe_i = 0, moe_e = 0, moe_bf16 = 0;
    for (int64_t l = 0; l < M->num_layers; l++) {
        const layer_t *L = &M->layers[l];
        if (!L->router) continue;
        moe_k = L->top_k > moe_k ? L->top_k : moe_k;
        moe_i = L->moe_inter > moe_i ? L->moe_inter : moe_i;
        moe_e = L->num_experts > moe_e ? L->num_experts : moe_e;
        moe_bf16 |= L->experts[0].act_bf16;
    }
    const int64_t P = B * moe_k;
    moe_t moe = {0};
    /* the experts' bf16 rows, where they take such and one may get MOE_ROUND_MIN_ROWS
       rows (each of the B rows routes to an expert once) */
    const int64_t xb_rows = moe_bf16 && B >= MOE_ROUND_MIN_ROWS ? moe_xb_rows(P) : 0;
    if (P) {
        moe.x = malloc(sizeof(float) * (size_t)(P * (Hd + moe_i + 1)) + sizeof(int64_t) * (size_t)P +
                       sizeof(uint16_t) * (size_t)(xb_rows * Hd));
        if (moe.x == NULL) {
            free(shared);
            free(att_next);
            free(claims);
            free(rows_res);
            return -1;
        }
        moe.act = moe.x + P * Hd;
        moe.w = moe.act + P * moe_i;
        moe.ids = (int64_t *)(moe.w + P);
        if (xb_rows) moe.xb = (uint16_t *)(moe.ids + P);
    }
    /* where every attention row is a flash or attend_task row (a step whose rows attend
       after the stores, no cascade), each writes its bf16 copy too, which o's tiles read */
    uint16_t *attn_b = NULL;
#if defined(__AMX_BF16__)
    if (flash && !n_chunks) attn_b = rows_attn;
#else
    (void)rows_attn;
#endif
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t phase = 0;
#if defined(__AMX_BF16__)
        amx_tiles_from = M->tiles_from > 0 ? M->tiles_from : AMX_TILES_MIN_ROWS;
#endif
        float *res = malloc(sizeof(float) * (size_t)(2 * B * Hd + 2 * B * SILU_CHUNK + SG * D +
                                                     SG * max_len + 3 * SG * D + 2 * B * R +
                                                     (B * G * D + 1) / 2 + Hd + 8));
#if defined(__AMX_BF16__)
        /* with the team's bf16 rows, the scratch of the linears over their tiles is had
           here, once: they then read those rows alone (no fallback that reads the fp32
           rows, which the steps below leave unwritten where every reader takes tiles) */
        const int64_t widest = Hd > I ? (Hd > H * D ? Hd : H * D) : (I > H * D ? I : H * D);
        if (rows_res && dp_buffer(amx_tiles_bytes(B, widest)) == NULL) res = (free(res), NULL);
#endif
        moe_own_t own = {0};
        if (P && (own.start = malloc(sizeof(int64_t) * (size_t)(2 * (moe_e + 1) + 2 * P) +
                                     sizeof(float) * (size_t)(ROUTER_ROWS * (moe_e + Hd)))) != NULL) {
            own.pstart = own.start + moe_e + 1;
            own.order = own.pstart + moe_e + 1;
            own.inv = own.order + P;
            own.probs = (float *)(own.inv + P);
            own.row = own.probs + ROUTER_ROWS * moe_e;
        }
        if (res == NULL || (P && own.start == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *xn = res + B * Hd, *tg = xn + B * Hd, *tu = tg + B * SILU_CHUNK;
            float *acc = tu + B * SILU_CHUNK, *scores = acc + SG * D;
            float *cq = scores + SG * max_len, *co = cq + SG * D, *cml = co + SG * D;
            float *u_gu = cml + SG * D; /* this thread's gate and up shrinks */
            uint16_t *o16 = (uint16_t *)(u_gu + 2 * B * R);
            (void)o16;
            float *normed = u_gu + 2 * B * R + (B * G * D + 1) / 2; /* a row: out_norm's */
            /* the residual rows and their norms: the team's (rr, xx; this thread makes
               rows [r0, r1)) or this thread's own (all rows) */
            const int split = rows_res != NULL;
            float *rr = split ? rows_res : res, *xx = split ? rows_xn : xn;
            int64_t r0 = 0, r1 = B;
            if (split) share(B, t, nt, &r0, &r1);
            for (int64_t b = r0; b < r1; b++) {
                const int64_t tok = tokens[b];
                if (M->embed_bf16)
                    for (int64_t i = 0; i < Hd; i++)
                        rr[b * Hd + i] = bf16_f32(((const uint16_t *)M->embed)[tok * Hd + i]);
                else
                    memcpy(rr + b * Hd, (const float *)M->embed + tok * Hd, sizeof(float) * (size_t)Hd);
                if (M->embed_scale != 0.)
                    for (int64_t i = 0; i < Hd; i++) {
                        const float v = rr[b * Hd + i] * (float)M->embed_scale;
                        rr[b * Hd + i] = M->embed_bf16 ? bf16_f32(f32_bf16(v)) : v;
                    }
            }
            norm_share(rr, NULL, M->layers[0].in_norm, xx, rows_xb, r0, r1, Hd, eps);
            if (split) team_wait(&team, nt, &phase);
            /* this thread's (row, KV head) tasks: those that attend by their contexts'
               lengths; with store_first the first ones only rotate and store, alike */
            int64_t c0, c1, lo, hi, att_lo, att_hi, rot_lo, rot_hi;
            share_tasks(seq_lens, n_chunks ? row_shared : NULL, B, Hkv, t, nt, &att_lo, &att_hi);
            if (store_first || n_parts)
                share(B * Hkv, t, nt, &rot_lo, &rot_hi);
            else
                rot_lo = att_lo, rot_hi = att_hi;
            for (int64_t l = 0; l < M->num_layers; l++) {
                const layer_t *L = &M->layers[l];
                const lora_t *ll = R ? M->lora + l * LORA_N : NULL;
                const float *lcos = cos_t + L->rope * B * M->rot_half;
                const float *lsin = sin_t + L->rope * B * M->rot_half;
                _Atomic int64_t *cl = claims ? claims + l * 4 : NULL;
                lin_team(&L->qkv, xx, rows_xb, B, Hd, qkv_n, qkv, qkv_n, cl, t, nt);
                share(B, t, nt, &lo, &hi);
                if (ll) lora_shrinks(ll, LORA_Q, 3, row_slots, xx, Hd, lo, hi, u_qkv, R);
                team_wait(&team, nt, &phase);
                for (int64_t task = rot_lo; task < rot_hi; task++) {
                    const int64_t b = task / Hkv, h = task % Hkv;
                    if (ll) { /* this task's columns of q, k and v get their deltas */
                        const int64_t s = row_slots[b];
                        float *row = qkv + b * qkv_n;
                        const float *u = u_qkv + b * 3 * R;
                        if (lora_rank(&ll[LORA_Q], s))
                            lora_expand_rows(&ll[LORA_Q], s, u, 0, row + h * G * D, 0, h * G * D,
                                             (h + 1) * G * D, 1);
                        if (lora_rank(&ll[LORA_K], s))
                            lora_expand_rows(&ll[LORA_K], s, u + R, 0, row + (H + h) * D, 0,
                                             h * D, (h + 1) * D, 1);
                        if (lora_rank(&ll[LORA_V], s))
                            lora_expand_rows(&ll[LORA_V], s, u + 2 * R, 0, row + (H + Hkv + h) * D,
                                             0, h * D, (h + 1) * D, 1);
                    }
                    const int64_t skip = n_chunks ? row_shared[b] : 0;
                    attention_task(M, l, b, h, qkv, qkv_n, lcos, lsin, slots[b],
                                   pages + b * table_stride, seq_lens[b], scores, acc,
                                   store_first || n_parts ? NULL : attn + b * H * D + h * G * D, skip,
                                   ml_rows + (b * H + h * G) * 2);
                }
                if (n_chunks) { /* every row's own part is in: the shared parts, merged */
                    team_wait(&team, nt, &phase);
                    share(n_chunks * Hkv, t, nt, &lo, &hi);
                    for (int64_t task = lo; task < hi; task++) {
                        const int64_t i = task / Hkv, h = task % Hkv;
                        const int64_t *rows = chunk_rows + chunk_ptr[i];
                        cascade_task(M, l, h, qkv, qkv_n, rows, chunk_ptr[i + 1] - chunk_ptr[i],
                                     pages + rows[0] * table_stride, row_shared[rows[0]], scores,
                                     acc, cq, co, cml, attn, ml_rows);
                    }
                }
                if (n_parts) { /* every row's key is in the pool: the parts, claimed */
                    team_wait(&team, nt, &phase);
                    _Atomic int64_t *next_part = att_next + l;
                    for (int64_t k; (k = atomic_fetch_add_explicit(next_part, 1, memory_order_relaxed)) < n_parts;)
                        att_part_task(M, l, k, B, qkv, qkv_n, pages, table_stride, seq_lens,
                                      scores, acc, part_o, part_ml, attn);
                    team_wait(&team, nt, &phase);
                    share(B * Hkv, t, nt, &lo, &hi);
                    for (int64_t task = lo; task < hi; task++)
                        att_merge_task(M, task / Hkv, task % Hkv, B, seq_lens, part_o, part_ml,
                                       attn);
                }
                if (store_first) { /* every row's key is in the pool: now they attend */
                    team_wait(&team, nt, &phase);
                    /* the fp32 rows only where something reads them: the adapters,
                       or an o projection without tiles (a 512-token prompt's attention
                       ~14.9 -> ~12.6 ms, 2-core AMX Xeon) */
                    float *attn_f = attn_b && !ll && L->o.tiles ? NULL : attn;
                    if (flash) { /* a task a (sequence, KV head, part of its rows): a
                                    sequence of FLASH_SPLIT_ROWS or more rows in nt parts
                                    (a row's sums do not depend on its tile's other rows);
                                    sequence i ends at row head_rows[i]. The tasks are
                                    claimed one at a time, the last first: a step's
                                    prompts come after its decodes, and their parts are
                                    the long tasks, which fixed shares by count left to
                                    one thread (~5 ms a step of 8 decodes and a 250-token
                                    prompt); the decodes' short ones even out the end. */
                        int64_t tasks = 0;
                        for (int64_t i = 0; i < n_head; i++)
                            tasks += Hkv * seq_parts(head_rows, i, nt);
                        int64_t i = n_head, first = tasks; /* sequence i's first task */
                        for (int64_t k; (k = atomic_fetch_add_explicit(att_next + l, 1, memory_order_relaxed)) < tasks;) {
                            const int64_t task = tasks - 1 - k;
                            while (task < first) first -= Hkv * seq_parts(head_rows, --i, nt);
                            const int64_t parts = seq_parts(head_rows, i, nt);
                            const int64_t r0 = i ? head_rows[i - 1] + 1 : 0, n = head_rows[i] + 1 - r0;
                            const int64_t *tb = pages + r0 * table_stride;
                            const int64_t h = (task - first) % Hkv, part = (task - first) / Hkv;
                            const int64_t pos = seq_lens[r0] - 1; /* row r0's */
                            const int64_t a = r0 + part_row(n, pos, part, parts);
                            const int64_t z = r0 + part_row(n, pos, part + 1, parts);
                            if (z - a >= FLASH_MIN_ROWS && !flash_rows(M, l, a, z - a, h, qkv, qkv_n, tb,
                                                                       seq_lens[a] - 1, o16, attn_f, attn_b))
                                continue;
                            for (int64_t b = a; b < z; b++) {
                                float *o = attn + b * H * D + h * G * D;
                                attend_task(M, l, b, h, qkv, qkv_n, tb, seq_lens[b], scores, acc, o);
#if defined(__AMX_BF16__)
                                if (attn_b) rows_bf16(o, attn_b + b * H * D + h * G * D, G * D);
#endif
                            }
                        }
                    } else
                        for (int64_t task = att_lo; task < att_hi; task++) { /* a (row, KV head) */
                            const int64_t b = task / Hkv, h = task % Hkv;
                            attend_task(M, l, b, h, qkv, qkv_n, pages + b * table_stride,
                                        seq_lens[b], scores, acc, attn + b * H * D + h * G * D);
                        }
                }
                team_wait(&team, nt, &phase);
                lin_team(&L->o, attn, attn_b, B, H * D, Hd, lin_out, Hd, cl ? cl + 1 : NULL, t, nt);
                share(B, t, nt, &lo, &hi);
                if (ll) lora_shrinks(ll, LORA_O, 1, row_slots, attn, H * D, lo, hi, u_o, R);
                team_wait(&team, nt, &phase);
                if (L->attn_out_norm)
                    add_normed(rr, lin_out, L->attn_out_norm, normed, r0, r1, Hd, eps,
                               ll ? &ll[LORA_O] : NULL, row_slots, u_o, R);
                else if (ll) { /* the adapters' deltas come between the add and the norm */
                    add_rows(rr + r0 * Hd, lin_out + r0 * Hd, (r1 - r0) * Hd);
                    lora_adds(&ll[LORA_O], row_slots, u_o, R, rr, Hd, 0, Hd, r0, r1);
                }
                norm_share(rr, ll || L->attn_out_norm ? NULL : lin_out, L->post_norm, xx, rows_xb,
                           r0, r1, Hd, eps);
                if (split) team_wait(&team, nt, &phase);
                if (L->router) {
                    moe_mlp(M, L, xx, rr, r0, r1, B, &moe, &own, tg, tu, act, lin_out, &team, t,
                            nt, &phase);
                } else {
                    if (ll) lora_shrinks(ll, LORA_GATE, 2, row_slots, xx, Hd, 0, B, u_gu, R);
                    if (cl) { /* chunks of at most SILU_CHUNK: tg and tu hold one */
                        const int64_t chunk = claim_cols(I, nt, SILU_CHUNK);
                        claims_begin(xx, rows_xb, B, Hd);
                        for (int64_t a, z; claim_next(cl + 2, chunk, I, &a, &z);)
                            gate_up_silu(&L->gate_up, xx, B, Hd, I, a, z, tg, tu, act, rows_act,
                                         !L->down.tiles, (int)M->act_gelu, ll, row_slots, u_gu, R);
                        claims_end();
                    } else {
                        lin_part(I, t, nt, &c0, &c1);
                        gate_up_silu(&L->gate_up, xx, B, Hd, I, c0, c1, tg, tu, act, NULL, 1,
                                     (int)M->act_gelu, ll, row_slots, u_gu, R);
                    }
                    team_wait(&team, nt, &phase);
                    lin_team(&L->down, act, rows_act, B, I, Hd, lin_out, Hd, cl ? cl + 3 : NULL, t, nt);
                    share(B, t, nt, &lo, &hi);
                    if (ll) lora_shrinks(ll, LORA_DOWN, 1, row_slots, act, I, lo, hi, u_down, R);
                    team_wait(&team, nt, &phase);
                    if (L->ffn_out_norm)
                        add_normed(rr, lin_out, L->ffn_out_norm, normed, r0, r1, Hd, eps,
                                   ll ? &ll[LORA_DOWN] : NULL, row_slots, u_down, R);
                    else if (ll) {
                        add_rows(rr + r0 * Hd, lin_out + r0 * Hd, (r1 - r0) * Hd);
                        lora_adds(&ll[LORA_DOWN], row_slots, u_down, R, rr, Hd, 0, Hd, r0, r1);
                    }
                }
                const float *next = l + 1 < M->num_layers ? M->layers[l + 1].in_norm : M->final_norm;
                const int added = ll || L->ffn_out_norm || L->router;
                norm_share(rr, added ? NULL : lin_out, next, xx, rows_xb, r0, r1, Hd, eps);
                if (split) team_wait(&team, nt, &phase);
            }
            int64_t rows = B;
            if (head_rows) { /* the rows that get logits, packed to the front of xn */
                for (int64_t i = 0; i < n_head; i++)
                    if (xx + head_rows[i] * Hd != xn + i * Hd)
                        memmove(xn + i * Hd, xx + head_rows[i] * Hd, sizeof(float) * (size_t)Hd);
                rows = n_head;
                xx = xn;
            }
            lin_part(M->vocab, t, nt, &c0, &c1);
            lin_cols(&M->head, xx, rows, Hd, c0, c1, logits, M->vocab);
            if (M->final_softcap > 0. && c1 > c0)
                for (int64_t r = 0; r < rows; r++)
                    att_softcap(logits + r * M->vocab + c0, c1 - c0, (float)M->final_softcap);
            if (picks) {
                for (int64_t r = 0; r < rows; r++)
                    part_picks[t * rows + r] =
                        c1 > c0 ? c0 + row_argmax(logits + r * M->vocab + c0, c1 - c0, NULL, 0) : -1;
                team_wait(&team, nt, &phase);
                share(rows, t, nt, &lo, &hi);
                for (int64_t r = lo; r < hi; r++) /* the threads' columns in order */
                    picks[r] = merge_picks(logits + r * M->vocab, part_picks + r, rows, nt);
            }
        }
        free(res);
        free(own.start);
#if defined(__AMX_BF16__)
        amx_tiles_from = AMX_TILES_MIN_ROWS;
#endif
    }
    free(shared);
    free(moe.x);
    free(claims);
    free(att_next);
    free(rows_res);
    return failed ? -1 : 0;
}

/* The cpu attention backend's decodes over a bf16 pool (cpu_decode.c reads fp32):
   the arguments of actorlm_paged_decode (starts NULL: none), q and out fp32, and the
   soft cap of the scores (0: none); and, with no starts, actorlm_decode_step's cascade
   (row_shared, chunk_ptr, chunk_rows, n_chunks; n_chunks 0: none). */
int actorlm_paged_decode_kv(const float *q, int64_t q_stride_b, const void *k, const void *v,
                            int64_t kv_bf16, int64_t num_pages, const int64_t *pages,
                            int64_t table_stride, const int64_t *seq_lens, const int64_t *starts,
                            float *out, int64_t B, int64_t Hkv, int64_t G, int64_t D,
                            int64_t page_size, int64_t max_len, float scale, float softcap,
                            const int64_t *row_shared, const int64_t *chunk_ptr,
                            const int64_t *chunk_rows, int64_t n_chunks, int threads) {
    int failed = 0;
    const int64_t head_elems = num_pages * page_size * D, esize = kv_bf16 ? 2 : 4;
    const int64_t most = G < CASCADE_ROWS ? CASCADE_ROWS : G, GD = G * D;
    if (starts || !cascade_ok(row_shared, chunk_ptr, chunk_rows, n_chunks, seq_lens, B, G, most,
                              page_size))
        n_chunks = 0;
    const int64_t SG = n_chunks ? most : G;
    float *ml = n_chunks ? malloc(sizeof(float) * (size_t)(B * Hkv * G * 2)) : NULL;
    if (n_chunks && ml == NULL) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(max_len * SG + 4 * SG * D + 8));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *acc = scores ? scores + max_len * SG : NULL;
        float *cq = acc ? acc + SG * D : NULL, *co = cq ? cq + SG * D : NULL;
        float *cml = co ? co + SG * D : NULL;
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hkv; h++) {
                if (scores == NULL) continue;
                const char *kh = (const char *)k + h * head_elems * esize;
                const char *vh = (const char *)v + h * head_elems * esize;
                const int64_t skip = n_chunks ? row_shared[b] : 0; /* whole pages */
                attend_pages(kv_bf16, q + b * q_stride_b + h * GD, kh, vh,
                             pages + b * table_stride + skip / page_size, seq_lens[b] - skip, G,
                             D, page_size, scale, starts ? starts[b] : 0, softcap, scores, acc,
                             out + (b * Hkv + h) * GD, skip ? ml + (b * Hkv + h) * G * 2 : NULL);
            }
        }
        if (n_chunks) { /* every row's own part is in (the loop's barrier): the shared parts */
#pragma omp for schedule(static)
            for (int64_t task = 0; task < n_chunks * Hkv; task++) {
                if (scores == NULL) continue;
                const int64_t i = task / Hkv, h = task % Hkv;
                const int64_t *rows = chunk_rows + chunk_ptr[i];
                cascade_rows(kv_bf16, (const char *)k + h * head_elems * esize,
                             (const char *)v + h * head_elems * esize, q + h * GD, q_stride_b,
                             rows, chunk_ptr[i + 1] - chunk_ptr[i], pages + rows[0] * table_stride,
                             row_shared[rows[0]], G, D, page_size, scale, softcap, scores, acc, cq,
                             co, cml, out + h * GD, Hkv * GD, ml + h * G * 2, Hkv * G * 2);
            }
        }
        free(scores);
    }
    free(ml);
    return failed ? -1 : 0;
}
