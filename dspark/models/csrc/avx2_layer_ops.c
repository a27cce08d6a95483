/* The small per-layer ops of an fp32 decoder step on AVX2 + FMA CPUs, one call each instead of a chain of
 * PyTorch ops: layer_ops.c's RMSNorm (+ residual), SiLU gating and RoPE + KV cache write, on fp32 rows. At
 * batch 1 on a 2-core Zen 1 those chains (with the Python between them) took about half of an fp32 step
 * whose matmuls ran on avx2_mm.c. Each row is computed on its own in a fixed order, so a row's result never
 * depends on how many rows share the call.
 */
#include "avx2.h"
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMENTS 65536 /* below this many elements a call runs on one thread */

/* out = x / sqrt(mean(x^2) + eps) * w per row of d (a multiple of 8). With residual != NULL, x is first
 * replaced by sum = x + residual (the decoder's skip connection), written to sum. */
void dspark_avx2_add_rmsnorm(const float *x, const float *residual, float *sum, const float *w, float eps, float *out,
                             int64_t rows, int64_t d, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            if (residual) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(residual + r * d + j));
                _mm256_storeu_ps(sum + r * d + j, v);
            }
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        if (residual)
            xr = sum + r * d;
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum8(ss) / (float)d + eps));
        for (int64_t j = 0; j < d; j += 8)
            _mm256_storeu_ps(out + r * d + j,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), scale), _mm256_loadu_ps(w + j)));
    }
}

/* gu [rows, 2 * n] (gate, then up; n a multiple of 8) -> out [rows, n] = silu(gate) * up (expf per element:
 * the SiLU of PyTorch's fp32 path to an ulp or two, and no polynomial to maintain for a few thousand values). */
void dspark_avx2_silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        for (int64_t j = 0; j < n; j++)
            out[r * n + j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* The fused qkv rows [T, H + 2 Hkv, hd] fp32 after the projection: q and k rotated (rotate-half RoPE:
 * x * cos + swap_halves(x) * signed_sin, tables [positions, hd] fp32 indexed by pos[t]) and q scaled by
 * q_scale; q goes to q_out [T, H, hd], k and v to the layer's cache pool [2 Hkv, pool_rows, hd] fp32 at row
 * slot[t] of each head. hd a multiple of 16. */
void dspark_avx2_rope_store(const float *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,
                            float q_scale, int64_t t_len, int64_t h, int64_t hkv, int64_t hd, float *q_out,
                            float *pool, int64_t pool_rows, const int64_t *slot, int threads) {
    const int64_t heads = h + 2 * hkv, half = hd / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (t_len * heads * hd >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < t_len; t++) {
        const float *c = cos_t + pos[t] * hd, *s = sin_t + pos[t] * hd;
        for (int64_t i = 0; i < heads; i++) {
            const float *x = qkv + (t * heads + i) * hd;
            float *dst = i < h ? q_out + (t * h + i) * hd : pool + ((i - h) * pool_rows + slot[t]) * hd;
            if (i >= h + hkv) { /* values: copied as they are */
                for (int64_t j = 0; j < hd; j += 8)
                    _mm256_storeu_ps(dst + j, _mm256_loadu_ps(x + j));
                continue;
            }
            const __m256 sc = _mm256_set1_ps(i < h ? q_scale : 1.0f);
            for (int64_t j = 0; j < hd; j += 8) {
                const int64_t other = j < half ? j + half : j - half;
                const __m256 y = _mm256_fmadd_ps(_mm256_loadu_ps(x + other), _mm256_loadu_ps(s + j),
                                                 _mm256_mul_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(c + j)));
                _mm256_storeu_ps(dst + j, _mm256_mul_ps(y, sc));
            }
        }
    }
}
