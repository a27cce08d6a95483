/* The small per-layer ops of a bf16 decoder step, one call each instead of a chain of PyTorch ops
 * (on AVX-512 CPUs). Each row is computed on its own in a fixed order, so a row's result never depends
 * on how many rows share the call.
 */
#include <cpuid.h>
#include <math.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <string.h>

#include "simd.h"

/* 1 where this CPU runs every kernel of the library (AVX-512 F / BW / BF16) */
int dspark_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}

int dspark_amx_on = 0;

/* Turn the AMX path of the 4-bit and 8-bit matmuls on (want = 1) where the CPU has AMX-BF16 and the OS
 * lets this process use tile data, or off; returns whether it is on. Call before any kernel runs. */
int dspark_amx_init(int want) {
    dspark_amx_on = 0;
#ifdef DSPARK_AMX
    unsigned a, b, c, d;
    if (want && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1) &&
        syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0)
        dspark_amx_on = 1;
#else
    (void)want;
#endif
    return dspark_amx_on;
}

int dspark_act8_on = 0;

/* Turn the 8-bit activations of the 4-bit matmuls on (want = 1) or off; returns whether they are on. Call
 * before any weights are packed (int4.pack_for_kernel lays them out for the choice). */
int dspark_act8_init(int want) {
    dspark_act8_on = want ? 1 : 0;
    return dspark_act8_on;
}

#define PARALLEL_ELEMENTS 65536 /* below this many elements a call runs on one thread */

/* out = x / sqrt(mean(x^2) + eps) * w per row of d (a multiple of 16), in fp32, rounded once to bf16.
 * With residual != NULL, x is first replaced by sum = bf16(x + residual) (the decoder's skip connection),
 * written to sum. */
void dspark_add_rmsnorm(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const float *w, float eps,
                        uint16_t *out, int64_t rows, int64_t d, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * d;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            __m512 v = bf16_load(xr + j);
            if (residual) {
                bf16_store(sum + r * d + j, _mm512_add_ps(v, bf16_load(residual + r * d + j)));
                v = bf16_load(sum + r * d + j);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        if (residual)
            xr = sum + r * d;
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps));
        for (int64_t j = 0; j < d; j += 16)
            bf16_store(out + r * d + j, _mm512_mul_ps(_mm512_mul_ps(bf16_load(xr + j), scale), _mm512_loadu_ps(w + j)));
    }
}

/* gu [rows, 2 * n] bf16 (gate, then up) -> out [rows, n] = silu(gate) * up, in fp32, rounded once. */
void dspark_silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j += 16) {
            const __m512 g = bf16_load(gu + r * 2 * n + j), u = bf16_load(gu + r * 2 * n + n + j);
            const __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                                exp_clamped(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            bf16_store(out + r * n + j, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
        }
}

/* The fused qkv rows [T, H + 2 Hkv, hd] bf16 after the projection: q and k rotated (rotate-half RoPE:
 * x * cos + swap_halves(x) * signed_sin, tables [positions, hd] fp32 indexed by pos[t]) and q scaled
 * by q_scale, all in fp32; q goes to q_out [T, H, hd], k and v to the layer's cache pool
 * [2 Hkv, pool_rows, hd] at row slot[t] of each head: fp32, or bf16 with pool_bf16 (keys rounded once,
 * values as they come). hd a multiple of 32. */
void dspark_rope_store(const uint16_t *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,
                       float q_scale, int64_t t_len, int64_t h, int64_t hkv, int64_t hd, float *q_out,
                       void *pool, int64_t pool_rows, const int64_t *slot, int pool_bf16, int threads) {
    const int64_t heads = h + 2 * hkv, half = hd / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (t_len * heads * hd >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < t_len; t++) {
        const float *c = cos_t + pos[t] * hd, *s = sin_t + pos[t] * hd;
        for (int64_t i = 0; i < heads; i++) {
            const uint16_t *x = qkv + (t * heads + i) * hd;
            const int64_t row = i < h ? (t * h + i) * hd : ((i - h) * pool_rows + slot[t]) * hd;
            const int to16 = i >= h && pool_bf16;  /* a key or value into a bf16 pool */
            float *dst = i < h ? q_out + row : (float *)pool + row;
            uint16_t *dst16 = (uint16_t *)pool + row;
            if (i >= h + hkv) { /* values: as they are (bf16), or widened to fp32 */
                if (to16)
                    memcpy(dst16, x, sizeof(uint16_t) * (size_t)hd);
                else
                    for (int64_t j = 0; j < hd; j += 16)
                        _mm512_storeu_ps(dst + j, bf16_load(x + j));
                continue;
            }
            const __m512 sc = _mm512_set1_ps(i < h ? q_scale : 1.0f);
            for (int64_t j = 0; j < hd; j += 16) {
                const int64_t other = j < half ? j + half : j - half;
                const __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(bf16_load(x + other), _mm512_loadu_ps(s + j),
                                                               _mm512_mul_ps(bf16_load(x + j), _mm512_loadu_ps(c + j))),
                                               sc);
                if (to16)  /* a key: rounded once, to nearest even */
                    bf16_store(dst16 + j, y);
                else
                    _mm512_storeu_ps(dst + j, y);
            }
        }
    }
}
