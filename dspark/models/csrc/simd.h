/* AVX-512 helpers shared by dspark's kernels: bf16 <-> fp32, a fixed-form exponential, the bf16 and 8-bit group dot
 * products, rows rounded to 8-bit groups, the blocked matmul driver and its AMX path. */
#ifndef DSPARK_SIMD_H
#define DSPARK_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 bf16 values -> fp32 (exact) */
static inline __m512 bf16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 values -> bf16, rounded to nearest even */
static inline void bf16_store(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

/* exp(x), x clamped to [-87, 88]: 2^n * p(r), r = x - n ln2, p of degree 6 (relative error ~2e-7) */
static inline __m512 exp_clamped(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* acc += w . (the bf16 pair at x, broadcast): VDPBF16PS with its broadcast folded into the memory operand
 * (compilers issue a separate broadcast for _mm512_set1_epi32, one more instruction per product). */
#define DPBF16_BCAST(acc, w, x) __asm__("vdpbf16ps %[xv]%{1to16%}, %[wv], %[av]" : [av] "+v"(acc) : [wv] "v"(w), [xv] "m"(x))

/* s = sum over a group of 32 inputs of one row's bf16 pairs xp[0..15] (int32 views) times the group's 16
 * decoded weight vectors w[0..15] (16 columns x one k-pair each): four partial sums, joined in one fixed
 * order, so the row's result never depends on the rows beside it. */
#define GROUP_DOT(s, xp, w)                                                                        \
    do {                                                                                           \
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                                 \
        __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();                                 \
        for (int p = 0; p < 16; p += 4) {                                                          \
            DPBF16_BCAST(a0, (w)[p], (xp)[p]);                                                     \
            DPBF16_BCAST(a1, (w)[p + 1], (xp)[p + 1]);                                             \
            DPBF16_BCAST(a2, (w)[p + 2], (xp)[p + 2]);                                             \
            DPBF16_BCAST(a3, (w)[p + 3], (xp)[p + 3]);                                             \
        }                                                                                          \
        s = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));                           \
    } while (0)

/* acc += the unsigned bytes of w . the signed bytes at x (4, broadcast), lane by lane */
#define DPBUSD_BCAST(acc, w, x) __asm__("vpdpbusd %[xv]%{1to16%}, %[wv], %[av]" : [av] "+v"(acc) : [wv] "v"(w), [xv] "m"(x))

/* Row r's groups of 32 -> bytes u, scales e and sums of u (a group of zeros gets e = 0, u = 0). */
static inline void quantize_row_q8(const uint16_t *x, int64_t k, int8_t *xq, float *e, int32_t *sx) {
    for (int64_t g = 0; g < k / 32; g++) {
        const __m512 a = bf16_load(x + g * 32), b = bf16_load(x + g * 32 + 16);
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
        e[g] = mx / 127.0f;
        const __m512 s = _mm512_set1_ps(inv);
        const __m512i ua = _mm512_cvtps_epi32(_mm512_mul_ps(a, s));  /* rounded to nearest */
        const __m512i ub = _mm512_cvtps_epi32(_mm512_mul_ps(b, s));
        sx[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(ua, ub));
        _mm_storeu_si128((__m128i *)(xq + g * 32), _mm512_cvtepi32_epi8(ua));
        _mm_storeu_si128((__m128i *)(xq + g * 32 + 16), _mm512_cvtepi32_epi8(ub));
    }
}

/* CALL(R) for n = 1..8 rows with R the same number as a compile-time constant (the matmuls' register-resident
 * row blocks, int4_mm.c act8_rows and q8_vnni_mm.c vnni_rows); n above 8 takes CALL(8). */
#define SWITCH_ROWS(n, CALL)                                                                                 \
    switch (n) {                                                                                             \
    case 1: CALL(1); break;                                                                                  \
    case 2: CALL(2); break;                                                                                  \
    case 3: CALL(3); break;                                                                                  \
    case 4: CALL(4); break;                                                                                  \
    case 5: CALL(5); break;                                                                                  \
    case 6: CALL(6); break;                                                                                  \
    case 7: CALL(7); break;                                                                                  \
    default: CALL(8); break;                                                                                 \
    }

/* The driver of the grouped-weight matmuls (int4_mm.c, q8_mm.c): rows in chunks of ROW_CHUNK, each chunk's
 * blocks of 16 output columns split between threads whole. block(args, b, r0, rows, ybuf) leaves the
 * chunk's outputs of block b in ybuf [rows, 16] fp32; store_block() writes them out. */
#define ROW_CHUNK 256
typedef void (*block_fn)(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf);

static inline void store_block(const float *ybuf, int64_t rows, void *y, int out_bf16, int64_t n, int64_t r0,
                               int64_t col0) {
    for (int64_t r = 0; r < rows; r++) {
        if (out_bf16)
            bf16_store((uint16_t *)y + (r0 + r) * n + col0, _mm512_loadu_ps(ybuf + r * 16));
        else
            _mm512_storeu_ps((float *)y + (r0 + r) * n + col0, _mm512_loadu_ps(ybuf + r * 16));
    }
}

/* AMX (Sapphire Rapids and later): where dspark_amx_init() turned it on, the 4-bit and 8-bit matmuls
 * take a group's sums from one tile multiply, TDPBF16PS, for up to 16 rows at once, in place of 16
 * VDPBF16PS per row. A row's sums are still computed on their own (C row m reads A row m only), in the
 * same order whatever the other rows of the tile, so a row's result stays the same in any window; they
 * are not the bits of the VDPBF16PS path, so a process uses one path for all calls (the SPS tables and
 * the kernels' build key name it). */
extern int dspark_amx_on;

/* Where dspark_act8_init() turned it on, the 4-bit matmuls round their activations to 8 bits and take exact
 * integer group sums from VPDPBUSD (int4_mm.c); the weights are then packed for it (a process-wide choice). */
extern int dspark_act8_on;

/* rows a call's tiles hold: the call's rows up to 16; calls of more rows are padded to a multiple of 16
 * (pad_rows) so every tile of them is full */
static inline int64_t amx_tile_rows(int64_t rows) { return rows < 16 ? rows : 16; }

/* x [rows, k] bf16 copied into a zeroed buffer of rows rounded up to 16 (NULL where rows needs none:
 * at most 16 rows, or a multiple of 16); free() it after the call. */
static inline uint16_t *pad_rows(const uint16_t *x, int64_t rows, int64_t k) {
    if (rows <= 16 || rows % 16 == 0)
        return NULL;
    const int64_t padded = (rows + 15) / 16 * 16;
    uint16_t *p = (uint16_t *)calloc((size_t)(padded * k), sizeof(uint16_t));
    memcpy(p, x, sizeof(uint16_t) * (size_t)(rows * k));
    return p;
}

#ifdef DSPARK_AMX
#define AMX_RING 8 /* ring buffers of amx_block's pipeline (at least 5 in use) */
/* Two sets of tiles, so that two groups' multiplies are in flight at once: 0 / 3 = A, rows x 32 bf16 (a
 * group of each row's inputs); 1 / 4 = B, the group's 16 k-pairs x 16 columns (the decoded codes, laid
 * out as VDPBF16PS reads them); 2 / 5 = C, rows x 16 fp32 sums. */
static inline void amx_configure_bf16(int rows) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed, aligned(64))) cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t % 3 == 1 ? 16 : (uint8_t)rows;
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* the intrinsic tells the compiler it reads 8 bytes only */
    _tile_loadconfig(&cfg);
}

/* cbuf [tile rows, 16] fp32 = the sums of a group for the tile's rows of x (rows ldx bytes apart, x at
 * the group's first input), the group's 16 k-pair vectors at wbuf (1 KB, 64-byte aligned); tile set
 * 0 or 1 (TSET of AMX_GROUP_DOT_SET), so that consecutive groups' multiplies need not wait for each
 * other. The tile numbers must be literals (the intrinsics paste them into the instruction). */
#define AMX_GROUP_DOT(A, B, C, x, ldx, wbuf, cbuf)                                                        \
    do {                                                                                               \
        _tile_zero(C);                                                                                 \
        _tile_loadd(A, x, ldx);                                                                        \
        _tile_loadd(B, wbuf, 64);                                                                      \
        _tile_dpbf16ps(C, A, B);                                                                       \
        _tile_stored(C, cbuf, 64);                                                                     \
    } while (0)
#define AMX_GROUP_DOT_SET(TSET, x, ldx, wbuf, cbuf)                                                       \
    do {                                                                                               \
        if (TSET)                                                                                      \
            AMX_GROUP_DOT(3, 4, 5, x, ldx, wbuf, cbuf);                                                \
        else                                                                                           \
            AMX_GROUP_DOT(0, 1, 2, x, ldx, wbuf, cbuf);                                                \
    } while (0)

/* A block of 16 output columns on AMX for the chunk of rows from r0 (x: its first row; rows: a multiple of
 * the configured tile rows tr): the grouped-weight matmuls' shared loop. decode(rec, w) turns a group's
 * record (record bytes each, from rec0) into its 16 k-pair vectors; scale(args, rec, g, row, c, y) adds
 * the sums c [16] fp32 of group g of the call's row `row` into y [16]. A software pipeline, so that what a step writes has left the store buffer
 * before the next reads it (tile loads do not take forwarded stores): decode group g, multiply group
 * g - 2 (both tile sets in turn), scale group g - 4, each row's groups in order. */
typedef void (*decode_fn)(const uint8_t *rec, __m512bh w[16]);
typedef void (*scale_fn)(const void *args, const uint8_t *rec, int64_t g, int64_t row, const float *c, float *y);

static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, int64_t k, int64_t r0, int64_t rows,
                                                            const uint8_t *rec0, int64_t record, decode_fn decode,
                                                            scale_fn scale, const void *args, float *ybuf) {
    static __thread __m512bh w_tls[AMX_RING][16] __attribute__((aligned(64)));
    static __thread float c_tls[AMX_RING][ROW_CHUNK * 16] __attribute__((aligned(64)));
    __m512bh(*w)[16] = w_tls;  /* thread-local buffers (too large for a stack), looked up once */
    float(*cbuf)[ROW_CHUNK * 16] = c_tls;
    const int64_t groups = k / 32, tr = amx_tile_rows(rows);
    for (int64_t r = 0; r < rows; r++)
        _mm512_storeu_ps(ybuf + r * 16, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups + 4; g++) {
        if (g < groups)
            decode(rec0 + g * record, w[g % AMX_RING]);
        const int64_t gm = g - 2, gs = g - 4;
        if (gm >= 0 && gm < groups)
            for (int64_t t0 = 0; t0 < rows; t0 += tr)
                AMX_GROUP_DOT_SET(gm & 1, x + t0 * k + gm * 32, 2 * k, w[gm % AMX_RING], cbuf[gm % AMX_RING] + t0 * 16);
        if (gs >= 0)
            for (int64_t r = 0; r < rows; r++)
                scale(args, rec0 + gs * record, gs, r0 + r, cbuf[gs % AMX_RING] + r * 16, ybuf + r * 16);
    }
}
#endif

typedef void (*configure_fn)(int rows);

/* run_blocks with, where configure is not NULL, each thread's tiles configured for the chunk's rows first
 * (a tile configuration belongs to the thread) */
static inline void run_blocks_tiled(int64_t rows, int64_t blocks, int threads, block_fn block, const void *args,
                                    configure_fn configure) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        const int64_t nr = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp parallel num_threads(threads)
        {
            float ybuf[ROW_CHUNK * 16] __attribute__((aligned(64)));
            if (configure)
                configure((int)amx_tile_rows(nr));
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                block(args, b, r0, nr, ybuf);
        }
    }
}

static inline void run_blocks(int64_t rows, int64_t blocks, int threads, block_fn block, const void *args) {
    run_blocks_tiled(rows, blocks, threads, block, args, NULL);
}

#endif
