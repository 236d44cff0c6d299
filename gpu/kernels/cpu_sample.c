/* A draw from each of a batch's rows of processed fp32 logits (see sample.py): the
 * temperature, top-k, top-p over what top-k left (renormalized), min-p, then the
 * inverse CDF of the kept weights at the row's uniform u in [0, 1).
 *
 * PyTorch's way (sampling.py's reference, which CUDA keeps) sorts the whole vocabulary
 * for top-k/top-p and draws one exponential a token for Gumbel-max: at a 49k vocabulary
 * ~1.4 ms a row for temperature alone and ~5 ms with top-p (2-core Xeon), more than the
 * forward pass of a small model. Here a row costs a few vectorized passes, and nothing
 * is sorted:
 *
 *   w = exp((z - max) / t)  its sum kept in blocks of BLK tokens
 *   top-k / top-p           the weight `at` where the heaviest tokens reach k (in
 *                           number) or top_p of the mass, by bisection over the bits of
 *                           the weights (positive floats order as their bits do): a
 *                           counting pass over the row a step until the interval is
 *                           an octave, then over that octave's weights alone. Kept:
 *                           every token heavier than `at`, and of those weighing
 *                           exactly `at` the first (by id) that reach it
 *   draw                    u times the kept mass, found in the blocks' running sums
 *
 * Weights below exp(-87) (a banned token's -inf among them) are 0: never drawn. A row
 * with a NaN, or with nothing above -inf, answers as torch.argmax does (the first NaN,
 * or 0).
 *
 * Log-probabilities (actorlm_logprob_rows) take two passes over a row of raw logits in
 * place of torch's log_softmax, gather and topk over copies of [R, V]: the first keeps
 * the k best as they go by (the largest of them is the row's max), the second sums
 * exp(z - max). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "argmax.h"
#include "simd.h"

#define BLK 1024 /* tokens a block of the running sums */

/* What a cut keeps: the tokens heavier than `at`, and the first `take` of those that
   weigh `at` (at 0: every token with a weight) */
typedef struct {
    float at;
    int64_t take;
} cut_t;

static inline float from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline uint32_t to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* The row's largest value, or NaN if it has one */
static float row_max(const float *z, int64_t V) {
    vf m = (vf){0} - INFINITY;
    vi nan = (vi){0};
    int64_t i = 0;
    for (; i + VW <= V; i += VW) {
        const vf x = *(const vf *)(z + i);
        const vi gt = x > m;
        nan |= x != x;
        m = (vf)(((vi)x & gt) | ((vi)m & ~gt));
    }
    float best = -INFINITY;
    for (int j = 0; j < VW; j++) {
        if (nan[j]) return NAN;
        best = m[j] > best ? m[j] : best;
    }
    for (; i < V; i++) {
        if (z[i] != z[i]) return NAN;
        best = z[i] > best ? z[i] : best;
    }
    return best;
}

/* w[i] = exp((z[i] - m) / t), 0 below exp(-87) or `floor`; blocks[b] the sum of block
   b (BLK tokens); returns the whole sum */
static double weigh(const float *z, int64_t V, float m, float inv_t, float floor, float *w,
                    double *blocks) {
    const vf lo = (vf){0} - 87.f, fl = (vf){0} + floor;
    double total = 0;
    for (int64_t b0 = 0, b = 0; b0 < V; b0 += BLK, b++) {
        const int64_t end = b0 + BLK < V ? b0 + BLK : V;
        vf acc = (vf){0};
        int64_t i = b0;
        for (; i + VW <= end; i += VW) {
            const vf x = (*(const vf *)(z + i) - m) * inv_t;
            const vf y = expv(x);
            const vf kept = (vf)((vi)y & ((x >= lo) & (y >= fl)));
            *(vf *)(w + i) = kept;
            acc += kept;
        }
        float s = hsumv(acc);
        for (; i < end; i++) {
            const float x = (z[i] - m) * inv_t, y = x >= -87.f ? expf(x) : 0.f;
            w[i] = y >= floor ? y : 0.f;
            s += w[i];
        }
        blocks[b] = s;
        total += s;
    }
    return total;
}

/* The number (by_count) or the mass of the weights in [lo, hi) of w[0 .. n) */
static double measure(const float *w, int64_t n, float lo, float hi, int by_count) {
    const vf l = (vf){0} + lo, h = (vf){0} + hi, one = (vf){0} + 1.f;
    vf m = (vf){0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) {
        const vf x = *(const vf *)(w + i);
        m += (vf)((vi)(by_count ? one : x) & ((x >= l) & (x < h)));
    }
    double s = hsumv(m);
    for (; i < n; i++)
        if (w[i] >= lo && w[i] < hi) s += by_count ? 1.0 : w[i];
    return s;
}

/* w's weights in [lo, hi), gathered into buf; returns how many */
static int64_t gather(const float *w, int64_t V, float lo, float hi, float *buf) {
    int64_t n = 0, i = 0;
#if VW == 16
    for (; i + 16 <= V; i += 16) {
        const __m512 x = _mm512_loadu_ps(w + i);
        const __mmask16 in = _mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_GE_OQ) &
                             _mm512_cmp_ps_mask(x, _mm512_set1_ps(hi), _CMP_LT_OQ);
        _mm512_mask_compressstoreu_ps(buf + n, in, x);
        n += __builtin_popcount(in);
    }
#endif
    for (; i < V; i++) {
        buf[n] = w[i];
        n += w[i] >= lo && w[i] < hi;
    }
    return n;
}

/* The cut where the heaviest of w's weights at or above `floor` (> 0) reach `need`: in
   number (by_count) or in mass. Weights equal to the floor count only `floor_take` (< 0:
   all of them: a cut within an earlier cut's ties). buf: scratch of V floats. */
static cut_t cut(const float *w, int64_t V, float floor, int64_t floor_take, double need,
                 int by_count, float *buf) {
    uint32_t lo = to_bits(floor), hi = to_bits(1.f) + 1; /* pred(lo) holds, pred(hi) not */
    double above = 0;                                   /* measure of [hi, 2) */
    const float *a = w;
    int64_t n = V;
    while (hi - lo > 1) {
        if (a == w && hi - lo <= (1u << 23)) { /* an octave or less: its weights alone */
            n = gather(w, V, from_bits(lo), from_bits(hi), buf);
            a = buf;
        }
        const uint32_t mid = lo + (hi - lo) / 2;
        const double m = above + measure(a, n, from_bits(mid), from_bits(hi), by_count);
        if (m >= need)
            lo = mid;
        else
            hi = mid, above = m;
    }
    const float at = from_bits(lo);
    const int64_t ties = (int64_t)measure(a, n, at, from_bits(hi), 1);
    int64_t take = by_count ? (int64_t)ceil(need - above) : (int64_t)ceil((need - above) / at);
    take = take < 1 ? 1 : take > ties ? ties : take;
    if (at == floor && floor_take >= 0 && take > floor_take) take = floor_take;
    return (cut_t){at, take};
}

/* Whether w's weights at or above `floor` reach `need` (in number, by_count, or mass) */
static int reaches(const float *w, int64_t V, float floor, double need, int by_count) {
    return measure(w, V, floor, 2.f, by_count) >= need;
}

/* The token at u of the mass of w that cut c keeps and min-p's `floor` leaves (block b's
   strict part summed vectorized; ties at c.at counted in id order) */
static int64_t draw_kept(const float *w, int64_t V, cut_t c, float floor, double u) {
    const float at = c.at > 0.f ? c.at : FLT_MIN;
    const int64_t take = c.at > 0.f && c.at >= floor ? c.take : 0;
    const float lo = c.at > 0.f ? nextafterf(c.at, 2.f) : FLT_MIN; /* strictly heavier */
    const float from = lo > floor ? lo : floor;
    const int64_t nb = (V + BLK - 1) / BLK;
    double kept = measure(w, V, from, 2.f, 0) + (double)take * at;
    const double target = u * kept;
    double cum = 0;
    int64_t seen = 0, last = -1;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t b0 = b * BLK, n = V - b0 < BLK ? V - b0 : BLK;
        const int64_t tied = take > seen ? (int64_t)measure(w + b0, n, at, lo, 1) : 0;
        const int64_t now = tied < take - seen ? tied : take - seen;
        const double s = measure(w + b0, n, from, 2.f, 0) + (double)now * at;
        if (cum + s <= target && b + 1 < nb) {
            cum += s, seen += now;
            continue;
        }
        for (int64_t i = b0; i < b0 + n; i++) {
            const int tie = w[i] == at && c.at > 0.f && seen < take;
            if (!(w[i] >= from || tie)) continue;
            seen += tie;
            last = i;
            cum += w[i];
            if (cum > target) return i;
        }
    }
    for (int64_t i = V - 1; last < 0 && i >= 0; i--) /* rounding: the last kept */
        if (w[i] >= from) last = i;
    return last < 0 ? 0 : last;
}

/* The token at u of the mass of w (blocks: its sums by BLK tokens) */
static int64_t draw_all(const float *w, int64_t V, const double *blocks, double total, double u) {
    const double target = u * total;
    double cum = 0;
    int64_t b = 0;
    const int64_t nb = (V + BLK - 1) / BLK;
    while (b + 1 < nb && cum + blocks[b] <= target) cum += blocks[b++];
    int64_t last = -1;
    for (int64_t i = b * BLK; i < V; i++)
        if (w[i] > 0.f) {
            last = i;
            cum += w[i];
            if (cum > target) return i;
        }
    for (int64_t i = b * BLK - 1; last < 0 && i >= 0; i--) /* rounding: the last weighed */
        if (w[i] > 0.f) last = i;
    return last < 0 ? 0 : last;
}

static int64_t sample_row(const float *z, int64_t V, float t, int64_t k, float p, float min_p,
                          double u, float *w, float *buf, double *blocks) {
    const float m = row_max(z, V);
    if (m != m || isinf(m)) return row_argmax(z, V, NULL, 0);
    const int top_k = k > 0 && k < V, top_p = p < 1.f;
    /* min-p alone is a floor under the weights (the heaviest weighs exp(0) = 1); after a
       cut it applies to what the cut kept */
    const double total = weigh(z, V, m, 1.f / t, top_k || top_p ? 0.f : min_p, w, blocks);
    if (!top_k && !top_p) return draw_all(w, V, blocks, total, u);
    cut_t c = {0.f, 0}; /* every token with a weight */
    double base = total; /* what top-p's shares are of: the top-k's mass, or all */
    if (top_k && reaches(w, V, FLT_MIN, (double)k, 1)) {
        c = cut(w, V, FLT_MIN, -1, (double)k, 1, buf);
        base = measure(w, V, nextafterf(c.at, 2.f), 2.f, 0) + (double)c.take * c.at;
    }
    if (top_p) {
        const float floor = c.at > 0.f ? c.at : FLT_MIN;
        c = cut(w, V, floor, c.at > 0.f ? c.take : -1, (double)p * base, 0, buf);
    }
    return draw_kept(w, V, c, min_p, u);
}

/* out[j] = a draw from row rows[j] of x [*, vocab] (row stride `stride`) with its
   temperature temp[j] > 0, top_k[j] (<= 0 or >= vocab: off), top_p[j] (1: off), min_p[j]
   (0: off) at the uniform u[j] in [0, 1). 0, or -1 when scratch memory could not be had. */
int actorlm_sample_rows(const float *x, int64_t stride, int64_t vocab, const int64_t *rows,
                        int64_t n, const float *temp, const int64_t *top_k, const float *top_p,
                        const float *min_p, const double *u, int64_t *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = malloc(sizeof(float) * (size_t)vocab);
        float *buf = malloc(sizeof(float) * (size_t)vocab);
        double *blocks = malloc(sizeof(double) * (size_t)((vocab + BLK - 1) / BLK));
        if (w == NULL || buf == NULL || blocks == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++)
            if (w && buf && blocks)
                out[j] = sample_row(x + rows[j] * stride, vocab, temp[j], top_k[j], top_p[j],
                                    min_p[j], u[j], w, buf, blocks);
        free(w);
        free(buf);
        free(blocks);
    }
    return failed ? -1 : 0;
}

/* Whether any lane of h is set */
static inline int any_lane(vi h) {
#if VW == 16
    return _mm512_test_epi32_mask((__m512i)h, (__m512i)h) != 0;
#elif defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)h, (__m256i)h);
#else
    int any = 0;
    for (int j = 0; j < VW; j++) any |= h[j];
    return any;
#endif
}

/* Row z's k >= 1 best values, largest first (of equal values the first by id), into
   vals and ids as the scan goes by: a token goes in where it beats the k-th so far (one
   compare a vector, a few hundred inserts a row). Returns how many were found above
   -inf (fewer than k: the row has fewer finite values), or -1 at a NaN. */
static int64_t row_top(const float *z, int64_t V, int64_t k, float *vals, int64_t *ids) {
    int64_t have = 0;
    float thr = -INFINITY;
    for (int64_t i0 = 0; i0 < V; i0 += 4 * VW) {
        const int64_t n = V - i0 < 4 * VW ? V - i0 : 4 * VW;
        if (n == 4 * VW) { /* lanes above the k-th so far, or NaN */
            const vf *x = (const vf *)(z + i0);
            if (!any_lane(~((x[0] <= thr) & (x[1] <= thr) & (x[2] <= thr) & (x[3] <= thr))))
                continue;
        }
        for (int64_t j = 0; j < n; j++) {
            const float v = z[i0 + j];
            if (v <= thr) continue;
            if (v != v) return -1;
            int64_t pos = have < k ? have++ : k - 1;
            for (; pos > 0 && vals[pos - 1] < v; pos--) vals[pos] = vals[pos - 1], ids[pos] = ids[pos - 1];
            vals[pos] = v, ids[pos] = i0 + j;
            if (have == k) thr = vals[k - 1];
        }
    }
    return have;
}

/* log sum exp of row z, whose largest value m is finite (sums by blocks of BLK in double) */
static double row_lse(const float *z, int64_t V, float m) {
    const vf lo = (vf){0} - 87.f;
    double total = 0;
    for (int64_t b0 = 0; b0 < V; b0 += BLK) {
        const int64_t end = b0 + BLK < V ? b0 + BLK : V;
        vf acc = (vf){0};
        int64_t i = b0;
        for (; i + VW <= end; i += VW) {
            const vf x = *(const vf *)(z + i) - m;
            acc += (vf)((vi)expv(x) & (x >= lo));
        }
        float s = hsumv(acc);
        for (; i < end; i++) s += z[i] - m >= -87.f ? expf(z[i] - m) : 0.f;
        total += s;
    }
    return m + log(total);
}

/* Log-probabilities under rows rows[j] of x [*, vocab] (row stride `stride`): chosen[j]
   token tokens[j]'s, and the k best (top_vals / top_ids [n, k], largest first). 0, or
   1 where a row has a NaN or no finite maximum, or fewer than k values above -inf (the
   caller asks torch: its answers there are NaN or ties it orders its own way). */
int actorlm_logprob_rows(const float *x, int64_t stride, int64_t vocab, const int64_t *rows,
                         int64_t n, const int64_t *tokens, int64_t k, float *chosen,
                         float *top_vals, int64_t *top_ids, int threads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) {
        const float *z = x + rows[j] * stride;
        float *vals = top_vals + j * k;
        const float m = k ? row_top(z, vocab, k, vals, top_ids + j * k) < k ? NAN : vals[0]
                          : row_max(z, vocab);
        if (m != m || isinf(m)) {
#pragma omp atomic write
            bad = 1;
            continue;
        }
        const double lse = row_lse(z, vocab, m);
        chosen[j] = (float)(z[tokens[j]] - lse);
        for (int64_t i = 0; i < k; i++) vals[i] = (float)(vals[i] - lse);
    }
    return bad;
}
