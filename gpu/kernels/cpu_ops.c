/* Fused element-wise layers for the CPU, fp32 and bf16: RMSNorm (with the residual add
 * folded in), SiLU-and-multiply, and rotary embedding in place.
 *
 * In PyTorch each is a chain of 4-7 small ops, each a pass over memory and
 * several microseconds of dispatch; at decode batch sizes the chains cost more
 * than their arithmetic. Here each is one pass. Rows split over OpenMP threads
 * only when there are enough to pay for waking the pool. Built by
 * actorlm/gpu/native.py; gpu/ops.py is the Python side.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"

#define PAR_MIN_ELEMS 65536 /* below this, one thread: waking the pool costs more */

/* out[r] = x[r] / rms(x[r]) * w; with residual != NULL, first residual[r] += x[r]
   and normalize that sum (residual keeps it: the next layer's input). out may be x. */
void actorlm_rms_norm(const float *x, int64_t x_stride, float *residual, int64_t res_stride,
                      const float *w, float *out, int64_t out_stride, int64_t rows, int64_t dim,
                      float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        float *o = out + r * out_stride;
        if (residual) {
            float *res = residual + r * res_stride;
            for (int64_t i = 0; i < dim; i++) res[i] += src[i];
            src = res;
        }
        const float scale = 1.f / sqrtf(dot(src, src, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = src[i] * scale * w[i];
    }
}

/* out[r] = silu(x[r, :d]) * x[r, d:2d]. */
void actorlm_silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                          int64_t rows, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + d;
        float *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + VW <= d; i += VW)
            *(vf *)(o + i) = siluv(*(const vf *)(g + i)) * *(const vf *)(u + i);
        for (; i < d; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotate the first `heads` heads of each row in place (the halves layout), row t
   by its own angles c = cos[t], s = sin[t] (each [half], rows cs_stride apart):
   x[:half] <- x[:half] c - x[half:] s and x[half:] <- x[half:] c + x[:half] s. */
void actorlm_rope(float *x, int64_t row_stride, int64_t rows, int64_t heads, int64_t head_dim,
                  const float *cos_t, const float *sin_t, int64_t cs_stride, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + t * cs_stride, *s = sin_t + t * cs_stride;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + t * row_stride + h * head_dim, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* The same three over bf16 tensors, rounding where a bf16 PyTorch model rounds (after
   each op of HF's Llama: the residual sum, the normed rows before the weight, silu
   before the product, each RoPE product), the arithmetic between in fp32: a bf16
   prefill costs its GEMMs, not torch's bf16 element-wise chains. */
static inline float rnd(float f) { return bf16_f32(f32_bf16(f)); }

void actorlm_rms_norm_bf16(const uint16_t *x, int64_t x_stride, uint16_t *residual,
                           int64_t res_stride, const uint16_t *w, uint16_t *out,
                           int64_t out_stride, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = x + r * x_stride;
        uint16_t *o = out + r * out_stride;
        int64_t i = 0;
        vf acc = {0};
        float ss = 0.f;
        if (residual) { /* the sum, rounded, is both the next residual and what is normed */
            uint16_t *res = residual + r * res_stride;
            for (; i + VW <= dim; i += VW) {
#if VW == 16 /* rounded once: the bf16 stored is what is squared */
                const __m256i h = bf16_pack(load_bf16(res + i) + load_bf16(src + i));
                _mm256_storeu_si256((__m256i *)(res + i), h);
                const vf v = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
                const vf v = round_bf16(load_bf16(res + i) + load_bf16(src + i));
                store_bf16(res + i, v);
#endif
                acc += v * v;
            }
            for (; i < dim; i++) {
                res[i] = f32_bf16(bf16_f32(res[i]) + bf16_f32(src[i]));
                ss += bf16_f32(res[i]) * bf16_f32(res[i]);
            }
            src = res;
        } else {
            for (; i + VW <= dim; i += VW) {
                const vf v = load_bf16(src + i);
                acc += v * v;
            }
            for (; i < dim; i++) ss += bf16_f32(src[i]) * bf16_f32(src[i]);
        }
        const float scale = 1.f / sqrtf((ss + hsumv(acc)) / (float)dim + eps);
        for (i = 0; i + VW <= dim; i += VW)
            store_bf16(o + i, load_bf16(w + i) * round_bf16(load_bf16(src + i) * scale));
        for (; i < dim; i++) o[i] = f32_bf16(bf16_f32(w[i]) * rnd(bf16_f32(src[i]) * scale));
    }
}

void actorlm_silu_and_mul_bf16(const uint16_t *x, int64_t x_stride, uint16_t *out,
                               int64_t out_stride, int64_t rows, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * d >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = x + r * x_stride, *u = g + d;
        uint16_t *o = out + r * out_stride;
        int64_t i = 0;
        for (; i + VW <= d; i += VW)
            store_bf16(o + i, round_bf16(siluv(load_bf16(g + i))) * load_bf16(u + i));
        for (; i < d; i++) {
            const float gf = bf16_f32(g[i]);
            o[i] = f32_bf16(rnd(gf / (1.f + expf(-gf))) * bf16_f32(u[i]));
        }
    }
}

void actorlm_rope_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int64_t heads,
                       int64_t head_dim, const uint16_t *cos_t, const uint16_t *sin_t,
                       int64_t cs_stride, int threads) {
    const int64_t half = head_dim / 2, vec = half / VW * VW;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos_t + t * cs_stride, *s = sin_t + t * cs_stride;
        uint16_t *row = x + t * row_stride;
        /* a token's angles widened once for all of its heads: ~1/4 of the work a head */
        for (int64_t i = 0; i < vec; i += VW) {
            const vf ci = load_bf16(c + i), si = load_bf16(s + i);
            for (int64_t h = 0; h < heads; h++) {
                uint16_t *a = row + h * head_dim + i, *b = a + half;
                const vf x1 = load_bf16(a), x2 = load_bf16(b);
                store_bf16(a, round_bf16(x1 * ci) - round_bf16(x2 * si));
                store_bf16(b, round_bf16(x2 * ci) + round_bf16(x1 * si));
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *a = row + h * head_dim, *b = a + half;
            for (int64_t i = vec; i < half; i++) {
                const float x1 = bf16_f32(a[i]), x2 = bf16_f32(b[i]);
                const float ci = bf16_f32(c[i]), si = bf16_f32(s[i]);
                a[i] = f32_bf16(rnd(x1 * ci) + rnd(-x2 * si));
                b[i] = f32_bf16(rnd(x2 * ci) + rnd(x1 * si));
            }
        }
    }
}

/* Store T new tokens' K and V into one layer of the paged pool (KVPool.write): k and v
   [T, heads, D] with rows `k_stride`/`v_stride` elements apart and heads D apart; the
   layer's pool [2, heads, total_slots, D]; `esize` bytes an element (the pool's dtype).
   A row copy per (token, head), where torch's index_copy_ of a transposed view walks
   element by element (~15% of a bf16 prefill). */
void actorlm_kv_write(char *pool, int64_t total_slots, const int64_t *slots, const char *k,
                      int64_t k_stride, const char *v, int64_t v_stride, int64_t T,
                      int64_t heads, int64_t D, int64_t esize, int threads) {
    const int64_t row = D * esize, head_bytes = total_slots * row;
    char *kp = pool, *vp = pool + heads * head_bytes;
#pragma omp parallel for num_threads(threads) if (T * heads * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t h = 0; h < heads; h++) {
            memcpy(kp + h * head_bytes + slots[t] * row, k + (t * k_stride + h * D) * esize, (size_t)row);
            memcpy(vp + h * head_bytes + slots[t] * row, v + (t * v_stride + h * D) * esize, (size_t)row);
        }
    }
}
