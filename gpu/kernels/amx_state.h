/* AMX's tile state for the kernels that use it (amx.h's linears, flash_amx.h's
 * attention): Linux hands it out only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once a
 * process), and each thread loads its own tile configuration. */
#ifndef ACTORLM_AMX_STATE_H
#define ACTORLM_AMX_STATE_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

/* 1: the kernel granted the tile state, -1: it refused (0: not asked yet) */
static int amx_state;

static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* ldtilecfg and tileloadd, telling the compiler what memory they read. GCC's own (12, at
   least) declare that ldtilecfg reads 8 bytes and that tileloadd reads nothing, so it may
   drop or sink the stores they depend on: built without inlining, a configuration was
   left half-written and loading it faulted (SIGSEGV). Clang's builtins say it right. */
static inline void amx_load_config(const amx_config_t *c) {
    __asm__ volatile("ldtilecfg %0" ::"m"(*c));
}

#if defined(__clang__)
#define AMX_LOADD(tile, base, stride) _tile_loadd(tile, base, stride)
#else
#define AMX_LOADD(tile, base, stride)                                                      \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #tile ::"m"(*(const char(*)[])(base)), \
                     "r"((const void *)(base)), "r"((long)(stride)))
#endif

/* Tiles [0, n) as 16 rows of 64 bytes each (palette 1), on this thread. */
static inline void amx_configure_tiles(int n) {
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < n; t++) c.colsb[t] = 64, c.rows[t] = 16;
    amx_load_config(&c);
}

#endif
