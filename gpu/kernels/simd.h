/* 8-float vectors for actorlm's C kernels (GCC/Clang vector extensions: AVX2 on
 * x86, two NEON registers on ARM, no intrinsics). Included by the kernels that
 * gpu/native.py builds; it hashes this file with them. */
#ifndef ACTORLM_SIMD_H
#define ACTORLM_SIMD_H
#include <stdint.h>

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

static inline float hsum(v8f v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
    int64_t i = 0;
    if (n % 8 == 0) {
        v8f acc = {0};
        for (; i < n; i += 8) acc += *(const v8f *)(a + i) * *(const v8f *)(b + i);
        return hsum(acc);
    }
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float p, const float *x, float *y, int64_t n) {
    int64_t i = 0;
    if (n % 8 == 0) {
        for (; i < n; i += 8) *(v8f *)(y + i) += p * *(const v8f *)(x + i);
        return;
    }
    for (; i < n; i++) y[i] += p * x[i];
}

/* exp(x) for x <= 0, 8 at a time: 2^n * P(r) with x = n ln2 + r, |r| <= ln2 / 2
   (Cephes' expf polynomial, ~2 ulp); x below -87 gives exp(-87) ~ 1.6e-38. */
static inline v8f exp8(v8f x) {
    const v8f lo = x * 0.f - 87.f;
    const v8i below = x < lo; /* all ones where true */
    x = (v8f)(((v8i)x & ~below) | ((v8i)lo & below));
    const v8f magic = x * 0.f + 12582912.f; /* 1.5 * 2^23: adding rounds to an integer */
    v8f n = (x * 1.44269504088896341f + magic) - magic;
    v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

#endif
