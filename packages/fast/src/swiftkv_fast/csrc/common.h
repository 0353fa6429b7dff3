/* The math the kernels share, so that every kernel computes it alike (the decode stack's ops are
   bit-identical to the separate kernels' because both use these):
   - swiftkv_expf: e^x in fp32 (Cephes: 2^n p(r), n = round(x / ln 2), |r| <= ln(2) / 2; about 1 ulp),
     branch-free so that loops over it vectorize; x is clamped to [-87, 88];
   - the model's row ops: RMSNorm with the residual add in front, SiLU-and-mul, rotate-half RoPE;
   - the KV cache's element type kv_t: float, or with -DKV_BF16=1 bfloat16 held as uint16_t. Rows go to
     the cache rounded to nearest even, as torch's .to(torch.bfloat16) rounds (a NaN becomes 0x7fc0),
     and come back exactly (bf16 is fp32's upper half). */
#ifndef SWIFTKV_COMMON_H
#define SWIFTKV_COMMON_H

/* What every exported kernel returns: 0, or what went wrong, with nothing written unless a kernel says
   otherwise (kernels/native.py turns each code into one exception) */
enum swiftkv_status {
    SWIFTKV_OK = 0,
    SWIFTKV_NO_MEMORY = 1,     /* a buffer could not be allocated */
    SWIFTKV_BAD_LENGTH = 2,    /* a seq_len beyond its block table, or more queries than positions */
    SWIFTKV_BAD_BLOCK = 3,     /* a block id read outside the cache */
    SWIFTKV_BAD_POSITION = 4,  /* a position outside the RoPE table */
    SWIFTKV_BAD_SLOT = 5,      /* a KV slot written outside the cache */
    SWIFTKV_NO_AMX = 6,        /* an AMX kernel built where the compiler does not target AMX */
};
#include <stdint.h>
#include <string.h>
/* The steps on a float or on a GCC vector of floats (prefill_attention.c's vexpf): n is
   floor(x * SWIFTKV_EXP_LOG2E + 0.5), r = SWIFTKV_EXP_REDUCE(x, n), e^x = SWIFTKV_EXP_POLY(r) * 2^n */
#define SWIFTKV_EXP_LOG2E 1.44269504088896341f
#define SWIFTKV_EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define SWIFTKV_EXP_POLY(r)                                                                          \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) \
       * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)
static inline float swiftkv_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = __builtin_floorf(x * SWIFTKV_EXP_LOG2E + 0.5f);
    float r = SWIFTKV_EXP_REDUCE(x, n);
    float p = SWIFTKV_EXP_POLY(r);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#include <math.h>
/* h += d in place (d NULL: no add) over H values; returns RMSNorm's scale 1 / sqrt(mean(h^2) + eps):
   the normed row is then (h[i] * scale) * w[i] */
static inline float swiftkv_add_rms_scale(float *h, const float *d, int64_t H, float eps) {
    float ss = 0.f;
    if (d != NULL) {
        for (int64_t i = 0; i < H; i++) {
            const float x = h[i] + d[i];
            h[i] = x;
            ss += x * x;
        }
    } else {
        for (int64_t i = 0; i < H; i++) ss += h[i] * h[i];
    }
    return 1.f / sqrtf(ss / (float)H + eps);
}

static inline float swiftkv_silu_mul(float gate, float up) { return gate / (1.f + swiftkv_expf(-gate)) * up; }

/* out[i] = silu(gate[i]) * up[i] over n values. Kept out of line: inlined into a caller's loop over rows,
   GCC vectorizes it several times worse. */
static __attribute__((noinline, unused)) void swiftkv_silu_mul_row(const float *gate, const float *up,
                                                                   float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = swiftkv_silu_mul(gate[i], up[i]);
}

/* Rotate-half RoPE in place on one token's `heads` heads of D values (x): with its position's table
   rows c, s (D / 2 each), a = x[:D/2], b = x[D/2:] become a c - b s, b c + a s */
static inline void swiftkv_rope_row(float *x, int64_t heads, int64_t D, const float *c, const float *s) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * D, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

#include <stdint.h>
#include <string.h>
#ifndef KV_BF16
#define KV_BF16 0
#endif
static inline float swiftkv_bf16_to_float(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t swiftkv_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* n values of a float row rounded into bf16 (whatever KV_BF16 is: row_ops.c's write_kv picks at run time) */
static inline void swiftkv_bf16_store(uint16_t *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = swiftkv_float_to_bf16(src[i]);
}
#if KV_BF16
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif
/* n values of a float row into the cache, and back */
static inline void swiftkv_kv_store(kv_t *dst, const float *src, int64_t n) {
#if KV_BF16
    swiftkv_bf16_store(dst, src, n);
#else
    memcpy(dst, src, sizeof(float) * n);
#endif
}
static inline void swiftkv_kv_load(float *dst, const kv_t *src, int64_t n) {
#if KV_BF16
    for (int64_t i = 0; i < n; i++) dst[i] = swiftkv_bf16_to_float(src[i]);
#else
    memcpy(dst, src, sizeof(float) * n);
#endif
}
#endif /* SWIFTKV_COMMON_H */
