/* y = x W^T (+ b) in fp32 over W packed in panels of 16 output columns (kernels/cpu_gemm.py).

   Panel p holds output columns [16 p, 16 p + 16), each input index's 16 weights side by side (one
   64-byte line), zeros past N. A register block of MR rows of x times one panel accumulates MR x 16
   outputs (AVX-512: MR = 16, so a 16-row decode batch loads each weight once; AVX2: MR = 6). Each call
   first packs x by register block, (blocks, K, MR), so that a block's broadcasts come from one
   sequential stream; the packing may first apply the op in front of the layer (RMSNorm with the
   residual add, or SiLU-and-mul), which then costs neither a call nor a pass of its own. Passes of
   IN_BLOCK inputs keep their slice of a panel in L1 while every register block of the item uses it,
   while the slice IN_BLOCK inputs ahead is prefetched into L2, spread over the blocks: a decode GEMM
   reads its weights from memory every step, and this overlaps those reads with the FMAs.

   Compact panels hold the same fp32 weights in fewer bytes where the weight is exactly of a form
   (kernels/weight_forms.py): 4-bit blocks d q + m (PANEL_Q4), 8-bit blocks d q (PANEL_Q8), values exact
   in bf16 (PANEL_BF16). The micro kernels rebuild each weight vector exactly and run the same FMAs in
   the same order, so the results are the fp32 panels' bit for bit. The 4- and 8-bit bytes may also be
   multiplied on AMX tiles with exact products (panel_gemm_amx.h).

   Work items are (run of register blocks, panel), split over the OpenMP threads in contiguous runs of
   equal size, so that each thread keeps its rows in cache across its panels.
   Build define: SWIFTKV_NO_AVX512 (1: the 8-lane blocks even where AVX-512 is there). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "isa.h"

#define IN_BLOCK 256  /* input features per pass: 16 KB of panel stays in L1 across the row blocks */
#define PACK_CHUNK 64  /* input features per step of the packing of x: MR rows of it on the stack */

/* A 4-bit panel holds a weight whose every run of Q4_BLOCK inputs of an output column is exactly
   d q + m in fp32 for one (d, m) and codes q in [0, 16) (4-bit checkpoints such as GGUF's Q4_1 and the
   embedded model, dequantized to fp32): per block of Q4_BLOCK inputs, d[16] and m[16] of the panel's
   columns, then per pair of inputs 16 bytes, byte c holding column c's code of the first input in its
   low nibble and of the second in its high one. 12 bytes per input and panel instead of 64, and the
   same fp32 weights: d q is exact (checked when packing), so d q + m rounds once, FMA-contracted or not. */
#define Q4_BLOCK 32
#define Q4_BLOCK_BYTES (2 * 16 * 4 + 16 * Q4_BLOCK / 2)
#define PANEL_F32 0
#define PANEL_Q4 1
#define PANEL_Q4_AMX 2  /* the 4-bit panels multiplied on AMX tiles (below) */
#define PANEL_Q8_AMX 3  /* 8-bit panels (d q per block, GGUF's Q8_0), on AMX tiles only */
#define PANEL_BF16 4     /* a weight whose every value is exact in bf16 (a bf16 checkpoint loaded as fp32):
                            its panels' bf16 bits, (K, 16) uint16 per panel, widened exactly (<< 16) */
#define PANEL_Q8 5       /* the 8-bit panels (PANEL_Q8_AMX's bytes) on FMAs: d q rebuilt per pair of inputs */
/* an 8-bit panel's block: d[16], m[16] (zeros), then per pair of inputs the 16 columns' two int8 codes */
#define Q8_BLOCK_BYTES (2 * 16 * 4 + 16 * Q4_BLOCK)
#define PANEL_AMX(format) ((format) == PANEL_Q4_AMX || (format) == PANEL_Q8_AMX)
#if defined(__x86_64__)
/* An accumulator's value as it stands: the 4-bit micro kernels add the inputs of a pair one after the
   other, as the fp32 ones do, where -fassociative-math had summed the pair first (other results, and
   one more add per pair) */
#define IN_ORDER(v) __asm__("" : "+v"(v))
#else
#define IN_ORDER(v) ((void)0)
#endif

#if SWIFTKV_AVX512
/* 32 vector registers of 16 lanes: up to 16 rows x one panel in 16 accumulators, so a 16-row decode
   batch loads each weight vector once and uses it 16 times */
#define MR 16
typedef float vec __attribute__((vector_size(64), aligned(4)));
/* Per input k, the panel's 16 weights as one vector w: fp32 as they are; bf16 widened exactly (bits
   << 16), and with `keep` stored there as an fp32 panel's row for the item's other blocks */
#define F32_TYPE float
#define F32_WEIGHTS(p, k) const vec w = *(const vec *)((p) + 16 * (k))
#define BF16_TYPE uint16_t
#define BF16_WEIGHTS(p, k)                                                                        \
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((p) + 16 * (k)));                   \
    const vec w = (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);                        \
    if (keep != NULL) *(vec *)(keep + 16 * (k)) = w
#define MICRO_INPUTS(KIND, name, R)                                                               \
static void name##R(const float *x, const void *panel, int64_t K, float *y, int64_t ldy, int add, \
                    const char *pf, int64_t pf_step, float *keep) {                               \
    const KIND##_TYPE *p = panel;                                                                 \
    (void)keep;                                                                                   \
    vec acc[R];                                                                                   \
    for (int r = 0; r < R; r++) acc[r] = add ? *(const vec *)(y + r * ldy) : (vec){0};             \
    for (int64_t k = 0; k < K; k++) {                                                             \
        __builtin_prefetch(pf + pf_step * k, 0, 1);                                               \
        KIND##_WEIGHTS(p, k);                                                                     \
        for (int r = 0; r < R; r++) acc[r] += x[MR * k + r] * w;                                  \
    }                                                                                             \
    for (int r = 0; r < R; r++) *(vec *)(y + r * ldy) = acc[r];                                   \
}
#define MICRO(R) MICRO_INPUTS(F32, micro, R)
#define MICRO_BF16(R) MICRO_INPUTS(BF16, micro_bf16_, R)
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6) MICRO(7) MICRO(8)
MICRO(9) MICRO(10) MICRO(11) MICRO(12) MICRO(13) MICRO(14) MICRO(15) MICRO(16)
#define MICROS {micro1, micro2, micro3, micro4, micro5, micro6, micro7, micro8, \
                micro9, micro10, micro11, micro12, micro13, micro14, micro15, micro16}
/* The same over a 4-bit panel (see Q4_BLOCK_BYTES) or an 8-bit one (Q8_BLOCK_BYTES), a pair of inputs
   at a time: their weight vectors w0, w1 rebuilt exactly from the block's scales (KIND##_SCALES) and the
   pair's codes (KIND##_PAIR), then the FMAs of micro##R in the same order, one input after the other.
   With `keep`, the rebuilt weights are stored there too, as an fp32 panel's rows (K, 16), for the item's
   other blocks. 4-bit: 16 code bytes widened to 16 lanes (one vpmovzxbd from memory), the low and the
   high nibbles converted, d q + m. 8-bit: the columns' two codes as 16 words sign-extended to 16 lanes,
   each input's code sign-extended from its byte and converted, d q. */
#define Q4_SCALES(blk) const vec d = *(const vec *)(blk), m = *(const vec *)((blk) + 64)
#define Q4_PAIR(blk, j)                                                                           \
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((blk) + 128 + 16 * (j)))); \
    const vec w0 = (vec)_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))) * d + m;   \
    const vec w1 = (vec)_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)) * d + m
#define Q8_SCALES(blk) const vec d = *(const vec *)(blk)
#define Q8_PAIR(blk, j)                                                                           \
    const __m512i c = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)((blk) + 128 + 32 * (j)))); \
    const vec w0 = (vec)_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(c, 24), 24)) * d;    \
    const vec w1 = (vec)_mm512_cvtepi32_ps(_mm512_srai_epi32(c, 8)) * d
#define MICRO_PAIRS(KIND, kind, R)                                                                \
static void micro_##kind##_##R(const float *x, const void *panel, int64_t K, float *y, int64_t ldy, \
                               int add, const char *pf, int64_t pf_step, float *keep) {           \
    vec acc[R];                                                                                   \
    for (int r = 0; r < R; r++) acc[r] = add ? *(const vec *)(y + r * ldy) : (vec){0};             \
    const unsigned char *blk = panel;                                                             \
    for (int64_t b = 0; b < K / Q4_BLOCK; b++, blk += KIND##_BLOCK_BYTES) {                       \
        KIND##_SCALES(blk);                                                                       \
        for (int j = 0; j < Q4_BLOCK / 2; j++) {                                                  \
            __builtin_prefetch(pf + pf_step * (Q4_BLOCK / 2 * b + j), 0, 1);                      \
            KIND##_PAIR(blk, j);                                                                  \
            if (keep != NULL) {                                                                   \
                *(vec *)(keep + 16 * (Q4_BLOCK * b + 2 * j)) = w0;                                \
                *(vec *)(keep + 16 * (Q4_BLOCK * b + 2 * j) + 16) = w1;                           \
            }                                                                                     \
            const float *xk = x + MR * (Q4_BLOCK * b + 2 * j);                                     \
            for (int r = 0; r < R; r++) acc[r] += xk[r] * w0;                                     \
            for (int r = 0; r < R; r++) IN_ORDER(acc[r]);                                         \
            for (int r = 0; r < R; r++) acc[r] += xk[MR + r] * w1;                                \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++) *(vec *)(y + r * ldy) = acc[r];                                   \
}
#define MICRO_Q4(R) MICRO_PAIRS(Q4, q4, R)
#define MICRO_Q8(R) MICRO_PAIRS(Q8, q8, R)
MICRO_Q4(1) MICRO_Q4(2) MICRO_Q4(3) MICRO_Q4(4) MICRO_Q4(5) MICRO_Q4(6) MICRO_Q4(7) MICRO_Q4(8)
MICRO_Q4(9) MICRO_Q4(10) MICRO_Q4(11) MICRO_Q4(12) MICRO_Q4(13) MICRO_Q4(14) MICRO_Q4(15) MICRO_Q4(16)
#define MICROS_Q4 {micro_q4_1, micro_q4_2, micro_q4_3, micro_q4_4, micro_q4_5, micro_q4_6, micro_q4_7,   \
                   micro_q4_8, micro_q4_9, micro_q4_10, micro_q4_11, micro_q4_12, micro_q4_13,            \
                   micro_q4_14, micro_q4_15, micro_q4_16}
MICRO_Q8(1) MICRO_Q8(2) MICRO_Q8(3) MICRO_Q8(4) MICRO_Q8(5) MICRO_Q8(6) MICRO_Q8(7) MICRO_Q8(8)
MICRO_Q8(9) MICRO_Q8(10) MICRO_Q8(11) MICRO_Q8(12) MICRO_Q8(13) MICRO_Q8(14) MICRO_Q8(15) MICRO_Q8(16)
#define MICROS_Q8 {micro_q8_1, micro_q8_2, micro_q8_3, micro_q8_4, micro_q8_5, micro_q8_6, micro_q8_7,   \
                   micro_q8_8, micro_q8_9, micro_q8_10, micro_q8_11, micro_q8_12, micro_q8_13,            \
                   micro_q8_14, micro_q8_15, micro_q8_16}
MICRO_BF16(1) MICRO_BF16(2) MICRO_BF16(3) MICRO_BF16(4) MICRO_BF16(5) MICRO_BF16(6) MICRO_BF16(7)
MICRO_BF16(8) MICRO_BF16(9) MICRO_BF16(10) MICRO_BF16(11) MICRO_BF16(12) MICRO_BF16(13) MICRO_BF16(14)
MICRO_BF16(15) MICRO_BF16(16)
#define MICROS_BF16 {micro_bf16_1, micro_bf16_2, micro_bf16_3, micro_bf16_4, micro_bf16_5, micro_bf16_6,     \
                     micro_bf16_7, micro_bf16_8, micro_bf16_9, micro_bf16_10, micro_bf16_11, micro_bf16_12,  \
                     micro_bf16_13, micro_bf16_14, micro_bf16_15, micro_bf16_16}
#else
/* 16 vector registers of 8 lanes: up to 6 rows x one panel in 12 accumulators */
#define MR 6
typedef float vec __attribute__((vector_size(32), aligned(4)));
/* 8 bf16 weights widened exactly to fp32 (bits << 16) */
#if SWIFTKV_AVX2
static inline vec bf16_widen(const uint16_t *bits) {
    return (vec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bits)), 16);
}
#else
static inline vec bf16_widen(const uint16_t *bits) {
    vec w;
    for (int c = 0; c < 8; c++) {
        const uint32_t u = (uint32_t)bits[c] << 16;
        memcpy(&w[c], &u, 4);
    }
    return w;
}
#endif
/* Per input k, the panel's 16 weights as two vectors of 8 lanes w0, w1: fp32 as they are; bf16 widened
   exactly (bits << 16), and with `keep` stored there as an fp32 panel's row */
#define F32_TYPE float
#define F32_WEIGHTS(p, k)                                                                         \
    const vec w0 = *(const vec *)((p) + 16 * (k)), w1 = *(const vec *)((p) + 16 * (k) + 8)
#define BF16_TYPE uint16_t
#define BF16_WEIGHTS(p, k)                                                                        \
    const vec w0 = bf16_widen((p) + 16 * (k)), w1 = bf16_widen((p) + 16 * (k) + 8);               \
    if (keep != NULL) {                                                                           \
        *(vec *)(keep + 16 * (k)) = w0;                                                           \
        *(vec *)(keep + 16 * (k) + 8) = w1;                                                       \
    }
#define MICRO_INPUTS(KIND, name, R)                                                               \
static void name##R(const float *x, const void *panel, int64_t K, float *y, int64_t ldy, int add, \
                    const char *pf, int64_t pf_step, float *keep) {                               \
    const KIND##_TYPE *p = panel;                                                                 \
    (void)keep;                                                                                   \
    vec acc[R][2];                                                                                \
    for (int r = 0; r < R; r++) {                                                                 \
        acc[r][0] = add ? *(const vec *)(y + r * ldy) : (vec){0};                                 \
        acc[r][1] = add ? *(const vec *)(y + r * ldy + 8) : (vec){0};                             \
    }                                                                                             \
    for (int64_t k = 0; k < K; k++) {                                                             \
        __builtin_prefetch(pf + pf_step * k, 0, 1);                                               \
        KIND##_WEIGHTS(p, k);                                                                     \
        for (int r = 0; r < R; r++) {                                                             \
            const float xv = x[MR * k + r];                                                       \
            acc[r][0] += xv * w0;                                                                 \
            acc[r][1] += xv * w1;                                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++) {                                                                 \
        *(vec *)(y + r * ldy) = acc[r][0];                                                        \
        *(vec *)(y + r * ldy + 8) = acc[r][1];                                                    \
    }                                                                                             \
}
#define MICRO(R) MICRO_INPUTS(F32, micro, R)
#define MICRO_BF16(R) MICRO_INPUTS(BF16, micro_bf16_, R)
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
#define MICROS {micro1, micro2, micro3, micro4, micro5, micro6}
/* w[i][h] = the weights of input i of a pair, columns [8 h, 8 h + 8) */
#if SWIFTKV_AVX2
static inline void q4_widen(const unsigned char *codes, vec d0, vec d1, vec m0, vec m1, vec w[2][2]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)codes);
    const __m256i c0 = _mm256_cvtepu8_epi32(raw), c1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
    const __m256i nibble = _mm256_set1_epi32(15);
    w[0][0] = (vec)_mm256_cvtepi32_ps(_mm256_and_si256(c0, nibble)) * d0 + m0;
    w[0][1] = (vec)_mm256_cvtepi32_ps(_mm256_and_si256(c1, nibble)) * d1 + m1;
    w[1][0] = (vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)) * d0 + m0;
    w[1][1] = (vec)_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)) * d1 + m1;
}
#else
static inline void q4_widen(const unsigned char *codes, vec d0, vec d1, vec m0, vec m1, vec w[2][2]) {
    for (int c = 0; c < 8; c++) {
        w[0][0][c] = (float)(codes[c] & 15) * d0[c] + m0[c];
        w[0][1][c] = (float)(codes[c + 8] & 15) * d1[c] + m1[c];
        w[1][0][c] = (float)(codes[c] >> 4) * d0[c] + m0[c];
        w[1][1][c] = (float)(codes[c + 8] >> 4) * d1[c] + m1[c];
    }
}
#endif
/* w[i][h] = d q of input i of a pair, columns [8 h, 8 h + 8), from the pair's 32 code bytes */
#if SWIFTKV_AVX2
static inline void q8_widen(const unsigned char *codes, vec d0, vec d1, vec w[2][2]) {
    const __m256i c0 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m256i c1 = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)));
    w[0][0] = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(c0, 24), 24)) * d0;
    w[0][1] = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(c1, 24), 24)) * d1;
    w[1][0] = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(c0, 8)) * d0;
    w[1][1] = (vec)_mm256_cvtepi32_ps(_mm256_srai_epi32(c1, 8)) * d1;
}
#else
static inline void q8_widen(const unsigned char *codes, vec d0, vec d1, vec w[2][2]) {
    const signed char *q = (const signed char *)codes;
    for (int c = 0; c < 8; c++) {
        w[0][0][c] = (float)q[2 * c] * d0[c];
        w[0][1][c] = (float)q[16 + 2 * c] * d1[c];
        w[1][0][c] = (float)q[2 * c + 1] * d0[c];
        w[1][1][c] = (float)q[16 + 2 * c + 1] * d1[c];
    }
}
#endif
/* The same over a 4-bit or an 8-bit panel, a pair of inputs at a time (see the 16-lane kernels): the
   pair's codes widened as two halves of 8 lanes (q4_widen, q8_widen) */
#define Q4_SCALES(blk)                                                                            \
    const vec d0 = *(const vec *)(blk), d1 = *(const vec *)((blk) + 32);                          \
    const vec m0 = *(const vec *)((blk) + 64), m1 = *(const vec *)((blk) + 96)
#define Q4_PAIR(blk, j, w) q4_widen((blk) + 128 + 16 * (j), d0, d1, m0, m1, w)
#define Q8_SCALES(blk) const vec d0 = *(const vec *)(blk), d1 = *(const vec *)((blk) + 32)
#define Q8_PAIR(blk, j, w) q8_widen((blk) + 128 + 32 * (j), d0, d1, w)
#define MICRO_PAIRS(KIND, kind, R)                                                                \
static void micro_##kind##_##R(const float *x, const void *panel, int64_t K, float *y, int64_t ldy, \
                               int add, const char *pf, int64_t pf_step, float *keep) {           \
    vec acc[R][2];                                                                                \
    for (int r = 0; r < R; r++) {                                                                 \
        acc[r][0] = add ? *(const vec *)(y + r * ldy) : (vec){0};                                 \
        acc[r][1] = add ? *(const vec *)(y + r * ldy + 8) : (vec){0};                             \
    }                                                                                             \
    const unsigned char *blk = panel;                                                             \
    for (int64_t b = 0; b < K / Q4_BLOCK; b++, blk += KIND##_BLOCK_BYTES) {                       \
        KIND##_SCALES(blk);                                                                       \
        for (int j = 0; j < Q4_BLOCK / 2; j++) {                                                  \
            __builtin_prefetch(pf + pf_step * (Q4_BLOCK / 2 * b + j), 0, 1);                      \
            vec w[2][2];                                                                          \
            KIND##_PAIR(blk, j, w);                                                               \
            if (keep != NULL)                                                                     \
                for (int h = 0; h < 4; h++)                                                       \
                    *(vec *)(keep + 16 * (Q4_BLOCK * b + 2 * j) + 8 * h) = w[h / 2][h % 2];       \
            const float *xk = x + MR * (Q4_BLOCK * b + 2 * j);                                     \
            for (int h = 0; h < 2; h++)                                                           \
                for (int r = 0; r < R; r++) {                                                     \
                    const float xv = xk[MR * h + r];                                              \
                    acc[r][0] += xv * w[h][0];                                                    \
                    acc[r][1] += xv * w[h][1];                                                    \
                    IN_ORDER(acc[r][0]);                                                          \
                    IN_ORDER(acc[r][1]);                                                          \
                }                                                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++) {                                                                 \
        *(vec *)(y + r * ldy) = acc[r][0];                                                        \
        *(vec *)(y + r * ldy + 8) = acc[r][1];                                                    \
    }                                                                                             \
}
#define MICRO_Q4(R) MICRO_PAIRS(Q4, q4, R)
#define MICRO_Q8(R) MICRO_PAIRS(Q8, q8, R)
MICRO_Q4(1) MICRO_Q4(2) MICRO_Q4(3) MICRO_Q4(4) MICRO_Q4(5) MICRO_Q4(6)
#define MICROS_Q4 {micro_q4_1, micro_q4_2, micro_q4_3, micro_q4_4, micro_q4_5, micro_q4_6}
MICRO_Q8(1) MICRO_Q8(2) MICRO_Q8(3) MICRO_Q8(4) MICRO_Q8(5) MICRO_Q8(6)
#define MICROS_Q8 {micro_q8_1, micro_q8_2, micro_q8_3, micro_q8_4, micro_q8_5, micro_q8_6}
MICRO_BF16(1) MICRO_BF16(2) MICRO_BF16(3) MICRO_BF16(4) MICRO_BF16(5) MICRO_BF16(6)
#define MICROS_BF16 {micro_bf16_1, micro_bf16_2, micro_bf16_3, micro_bf16_4, micro_bf16_5, micro_bf16_6}
#endif
#define GROUPS_PER_ITEM (96 / MR)  /* at most this many register blocks (about 96 rows of x) in an item,
                                      which keeps them in cache across its panel */

/* y[R][16] (rows ldy apart) = x[R][K] (rows ldx apart) . panel[K][16], plus y's own values when `add`
   (the partial sums of the preceding K block); R <= MR; over an fp32 panel, or a 4-bit, 8-bit or
   bf16 one whose rebuilt weights are also stored in `keep` (K, 16) unless NULL */
typedef void (*micro_fn)(const float *, const void *, int64_t, float *, int64_t, int, const char *, int64_t,
                         float *);
static const micro_fn micro[MR] = MICROS, micro_q4[MR] = MICROS_Q4, micro_q8[MR] = MICROS_Q8;
static const micro_fn micro_bf16[MR] = MICROS_BF16;

int swiftkv_gemm_rows_per_block(void) { return MR; }

/* the first row of register block g when the first `extra` blocks hold base + 1 rows, the rest base */
static inline int64_t group_start(int64_t g, int64_t base, int64_t extra, int64_t M) {
    const int64_t m = g * base + (g < extra ? g : extra);
    return m < M ? m : M;
}

/* w: (N, K) rows ldw apart -> packed: (ceil(N / 16), K, 16), zero past N. */
int swiftkv_gemm_pack(const float *w, int64_t ldw, int64_t N, int64_t K, float *packed, int num_threads) {
    const int64_t panels = (N + 15) / 16;
    #pragma omp parallel for num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * 16;
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < 16; c++) {
                const int64_t n = 16 * p + c;
                dst[16 * k + c] = n < N ? w[n * ldw + k] : 0.f;
            }
    }
    return 0;
}

/* What the packing of x applies to each row first (its result is the GEMM's input row of K values). */
#define PROLOGUE_NONE 0      /* x (M, K): the rows as they are */
#define PROLOGUE_RMS_NORM 1  /* x (M, K) is the residual stream h: h += d in place (d NULL: no add), then
                                RMSNorm(h) * norm_w, as swiftkv_add_rms_norm computes it */
#define PROLOGUE_SILU_MUL 2  /* x (M, 2 K) = [gate | up]: silu(gate) * up, as swiftkv_silu_and_mul */

/* How a call's M rows are cut into register blocks ("groups"): of equal sizes where that costs each
   at most one row (16 rows on AVX2: 6 + 5 + 5, not 6 + 6 + 4, whose 4-row block takes nearly as long
   as a 6-row one); else MR rows each and the rest in the last (8 rows: 6 + 2, faster there than
   4 + 4). */
struct gemm_rows {
    int64_t M, groups, base, extra;
    int64_t per_item;  /* register blocks per item: runs of equal size, at most GROUPS_PER_ITEM */
};

static inline struct gemm_rows gemm_rows(int64_t M) {
    const int64_t groups = (M + MR - 1) / MR;
    struct gemm_rows r = {M, groups, groups ? M / groups : 0, groups ? M % groups : 0, 1};
    if (r.base < MR - 1) r.base = MR, r.extra = 0;
    if (groups) {
        const int64_t runs = (groups + GROUPS_PER_ITEM - 1) / GROUPS_PER_ITEM;
        r.per_item = (groups + runs - 1) / runs;
    }
    return r;
}

/* floats of the packed copy of x for M rows of K inputs: (groups, K, MR), or for PANEL_Q4_AMX its three
   bf16 parts and block sums (amx_pack_rows), which take 1.53x that: room for either */
static inline int64_t gemm_xp_floats(int64_t M, int64_t K) { return 2 * ((M + MR - 1) / MR * K * MR); }

#define GROUP_START(g) group_start(g, rows.base, rows.extra, rows.M)

#include "panel_gemm_amx.h"

int swiftkv_gemm_has_amx(void) { return SWIFTKV_AMX_PANELS; }


/* Inside a parallel region (a worksharing loop over the groups, so every thread of the region must
   call it): x packed by group into xp, (groups, K, MR), zero past a group's rows, so that every
   broadcast of a register block comes from one sequential stream; the prologue applied to each row
   on the way. By chunks of PACK_CHUNK inputs: each row's prologue into a contiguous buffer (loops the
   compiler vectorizes), then the chunk's MR-float lines of xp written one after the other (several
   times faster than writing each row's values MR floats apart). */
static void gemm_pack_x(float *x, int64_t ldx, int64_t K, struct gemm_rows rows, int prologue,
                        const float *d, int64_t ldd, const float *norm_w, float eps, float *xp, int format) {
    #pragma omp for schedule(static)
    for (int64_t g = 0; g < rows.groups; g++) {
        const int64_t m0 = GROUP_START(g), n_rows = GROUP_START(g + 1) - m0;
        float scale[MR], chunk[MR][PACK_CHUNK];
        for (int64_t r = 0; r < n_rows && prologue == PROLOGUE_RMS_NORM; r++) {
            const float *dr = d != NULL ? d + (m0 + r) * ldd : NULL;
            scale[r] = swiftkv_add_rms_scale(x + (m0 + r) * ldx, dr, K, eps);
        }
        for (int64_t k0 = 0; k0 < K; k0 += PACK_CHUNK) {
            const int64_t n = K - k0 < PACK_CHUNK ? K - k0 : PACK_CHUNK;
            for (int64_t r = 0; r < MR; r++) {
                float *c = chunk[r];
                if (r >= n_rows) {
                    for (int64_t k = 0; k < n; k++) c[k] = 0.f;
                    continue;
                }
                const float *xr = x + (m0 + r) * ldx + k0;
                if (prologue == PROLOGUE_RMS_NORM)
                    for (int64_t k = 0; k < n; k++) c[k] = (xr[k] * scale[r]) * norm_w[k0 + k];
                else if (prologue == PROLOGUE_SILU_MUL)
                    swiftkv_silu_mul_row(xr, xr + K, c, n);
                else
                    for (int64_t k = 0; k < n; k++) c[k] = xr[k];
            }
#if SWIFTKV_AMX_PANELS
            if (PANEL_AMX(format)) {
                amx_pack_rows(chunk, g, rows.groups, K, k0, n, (uint16_t *)xp);
                continue;
            }
#else
            (void)format;
#endif
            float *dst = xp + g * K * MR + k0 * MR;
            for (int64_t k = 0; k < n; k++)
                for (int r = 0; r < MR; r++) dst[MR * k + r] = chunk[r][k];
        }
    }
}

static inline int64_t gemm_items(struct gemm_rows rows, int64_t N) {
    return (rows.groups + rows.per_item - 1) / rows.per_item * ((N + 15) / 16);
}

/* Inside a parallel region, after gemm_pack_x (a worksharing loop over the items): y (M, N)
   contiguous = xp times the packed W^T (`format` PANEL_F32, PANEL_Q4, PANEL_Q8 or PANEL_BF16, or on AMX
   PANEL_Q4_AMX / PANEL_Q8_AMX), plus bias (N,) unless NULL. Over a 4-bit, 8-bit or bf16 panel, an item's
   first register block rebuilds each slice's weights in registers (micro_q4, _q8, _bf16) and keeps them
   in an fp32 buffer that the item's other blocks read from L1 with the fp32 micro kernels: each weight
   is rebuilt once per item instead of once per block (rebuilding costs FMA-port slots). The same FMAs
   in the same order either way, so the results are the fp32 panels' bit for bit. */
static void gemm_run(const float *xp, const void *packed, int format, const float *bias, float *y,
                     int64_t N, int64_t K, struct gemm_rows rows) {
    const int64_t panels = (N + 15) / 16, groups = rows.groups;
#if SWIFTKV_AMX_PANELS
    if (PANEL_AMX(format)) {
        amx_run((const uint16_t *)xp, packed, bias, y, N, K, rows, format);
        return;
    }
#endif
    /* the micro kernels that rebuild this format's weights (NULL: fp32 panels, read as they are); bytes
       per input and panel; inputs per prefetch (the 4- and 8-bit kernels prefetch once a pair) */
    const int q4 = format == PANEL_Q4, q8 = format == PANEL_Q8;
    const micro_fn *rebuild = q4 ? micro_q4 : q8 ? micro_q8 : format == PANEL_BF16 ? micro_bf16 : NULL;
    const int64_t in_bytes = q4   ? Q4_BLOCK_BYTES / Q4_BLOCK
                             : q8 ? Q8_BLOCK_BYTES / Q4_BLOCK
                             : rebuild ? 32 /* bf16 */ : 64;
    const int64_t pf_inputs = q4 || q8 ? 2 : 1;
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < gemm_items(rows, N); item++) {
        const int64_t g0 = (item / panels) * rows.per_item, p = item % panels;
        const int64_t g1 = g0 + rows.per_item < groups ? g0 + rows.per_item : groups;
        const int64_t m0 = GROUP_START(g0), m1 = GROUP_START(g1), n0 = 16 * p;
        const char *panel = (const char *)packed + p * K * in_bytes;
        const int full = n0 + 16 <= N;
        float tmp[GROUPS_PER_ITEM * MR * 16];  /* a panel past N: its outputs before the copy */
        float kept[IN_BLOCK * 16] __attribute__((aligned(64)));  /* a compact slice rebuilt in fp32 */
        float *out = full ? y + m0 * N + n0 : tmp;
        const int64_t ldo = full ? N : 16;
        for (int64_t k0 = 0; k0 < K; k0 += IN_BLOCK) {
            const int64_t kc = K - k0 < IN_BLOCK ? K - k0 : IN_BLOCK;
            /* the kc panel rows IN_BLOCK rows ahead in memory (in this panel, then the next one)
               are prefetched while this slice runs, spread evenly over its g1 - g0 register blocks,
               so that memory stays busy while the later blocks reuse the slice from L1. A fixed
               distance, so that the slices' prefetches tile the stream: prefetching the next kc rows
               instead skipped rows 64-255 of every panel after a 64-row last slice (K = 576). Past the
               last panel this points beyond the buffer: a prefetch is a hint that never faults. */
            const int64_t step = (in_bytes * pf_inputs + (g1 - g0) - 1) / (g1 - g0);
            const char *ahead = panel + in_bytes * (k0 + IN_BLOCK);
            for (int64_t g = g0; g < g1; g++) {
                const int64_t m = GROUP_START(g), r = GROUP_START(g + 1) - m - 1;
                const float *xg = xp + g * K * MR + k0 * MR;
                const char *pf = ahead + (g - g0) * step * (kc / pf_inputs);
                if (rebuild == NULL)
                    micro[r](xg, panel + in_bytes * k0, kc, out + (m - m0) * ldo, ldo, k0 > 0, pf, step,
                             NULL);
                else if (g == g0)
                    rebuild[r](xg, panel + in_bytes * k0, kc, out + (m - m0) * ldo, ldo, k0 > 0, pf, step,
                               g1 - g0 > 1 ? kept : NULL);
                else  /* the fp32 kernels prefetch once per input, the 4- and 8-bit ones once per pair */
                    micro[r](xg, kept, kc, out + (m - m0) * ldo, ldo, k0 > 0, pf, step / pf_inputs, NULL);
            }
        }
        const int64_t width = full ? 16 : N - n0;
        for (int64_t m = m0; m < m1; m++) {
            float *dst = y + m * N + n0;
            if (!full) memcpy(dst, tmp + (m - m0) * 16, sizeof(float) * width);
            if (bias != NULL)
                for (int64_t c = 0; c < width; c++) dst[c] += bias[n0 + c];
        }
    }
}
#undef GROUP_START

/* y (M, N) contiguous = f(x) times the packed W^T, plus bias (N,) unless NULL; x's rows ldx apart,
   f the prologue (d's rows ldd apart). Returns 0, or SWIFTKV_NO_MEMORY when the packed copy of x cannot be allocated
   (nothing written then: the prologue's in-place add runs after the allocation). */
int swiftkv_gemm(float *x, int64_t ldx, const void *packed, int format, const float *bias, float *y,
                 int64_t M, int64_t N, int64_t K, int num_threads, int prologue, const float *d,
                 int64_t ldd, const float *norm_w, float eps) {
    const struct gemm_rows rows = gemm_rows(M);
    float *xp = malloc(sizeof(float) * gemm_xp_floats(M, K));
    if (xp == NULL) return SWIFTKV_NO_MEMORY;
    #pragma omp parallel num_threads(num_threads) if (gemm_items(rows, N) > 1)
    {
        gemm_pack_x(x, ldx, K, rows, prologue, d, ldd, norm_w, eps, xp, format);
        gemm_run(xp, packed, format, bias, y, N, K, rows);
    }
    free(xp);
    return 0;
}
