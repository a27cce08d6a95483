/* y = x @ W^T for 4-bit grouped weights, bf16 activations and outputs, on AVX-512 BF16 CPUs.
 *
 * W[n, k] = d[n, g] * q[n, k] + m[n, g] with q in 0..15, g = k / 32 (GGUF Q4_1's form). For each group:
 *     y[r, n] += d[n, g] * sum_k x[r, k] q[n, k]  +  m[n, g] * sum_k x[r, k]
 * d and m are stored in bf16 as d and z = m + 8 d (the group's centre, small where m is about -8 d, so
 * its rounding costs little), and m = z - 8 d is formed in fp32.
 * The inner sum runs on VDPBF16PS with the codes as exact bf16 integers, so a weight is never
 * dequantised to bf16 and rounded; the group's sums are scaled in fp32.
 *
 * Layout (int4_pack in int4_native.py): for each block of 16 output columns, for each group, a
 * 320-byte record: 256 bytes of codes, then the 16 columns' d and then z as bf16. Code byte j of
 * chunk c (c = 0..7, 32 bytes each) holds in its low nibble element j of pair-vector 2c and in its
 * high nibble element j of pair-vector 2c+1, where element j of pair-vector p is
 * q[16 * block + j / 2, 32 * g + 2 * p + j % 2]: the (column, k-pair) interleave VDPBF16PS reads.
 *
 * The codes of a (block, group) are decoded once into registers and then used for every row of the
 * call, so a window of 8 rows costs little more than one row. Each row's arithmetic is the same
 * sequence of operations whatever the number of rows or threads (rows only interleave, columns are
 * split between threads whole), so a row's output is bit-identical in any batch.
 *
 * With 8-bit activations on (the default; DSPARK_INT8_ACTIVATIONS=0 or DSPARK_AMX=1 turn them off;
 * dspark_act8_init; block_rows_act8 below), each row's group of 32 inputs is rounded to e * u
 * (e = max|x| / 127, u in -127..127, as llama.cpp's Q8_1) and the group's dot with the codes is an exact
 * integer from VPDPBUSD (4 products a lane against VDPBF16PS's 2, the codes used as stored bytes):
 * y[r, n] += d e isum + m e sum(u). The codes are then laid out by k-quads (pack_for_kernel's act8
 * layout): chunk c (64 bytes) byte 4 j + i holds in its low nibble q[16 * block + j, 32 * g + 8 c + i]
 * and in its high nibble q[.., 32 * g + 8 c + 4 + i]; d and z as above.
 *
 * With AMX on (DSPARK_AMX=1, dspark_amx_init), the group sums come from tile multiplies instead
 * (block_rows_amx, amx_block in simd.h): the same scaling after them, other bits than VDPBF16PS's, and
 * still the same for a row whatever the other rows.
 */
#include <stdlib.h>

#include "simd.h"

#define GROUP 32
#define RECORD 320
#define PREFETCH_AHEAD (8 * RECORD) /* bytes (act8_rows) */

/* Sum of each group of 32 bf16 values of each row, in fp32, in one fixed order. */
static void group_sums(const uint16_t *x, int64_t rows, int64_t k, float *out) {
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + r * k + g * GROUP;
            out[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16_load(p), bf16_load(p + 16)));
        }
}

/* One row's group: its dot with the codes, scaled, plus the minimum times the row's group sum. */
#define ROW_GROUP(acc_y, xrow, g, w, d, m, xs)                                                    \
    do {                                                                                       \
        __m512 s;                                                                              \
        GROUP_DOT(s, (const int32_t *)((xrow) + (g) * GROUP), w);                              \
        acc_y = _mm512_fmadd_ps(s, d, acc_y);                                                  \
        acc_y = _mm512_fmadd_ps(_mm512_set1_ps(xs), m, acc_y);                                 \
    } while (0)

struct mm_args {
    const uint16_t *x;
    int64_t k, n;
    const uint8_t *packed;
    const float *xsum;
    uint16_t *y;
    int64_t rows;  /* the call's rows (x and xsum may hold more: padding for the tiles) */
};

/* bf16 of 0..15 (and zeros above), the lookup that turns a code into its exact bf16 value */
#define CODE_TABLE                                                                                 \
    _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, \
                     0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000,  \
                     0x3F80, 0x0000)

/* The record's codes as 16 k-pair vectors of exact bf16 integers (see the layout above). */
static inline void decode_codes(const uint8_t *rec, __m512bh w[16]) {
    const __m512i table = CODE_TABLE, low = _mm512_set1_epi16(0x0F);
    for (int c = 0; c < 8; c++) {
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 32 * c)));
        w[2 * c] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, low), table);
        w[2 * c + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
    }
}

/* Block b of 16 output columns for rows r0 .. r0 + rows - 1 (see run_blocks in simd.h). */
static void block_rows(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct mm_args *a = args;
    const int64_t k = a->k, groups = k / GROUP;
    const uint16_t *x = a->x + r0 * k;
    const float *xsum = a->xsum + r0 * groups;
    const uint8_t *rec0 = a->packed + b * groups * RECORD;
    for (int64_t r = 0; r < rows; r++)
        _mm512_storeu_ps(ybuf + r * 16, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD;
        __m512bh w[16];
        decode_codes(rec, w);
        const __m512 d = bf16_load((const uint16_t *)(rec + 256));
        const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), d, bf16_load((const uint16_t *)(rec + 288)));
        int64_t r = 0;
        for (; r + 1 < rows; r += 2) {
            __m512 y0 = _mm512_loadu_ps(ybuf + r * 16), y1 = _mm512_loadu_ps(ybuf + (r + 1) * 16);
            ROW_GROUP(y0, x + r * k, g, w, d, m, xsum[r * groups + g]);
            ROW_GROUP(y1, x + (r + 1) * k, g, w, d, m, xsum[(r + 1) * groups + g]);
            _mm512_storeu_ps(ybuf + r * 16, y0);
            _mm512_storeu_ps(ybuf + (r + 1) * 16, y1);
        }
        for (; r < rows; r++) {
            __m512 y0 = _mm512_loadu_ps(ybuf + r * 16);
            ROW_GROUP(y0, x + r * k, g, w, d, m, xsum[r * groups + g]);
            _mm512_storeu_ps(ybuf + r * 16, y0);
        }
    }
    store_block(ybuf, rows, a->y, 1, a->n, r0, b * 16);
}


/* 8-bit activations (see the top): the row's rounded groups, their scales e and e * sum(u) */
struct act8_args {
    const int8_t *xq;
    const float *e, *xs;
    int64_t k, n;
    const uint8_t *packed;
    uint16_t *y;
};

/* Rows r0 .. r0 + R - 1 of block b, R <= 8 a compile-time constant (block_rows_act8 picks it): the rows'
 * sums stay in registers over all groups instead of a round trip through ybuf a group, which made a
 * window's extra rows cost ~1.4x more (one thread, 8 rows). A row's arithmetic is the same sequence
 * whatever R, so its result still does not depend on the rows beside it. */
static inline __attribute__((always_inline)) void act8_rows(const struct act8_args *a, int64_t b, int64_t r0,
                                                            const int R, float *ybuf) {
    const int64_t k = a->k, groups = k / GROUP;
    const uint8_t *rec0 = a->packed + b * groups * RECORD;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 y[8];
    for (int r = 0; r < R; r++)
        y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD;
        /* with 4 or more rows, the record 8 ahead into L1, as q8_vnni_mm.c does (4 ahead): a group's arithmetic for
         * the rows of a verify window is long enough that the hardware prefetcher falls behind the weight
         * stream, and the window's compute and its weight reads then take turns instead of overlapping (one
         * row keeps up without it, and got slower with it); a prefetch past the buffer's end never faults */
        if (R >= 4)
            for (int l = 0; l < RECORD; l += 64)
                _mm_prefetch((const char *)(rec + PREFETCH_AHEAD + l), _MM_HINT_T0);
        __m512i w[8];
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(rec + 64 * c);
            w[2 * c] = _mm512_and_si512(v, low);
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 d = bf16_load((const uint16_t *)(rec + 256));
        const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), d, bf16_load((const uint16_t *)(rec + 288)));
        for (int r = 0; r < R; r++) {
            const int64_t i = (r0 + r) * groups + g;
            const int32_t *xr = (const int32_t *)(a->xq + (r0 + r) * k + g * GROUP);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {
                DPBUSD_BCAST(s0, w[t], xr[t]);
                DPBUSD_BCAST(s1, w[t + 1], xr[t + 1]);
            }
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_mul_ps(d, _mm512_set1_ps(a->e[i])), y[r]);
            y[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->xs[i]), y[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(ybuf + r * 16, y[r]);
}

/* Block b of 16 output columns for rows r0 .. r0 + rows - 1 (see run_blocks in simd.h), 8 rows at a time. */
static void block_rows_act8(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct act8_args *a = args;
    for (int64_t done = 0; done < rows; done += 8) {
        const int64_t n = rows - done < 8 ? rows - done : 8;
        float *yb = ybuf + done * 16;
#define ROWS(R) act8_rows(a, b, r0 + done, R, yb)
        SWITCH_ROWS(n, ROWS)
#undef ROWS
    }
    store_block(ybuf, rows, a->y, 1, a->n, r0, b * 16);
}

static void int4_mm_act8(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, uint16_t *y,
                         int threads) {
    const int64_t groups = k / GROUP, cells = rows * groups > 0 ? rows * groups : 1;
    int8_t *xq = (int8_t *)malloc((size_t)(rows * k > 0 ? rows * k : 1));
    float *e = (float *)malloc(sizeof(float) * (size_t)cells), *xs = (float *)malloc(sizeof(float) * (size_t)cells);
    int32_t *sx = (int32_t *)malloc(sizeof(int32_t) * (size_t)cells);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        quantize_row_q8(x + r * k, k, xq + r * k, e + r * groups, sx + r * groups);
        for (int64_t g = 0; g < groups; g++)
            xs[r * groups + g] = e[r * groups + g] * (float)sx[r * groups + g];
    }
    const struct act8_args args = {xq, e, xs, k, n, packed, y};
    run_blocks(rows, n / 16, threads, block_rows_act8, &args);
    free(xq), free(e), free(xs), free(sx);
}

#ifdef DSPARK_AMX
/* The same on AMX (amx_block in simd.h): a group's sums from one tile multiply for up to 16 rows, then
 * each row scaled as above, group after group in the same order. */
static inline void scale_group(const void *args, const uint8_t *rec, int64_t g, int64_t row, const float *c, float *yr) {
    const struct mm_args *a = args;
    const __m512 d = bf16_load((const uint16_t *)(rec + 256));
    const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), d, bf16_load((const uint16_t *)(rec + 288)));
    __m512 y = _mm512_loadu_ps(yr);
    y = _mm512_fmadd_ps(_mm512_load_ps(c), d, y);
    y = _mm512_fmadd_ps(_mm512_set1_ps(a->xsum[row * (a->k / GROUP) + g]), m, y);
    _mm512_storeu_ps(yr, y);
}

static void block_rows_amx(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct mm_args *a = args;
    const int64_t groups = a->k / GROUP;
    amx_block(a->x + r0 * a->k, a->k, r0, rows, a->packed + b * groups * RECORD, RECORD, decode_codes, scale_group,
              a, ybuf);
    store_block(ybuf, a->rows - r0 < rows ? a->rows - r0 : rows, a->y, 1, a->n, r0, b * 16);
}
#endif

/* x [rows, k] bf16, packed as above for n outputs, y [rows, n] bf16. threads: OpenMP threads to use. */
void dspark_int4_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, uint16_t *y,
                    int threads) {
    const int64_t groups = k / GROUP;
    if (dspark_act8_on) {
        int4_mm_act8(x, rows, k, packed, n, y, threads);
        return;
    }
#ifdef DSPARK_AMX
    if (dspark_amx_on) {
        uint16_t *xp = pad_rows(x, rows, k);
        const int64_t padded = xp ? (rows + 15) / 16 * 16 : rows;
        float *xsum = (float *)calloc((size_t)(padded * groups > 0 ? padded * groups : 1), sizeof(float));
        group_sums(x, rows, k, xsum);
        const struct mm_args args = {xp ? xp : x, k, n, packed, xsum, y, rows};
        run_blocks_tiled(padded, n / 16, threads, block_rows_amx, &args, amx_configure_bf16);
        free(xsum);
        free(xp);
        return;
    }
#endif
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(rows * groups > 0 ? rows * groups : 1));
    group_sums(x, rows, k, xsum);
    const struct mm_args args = {x, k, n, packed, xsum, y, rows};
    run_blocks(rows, n / 16, threads, block_rows, &args);
    free(xsum);
}
