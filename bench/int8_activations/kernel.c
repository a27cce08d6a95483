/* A prototype, not the engine's kernel: y = x @ W^T for 4-bit weights in GGUF Q4_1's form (W = d q + m, q in
 * 0..15, groups of 32 inputs) with the activations rounded to 8 bits per row and group (dx = max|x| / 127, as
 * llama.cpp's Q8_1), so that a group's dot product is an exact integer from VPDPBUSD (4 products per 32-bit
 * lane, against VDPBF16PS's 2): y[r, n] += d dx isum + m sx, where sx = dx * sum of the row's codes.
 *
 * Layout per (block of 16 output columns, group): 256 bytes of codes in 4 chunks of 64; byte 4 n + j of chunk
 * c holds q[n, 8 c + j] in its low nibble and q[n, 8 c + 4 + j] in its high one (the (column, k-quad)
 * interleave VPDPBUSD reads); then the 16 columns' d and m as fp32. A row's sums are exact integers, so its
 * result is the same whatever the other rows: a window could take them from AMX-INT8 tiles instead with
 * the same bits. */
#include <immintrin.h>
#include <stdint.h>

#define RECORD (256 + 128)

/* x [rows, k] bf16 -> codes q [rows, k] int8, dx and sx [rows, k / 32] fp32 */
void quantize_rows(const uint16_t *x, int64_t rows, int64_t k, int8_t *q, float *dx, float *sx) {
    const int64_t groups = k / 32;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *p = x + r * k + g * 32;
            __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
            __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.0f / mx : 0.0f);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
            _mm_storeu_si128((__m128i *)(q + r * k + g * 32), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(q + r * k + g * 32 + 16), _mm512_cvtsepi32_epi8(qb));
            dx[r * groups + g] = mx / 127.0f;
            sx[r * groups + g] = mx / 127.0f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
}

/* acc += w . (4 activation bytes at x, broadcast), the broadcast folded into the instruction's memory operand */
#define DPBUSD_BCAST(acc, w, x) __asm__("vpdpbusd %[xv]%{1to16%}, %[wv], %[av]" : [av] "+v"(acc) : [wv] "v"(w), [xv] "m"(x))

/* q, dx, sx from quantize_rows; packed as above for n outputs; y [rows, n] fp32 */
void int4_q8act_mm(const int8_t *q, const float *dx, const float *sx, int64_t rows, int64_t k, const uint8_t *packed,
                   int64_t n, float *y, int threads) {
    const int64_t groups = k / 32, blocks = n / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
            const int64_t nr = rows - r0 < 16 ? rows - r0 : 16;
            __m512 acc[16];
            for (int64_t r = 0; r < nr; r++)
                acc[r] = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *rec = packed + (b * groups + g) * RECORD;
                const __m512i low = _mm512_set1_epi8(0x0F);
                __m512i w[8];
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512(rec + 64 * c);
                    w[2 * c] = _mm512_and_si512(v, low);
                    w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
                const __m512 d = _mm512_loadu_ps((const float *)(rec + 256)), m = _mm512_loadu_ps((const float *)(rec + 320));
                for (int64_t r = 0; r < nr; r++) {
                    const int32_t *xr = (const int32_t *)(q + (r0 + r) * k + g * 32);
                    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                    for (int t = 0; t < 8; t += 2) {
                        DPBUSD_BCAST(s0, w[t], xr[t]);
                        DPBUSD_BCAST(s1, w[t + 1], xr[t + 1]);
                    }
                    const int64_t i = (r0 + r) * groups + g;
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                             _mm512_mul_ps(d, _mm512_set1_ps(dx[i])), acc[r]);
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[r]);
                }
            }
            for (int64_t r = 0; r < nr; r++)
                _mm512_storeu_ps(y + (r0 + r) * n + b * 16, acc[r]);
        }
    }
}
