/* The model's small ops on fp32 rows (kernels/cpu_ops.py): RMSNorm with the residual add in front,
   SiLU-and-mul, in-place RoPE, the KV cache write by slot, and the greedy sampler's argmax (with the
   logsumexp from the same passes). Each reads its input once and writes its output once. Rows are split
   over the OpenMP threads when a call has at least PARALLEL_MIN (a build define) elements. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* h: (T, H), rows h_stride apart; d: NULL, or (T, H) rows d_stride apart that are added to h first
   (in place: h += d); w: (H,); out: (T, H) contiguous = h * rsqrt(mean(h^2) + eps) * w. */
int swiftkv_add_rms_norm(float *h, int64_t h_stride, const float *d, int64_t d_stride, const float *w,
                         float *out, int64_t T, int64_t H, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *ht = h + t * h_stride, *ot = out + t * H;
        const float r = swiftkv_add_rms_scale(ht, d != NULL ? d + t * d_stride : NULL, H, eps);
        for (int64_t i = 0; i < H; i++) ot[i] = (ht[i] * r) * w[i];
    }
    return 0;
}

/* gu: (T, 2 I) rows gu_stride apart, [gate | up]; out: (T, I) contiguous = silu(gate) * up. */
int swiftkv_silu_and_mul(const float *gu, int64_t gu_stride, float *out, int64_t T, int64_t I,
                         int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * I;
        swiftkv_silu_mul_row(g, u, o, I);
    }
    return 0;
}

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* The largest number of r[0..V), NaNs left out (a blend on 8 lanes: the compiler keeps a scalar
   `a > b ? a : b` loop scalar, as it cannot assume there is no NaN). */
static float row_max(const float *r, int64_t V) {
    float m = r[0];
    int64_t i = 0;
    if (V >= 8) {
        v8f vm = *(const v8f *)r;
        for (; i + 8 <= V; i += 8) {
            const v8f v = *(const v8f *)(r + i);
            const v8i gt = v > vm;
            vm = (v8f)(((v8i)v & gt) | ((v8i)vm & ~gt));
        }
        for (int l = 0; l < 8; l++) m = vm[l] > m ? vm[l] : m;
    }
    for (; i < V; i++) m = r[i] > m ? r[i] : m;
    return m;
}

/* out[b] = the index of the largest value of row b of x (B, V), rows x_stride apart: its first
   occurrence, a NaN counting as larger than any number, as torch.argmax. Vectorized passes find the
   maximum and whether there is a NaN, a scan finds where the winner first occurs. stats: NULL, or
   (B, 2): the row's maximum m and sum(exp(x - m)) from the same passes (so that logsumexp = m +
   log(sum)), both NaN when the row holds a NaN or its maximum is not finite (where torch's
   log_softmax is NaN too). */
int swiftkv_argmax_rows(const float *x, int64_t x_stride, int64_t B, int64_t V, int64_t *out, float *stats,
                        int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (B * V >= PARALLEL_MIN)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * x_stride;
        int nan = 0;
        for (int64_t i = 0; i < V; i++) nan |= r[i] != r[i];
        int64_t at = 0;
        float m = NAN, sum = NAN;
        if (nan) {
            while (r[at] == r[at]) at++;
        } else {
            m = row_max(r, V);
            while (r[at] != m) at++;
            if (stats != NULL && isfinite(m)) {
                sum = 0.f;
                for (int64_t i = 0; i < V; i++) sum += swiftkv_expf(r[i] - m);
            }
        }
        out[b] = at;
        if (stats != NULL) {
            stats[2 * b] = isfinite(m) ? m : NAN;
            stats[2 * b + 1] = sum;
        }
    }
    return 0;
}

/* Rotate-half RoPE in place: x holds T tokens, rows x_stride apart, each `heads` heads of D contiguous
   values; cos, sin: (max_pos, D / 2); token t uses row positions[t]: a = x[:D/2], b = x[D/2:] become
   a cos - b sin, b cos + a sin. SWIFTKV_BAD_POSITION (nothing written) for a position outside [0, max_pos). */
int swiftkv_rope(float *x, int64_t x_stride, int64_t T, int64_t heads, int64_t D, const int64_t *positions,
                 const float *cos_table, const float *sin_table, int64_t max_pos, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return SWIFTKV_BAD_POSITION;
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(num_threads) if (T * heads * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        swiftkv_rope_row(x + t * x_stride, heads, D, cos_table + positions[t] * half,
                         sin_table + positions[t] * half);
    return 0;
}

/* The K/V rows of T tokens for n_layers cache layers written to their slots. cache: layer l's K row of
   slot s at cache + l * layer_stride + s * row, its V row kv_stride further; k, v: token t's row of
   layer l at k + t * k_ts + l * k_ls (same for v), each `row` values dense; slots: (T,) int64, a
   negative slot is skipped. SWIFTKV_BAD_SLOT (nothing written) for a slot >= num_slots. */
static int write_kv_rows(void *cache, int bf16, int64_t layer_stride, int64_t kv_stride, int64_t num_slots,
                         int64_t row, const float *k, int64_t k_ts, int64_t k_ls, const float *v,
                         int64_t v_ts, int64_t v_ls, const int64_t *slots, int64_t T, int64_t n_layers,
                         int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return SWIFTKV_BAD_SLOT;
    #pragma omp parallel for num_threads(num_threads) if (T * n_layers * row >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t at = l * layer_stride + slots[t] * row;
            const float *ks = k + t * k_ts + l * k_ls, *vs = v + t * v_ts + l * v_ls;
            if (bf16) {
                uint16_t *kc = (uint16_t *)cache + at;
                swiftkv_bf16_store(kc, ks, row);
                swiftkv_bf16_store(kc + kv_stride, vs, row);
            } else {
                float *kc = (float *)cache + at, *vc = kc + kv_stride;
                memcpy(kc, ks, sizeof(float) * row);
                memcpy(vc, vs, sizeof(float) * row);
            }
        }
    }
    return 0;
}

/* into an fp32 cache, and into a bf16 one (rounded to nearest even, as torch rounds) */
int swiftkv_write_kv(float *cache, int64_t layer_stride, int64_t kv_stride, int64_t num_slots, int64_t row,
                     const float *k, int64_t k_ts, int64_t k_ls, const float *v, int64_t v_ts, int64_t v_ls,
                     const int64_t *slots, int64_t T, int64_t n_layers, int num_threads) {
    return write_kv_rows(cache, 0, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls,
                         slots, T, n_layers, num_threads);
}

int swiftkv_write_kv_bf16(uint16_t *cache, int64_t layer_stride, int64_t kv_stride, int64_t num_slots,
                          int64_t row, const float *k, int64_t k_ts, int64_t k_ls, const float *v,
                          int64_t v_ts, int64_t v_ls, const int64_t *slots, int64_t T, int64_t n_layers,
                          int num_threads) {
    return write_kv_rows(cache, 1, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls,
                         slots, T, n_layers, num_threads);
}
