/* Grammar bitmasks over fp32 logits (see bitmask.py): bit j of word w allows token
 * 32 * w + j; a row's mask may be shorter than the vocabulary (tokens past its end
 * are banned) and a NULL mask allows every token.
 *
 * The masked argmax reads only the allowed words of a row and compares 32 logits
 * at a time against the best so far, so a step pays about one read of the logits
 * and no -inf writes: the unpacked mask and the masked copy (two [B, V] passes and
 * allocations) are what made a constrained step slower. Its result is what
 * torch.argmax gives on the masked row: the first maximum, or the first NaN. */
#include <math.h>
#include <stdint.h>
#include "argmax.h"

/* out[r] = argmax of row r of x [rows, vocab] (row stride `stride`) under masks[r]. */
void actorlm_masked_argmax(const float *x, int64_t stride, int64_t rows, int64_t vocab,
                           const int32_t *const *masks, int64_t words, int64_t *out,
                           int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        out[r] = row_argmax(x + r * stride, vocab, masks[r], words);
}

/* x[r, t] = -inf for every token t that masks[r] bans (rows with a NULL mask untouched). */
void actorlm_apply_bitmask(float *x, int64_t stride, int64_t rows, int64_t vocab,
                           const int32_t *const *masks, int64_t words, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *mask = masks[r];
        if (!mask) continue;
        float *row = x + r * stride;
        const int64_t end = 32 * words < vocab ? 32 * words : vocab;
        for (int64_t base = 0; base < end; base += 32) {
            const uint32_t bits = (uint32_t)mask[base / 32];
            const int64_t n = end - base < 32 ? end - base : 32;
            if (bits == 0xffffffffu) continue;
            for (int j = 0; j < n; j++)
                row[base + j] = (bits >> j) & 1 ? row[base + j] : -INFINITY;
        }
        for (int64_t t = end; t < vocab; t++) row[t] = -INFINITY;
    }
}
