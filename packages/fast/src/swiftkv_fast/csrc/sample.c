/* Sampling kernels (kernels/cpu_sample.py).

   swiftkv_exponential_race: per row, the token argmax(probs / q) with q drawn exactly as
   `torch.empty_like(probs[b]).exponential_(generator=g_b)` draws it, the generator (torch's CPU
   MT19937, its serialized state read and written in place) left where torch would leave it. Torch
   draws one fp32 exponential from two 32-bit outputs w1, w2: u = ((w1 << 32 | w2) mod 2^53) * 2^-53,
   q = (float)(-log1p(-u)). A token's ratio r = p / q is at most p / u * (1 + 2^-21) (q >= u before
   rounding, and each of the three roundings moves it by at most 2^-23 relative), so a token whose
   p * (1 + 2^-20) is below best * u cannot win and its log1p is skipped; every other token gets the
   exact q and r. Ties keep the lowest index and a NaN ratio wins (the first one), as torch's argmax.

       Worked example, one row of 4 tokens, probs (0.5, 0.3, 0.15, 0.05), uniforms (0.9, 0.2, 0.001, 0.5):
       token 0: nothing to beat yet: q = 2.303, r = 0.217, best = 0.217
       token 1: 0.3 >= 0.217 * 0.2 = 0.043: q = 0.223, r = 1.344, best = 1.344
       token 2: 0.15 >= 1.344 * 0.001: q = 0.0010005, r = 149.9, best = 149.9 (a rare draw wins)
       token 3: 0.05 < 149.9 * 0.5: skipped (its r would be 0.072); the token is 2

   swiftkv_topk_values: top-p's sorted prefix, the k largest values of each row. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MT_N 624
#define MT_M 397
#define LEFT_AT 8       /* int32: outputs left before the next twist, plus one */
#define NEXT_AT 16      /* uint64: index of the next output word */
#define WORDS_AT 24     /* uint64[624]: the 32-bit state words, zero-extended */
#define CHUNK 2048      /* draws per pass (4,096 words: 16 KiB on the stack) */
#define SLACK (1.0 + 0x1p-20)

static inline uint32_t mt_mix(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

/* the next 624 words (three loops without a modulo, so that the compiler vectorizes them) */
static void mt_twist(uint32_t *mt) {
    int k = 0;
    for (; k < MT_N - MT_M; k++) mt[k] = mt[k + MT_M] ^ mt_mix(mt[k], mt[k + 1]);
    for (; k < MT_N - 1; k++) mt[k] = mt[k + MT_M - MT_N] ^ mt_mix(mt[k], mt[k + 1]);
    mt[MT_N - 1] = mt[MT_M - 1] ^ mt_mix(mt[MT_N - 1], mt[0]);
}

static inline uint32_t mt_temper(uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* the generator's next n outputs into out, as n calls of torch's mt19937 would return them */
static void mt_fill(uint32_t *mt, int32_t *left, uint64_t *next, uint32_t *out, int64_t n) {
    while (n > 0) {
        int64_t avail = (int64_t)*left - 1;
        if (avail <= 0) {
            mt_twist(mt);
            *left = MT_N + 1;
            *next = 0;
            avail = MT_N;
        }
        const int64_t k = n < avail ? n : avail;
        const uint32_t *src = mt + *next;
        for (int64_t j = 0; j < k; j++) out[j] = mt_temper(src[j]);
        *left -= (int32_t)k;
        *next += (uint64_t)k;
        out += k;
        n -= k;
    }
}

/* u = ((w1 << 32 | w2) mod 2^53) * 2^-53 from two halves, each product and the sum exact */
static inline double uniform(uint32_t w1, uint32_t w2) {
    return (double)(w1 & 0x1fffffu) * 0x1p-21 + (double)w2 * 0x1p-53;
}

/* argmax over V of p[i] / q[i], q[i] the i-th exponential of the generator `state` (advanced in
   place); -1 when the state is not one torch's generator can be in */
static int64_t race_row(const float *p, int64_t V, uint8_t *state) {
    int32_t left;
    uint64_t next;
    uint32_t mt[MT_N], words[2 * CHUNK];
    uint8_t candidate[CHUNK];
    memcpy(&left, state + LEFT_AT, 4);
    memcpy(&next, state + NEXT_AT, 8);
    for (int i = 0; i < MT_N; i++) {
        uint64_t w;
        memcpy(&w, state + WORDS_AT + 8 * i, 8);
        if (w >> 32) return -1;
        mt[i] = (uint32_t)w;
    }
    if (left < 1 || left > MT_N || next > MT_N || next + (uint64_t)left - 1 > MT_N) return -1;
    float best = -INFINITY;
    int64_t arg = 0;
    for (int64_t a = 0; a < V; a += CHUNK) {
        const int64_t n = V - a < CHUNK ? V - a : CHUNK;
        const float *pa = p + a;
        mt_fill(mt, &left, &next, words, 2 * n);
        if (isnan(best)) continue;  /* the first NaN ratio won; the draws still advance the state */
        /* a vectorized pass against the best at the chunk's start (it only grows, so this keeps every
           token that can win), then the exact ratios of the candidates, in order */
        const double limit = best >= 0x1p-100f ? (double)best : 0.0;
        for (int64_t j = 0; j < n; j++)
            candidate[j] = !((double)pa[j] * SLACK < limit * uniform(words[2 * j], words[2 * j + 1]));
        for (int64_t j = 0; j < n; j++) {
            if (!candidate[j]) continue;
            const double u = uniform(words[2 * j], words[2 * j + 1]);
            if (best >= 0x1p-100f && (double)pa[j] * SLACK < (double)best * u) continue;
            float r;
            if (u == 0.0) {
                r = pa[j] > 0.0f ? INFINITY : NAN;  /* q = +0: p / q, without relying on zero signs */
            } else {
                const float q = (float)(-log1p(-u));
                r = pa[j] / q;
            }
            if (isnan(r) ? !isnan(best) : r > best) {
                best = r;
                arg = a + j;
            }
        }
    }
    memcpy(state + LEFT_AT, &left, 4);
    memcpy(state + NEXT_AT, &next, 8);
    for (int i = 0; i < MT_N; i++) {
        const uint64_t w = mt[i];
        memcpy(state + WORDS_AT + 8 * i, &w, 8);
    }
    return arg;
}

/* out (B, k), rows k apart: the k largest values of each row of x (B, V), rows x_stride apart, in
   descending order (torch.topk(x, k).values); a min-heap of the k largest so far, one compare per value
   that does not enter it. NaN never enters (its row is the caller's to handle). */
int swiftkv_topk_values(const float *x, int64_t x_stride, int64_t B, int64_t V, int64_t k, float *out,
                        int num_threads) {
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * x_stride;
        float *heap = out + b * k;
        for (int64_t i = 0; i < k; i++) heap[i] = -INFINITY;
        for (int64_t i = 0; i < V; i++) {
            const float v = row[i];
            if (!(v > heap[0])) continue;
            int64_t j = 0;  /* replace the root, sift down */
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= k) break;
                if (c + 1 < k && heap[c + 1] < heap[c]) c++;
                if (!(heap[c] < v)) break;
                heap[j] = heap[c];
                j = c;
            }
            heap[j] = v;
        }
        /* heap sort in place: repeatedly move the minimum to the end -> descending order */
        for (int64_t n = k; n > 1; n--) {
            const float last = heap[n - 1];
            heap[n - 1] = heap[0];
            int64_t j = 0;
            for (;;) {
                int64_t c = 2 * j + 1;
                if (c >= n - 1) break;
                if (c + 1 < n - 1 && heap[c + 1] < heap[c]) c++;
                if (!(heap[c] < last)) break;
                heap[j] = heap[c];
                j = c;
            }
            heap[j] = last;
        }
    }
    return 0;
}

/* probs: (B, V) fp32, rows p_stride apart; states: (B, state_stride) bytes, one generator each,
   advanced in place; out: (B,) int64 tokens (-1 for a row whose state is not valid) */
int swiftkv_exponential_race(const float *probs, int64_t p_stride, int64_t B, int64_t V,
                             uint8_t *states, int64_t state_stride, int64_t *out, int num_threads) {
    #pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (B > 1)
    for (int64_t b = 0; b < B; b++) out[b] = race_row(probs + b * p_stride, V, states + b * state_stride);
    return 0;
}
