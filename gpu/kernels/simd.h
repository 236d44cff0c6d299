/* Vectors for actorlm's C kernels (GCC/Clang vector extensions, no intrinsics): v8f
 * is 8 floats (AVX2 on x86, two NEON registers on ARM); vf is the widest the build
 * targets (VW lanes: 16 in the avx512 build, else 8), for loops that gain from
 * AVX-512. bf16 and fp16 widen to fp32 here. Included by the kernels that
 * gpu/native.py builds; it hashes this file with them. */
#ifndef ACTORLM_SIMD_H
#define ACTORLM_SIMD_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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

/* exp(x) for x <= 0: 2^n * P(r) with x = n ln2 + r, |r| <= ln2 / 2 (Cephes' expf
   polynomial, ~2 ulp); x below -87 gives exp(-87) ~ 1.6e-38. And silu(g) = g * sigmoid(g),
   with exp taken of -|g| only (exp's domain, no overflow): sigmoid is 1 / (1 + e) for
   g >= 0 and e / (1 + e) below, with e = exp(-|g|). Defined for a vector type F of
   integer twin I: exp8 and silu8 on 8 lanes here, expv and siluv on the build's widest
   below. */
#define ACTORLM_EXP_SILU(exp_name, silu_name, F, I)                                    \
    static inline F exp_name(F x) {                                                    \
        const F lo = x * 0.f - 87.f;                                                   \
        const I below = x < lo; /* all ones where true */                              \
        x = (F)(((I)x & ~below) | ((I)lo & below));                                    \
        const F magic = x * 0.f + 12582912.f; /* 1.5 * 2^23: adding rounds */          \
        F n = (x * 1.44269504088896341f + magic) - magic;                              \
        F r = x - n * 0.693359375f + n * 2.12194440e-4f;                               \
        F p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                 \
        p = p * r + 8.3334519073e-3f;                                                  \
        p = p * r + 4.1665795894e-2f;                                                  \
        p = p * r + 1.6666665459e-1f;                                                  \
        p = p * r + 5.0000001201e-1f;                                                  \
        p = p * r * r + r + 1.f;                                                       \
        return p * (F)((__builtin_convertvector(n, I) + 127) << 23);                   \
    }                                                                                  \
    static inline F silu_name(F g) {                                                   \
        const I neg = g < g * 0.f;                                                     \
        const F e = exp_name((F)((I)g | INT32_MIN)); /* exp(-|g|) */                   \
        const F one = g * 0.f + 1.f;                                                   \
        return g * ((F)(((I)e & neg) | ((I)one & ~neg)) / (1.f + e));                  \
    }

ACTORLM_EXP_SILU(exp8, silu8, v8f, v8i)

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2), aligned(2)));
#if VW == 16
#include <immintrin.h>
/* AVX-512's own forms of the two, ~2/3 of the instructions: the same polynomial, with
   the rounding of n (vrndscaleps) and the scaling by 2^n (vscalefps) one instruction
   each, and silu as torch computes it, g / (1 + exp(-g)), without the sign's selects.
   A prompt's SiLU issued ~40 512-bit operations a vector, on the two ports that take
   them: 26 cycles a vector, now 19 (the division runs on its own unit). expv takes
   x <= 88 (silu needs exp(-g) for g of either sign). */
static inline vf expv(vf x) {
    x = (vf)_mm512_max_ps(_mm512_set1_ps(-87.f), (__m512)x); /* a NaN x stays NaN */
    const vf n = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
}
/* exp's argument capped at 80: the quotient is then below 2^-110 |g|, as good as 0
   next to the rounding of anything it meets */
static inline vf siluv(vf g) {
    const vf e = expv((vf)_mm512_min_ps((__m512)-g, _mm512_set1_ps(80.f)));
    return g / (1.f + e);
}
/* 2^x for probabilities that round to bf16 next (flash.h's prompts, attend.h's decodes):
   a degree-3 polynomial (relative error ~7.5e-5, a 26th of bf16's rounding step) and no
   clamp (x below -149 gives 0 through scalef; x not finite: mask the lane off) */
static inline __m512 exp2v_bf16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(5.517084e-2f), _mm512_set1_ps(2.4260935e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326096e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992818e-1f));
    return _mm512_scalef_ps(p, n);
}
/* s[0..n) = exp(s - m) (m >= each s) as exp2v_bf16 gives it, for probabilities that
   round to bf16 next; returns their sum. Two sums in flight, not one chain. */
static inline float exp_sum_bf16(float *s, int64_t n, float m) {
    const __m512 c = _mm512_set1_ps(1.44269504088896341f), mv = _mm512_set1_ps(m);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) { /* (s - m) first: exact near m, whatever m's size */
        const __m512 e0 = exp2v_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv), c));
        const __m512 e1 = exp2v_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + i + 16), mv), c));
        _mm512_storeu_ps(s + i, e0);
        _mm512_storeu_ps(s + i + 16, e1);
        a0 = _mm512_add_ps(a0, e0), a1 = _mm512_add_ps(a1, e1);
    }
    for (; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 e = exp2v_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv), c));
        _mm512_mask_storeu_ps(s + i, k, e);
        a0 = _mm512_mask_add_ps(a0, k, a0, e);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
/* The 16 x 16 transpose of 32-bit lanes: r[j]'s lane p -> r[p]'s lane j (attend_dp.h: key
   j's 16 bf16 pairs -> pair p of the 16 keys; amx.h: a weight row's pairs -> a B tile) */
static inline __attribute__((always_inline)) void tr16_dwords(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c]: rows i..i+3, column 4L + c of lane L */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        r[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
}
#else
#define expv exp8
#define siluv silu8
#endif

/* tanh-GELU (Gemma's MLP), 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3),
   as g sigmoid(2u): silu's sigmoid, of z = 2u, exp taken of -|z| only */
static inline vf geluv(vf g) {
    const vf z = g * (1.5957691216057308f + 0.07135481627260025f * g * g);
    const vi neg = z < z * 0.f;
    const vf e = expv((vf)((vi)z | INT32_MIN)); /* exp(-|z|) */
    const vf one = z * 0.f + 1.f;
    return g * ((vf)(((vi)e & neg) | ((vi)one & ~neg)) / (1.f + e));
}

static inline float gelu1(float g) {
    return g / (1.f + expf(-g * (1.5957691216057308f + 0.07135481627260025f * g * g)));
}

/* s[0..n) = cap * tanh(s / cap) (soft-capped scores and logits: Gemma 2), tanh from
   exp8 of -2|x| (its domain; no overflow) */
static inline void att_softcap(float *s, int64_t n, float cap) {
    const float inv = 1.f / cap;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const v8f x = *(v8f *)(s + i) * inv;
        const v8i sign = (v8i)x & INT32_MIN;
        const v8f e = exp8((v8f)((v8i)x | INT32_MIN) * 2.f); /* exp(-2|x|) */
        const v8f t = (1.f - e) / (1.f + e);                  /* tanh(|x|) */
        *(v8f *)(s + i) = (v8f)((v8i)t | sign) * cap;
    }
    for (; i < n; i++) s[i] = tanhf(s[i] * inv) * cap;
}

static inline float hsumv(vf v) {
#if VW == 16
    const v8f lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8f hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return hsum(lo + hi);
#else
    return hsum(v);
#endif
}

/* A scratch buffer kept between calls that grows to `bytes` (64-byte aligned): *buf and
   *have are the caller's state, thread-local where threads call; NULL when memory could
   not be had (the old buffer is then kept). */
static inline void *grow_buffer(void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes)) return NULL;
        free(*buf);
        *buf = p;
        *have = bytes;
    }
    return *buf;
}

/* The size of each part where n splits into the fewest parts of at most `most`, all of
   one size but the last, which may be smaller (12 rows at most 8 a pass: 6 + 6) */
static inline int64_t even_part(int64_t n, int64_t most) {
    const int64_t parts = (n + most - 1) / most;
    return parts ? (n + parts - 1) / parts : 0;
}

/* max(m, s[0..n)), VW lanes at a time (a scalar loop waits ~4 cycles an element on
   the last) */
static inline float max_of(const float *s, int64_t n, float m) {
    int64_t i = 0;
    if (n >= VW) {
        vf mv = *(const vf *)s;
        for (i = VW; i + VW <= n; i += VW) {
            const vf x = *(const vf *)(s + i);
            const vi gt = x > mv;
            mv = (vf)(((vi)x & gt) | ((vi)mv & ~gt));
        }
        for (int j = 0; j < VW; j++) m = mv[j] > m ? mv[j] : m;
    }
    for (; i < n; i++) m = s[i] > m ? s[i] : m;
    return m;
}

/* s[0..n) = exp(s - m) (m >= each s); returns their sum */
static inline float exp_sum(float *s, int64_t n, float m) {
    float sum = 0.f;
    int64_t i = 0;
    vf acc = {0};
    for (; i + VW <= n; i += VW) {
        const vf e = expv(*(vf *)(s + i) - m);
        *(vf *)(s + i) = e;
        acc += e;
    }
    for (; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum + hsumv(acc);
}

/* bf16 is the top half of an fp32: widening is a shift; narrowing rounds to nearest
   even (as torch does; NaN payloads are not preserved). */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}
static inline uint16_t f32_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* 8 bf16 at a time, for element-wise loops (rounding to nearest even as above) */
typedef uint16_t v8h __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4)));
static inline v8f load8_bf16(const uint16_t *p) {
    return (v8f)(__builtin_convertvector(*(const v8h *)p, v8u) << 16);
}
static inline v8u bf16_bits8(v8f v) {
    const v8u u = (v8u)v;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
static inline void store8_bf16(uint16_t *p, v8f v) { *(v8h *)p = __builtin_convertvector(bf16_bits8(v), v8h); }
static inline v8f round8_bf16(v8f v) { return (v8f)(bf16_bits8(v) << 16); }

/* IEEE half to fp32 without F16C (the generic build): exact for every value. */
static inline float f16_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    union { uint32_t u; float f; } c;
    if (e == 31) {
        c.u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        c.u = sign | ((e + 112) << 23) | (m << 13);
    } else { /* zero or subnormal: m * 2^-24 */
        c.f = (float)m * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}
#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* (the generic conversion compiles to two half-width widenings and a merge) */
static inline vf load_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif defined(__AVX2__)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return (vf)(__builtin_convertvector(*(const vh *)p, vu) << 16);
#endif
}
/* vf to bf16, rounding to nearest even: one instruction with AVX512-BF16 */
#if VW == 16 && defined(__AVX512BF16__)
static inline __m256i bf16_pack(vf v) { return (__m256i)_mm512_cvtneps_pbh((__m512)v); }
#elif VW == 16
static inline __m256i bf16_pack(vf v) {
    const vu u = (vu)v;
    return _mm512_cvtepi32_epi16((__m512i)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
}
#endif
#if VW == 16
static inline void store_bf16(uint16_t *p, vf v) { _mm256_storeu_si256((__m256i *)p, bf16_pack(v)); }
static inline vf round_bf16(vf v) { return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(v)), 16); }
#else
static inline vu bf16_bits(vf v) {
    const vu u = (vu)v;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
static inline void store_bf16(uint16_t *p, vf v) { *(vh *)p = __builtin_convertvector(bf16_bits(v), vh); }
static inline vf round_bf16(vf v) { return (vf)(bf16_bits(v) << 16); }
#endif
static inline vf load_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = f16_f32(p[i]);
    return v;
#endif
}

#endif
