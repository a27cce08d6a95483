/* y = x @ W^T for 8-bit grouped weights (W[n, k] = d[n, g] * q[n, k], g = k / 32) with the activations
 * rounded to 8-bit groups too, on AVX-512 VNNI: VPDPBUSD does 64 multiply-adds an instruction against
 * VDPBF16PS's 32, and the codes are used as they are stored (no decoding to bf16).
 *
 * Each row's group of 32 is rounded to x = e * u with e = max|x| / 127 and u in -127..127. VPDPBUSD multiplies
 * unsigned by signed bytes, so the codes are stored as q + 128 and y[r, n] += d[n, g] * e[r, g] *
 * (sum_k (q + 128) u - 128 sum_k u): integer sums are exact, and the row's sum of u per group is kept
 * beside its scale. Used for the drafter's projections, whose drafts need not be exact (verification keeps
 * the output lossless), and for the target's LM head where its 4-bit matmuls round their rows too
 * (the default; dspark_act8_on). A row's result depends on that row alone.
 *
 * Layout (q8.pack_for_vnni): for each block of 16 output columns, for each group, a 576-byte record: 512
 * bytes of codes plus 128 (8 vectors; byte 4 c + i of vector p is q[16 * block + c, 32 * g + 4 p + i] + 128),
 * then the 16 columns' d as fp32.
 */
#include "simd.h"

#define GROUP 32
#define RECORD 576
#define PREFETCH_AHEAD (4 * RECORD) /* bytes (vnni_rows) */

struct vnni_args {
    const int8_t *xq;   /* [rows, k] u */
    const float *e;     /* [rows, k / GROUP] */
    const int32_t *sx;  /* [rows, k / GROUP]: sum of u over the group */
    int64_t k, n;
    const uint8_t *packed;
    void *y;
    int out_bf16;
};

static inline __m512 row_group(const int8_t *xg, const __m512i *w, int32_t sum) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    for (int p = 0; p < 8; p += 2) {
        DPBUSD_BCAST(a0, w[p], ((const int32_t *)xg)[p]);
        DPBUSD_BCAST(a1, w[p + 1], ((const int32_t *)xg)[p + 1]);
    }
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(a0, a1), _mm512_set1_epi32(128 * sum)));
}

/* Rows r0 .. r0 + R - 1 of block b, R <= 8 a compile-time constant: the rows' sums stay in registers over all
 * groups (as in int4_mm.c's act8_rows), each row's arithmetic the same sequence whatever R. */
static inline __attribute__((always_inline)) void vnni_rows(const struct vnni_args *a, int64_t b, int64_t r0,
                                                            const int R, float *ybuf) {
    const int64_t k = a->k, groups = k / GROUP;
    const uint8_t *rec0 = a->packed + b * groups * RECORD;
    __m512 y[8];
    for (int r = 0; r < R; r++)
        y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD;
        /* the record 4 ahead into L1: with several rows a group's arithmetic is long enough that the hardware
         * prefetcher fell behind (Zen 5: 7 rows of the drafter's 16k-row head streamed from memory took 2x
         * as long without this as with the sums in memory); a prefetch past the buffer's end never faults */
        for (int l = 0; l < RECORD; l += 64)
            _mm_prefetch((const char *)(rec + PREFETCH_AHEAD + l), _MM_HINT_T0);
        __m512i w[8];
        for (int p = 0; p < 8; p++)
            w[p] = _mm512_loadu_si512(rec + 64 * p);
        const __m512 d = _mm512_loadu_ps((const float *)(rec + 512));
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const __m512 s = row_group(a->xq + row * k + g * GROUP, w, a->sx[row * groups + g]);
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a->e[row * groups + g]));
            y[r] = _mm512_fmadd_ps(s, scale, y[r]);
        }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(ybuf + r * 16, y[r]);
}

static void block_rows(const void *args, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const struct vnni_args *a = args;
    for (int64_t done = 0; done < rows; done += 8) {
        const int64_t n = rows - done < 8 ? rows - done : 8;
        float *yb = ybuf + done * 16;
#define ROWS(R) vnni_rows(a, b, r0 + done, R, yb)
        SWITCH_ROWS(n, ROWS)
#undef ROWS
    }
    store_block(ybuf, rows, a->y, a->out_bf16, a->n, r0, b * 16);
}

/* x [rows, k] bf16, packed as above for n outputs (a multiple of 16), y [rows, n] fp32 (bf16 with
 * out_bf16); xq [rows, k] bytes, e [rows, k / 32] fp32 and sx [rows, k / 32] int32 are the caller's scratch. */
void dspark_q8_vnni_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                       int out_bf16, int8_t *xq, float *e, int32_t *sx, int threads) {
    const int64_t groups = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++)
        quantize_row_q8(x + r * k, k, xq + r * k, e + r * groups, sx + r * groups);
    const struct vnni_args args = {xq, e, sx, k, n, packed, y, out_bf16};
    run_blocks(rows, n / 16, threads, block_rows, &args);
}
