/* The two products of flash.h's attention blocks on AMX tiles, for the builds with AMX
 * (included by flash.h, which holds the rest: packing, the online softmax, the tasks):
 *
 *   S = Q K^T    A: 16 rows of q (32 d a tile, bf16 as they are), B: K^T as bf16 pairs
 *                (row p holds d = 2p, 2p + 1 of 16 keys); 4 C tiles, one per 16 keys, 64
 *                keys at a time
 *   O = P V      A: P (32 keys a tile), B: V as bf16 pairs (row p holds keys 2p, 2p + 1
 *                of 16 d); 4 C tiles, 64 d at a time
 */
#ifndef ACTORLM_FLASH_AMX_H
#define ACTORLM_FLASH_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include "amx_state.h"

/* s[tile] = q K^T, 64 keys (4 C tiles) at a time */
static void fa_scores_amx(const fa_scratch *sc, int64_t t, int64_t most, int64_t D) {
    const int64_t groups = (most + 15) / 16, ws = sc->w * 4;
    const uint16_t *q = sc->q + t * 16 * D;
    float *s = sc->s + t * 16 * sc->w;
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        const int64_t left = groups - g0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t dc = 0; dc < D / 32; dc++) {
            const uint32_t *kt = sc->kt + dc * 16 * FA_KB + g0 * 16;
            AMX_LOADD(4, q + dc * 32, D * 2);
            AMX_LOADD(5, kt, FA_KB * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (left < 2) continue;
            AMX_LOADD(5, kt + 16, FA_KB * 4);
            _tile_dpbf16ps(1, 4, 5);
            if (left < 3) continue;
            AMX_LOADD(5, kt + 32, FA_KB * 4);
            _tile_dpbf16ps(2, 4, 5);
            if (left < 4) continue;
            AMX_LOADD(5, kt + 48, FA_KB * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, s + g0 * 16, ws);
        _tile_stored(1, s + g0 * 16 + 16, ws);
        _tile_stored(2, s + g0 * 16 + 32, ws);
        _tile_stored(3, s + g0 * 16 + 48, ws);
    }
}

/* s[tile] = P V, 64 of D at a time */
static void fa_values_amx(const fa_scratch *sc, int64_t t, int64_t most, int64_t D) {
    const int64_t chunks = (most + 31) / 32, ws = sc->w * 4;
    const uint16_t *p = sc->p + t * 16 * FA_KB;
    float *s = sc->s + t * 16 * sc->w;
    for (int64_t e0 = 0; e0 < D; e0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; c++) {
            const uint32_t *vp = sc->vp + c * 16 * D + e0;
            AMX_LOADD(4, p + c * 32, FA_KB * 2);
            AMX_LOADD(5, vp, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            AMX_LOADD(5, vp + 16, D * 4);
            _tile_dpbf16ps(1, 4, 5);
            AMX_LOADD(5, vp + 32, D * 4);
            _tile_dpbf16ps(2, 4, 5);
            AMX_LOADD(5, vp + 48, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, s + e0, ws);
        _tile_stored(1, s + e0 + 16, ws);
        _tile_stored(2, s + e0 + 32, ws);
        _tile_stored(3, s + e0 + 48, ws);
    }
}

#endif
