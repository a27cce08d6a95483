/* One decoder layer of one sequence in one call: the kernels of a layer, called in the order the Python
 * layer calls them (RMSNorm, qkv, RoPE + cache write, attention, o, residual + RMSNorm, gate_up, SiLU
 * gating, down, residual), so its result is bit-identical to that path's (which still serves batches of
 * several sequences, whose steps must agree with this one's row for row).
 *
 * Why: at batch 1 a layer is ~10 kernel calls of a few microseconds each, and the Python between them
 * (tensor allocation, views, ctypes) cost as much as the kernels; 30 layers a step.
 */
#include <stdlib.h>

#include "simd.h"

void dspark_add_rmsnorm(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const float *w, float eps,
                        uint16_t *out, int64_t rows, int64_t d, int threads);
void dspark_silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n, int threads);
void dspark_rope_store(const uint16_t *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,
                       float q_scale, int64_t t_len, int64_t h, int64_t hkv, int64_t hd, float *q_out,
                       float *pool, int64_t pool_rows, const int64_t *slot, int threads);
void dspark_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                      int64_t kvsh, int64_t kvsb, const uint8_t *mask, void *out, int out_bf16, int64_t osb,
                      int64_t osh, int64_t osq, int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len,
                      int64_t hd, int threads);
void dspark_int4_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, uint16_t *y,
                    int threads);

/* x [t, d] bf16 -> x_out [t, d] bf16 (x is left as it is). Weights: the two norms' fp32 gains, the four
 * projections packed by int4.pack_for_kernel (no biases). RoPE: positions [t], fp32 cos / signed sin tables,
 * q's scale. Cache: the layer's pool [2 hkv, pool_rows, hd] fp32; the t rows are written at slot[t]; the
 * sequence's keys are the s_len rows from kv_start, mask [t, s_len] bool. scratch: bf16 of
 * t * (5 d + (h + 2 hkv + h) hd + 3 inter) elements; q_buf: fp32 of t * h * hd. */
void dspark_layer(const uint16_t *x, uint16_t *x_out, int64_t t, int64_t d, const float *ln1, const float *ln2,
                  float eps, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                  int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t,
                  const float *sin_t, float q_scale, float *pool, int64_t pool_rows, const int64_t *slot,
                  int64_t kv_start, const uint8_t *mask, int64_t s_len, uint16_t *scratch, float *q_buf,
                  int threads) {
    const int64_t nqkv = (h + 2 * hkv) * hd, natt = h * hd;
    uint16_t *xn = scratch, *qkv = xn + t * d, *att = qkv + t * nqkv, *ho = att + t * natt, *x2 = ho + t * d,
             *xn2 = x2 + t * d, *gu = xn2 + t * d, *act = gu + t * 2 * inter, *m = act + t * inter;
    dspark_add_rmsnorm(x, NULL, NULL, ln1, eps, xn, t, d, threads);
    dspark_int4_mm(xn, t, d, w_qkv, nqkv, qkv, threads);
    dspark_rope_store(qkv, pos, cos_t, sin_t, q_scale, t, h, hkv, hd, q_buf, pool, pool_rows, slot, threads);
    const float *k = pool + kv_start * hd, *v = pool + (hkv * pool_rows + kv_start) * hd;
    dspark_attention(q_buf, t * natt, hd, natt, k, v, pool_rows * hd, 0, mask, att, 1, t * natt, hd, natt, 1, h, hkv,
                     t, s_len, hd, threads);
    dspark_int4_mm(att, t, natt, w_o, d, ho, threads);
    dspark_add_rmsnorm(x, ho, x2, ln2, eps, xn2, t, d, threads);
    dspark_int4_mm(xn2, t, d, w_gu, 2 * inter, gu, threads);
    dspark_silu_mul(gu, act, t, inter, threads);
    dspark_int4_mm(act, t, inter, w_down, d, m, threads);
    for (int64_t i = 0; i + 16 <= t * d; i += 16)  /* the residual add, rounded to bf16 as PyTorch's add is */
        bf16_store(x_out + i, _mm512_add_ps(bf16_load(x2 + i), bf16_load(m + i)));
}
