/* The argmax of a row of fp32 logits, as torch.argmax answers it: the first maximum, or
 * the first NaN; under a grammar's bitmask (bit j of word w allows token 32 w + j;
 * tokens past the mask's end are banned; NULL allows every token) the same over the
 * allowed tokens. Used by cpu_bitmask.c (the sampler's argmax) and by cpu_step.c (a
 * step's argmax over each thread's columns of the logits, as they are made). */
#ifndef ACTORLM_ARGMAX_H
#define ACTORLM_ARGMAX_H
#include <math.h>
#include <stdint.h>

/* Bit j set where !(x[j] <= best), j < n: x[j] > best or x[j] is NaN (an unordered
   compare: at n = 32 one vector compare over the 32 lanes). */
static inline uint32_t argmax_above(const float *x, int64_t n, float best) {
    uint32_t hit = 0;
    if (n == 32) {
        for (int j = 0; j < 32; j++) hit |= (uint32_t)!(x[j] <= best) << j;
    } else {
        for (int j = 0; j < n; j++) hit |= (uint32_t)!(x[j] <= best) << j;
    }
    return hit;
}

/* The index of x[0 .. vocab)'s maximum under mask (`words` words; NULL: none) */
static int64_t row_argmax(const float *x, int64_t vocab, const int32_t *mask, int64_t words) {
    const int64_t end = mask && 32 * words < vocab ? 32 * words : vocab;
    float best = -INFINITY;
    int64_t idx = 0; /* torch's argmax of an all -inf row */
    for (int64_t base = 0; base < end; base += 32) {
        const int64_t n = end - base < 32 ? end - base : 32;
        uint32_t bits = mask ? (uint32_t)mask[base / 32] : 0xffffffffu;
        if (n < 32) bits &= (1u << n) - 1;
        if (!bits) continue;
        uint32_t hit = argmax_above(x + base, n, best) & bits;
        while (hit) { /* rare once best is near the row's maximum */
            const int j = __builtin_ctz(hit);
            hit &= hit - 1;
            const float v = x[base + j];
            if (v != v) return base + j;
            if (v > best) {
                best = v;
                idx = base + j;
            }
        }
    }
    return idx;
}

#endif
