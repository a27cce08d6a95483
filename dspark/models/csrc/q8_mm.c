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
#define ROW_CHUNK 256

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

static void block_rows(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *rec0, void *y, int out_bf16,
                       int64_t n, int64_t col0, float *ybuf) {
    const int64_t groups = k / GROUP;
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
    for (int64_t r = 0; r < rows; r++) {
        if (out_bf16)
            bf16_store((uint16_t *)y + r * n + col0, _mm512_loadu_ps(ybuf + r * 16));
        else
            _mm512_storeu_ps((float *)y + r * n + col0, _mm512_loadu_ps(ybuf + r * 16));
    }
}

/* x [rows, k] bf16, packed as above for n outputs, y [rows, n] fp32 (bf16 with out_bf16). threads: OpenMP
 * threads to use. */
void dspark_q8_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                  int out_bf16, int threads) {
    const size_t esize = out_bf16 ? 2 : 4;
    const int64_t groups = k / GROUP, blocks = n / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        const int64_t nr = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp parallel num_threads(threads)
        {
            float ybuf[ROW_CHUNK * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                block_rows(x + r0 * k, nr, k, packed + b * groups * RECORD, (char *)y + r0 * n * esize, out_bf16, n,
                           b * 16, ybuf);
        }
    }
}
