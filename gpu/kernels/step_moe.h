/* The fused step's sparse MoE layers (layer_t.router: Qwen3-MoE, Mixtral, a plugin's
 * Qwen2-MoE with its shared expert). Included by cpu_step.c after its model types, row
 * helpers, gate_up_silu and the team's barrier and claims, which it uses.
 */
#ifndef ACTORLM_STEP_MOE_H
#define ACTORLM_STEP_MOE_H

/* A sparse MoE layer's MLP (layer_t.router): every row's top_k experts by the router's
 * softmax; the (row, expert) pairs gathered by expert, so each expert's weights are read
 * once a step for all its rows (a decode batch of 8 at 8 of 128 experts a row reads up
 * to 64 experts, each with 1-2 rows); each expert's gate_up, activation and down over
 * its rows, the columns split over the team; each row's outputs weighted and added to
 * its residual. Four barriers: after the routing, the gathering, gate_up and down. */
typedef struct {
    int64_t *ids; /* [B * top_k] each pair's expert (pair b * top_k + j: row b's j-th) */
    float *w;     /* [B * top_k] its weight */
    float *x;     /* [B * top_k, hidden] the pairs' rows by expert, then their outputs */
    float *act;   /* [B * top_k, moe_inter] */
    uint16_t *xb; /* the rows of experts with MOE_ROUND_MIN_ROWS or more, in bf16, each
                     expert's padded with zero rows to whole tiles (moe_own_t.pstart), or
                     NULL: none can have so many this step */
} moe_t;

typedef struct { /* a thread's own */
    int64_t *start;      /* [E + 1] where each expert's pairs begin in moe_t.x */
    int64_t *pstart;     /* [E + 1] and its rows in moe_t.xb (none below MOE_ROUND_MIN_ROWS) */
    int64_t *order, *inv; /* [B * top_k] the pair at each place, the place of each pair */
    float *probs, *row;  /* [ROUTER_ROWS, E], [ROUTER_ROWS, hidden] */
} moe_own_t;

/* an expert's rows are rounded to bf16 once, by the team, for the weights that take
   them so: from the rows where the tiles read such a copy (amx_expanded_cols; fewer
   take amx_blocks_cols, which rounds its rows with their sums itself) */
#if defined(__AMX_BF16__)
#define MOE_ROUND_MIN_ROWS AMX_DQ_MIN_ROWS
#else
#define MOE_ROUND_MIN_ROWS INT64_MAX /* claims_begin rounds nothing here */
#endif

static inline float bf16_round(float f) { return bf16_f32(f32_bf16(f)); }

/* Rows the router scores together: each expert's weights are loaded once for them (a row
   at a time streamed the router's [E, hidden] from L2 once a row, ~10% of a 512-token
   prompt's step on Qwen3-MoE's shape); their sums in registers, four experts a pass */
#define ROUTER_ROWS (VW >= 16 ? 4 : 2)

/* p[r * E + e] = x_r . w[e] (x_r: x + r * Hd) for rows r < R and the E experts, four
   at a time: four independent sums a row hide the multiply-add's latency. Each sum
   is the same whatever R (lanes over the row, then hsumv). */
static inline __attribute__((always_inline)) void router_block(const float *x, const int R,
                                                               const float *w, int64_t E,
                                                               int64_t Hd, float *p) {
    int64_t e = 0;
    if (Hd % VW == 0)
        for (; e + 4 <= E; e += 4) {
            const float *w0 = w + e * Hd, *w1 = w0 + Hd, *w2 = w1 + Hd, *w3 = w2 + Hd;
            vf a[ROUTER_ROWS][4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = (vf){0};
            for (int64_t i = 0; i < Hd; i += VW) {
                const vf v0 = *(const vf *)(w0 + i), v1 = *(const vf *)(w1 + i);
                const vf v2 = *(const vf *)(w2 + i), v3 = *(const vf *)(w3 + i);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const vf xv = *(const vf *)(x + r * Hd + i);
                    a[r][0] += xv * v0, a[r][1] += xv * v1, a[r][2] += xv * v2, a[r][3] += xv * v3;
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++) p[r * E + e + j] = hsumv(a[r][j]);
        }
    for (; e < E; e++)
        for (int r = 0; r < R; r++) p[r * E + e] = dot(x + r * Hd, w + e * Hd, Hd);
}

static void router_scores(const float *x, int64_t R, const float *w, int64_t E, int64_t Hd,
                          float *p) {
    switch (R) {
    case 1: router_block(x, 1, w, E, Hd, p); break;
    case 2: router_block(x, 2, w, E, Hd, p); break;
#if VW >= 16
    case 3: router_block(x, 3, w, E, Hd, p); break;
    case 4: router_block(x, 4, w, E, Hd, p); break;
#endif
    }
}

/* ids, w of rows [b0, b1): softmax over all experts, the top k (the first of equals
   first), renormalized where the family does; as SparseMoE.route computes them */
static void moe_route(const layer_t *L, const float *x, int64_t Hd, int64_t b0, int64_t b1,
                      const moe_t *S, const moe_own_t *own) {
    const int64_t E = L->num_experts, k = L->top_k;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t r = (b - b0) % ROUTER_ROWS;
        if (r == 0) { /* the scores of this row and the next ROUTER_ROWS - 1 */
            const int64_t R = b1 - b < ROUTER_ROWS ? b1 - b : ROUTER_ROWS;
            const float *xr = x + b * Hd;
            if (L->route_bf16) {
                for (int64_t i = 0; i < R * Hd; i++) own->row[i] = bf16_round(xr[i]);
                xr = own->row;
            }
            router_scores(xr, R, L->router, E, Hd, own->probs);
        }
        float *p = own->probs + r * E, most = -INFINITY, sum = 0.f;
        for (int64_t e = 0; e < E; e++) {
            if (L->route_bf16) p[e] = bf16_round(p[e]);
            most = p[e] > most ? p[e] : most;
        }
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(p[e] - most);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        float total = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = 0;
            for (int64_t e = 1; e < E; e++) best = p[e] > p[best] ? e : best;
            S->ids[b * k + j] = best;
            total += S->w[b * k + j] = p[best];
            p[best] = -1.f; /* taken */
        }
        for (int64_t j = 0; j < k; j++) {
            float v = S->w[b * k + j];
            if (L->renorm) v /= total;
            S->w[b * k + j] = L->route_bf16 ? bf16_round(v) : v;
        }
    }
}

/* The pairs [0, P) by expert, in pair order within one (a stable counting sort), and
   where each expert's rows lie in moe_t.xb */
static void moe_group(const int64_t *ids, int64_t P, int64_t E, const moe_own_t *own) {
    int64_t *start = own->start, *pstart = own->pstart;
    memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < P; p++) own->order[own->inv[p] = start[ids[p]]++] = p;
    for (int64_t e = E; e > 0; e--) start[e] = start[e - 1]; /* back to each one's first */
    start[0] = 0;
    pstart[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = start[e + 1] - start[e];
        pstart[e + 1] = pstart[e] + (n >= MOE_ROUND_MIN_ROWS ? (n + 15) / 16 * 16 : 0);
    }
}

/* The bound on moe_t.xb's rows: a pad of at most 15 to each expert of MOE_ROUND_MIN_ROWS
   or more of the P rows */
static inline int64_t moe_xb_rows(int64_t P) { return P + P / MOE_ROUND_MIN_ROWS * 15; }

/* rr's rows [r0, r1) += the MoE of xx's (all B rows of xx normed: the team's, or this
   thread's copy); a shared expert's act [B, its inter] and out [B, hidden] through the
   team's act and lin_out, in the experts' phases */
static void moe_mlp(const model_t *M, const layer_t *L, const float *xx, float *rr, int64_t r0,
                    int64_t r1, int64_t B, const moe_t *S, const moe_own_t *own, float *tg,
                    float *tu, float *act, float *out, team_t *team, int t, int nt,
                    int64_t *phase) {
    const int64_t shared = L->shared_gate ? L->down.k : 0;
    const int64_t Hd = M->hidden, I = L->moe_inter, k = L->top_k, E = L->num_experts, P = B * k;
    int64_t lo, hi, c0, c1;
    share(B, t, nt, &lo, &hi);
    moe_route(L, xx, Hd, lo, hi, S, own);
    team_wait(team, nt, phase);
    moe_group(S->ids, P, E, own);
    share(P, t, nt, &lo, &hi);
    for (int64_t q = lo; q < hi; q++) {
        const float *xr = xx + own->order[q] / k * Hd;
        memcpy(S->x + q * Hd, xr, sizeof(float) * (size_t)Hd);
#if defined(__AMX_BF16__)
        const int64_t e = S->ids[own->order[q]];
        if (S->xb && own->pstart[e + 1] > own->pstart[e])
            rows_bf16(xr, S->xb + (own->pstart[e] + q - own->start[e]) * Hd, Hd);
#endif
    }
    if (S->xb) { /* the pads of this thread's share of the experts */
        share(E, t, nt, &lo, &hi);
        for (int64_t e = lo; e < hi; e++) {
            const int64_t rows = own->start[e + 1] - own->start[e];
            const int64_t pad = own->pstart[e + 1] - own->pstart[e] - rows;
            if (pad > 0)
                memset(S->xb + (own->pstart[e] + rows) * Hd, 0, sizeof(uint16_t) * (size_t)(pad * Hd));
        }
    }
    team_wait(team, nt, phase);
    lin_part(I, t, nt, &c0, &c1);
    for (int64_t e = 0; e < E; e++) {
        const int64_t a = own->start[e], n = own->start[e + 1] - a;
        if (!n) continue;
        /* its rows as the team rounded them, for gate and up */
        const int once = S->xb && L->experts[2 * e].act_bf16 && n >= MOE_ROUND_MIN_ROWS;
        if (once) claims_begin(S->x + a * Hd, S->xb + own->pstart[e] * Hd, n, Hd);
        gate_up_silu(&L->experts[2 * e], S->x + a * Hd, n, Hd, I, c0, c1, tg, tu, S->act + a * I,
                     NULL, 1, (int)M->act_gelu, NULL, NULL, NULL, 0);
        if (once) claims_end();
    }
    if (shared) {
        lin_part(shared, t, nt, &c0, &c1);
        gate_up_silu(&L->gate_up, xx, B, Hd, shared, c0, c1, tg, tu, act, NULL, 1,
                     (int)M->act_gelu, NULL, NULL, NULL, 0);
    }
    team_wait(team, nt, phase);
    lin_part(Hd, t, nt, &c0, &c1);
    for (int64_t e = 0; e < E; e++) { /* the outputs over the inputs, read by now */
        const int64_t a = own->start[e], n = own->start[e + 1] - a;
        if (n) lin_cols(&L->experts[2 * e + 1], S->act + a * I, n, I, c0, c1, S->x + a * Hd, Hd);
    }
    if (shared) lin_cols(&L->down, act, B, shared, c0, c1, out, Hd);
    team_wait(team, nt, phase);
    for (int64_t b = r0; b < r1; b++) {
        float *sum = own->row;
        memset(sum, 0, sizeof(float) * (size_t)Hd);
        for (int64_t j = 0; j < k; j++)
            axpy(S->w[b * k + j], S->x + own->inv[b * k + j] * Hd, sum, Hd);
        if (shared) { /* its gate rounded as the router's scores are */
            const float *xr = xx + b * Hd;
            float g = 0.f;
            if (L->route_bf16) {
                for (int64_t i = 0; i < Hd; i++) g += bf16_round(xr[i]) * L->shared_gate[i];
                g = bf16_round(1.f / (1.f + expf(-bf16_round(g))));
            } else
                g = 1.f / (1.f + expf(-dot(xr, L->shared_gate, Hd)));
            for (int64_t i = 0; i < Hd; i++) sum[i] += g * out[b * Hd + i];
        }
        add_rows(rr + b * Hd, sum, Hd);
    }
}

#endif
