/* y = x @ W^T for 8-bit grouped weights (GGUF Q8_0's form: W[n, k] = d[n, g] * q[n, k], q in -128..127,
 * g = k / 32), bf16 activations, fp32 or bf16 outputs, on AVX-512 BF16 CPUs: an LM head in half the bytes of bf16.
 *
 * For each group, y[r, n] += d[n, g] * sum_k x[r, k] q[n, k]: the codes become exact bf16 integers and the
 * sum runs on VDPBF16PS, so each product is exact and only the fp32 sums round. d is kept in fp32 (a
 * GGUF's fp16 scale exactly), so the kernel computes with the file's own weights.
 *
 * Layout (q8.pack_for_kernel): for each block of 16 output columns, for each group, a 576-byte record:
 * 512 bytes of codes, then the 16 columns' d as fp32. Codes byte j of pair-vector p (p = 0..15, 32 bytes
 * each) is q[16 * block + j / 2, 32 * g + 2 * p + j % 2], the (column, k-pair) interleave VDPBF16PS reads.
 *
 * As in int4_mm.c, a (block, group)'s codes are decoded once for all rows of the call, and a row's
 * result is the same sequence of operations whatever the number of rows or threads.
 */
#include <stdlib.h>

#include "simd.h"

#define GROUP 32
#define RECORD 576

/* One row's group: its dot with the codes, scaled. */
#define ROW_GROUP(acc_y, xrow, g, w, d)                                                           \
    do {                                                                                       \
        __m512 s;                                                                              \
        GROUP_DOT(s, (const int32_t *)((xrow) + (g) * GROUP), w);                              \
        acc_y = _mm512_fmadd_ps(s, d, acc_y);                                                  \
    } while (0)

/* 32 int8 codes -> 32 exact bf16 values */
static inline __m512bh codes_to_bf16(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

struct mm_args {
    const uint16_t *x;
    int64_t k, n;
    const uint8_t *packed;
    void *y;
    int out_bf16;
    int64_t rows;  /* the call's rows (x may hold more: padding for the tiles) */
};

/* Block b of 16 output columns for rows r0 .. r0 + rows - 1 (see run_blocks in simd.h). */
static void block_rows(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct mm_args *a = args;
    const int64_t k = a->k, groups = k / GROUP;
    const uint16_t *x = a->x + r0 * k;
    const uint8_t *rec0 = a->packed + b * groups * RECORD;
    for (int64_t r = 0; r < rows; r++)
        _mm512_storeu_ps(ybuf + r * 16, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD;
        __m512bh w[16];
        for (int p = 0; p < 16; p++)
            w[p] = codes_to_bf16((const int8_t *)rec + 32 * p);
        const __m512 d = _mm512_loadu_ps((const float *)(rec + 512));
        int64_t r = 0;
        for (; r + 1 < rows; r += 2) {
            __m512 y0 = _mm512_loadu_ps(ybuf + r * 16), y1 = _mm512_loadu_ps(ybuf + (r + 1) * 16);
            ROW_GROUP(y0, x + r * k, g, w, d);
            ROW_GROUP(y1, x + (r + 1) * k, g, w, d);
            _mm512_storeu_ps(ybuf + r * 16, y0);
            _mm512_storeu_ps(ybuf + (r + 1) * 16, y1);
        }
        for (; r < rows; r++) {
            __m512 y0 = _mm512_loadu_ps(ybuf + r * 16);
            ROW_GROUP(y0, x + r * k, g, w, d);
            _mm512_storeu_ps(ybuf + r * 16, y0);
        }
    }
    store_block(ybuf, rows, a->y, a->out_bf16, a->n, r0, b * 16);
}

#ifdef DSPARK_AMX
/* The same on AMX (amx_block in simd.h, as in int4_mm.c). */
static inline void decode_codes(const uint8_t *rec, __m512bh w[16]) {
    for (int p = 0; p < 16; p++)
        w[p] = codes_to_bf16((const int8_t *)rec + 32 * p);
}

static inline void scale_group(const void *args, const uint8_t *rec, int64_t g, int64_t row, const float *c, float *yr) {
    (void)args, (void)g, (void)row;
    _mm512_storeu_ps(yr, _mm512_fmadd_ps(_mm512_load_ps(c), _mm512_loadu_ps((const float *)(rec + 512)),
                                         _mm512_loadu_ps(yr)));
}

static void block_rows_amx(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct mm_args *a = args;
    const int64_t groups = a->k / GROUP;
    amx_block(a->x + r0 * a->k, a->k, r0, rows, a->packed + b * groups * RECORD, RECORD, decode_codes, scale_group,
              NULL, ybuf);
    store_block(ybuf, a->rows - r0 < rows ? a->rows - r0 : rows, a->y, a->out_bf16, a->n, r0, b * 16);
}
#endif

/* x [rows, k] bf16, packed as above for n outputs, y [rows, n] fp32 (bf16 with out_bf16). threads: OpenMP
 * threads to use. */
void dspark_q8_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                  int out_bf16, int threads) {
#ifdef DSPARK_AMX
    if (dspark_amx_on) {
        uint16_t *xp = pad_rows(x, rows, k);
        const struct mm_args args = {xp ? xp : x, k, n, packed, y, out_bf16, rows};
        run_blocks_tiled(xp ? (rows + 15) / 16 * 16 : rows, n / 16, threads, block_rows_amx, &args,
                         amx_configure_bf16);
        free(xp);
        return;
    }
#endif
    const struct mm_args args = {x, k, n, packed, y, out_bf16, rows};
    run_blocks(rows, n / 16, threads, block_rows, &args);
}
