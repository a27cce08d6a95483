/* The grouped-weight matmuls for CPUs with AVX2 and FMA but without AVX-512 (AMD Zen 1-3, Intel before
 * Skylake-SP / Ice Lake, and every x86 CPU newer than those too): fp32 rows in, fp32 rows out, the weights in
 * the 8-bit-activation layouts of the AVX-512 kernels (int4.pack_for_kernel with quads, q8.pack_for_vnni),
 * so a model packs its weights one way for either library. Built as a library of its own (native.py:
 * avx2_library), with AVX2 flags only, so it loads where the AVX-512 one cannot.
 *
 * Why: without these, such a CPU ran the embedded model's linears as fp32 matmuls (~540 MB read a decode
 * step, ~80% of the step) or through PyTorch's int4 kernel on bf16 rows (slower than fp32 there).
 *
 * Each row's group of 32 inputs is rounded to e * u (e = max|x| / 127, u in -127..127, llama.cpp's Q8_1) and
 * its dot with the group's codes is an exact integer from VPMADDUBSW / VPMADDWD:
 *   4-bit (W = d q + m, q in 0..15):  y[r, n] += (d e) * sum_k q u  +  m * (e sum_k u)
 *   8-bit (W = d q, q in -128..127):   y[r, n] += (d e) * sum_k q u
 * VPMADDUBSW multiplies unsigned by signed bytes into saturating 16-bit pair sums. For 4-bit codes a pair is at
 * most 2 * 15 * 127 = 3810, and a group's eight quad-sums at most 30480, so they add up in 16 bits exactly.
 * For 8-bit codes the product is taken as |q| times u with q's sign (at most 2 * 128 * 127 = 32512 a pair) and
 * widened to 32 bits at once. The integer sums equal the AVX-512 kernels' (VPDPBUSD), and the fp32 scaling
 * runs the same operations in the same order, so a row's outputs are the bits dspark_int4_mm and
 * dspark_q8_vnni_mm give it before their output rounding.
 *
 * Rows never mix: a row's arithmetic is the same sequence whatever the number of rows or threads (threads
 * split output columns, 16 at a time), so a row's result is bit-identical in any batch or verify window.
 */
#include "avx2.h"
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define RECORD4 320 /* 4-bit: 256 bytes of codes (4 chunks of 64), 16 bf16 d, 16 bf16 z = m + 8 d */
#define RECORD8 576 /* 8-bit: 512 bytes of codes + 128 (8 quads of 64), 16 fp32 d */
#define ROW_CHUNK 64

int dspark_avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* 8 bf16 values -> fp32 (exact) */
static inline __m256 bf16_load8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* A row's groups of 32 -> bytes u, scales e and e * sum(u) (a group of zeros gets e = 0, u = 0): the
 * rounding of the AVX-512 kernels' quantize_row_q8, on fp32 rows. */
static void quantize_row(const float *x, int64_t k, int8_t *xq, float *e, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < k / GROUP; g++) {
        const float *p = x + g * GROUP;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        const float m = hmax8(mx);
        const float inv = m > 0.0f ? 127.0f / m : 0.0f;
        const __m256 s = _mm256_set1_ps(inv);
        __m256i u[4];
        for (int i = 0; i < 4; i++)
            u[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], s)); /* rounded to nearest even */
        const int32_t su = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(u[0], u[1]), _mm256_add_epi32(u[2], u[3])));
        /* 32 int32 -> 32 int8, in order (the values fit, so the saturating packs are exact) */
        const __m256i w01 = _mm256_packs_epi32(u[0], u[1]), w23 = _mm256_packs_epi32(u[2], u[3]);
        const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + g * GROUP), b);
        e[g] = m / 127.0f;
        xs[g] = e[g] * (float)su;
    }
}

struct args {
    const int8_t *xq;
    const float *e, *xs;
    int64_t k, n;
    const uint8_t *packed;
    float *y;
};

/* 4-bit: block b's 16 output columns for rows r0 .. r0 + rows - 1, into ybuf [rows, 16]. Chunk c of a record:
 * byte 4 j + i holds q[column j, 8 c + i] in its low nibble and q[column j, 8 c + 4 + i] in its high one, so the
 * 32 bytes of columns 0-7 (then 8-15) are eight lanes of 4 codes against the row's quad 2 c (low) / 2 c + 1 (high). */
static void block_int4(const struct args *a, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const int64_t k = a->k, groups = k / GROUP;
    const uint8_t *rec0 = a->packed + b * groups * RECORD4;
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < rows * 16; i += 8)
        _mm256_storeu_ps(ybuf + i, _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD4;
        for (int h = 0; h < 2; h++) { /* columns 8 h .. 8 h + 7 */
            __m256i w[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * h));
                w[2 * c] = _mm256_and_si256(v, low);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const __m256 d = bf16_load8((const uint16_t *)(rec + 256) + 8 * h);
            const __m256 m = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), d, bf16_load8((const uint16_t *)(rec + 288) + 8 * h));
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = (r0 + r) * groups + g;
                const int32_t *xr = (const int32_t *)(a->xq + (r0 + r) * k + g * GROUP);
                __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
                for (int t = 1; t < 8; t++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(xr[t])));
                const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                float *yr = ybuf + r * 16 + 8 * h;
                __m256 y = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(a->e[i])), _mm256_loadu_ps(yr));
                y = _mm256_fmadd_ps(m, _mm256_set1_ps(a->xs[i]), y);
                _mm256_storeu_ps(yr, y);
            }
        }
    }
}

/* 8-bit: the same for a record of 8 quad-vectors (byte 4 j + i of vector p: q[column j, 4 p + i] + 128). */
static void block_q8(const struct args *a, int64_t b, int64_t r0, int64_t rows, float *ybuf) {
    const int64_t k = a->k, groups = k / GROUP;
    const uint8_t *rec0 = a->packed + b * groups * RECORD8;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < rows * 16; i += 8)
        _mm256_storeu_ps(ybuf + i, _mm256_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = rec0 + g * RECORD8;
        for (int h = 0; h < 2; h++) {
            __m256i w[8], aw[8];
            for (int p = 0; p < 8; p++) {
                w[p] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + 64 * p + 32 * h)), flip); /* q */
                aw[p] = _mm256_abs_epi8(w[p]); /* |q| as unsigned bytes (128 for -128) */
            }
            const __m256 d = _mm256_loadu_ps((const float *)(rec + 512) + 8 * h);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = (r0 + r) * groups + g;
                const int32_t *xr = (const int32_t *)(a->xq + (r0 + r) * k + g * GROUP);
                __m256i s32 = _mm256_setzero_si256();
                for (int p = 0; p < 8; p++) {
                    const __m256i u = _mm256_sign_epi8(_mm256_set1_epi32(xr[p]), w[p]); /* u with q's sign */
                    s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[p], u), ones));
                }
                float *yr = ybuf + r * 16 + 8 * h;
                const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a->e[i]));
                _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, _mm256_loadu_ps(yr)));
            }
        }
    }
}

/* x [rows, k] fp32 -> y [rows, n] fp32 (n a multiple of 16). bits 4 or 8: the packed weights' kind. */
static void grouped_mm(const float *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, float *y,
                       int threads, int bits) {
    const int64_t groups = k / GROUP, cells = rows * groups > 0 ? rows * groups : 1;
    int8_t *xq = (int8_t *)malloc((size_t)(rows * k > 0 ? rows * k : 1));
    float *e = (float *)malloc(sizeof(float) * (size_t)cells), *xs = (float *)malloc(sizeof(float) * (size_t)cells);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * k, k, xq + r * k, e + r * groups, xs + r * groups);
    const struct args a = {xq, e, xs, k, n, packed, y};
    const int64_t blocks = n / 16;
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        const int64_t nr = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp parallel num_threads(threads)
        {
            float ybuf[ROW_CHUNK * 16] __attribute__((aligned(32)));
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++) {
                if (bits == 4)
                    block_int4(&a, b, r0, nr, ybuf);
                else
                    block_q8(&a, b, r0, nr, ybuf);
                for (int64_t r = 0; r < nr; r++) {
                    _mm256_storeu_ps(y + (r0 + r) * n + b * 16, _mm256_loadu_ps(ybuf + r * 16));
                    _mm256_storeu_ps(y + (r0 + r) * n + b * 16 + 8, _mm256_loadu_ps(ybuf + r * 16 + 8));
                }
            }
        }
    }
    free(xq), free(e), free(xs);
}

void dspark_avx2_int4_mm(const float *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, float *y,
                         int threads) {
    grouped_mm(x, rows, k, packed, n, y, threads, 4);
}

void dspark_avx2_q8_mm(const float *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, float *y,
                       int threads) {
    grouped_mm(x, rows, k, packed, n, y, threads, 8);
}
