/* Fused element-wise layers for the CPU, fp32: RMSNorm (with the residual add
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
        for (; i + 8 <= d; i += 8)
            *(v8f *)(o + i) = silu8(*(const v8f *)(g + i)) * *(const v8f *)(u + i);
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
