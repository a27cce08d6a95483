/* A decoder layer in one call on AVX2 CPUs: layer.c's counterpart for fp32 rows, built from the AVX2 library's
 * kernels called in the order the Python layer calls them (RMSNorm, qkv, RoPE + cache write, attention, o,
 * residual + RMSNorm, gate_up, SiLU gating, down, residual), so its result is bit-identical to that path's, which
 * still serves steps with a prefill chunk beside other sequences.
 *
 * Why: at batch 1 on a 2-core Zen 1 the Python between a layer's ~10 kernel calls (tensor allocation, views,
 * ctypes) cost about as much as the kernels did.
 */
#include "avx2.h"
#include <stdint.h>
#include <string.h>

/* x [t, d] fp32 -> x_out [t, d] fp32 (x is left as it is): layer.c's layer() with fp32 rows and an fp32 cache; the
 * four projections packed by int4.pack_for_kernel with quads (no biases). One sequence (krows NULL): its keys are
 * the s_len rows from kv_start, mask [t, s_len] bool. Or b_len sequences, in order, sequence b's q_lens[b] rows
 * from row q_off[b] (krows [b_len, s_len]: the pool row of each one's key s, read in place), mask [b_len, q_max,
 * s_len]. scratch: fp32 of t * (5 d + (h + 2 hkv + h) hd + 3 inter) elements; q_buf: fp32 of t * h * hd. */
static void layer(const float *x, float *x_out, int64_t t, int64_t d, const float *ln1, const float *ln2, float eps,
                  const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down, int64_t h,
                  int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t, const float *sin_t,
                  float q_scale, float *pool, int64_t pool_rows, const int64_t *slot, int64_t kv_start,
                  const int64_t *krows, const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max,
                  const uint8_t *mask, int64_t s_len, float *scratch, float *q_buf, int threads) {
    const int64_t nqkv = (h + 2 * hkv) * hd, natt = h * hd;
    float *xn = scratch, *qkv = xn + t * d, *att = qkv + t * nqkv, *ho = att + t * natt, *x2 = ho + t * d,
          *xn2 = x2 + t * d, *gu = xn2 + t * d, *act = gu + t * 2 * inter, *m = act + t * inter;
    dspark_avx2_add_rmsnorm(x, 0, 0, ln1, eps, xn, t, d, threads);
    dspark_avx2_int4_mm(xn, t, d, w_qkv, nqkv, qkv, threads);
    dspark_avx2_rope_store(qkv, pos, cos_t, sin_t, q_scale, t, h, hkv, hd, q_buf, pool, pool_rows, slot, threads);
    if (krows) {
        dspark_avx2_attention_paged(q_buf, 0, hd, natt, pool, pool + hkv * pool_rows * hd, pool_rows * hd, krows, q_off,
                                    q_lens, mask, att, 0, hd, natt, b_len, h, hkv, q_max, s_len, hd, threads);
    } else {
        const float *k = pool + kv_start * hd, *v = pool + (hkv * pool_rows + kv_start) * hd;
        dspark_avx2_attention(q_buf, t * natt, hd, natt, k, v, pool_rows * hd, 0, mask, att, t * natt, hd, natt, 1, h,
                              hkv, t, s_len, hd, threads);
    }
    dspark_avx2_int4_mm(att, t, natt, w_o, d, ho, threads);
    dspark_avx2_add_rmsnorm(x, ho, x2, ln2, eps, xn2, t, d, threads);
    dspark_avx2_int4_mm(xn2, t, d, w_gu, 2 * inter, gu, threads);
    dspark_avx2_silu_mul(gu, act, t, inter, threads);
    dspark_avx2_int4_mm(act, t, inter, w_down, d, m, threads);
    for (int64_t i = 0; i < t * d; i++) /* the residual add, as PyTorch's fp32 add */
        x_out[i] = x2[i] + m[i];
}

/* One sequence's layer (layer() above with krows NULL): DecoderLayer.forward_fused's call. */
void dspark_avx2_layer(const float *x, float *x_out, int64_t t, int64_t d, const float *ln1, const float *ln2,
                       float eps, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                       int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t,
                       const float *sin_t, float q_scale, float *pool, int64_t pool_rows, const int64_t *slot,
                       int64_t kv_start, const uint8_t *mask, int64_t s_len, float *scratch, float *q_buf,
                       int threads) {
    layer(x, x_out, t, d, ln1, ln2, eps, w_qkv, w_o, w_gu, w_down, h, hkv, hd, inter, pos, cos_t, sin_t, q_scale, pool,
          pool_rows, slot, kv_start, NULL, NULL, NULL, 1, t, mask, s_len, scratch, q_buf, threads);
}

/* Every layer of a step in one call (layer.c's dspark_layers on fp32 rows): layer() for layer 0, 1, ... in turn, so
 * the same bits as calling them one by one. w: 6 pointers a layer (ln1 and ln2 gains, then the qkv, o, gate_up and
 * down packed weights); layer i's cache pool at pool + i * layer_stride floats. x [t, d] -> x_out [t, d]; x_tmp
 * [t, d] holds every other layer's output. taps: for each layer, -1, or the column of hidden [t, hidden_ld] fp32
 * where that layer's output is copied (a drafter reads them). */
void dspark_avx2_layers(const float *x, float *x_out, float *x_tmp, int64_t n_layers, const void *const *w, int64_t t,
                        int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos,
                        const float *cos_t, const float *sin_t, float q_scale, float *pool, int64_t layer_stride,
                        int64_t pool_rows, const int64_t *slot, int64_t kv_start, const int64_t *krows,
                        const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max, const uint8_t *mask,
                        int64_t s_len, float *scratch, float *q_buf, const int64_t *taps, float *hidden,
                        int64_t hidden_ld, int threads) {
    const float *cur = x;
    for (int64_t i = 0; i < n_layers; i++) {
        float *next = (n_layers - 1 - i) % 2 ? x_tmp : x_out; /* the last layer writes x_out */
        const void *const *wi = w + 6 * i;
        layer(cur, next, t, d, wi[0], wi[1], eps, wi[2], wi[3], wi[4], wi[5], h, hkv, hd, inter, pos, cos_t, sin_t,
              q_scale, pool + i * layer_stride, pool_rows, slot, kv_start, krows, q_off, q_lens, b_len, q_max, mask,
              s_len, scratch, q_buf, threads);
        if (taps && taps[i] >= 0)
            for (int64_t r = 0; r < t; r++)
                memcpy(hidden + r * hidden_ld + taps[i], next + r * d, sizeof(float) * (size_t)d);
        cur = next;
    }
}
