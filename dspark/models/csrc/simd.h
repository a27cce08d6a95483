/* AVX-512 helpers shared by dspark's kernels: bf16 <-> fp32 and a fixed-form exponential. */
#ifndef DSPARK_SIMD_H
#define DSPARK_SIMD_H
#include <immintrin.h>
#include <stdint.h>

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

static inline void run_blocks(int64_t rows, int64_t blocks, int threads, block_fn block, const void *args) {
    for (int64_t r0 = 0; r0 < rows; r0 += ROW_CHUNK) {
        const int64_t nr = rows - r0 < ROW_CHUNK ? rows - r0 : ROW_CHUNK;
#pragma omp parallel num_threads(threads)
        {
            float ybuf[ROW_CHUNK * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                block(args, b, r0, nr, ybuf);
        }
    }
}

#endif
