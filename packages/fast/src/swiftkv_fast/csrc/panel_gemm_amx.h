/* The panel GEMM's 4- and 8-bit panels (PANEL_Q4_AMX, PANEL_Q8_AMX) multiplied on AMX tiles with exact
   products: part of panel_gemm.c, included after its register blocks and row groups.

   A code is an integer (below 16, or up to 127 in magnitude), exact in bf16; an input v is split into
   bf16 parts hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid), which sum to v exactly, so every
   part-times-code product is exact in TDPBF16PS's fp32 sums. Per block of 32 inputs the tiles give
   S = sum_k x_k q_k for a row group's 16 rows and a panel's 16 columns, then y += d S + m X, X the
   block's sum of the row's inputs (m is 0 for 8-bit panels). Two panels' tile chains run interleaved,
   and a slice of blocks' codes is unpacked to bf16 tiles once for every row group of a work item.
   Compiled only where SWIFTKV_AMX_PANELS (isa.h); swiftkv_gemm_has_amx() says which. */
#if SWIFTKV_AMX_PANELS
/* A group's parts are tiles of 16 rows x 32 inputs: (3, groups, K / 32, 16, 32) bf16, then its block
   sums (groups, 16, K / 32) fp32. Inputs below ~1e-30 lose their last part (VCVTNEPS2BF16 flushes). */
static inline __m512 amx_widen(__m256bh h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

/* rows r of group g: n inputs of chunk (row-major, PACK_CHUNK apart) at input k0 into the parts and
   block sums; k0 and n multiples of Q4_BLOCK */
static void amx_pack_rows(float chunk[][PACK_CHUNK], int64_t g, int64_t groups, int64_t K, int64_t k0,
                          int64_t n, uint16_t *tiles) {
    const int64_t blocks = K / Q4_BLOCK, part = groups * blocks * 512;
    float *sums = (float *)(tiles + 3 * part);
    for (int r = 0; r < MR; r++)
        for (int64_t k = 0; k < n; k += 16) {
            const __m512 v = _mm512_loadu_ps(chunk[r] + k);
            const __m256bh hi = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, amx_widen(hi));
            const __m256bh mid = _mm512_cvtneps_pbh(r1);
            const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, amx_widen(mid)));
            const int64_t kk = k0 + k, b = kk / Q4_BLOCK;
            uint16_t *t = tiles + (g * blocks + b) * 512 + r * 32 + kk % Q4_BLOCK;
            _mm256_storeu_si256((__m256i *)t, (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(t + part), (__m256i)mid);
            _mm256_storeu_si256((__m256i *)(t + 2 * part), (__m256i)lo);
            if (kk % Q4_BLOCK == 0) {
                const __m512 w = _mm512_loadu_ps(chunk[r] + k + 16);
                sums[(g * MR + r) * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v, w));
            }
        }
}

static const uint16_t AMX_BF16_INT[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                          0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* a 4-bit panel's block (d, m, then 16 rows of 16 code bytes) -> the codes as a bf16 tile in the order
   TDPBF16PS reads (row j: column c's codes of inputs 2 j and 2 j + 1 side by side) */
static inline void amx_codes_tile(const unsigned char *blk, uint16_t *tile) {
    const __m512i table = _mm512_loadu_si512(AMX_BF16_INT), nibbles = _mm512_set1_epi32(0x000F000F);
    for (int j = 0; j < Q4_BLOCK / 2; j++) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 128 + 16 * j)));
        const __m512i pairs = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), nibbles);
        _mm512_store_si512(tile + 32 * j, _mm512_permutexvar_epi16(pairs, table));
    }
}

/* an 8-bit panel's block -> its codes as a bf16 tile (exact: integers up to 127) */
static inline void amx_codes_tile_q8(const unsigned char *blk, uint16_t *tile) {
    for (int j = 0; j < Q4_BLOCK / 2; j++) {
        const __m128i *c = (const __m128i *)(blk + 128 + 32 * j);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1)));
        _mm512_store_si512(tile + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static inline void amx_unpack(int format, const unsigned char *blk, uint16_t *tile) {
    if (format == PANEL_Q8_AMX)
        amx_codes_tile_q8(blk, tile);
    else
        amx_codes_tile(blk, tile);
}

#define AMX_SLICE 8  /* blocks whose codes are unpacked at once (8 KB of tiles per panel) */

/* acc[r * 32] += d S[r] + m X[r] for a group's rows: one block's products of one panel, scaled */
static inline void amx_scale(float *acc, int64_t n, const float *s, const unsigned char *blk,
                             const float *x, int64_t x_stride) {
    const __m512 d = _mm512_loadu_ps((const float *)blk), m = _mm512_loadu_ps((const float *)(blk + 64));
    for (int64_t r = 0; r < n; r++) {
        float *a = acc + 32 * r;
        const __m512 offset = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r * x_stride]), _mm512_load_ps(a));
        _mm512_store_ps(a, _mm512_fmadd_ps(d, _mm512_load_ps(s + 16 * r), offset));
    }
}

/* Rows [m0, m1) (groups g0..g1) times two adjacent panels (`pair` of them: 1 or 2) into acc, (rows, 32)
   fp32 zeroed by the caller. Two panels at a time because a block's three tile products accumulate in
   one tile, one after the other: the two panels' chains interleave on the tile unit. Per slice of
   AMX_SLICE blocks the codes are unpacked once for every group; a block's products run while the
   previous block's are scaled. */
static void amx_pair(const uint16_t *tiles, int64_t groups, const unsigned char *panel0, int pair, int64_t K,
                     struct gemm_rows rows, int64_t g0, int64_t g1, float *acc, int format) {
    const int64_t block_bytes = format == PANEL_Q8_AMX ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES;
    const int64_t blocks = K / Q4_BLOCK, part = groups * blocks * 512, panel_bytes = blocks * block_bytes;
    const float *sums = (const float *)(tiles + 3 * part);
    const unsigned char *panel1 = panel0 + (pair > 1 ? panel_bytes : 0);
    uint16_t codes[2][AMX_SLICE][512] __attribute__((aligned(64)));
    float s[2][2][256] __attribute__((aligned(64)));
    const int64_t m0 = group_start(g0, rows.base, rows.extra, rows.M);
    for (int64_t b0 = 0; b0 < blocks; b0 += AMX_SLICE) {
        const int64_t nb = blocks - b0 < AMX_SLICE ? blocks - b0 : AMX_SLICE;
        for (int64_t b = 0; b < nb; b++) {
            amx_unpack(format, panel0 + (b0 + b) * block_bytes, codes[0][b]);
            if (pair > 1) amx_unpack(format, panel1 + (b0 + b) * block_bytes, codes[1][b]);
        }
        for (int64_t g = g0; g < g1; g++) {
            const int64_t gm = group_start(g, rows.base, rows.extra, rows.M);
            const int64_t n = group_start(g + 1, rows.base, rows.extra, rows.M) - gm;
            const float *x = sums + g * MR * blocks + b0;
            float *a0 = acc + (gm - m0) * 32, *a1 = a0 + 16;
            for (int64_t b = 0; b <= nb; b++) {
                if (b < nb) {  /* the two panels' products of block b, interleaved */
                    const uint16_t *a = tiles + (g * blocks + b0 + b) * 512;
                    _tile_loadd(4, codes[0][b], 64);
                    _tile_loadd(6, codes[1][b], 64);  /* a lone last panel: stale codes, result unused */
                    _tile_zero(0);
                    _tile_zero(5);
                    _tile_loadd(1, a, 64);
                    _tile_dpbf16ps(0, 1, 4);
                    _tile_dpbf16ps(5, 1, 6);
                    _tile_loadd(2, a + part, 64);
                    _tile_dpbf16ps(0, 2, 4);
                    _tile_dpbf16ps(5, 2, 6);
                    _tile_loadd(3, a + 2 * part, 64);
                    _tile_dpbf16ps(0, 3, 4);
                    _tile_dpbf16ps(5, 3, 6);
                }
                if (b) {  /* block b - 1's, scaled while block b's products run */
                    const int64_t k = b - 1;
                    amx_scale(a0, n, s[k & 1][0], panel0 + (b0 + k) * block_bytes, x + k, blocks);
                    if (pair > 1)
                        amx_scale(a1, n, s[k & 1][1], panel1 + (b0 + k) * block_bytes, x + k, blocks);
                }
                if (b < nb) {
                    _tile_stored(0, s[b & 1][0], 64);
                    _tile_stored(5, s[b & 1][1], 64);
                }
            }
        }
    }
}

/* Inside a parallel region, after gemm_pack_x: y (M, N) contiguous = x times the 4-bit panels on AMX
   tiles, plus bias unless NULL; items are (run of groups, pair of panels) */
static void amx_run(const uint16_t *tiles, const unsigned char *packed, const float *bias, float *y,
                    int64_t N, int64_t K, struct gemm_rows rows, int format) {
    amx_tile_config(7);  /* tiles 0, 5: S of two panels; 1-3: the parts of x; 4, 6: the panels' codes */
    const int64_t panels = (N + 15) / 16, pairs = (panels + 1) / 2, groups = rows.groups;
    const int64_t runs = (groups + rows.per_item - 1) / rows.per_item;
    const int64_t panel_bytes = K / Q4_BLOCK * (format == PANEL_Q8_AMX ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES);
    float acc[GROUPS_PER_ITEM * MR * 32] __attribute__((aligned(64)));
    #pragma omp for schedule(static)
    for (int64_t item = 0; item < runs * pairs; item++) {
        const int64_t g0 = (item / pairs) * rows.per_item, p0 = 2 * (item % pairs);
        const int64_t g1 = g0 + rows.per_item < groups ? g0 + rows.per_item : groups;
        const int64_t m0 = group_start(g0, rows.base, rows.extra, rows.M);
        const int64_t m1 = group_start(g1, rows.base, rows.extra, rows.M);
        const int pair = p0 + 1 < panels ? 2 : 1;
        memset(acc, 0, sizeof(float) * 32 * (m1 - m0));
        amx_pair(tiles, groups, packed + p0 * panel_bytes, pair, K, rows, g0, g1, acc, format);
        const int64_t n0 = 16 * p0, width = N - n0 < 32 ? N - n0 : 32;
        for (int64_t m = m0; m < m1; m++) {
            float *dst = y + m * N + n0;
            const float *src = acc + (m - m0) * 32;
            for (int64_t c = 0; c < width; c++) dst[c] = src[c] + (bias != NULL ? bias[n0 + c] : 0.f);
        }
    }
}
#endif /* SWIFTKV_AMX_PANELS */
