/* GGUF's Q4_1 / Q8_0 blocks at load time, both ways. Dequantizing a file's blocks to
 * fp32 (as gguf.quants does), finding a weight's blocks in its fp32 values in one
 * pass, and rounding any weight to blocks (``--quantization q8_0 / q4_1``): the same
 * arithmetic and checks as qgemm.py's NumPy and torch paths (which stay the reference
 * and the fallback), the found blocks written straight into the kernel's
 * row-interleaved layout. NumPy's passes over a model's weights took ~6 s of every
 * worker start on 2 busy cores; these take a fraction of a second.
 *
 * A block is accepted only when its values rebuild bit for bit from the codes and
 * fp16 scales found, so a weight of another format is refused (returns 0), never
 * approximated. Built by actorlm/gpu/kernels/native.py.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define QK 32
#define GROUP 16

/* ``a`` as fp16 bits when fp16 holds it exactly (what NumPy's round trip
 * ``a.astype(float16).astype(float32) == a`` accepts), else -1. */
static int32_t f16_exact(float a) {
    uint32_t u;
    memcpy(&u, &a, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, mag = u & 0x7fffffffu;
    if (mag == 0) return (int32_t)sign;
    const int32_t e = (int32_t)(mag >> 23) - 127; /* unbiased exponent (finite a) */
    if (e > 15 || e < -24) return -1;
    const uint32_t mant = (mag & 0x7fffffu) | 0x800000u; /* 24 bits with the leading one */
    if (e >= -14) { /* a normal fp16: 10 mantissa bits, the low 13 of fp32's must be 0 */
        if (mag & 0x1fffu) return -1;
        return (int32_t)(sign | (uint32_t)(e + 15) << 10 | (mag & 0x7fffffu) >> 13);
    }
    /* a subnormal fp16: a multiple of 2^-24, below 2^-14 */
    const int shift = -e - 1; /* a = mant * 2^(e - 23) = (mant >> shift) * 2^-24 */
    if (mant & ((1u << shift) - 1)) return -1;
    return (int32_t)(sign | (mant >> shift));
}

/* Whether q * d is exact in fp32 for every code of ``bits`` bits. */
static int exact_products(float d, int bits) {
    uint32_t u;
    memcpy(&u, &d, 4);
    return (u & ((1u << bits) - 1)) == 0;
}

/* The loops below have no early exit and a fixed count, so they vectorize (-O3); the
 * min and max reduce as a tree (exact: the order cannot change them). A non-finite
 * value fails its block's check like any other mismatch. */
static inline float block_extreme(const float *b, int want_max) {
    float t[QK / 2];
    for (int i = 0; i < QK / 2; i++) {
        const float x = b[i], y = b[i + QK / 2];
        t[i] = want_max ? (x > y ? x : y) : (x < y ? x : y);
    }
    for (int w = QK / 4; w > 0; w /= 2)
        for (int i = 0; i < w; i++) {
            const float x = t[i], y = t[i + w];
            t[i] = want_max ? (x > y ? x : y) : (x < y ? x : y);
        }
    return t[0];
}

/* One block as Q4_1: codes in q[32], fp16 d and m; 1 when exact. */
static int block_q4_1(const float *b, uint8_t *q, int32_t *d16, int32_t *m16) {
    const float lo = block_extreme(b, 0), hi = block_extreme(b, 1);
    const float d = (hi - lo) / 15.0f, safe = d > 0 ? d : 1.0f;
    int bad = 0;
    for (int i = 0; i < QK; i++) {
        float c = rintf((b[i] - lo) / safe);
        c = c < 0 ? 0 : (c > 15 ? 15 : c);
        /* c * d is exact where exact_products holds: a fused multiply-add rounds the same */
        bad |= (c * d + lo != b[i]) | !(fabsf(b[i]) <= FLT_MAX);
        q[i] = (uint8_t)c;
    }
    if (bad || !exact_products(d, 4)) return 0;
    *d16 = f16_exact(d), *m16 = f16_exact(lo);
    return *d16 >= 0 && *m16 >= 0;
}

static int block_q8_0(const float *b, int8_t *q, int32_t *d16) {
    float a[QK];
    for (int i = 0; i < QK; i++) a[i] = fabsf(b[i]);
    const float d = block_extreme(a, 1) / 127.0f, safe = d > 0 ? d : 1.0f;
    int bad = 0;
    for (int i = 0; i < QK; i++) {
        float c = rintf(b[i] / safe);
        c = c < -127 ? -127 : (c > 127 ? 127 : c);
        bad |= (c * d != b[i]) | !(a[i] <= FLT_MAX);
        q[i] = (int8_t)c;
    }
    if (bad || !exact_products(d, 7)) return 0;
    *d16 = f16_exact(d);
    return *d16 >= 0;
}

/* One block's codes into its place in q: Q4_1 [G, nb, 16, GROUP] (byte i: code 2i low
 * nibble, 2i + 1 high), Q8_0 [G, nb, 32, GROUP] int8; at = the block's (g, b) index. */
static int find_block(int q4, const float *src, void *q, uint16_t *d, uint16_t *m,
                      int64_t at, int64_t r) {
    uint8_t codes[QK];
    int32_t d16, m16 = 0;
    if (q4 ? !block_q4_1(src, codes, &d16, &m16) : !block_q8_0(src, (int8_t *)codes, &d16))
        return 0;
    d[at * GROUP + r] = (uint16_t)d16;
    if (q4) {
        m[at * GROUP + r] = (uint16_t)m16;
        uint8_t *out = (uint8_t *)q + at * (QK / 2) * GROUP + r;
        for (int i = 0; i < QK / 2; i++)
            out[i * GROUP] = (uint8_t)(codes[2 * i] | codes[2 * i + 1] << 4);
    } else {
        uint8_t *out = (uint8_t *)q + at * QK * GROUP + r;
        for (int i = 0; i < QK; i++) out[i * GROUP] = codes[i];
    }
    return 1;
}

/* w [N, K] fp32 row-major (K a multiple of 32) into the zeroed outputs q (layout above),
 * d and m [G, nb, GROUP] fp16 bits (m: Q4_1 only; NULL for Q8_0). q4: Q4_1, else Q8_0.
 * Returns 1 when every block is exact in that format, else 0 (the outputs are then
 * garbage). */
int actorlm_find_blocks(int q4, const float *w, int64_t N, int64_t K, void *q, uint16_t *d,
                        uint16_t *m, int threads) {
    const int64_t nb = K / QK;
    int ok = 1;
#pragma omp parallel for num_threads(threads) reduction(&& : ok) schedule(dynamic, 16)
    for (int64_t n = 0; n < N; n++) {
        if (!ok) continue;
        const int64_t g = n / GROUP, r = n % GROUP;
        for (int64_t b = 0; b < nb && ok; b++)
            ok = find_block(q4, w + n * K + b * QK, q, d, m, g * nb + b, r);
    }
    return ok;
}

/* The other way, for loading: GGUF's Q4_1 blocks (fp16 d, fp16 m, 16 bytes: code j in
 * byte j's low nibble, code j + 16 in its high one) and Q8_0 blocks (fp16 d, 32 int8
 * codes) to fp32, as gguf.quants computes them (d * q + m: the product is exact, so
 * the value is the same fused or not), over ``threads`` threads. */
void actorlm_dequant_q4_1(const uint8_t *raw, int64_t blocks, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4096)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = raw + b * 20;
        const float d = f16_f32((uint16_t)(blk[0] | blk[1] << 8));
        const float m = f16_f32((uint16_t)(blk[2] | blk[3] << 8));
        float *o = out + b * QK;
        for (int j = 0; j < QK / 2; j++) {
            o[j] = d * (float)(blk[4 + j] & 15) + m;
            o[j + QK / 2] = d * (float)(blk[4 + j] >> 4) + m;
        }
    }
}

void actorlm_dequant_q8_0(const uint8_t *raw, int64_t blocks, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4096)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = raw + b * 34;
        const float d = f16_f32((uint16_t)(blk[0] | blk[1] << 8));
        float *o = out + b * QK;
        for (int j = 0; j < QK; j++) o[j] = (float)(int8_t)blk[2 + j] * d;
    }
}

/* Rounding fp32 weights to blocks (``--quantization q8_0 / q4_1``), as qgemm.quantize's
 * torch path and gguf.quants round them, bit for bit: Q8_0 d = max|w| / 127, codes
 * w * (1 / d) rounded half away from zero; Q4_1 d = (max - min) / 15, m = min, codes
 * trunc((w - m) * (1 / d) + 0.5) in 0..15; the scales stored as fp16 (to nearest even).
 * ``values`` (or NULL) receives what the blocks encode, q * d (+ m) in fp32, or that
 * rounded to bf16 (to nearest even, as torch converts) where ``values_bf16``. Layouts as
 * the torch path writes them: Q8_0 codes int8 [N, K/32, 32]; Q4_1 codes [N, K/32, 16],
 * byte j = code 2j | code 2j+1 << 4; d16 and m16 fp16 bits [N, K/32]. Each product and
 * sum rounds on its own, as torch's separate ops do: no multiply-add is fused here
 * (GCC's optimize attribute, clang's pragma). Returns 0 where a weight or a stored
 * scale is not finite (the torch path's None), else 1. */
__attribute__((optimize("O3", "fp-contract=off"))) int actorlm_quantize_blocks(
    int q4, const float *w, int64_t N, int64_t K, void *codes, uint16_t *d16, uint16_t *m16,
    void *values, int values_bf16, int threads) {
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
    const int64_t nb = K / QK;
    int ok = 1;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(&& : ok)
    for (int64_t r = 0; r < N; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *x = w + r * K + b * QK;
            float lo = x[0], hi = x[0];
            int finite = 1;
            for (int j = 0; j < QK; j++) {
                finite &= isfinite(x[j]) != 0;
                lo = x[j] < lo ? x[j] : lo;
                hi = x[j] > hi ? x[j] : hi;
            }
            if (!finite) { /* refused: nothing of it is read (and NaN has no code) */
                ok = 0;
                continue;
            }
            const int64_t blk = r * nb + b;
            float v[QK]; /* the encoded values, stored below where asked for */
            if (!q4) {
                const float amax = hi > -lo ? hi : -lo;
                const float d = amax / 127.f, id = d == 0.f ? 0.f : 1.f / d;
                const _Float16 dh = (_Float16)d;
                const float dq = (float)dh;
                int8_t *q = (int8_t *)codes + blk * QK;
                for (int j = 0; j < QK; j++) {
                    const float y = x[j] * id, a = fabsf(y), f = truncf(a);
                    const float half = truncf((a - f) * 2.f);
                    const float code = copysignf(half + f, y);
                    q[j] = (int8_t)code;
                    v[j] = (code + 0.f) * dq;
                }
                memcpy(d16 + blk, &dh, 2);
                ok = ok && isfinite(dq);
            } else {
                const float d = (hi - lo) / 15.f, id = d == 0.f ? 0.f : 1.f / d;
                const _Float16 dh = (_Float16)d, mh = (_Float16)lo;
                const float dq = (float)dh, mq = (float)mh;
                uint8_t *q = (uint8_t *)codes + blk * (QK / 2);
                float c[QK];
                for (int j = 0; j < QK; j++) {
                    float t = truncf((x[j] - lo) * id + 0.5f);
                    c[j] = t > 0.f ? (t < 15.f ? t : 15.f) : 0.f; /* NaN (inf - inf): 0 */
                    const float p = c[j] * dq;
                    v[j] = p + mq;
                }
                for (int j = 0; j < QK / 2; j++)
                    q[j] = (uint8_t)((uint8_t)c[2 * j] | (uint8_t)c[2 * j + 1] << 4);
                memcpy(d16 + blk, &dh, 2);
                memcpy(m16 + blk, &mh, 2);
                ok = ok && isfinite(dq) && isfinite(mq);
            }
            if (values && values_bf16) {
                uint16_t *o = (uint16_t *)values + r * K + b * QK;
                for (int j = 0; j < QK; j++) o[j] = f32_bf16(v[j]);
            } else if (values) {
                memcpy((float *)values + r * K + b * QK, v, sizeof v);
            }
        }
    }
    return ok;
}
