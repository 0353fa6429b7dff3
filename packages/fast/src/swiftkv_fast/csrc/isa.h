/* What differs between the instruction sets the kernels are built for, in one place.

   The kernels are compiled with -march=native (kernels/build.py), optionally held back by
   SWIFTKV_CPU_MAX_ISA (-mno-avx512f, -mno-amx-*). Each kernel picks its register blocking from these
   macros only, never from the compiler's own __AVX512F__ / __AMX_*__ tests:

     SWIFTKV_AVX512      32 vector registers of 16 fp32 lanes (unless built with -DSWIFTKV_NO_AVX512=1,
                         which tests use to run the 8-lane blocks on an AVX-512 machine)
     SWIFTKV_AVX2        16 vector registers of 8 lanes, with the integer widenings of AVX2
     SWIFTKV_AMX         AMX tiles with bf16 products (TDPBF16PS); the helpers below
     SWIFTKV_AMX_PANELS  AMX with AVX512-BF16 conversions and 16-row register blocks: the panel GEMM's
                         4- and 8-bit panels may run on tiles

   Without AVX2 the kernels fall back to GCC vector extensions (portable, slower). */
#ifndef SWIFTKV_ISA_H
#define SWIFTKV_ISA_H
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifndef SWIFTKV_NO_AVX512
#define SWIFTKV_NO_AVX512 0
#endif

#if defined(__AVX512F__) && !SWIFTKV_NO_AVX512
#define SWIFTKV_AVX512 1
#else
#define SWIFTKV_AVX512 0
#endif

#if defined(__AVX2__)
#define SWIFTKV_AVX2 1
#else
#define SWIFTKV_AVX2 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SWIFTKV_AMX 1
#else
#define SWIFTKV_AMX 0
#endif

#if SWIFTKV_AMX && defined(__AVX512BF16__) && SWIFTKV_AVX512
#define SWIFTKV_AMX_PANELS 1
#else
#define SWIFTKV_AMX_PANELS 0
#endif

#if SWIFTKV_AMX
/* Helpers of the AMX kernels (amx_gemm.c, amx_q4_gemm.c, panel_gemm_amx.h) */
static inline uint16_t bf16_round(float f) {  /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v = hi + mid + lo exactly: each difference is exact in fp32, the last one has at most 8 bits */
static inline void split3(float v, uint16_t *hi, uint16_t *mid, uint16_t *lo) {
    const uint16_t h = bf16_round(v);
    const float r = v - bf16_value(h);
    const uint16_t m = bf16_round(r);
    *hi = h;
    *mid = m;
    *lo = bf16_round(r - bf16_value(m));
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* this thread's tiles 0 .. n - 1 as 16 rows of 64 bytes */
static inline void amx_tile_config(int n) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < n; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* the 2 x 2 accumulators (tiles 0-3) += the two x tiles (4, 5) times the two weight tiles (6, 7) */
#define BLOCK_PRODUCTS()         \
    do {                         \
        _tile_dpbf16ps(0, 4, 6); \
        _tile_dpbf16ps(1, 4, 7); \
        _tile_dpbf16ps(2, 5, 6); \
        _tile_dpbf16ps(3, 5, 7); \
    } while (0)
#endif /* SWIFTKV_AMX */
#endif /* SWIFTKV_ISA_H */
