/* One decoder layer of one sequence in one call: the kernels of a layer, called in the order the Python
 * layer calls them (RMSNorm, qkv, RoPE + cache write, attention, o, residual + RMSNorm, gate_up, SiLU
 * gating, down, residual), so its result is bit-identical to that path's (which still serves batches of
 * several sequences, whose steps must agree with this one's row for row).
 *
 * Why: at batch 1 a layer is ~10 kernel calls of a few microseconds each, and the Python between them
 * (tensor allocation, views, ctypes) cost as much as the kernels; 30 layers a step.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

void dspark_add_rmsnorm(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const float *w, float eps,
                        uint16_t *out, int64_t rows, int64_t d, int threads);
void dspark_silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n, int threads);
void dspark_rope_store(const uint16_t *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,
                       float q_scale, int64_t t_len, int64_t h, int64_t hkv, int64_t hd, float *q_out,
                       void *pool, int64_t pool_rows, const int64_t *slot, int pool_bf16, int threads);
void dspark_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const void *k, const void *v,
                      int64_t kvsh, int64_t kvsb, const uint8_t *mask, void *out, int out_bf16, int64_t osb,
                      int64_t osh, int64_t osq, int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len,
                      int64_t hd, int kv_bf16, int threads);
void dspark_attention_paged(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const void *k, const void *v,
                            int64_t kvsh, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                            const uint8_t *mask, void *out, int out_bf16, int64_t osb, int64_t osh, int64_t osq,
                            int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len, int64_t hd,
                            int kv_bf16, int threads);
void dspark_int4_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, uint16_t *y,
                    int threads);

/* x [t, d] bf16 -> x_out [t, d] bf16 (x is left as it is). Weights: the two norms' fp32 gains, the four
 * projections packed by int4.pack_for_kernel (no biases). RoPE: positions [t], fp32 cos / signed sin tables,
 * q's scale. Cache: the layer's pool [2 hkv, pool_rows, hd], fp32 or bf16 (kv_bf16); the t rows are written at
 * slot[t]. One sequence (krows NULL): its keys are the s_len rows from kv_start, mask [t, s_len] bool. Or b_len
 * sequences, in order, sequence b's q_lens[b] rows from row q_off[b] (krows [b_len, s_len]: the pool row of each
 * one's key s, read in place by dspark_attention_paged), mask [b_len, q_max, s_len]. scratch: bf16 of
 * t * (5 d + (h + 2 hkv + h) hd + 3 inter) elements; q_buf: fp32 of t * h * hd. */
static void layer(const uint16_t *x, uint16_t *x_out, int64_t t, int64_t d, const float *ln1, const float *ln2,
                  float eps, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                  int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t,
                  const float *sin_t, float q_scale, void *pool, int64_t pool_rows, const int64_t *slot,
                  int64_t kv_start, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                  int64_t b_len, int64_t q_max, const uint8_t *mask, int64_t s_len, uint16_t *scratch, float *q_buf,
                  int kv_bf16, int threads) {
    const int64_t nqkv = (h + 2 * hkv) * hd, natt = h * hd;
    uint16_t *xn = scratch, *qkv = xn + t * d, *att = qkv + t * nqkv, *ho = att + t * natt, *x2 = ho + t * d,
             *xn2 = x2 + t * d, *gu = xn2 + t * d, *act = gu + t * 2 * inter, *m = act + t * inter;
    dspark_add_rmsnorm(x, NULL, NULL, ln1, eps, xn, t, d, threads);
    dspark_int4_mm(xn, t, d, w_qkv, nqkv, qkv, threads);
    dspark_rope_store(qkv, pos, cos_t, sin_t, q_scale, t, h, hkv, hd, q_buf, pool, pool_rows, slot, kv_bf16, threads);
    const size_t el = kv_bf16 ? 2 : 4;
    if (krows) {
        dspark_attention_paged(q_buf, 0, hd, natt, pool, (const char *)pool + el * hkv * pool_rows * hd,
                               pool_rows * hd, krows, q_off, q_lens, mask, att, 1, 0, hd, natt, b_len, h, hkv, q_max,
                               s_len, hd, kv_bf16, threads);
    } else {
        const char *k = (const char *)pool + el * kv_start * hd;
        const char *v = (const char *)pool + el * (hkv * pool_rows + kv_start) * hd;
        dspark_attention(q_buf, t * natt, hd, natt, k, v, pool_rows * hd, 0, mask, att, 1, t * natt, hd, natt, 1, h,
                         hkv, t, s_len, hd, kv_bf16, threads);
    }
    dspark_int4_mm(att, t, natt, w_o, d, ho, threads);
    dspark_add_rmsnorm(x, ho, x2, ln2, eps, xn2, t, d, threads);
    dspark_int4_mm(xn2, t, d, w_gu, 2 * inter, gu, threads);
    dspark_silu_mul(gu, act, t, inter, threads);
    dspark_int4_mm(act, t, inter, w_down, d, m, threads);
    for (int64_t i = 0; i + 16 <= t * d; i += 16)  /* the residual add, rounded to bf16 as PyTorch's add is */
        bf16_store(x_out + i, _mm512_add_ps(bf16_load(x2 + i), bf16_load(m + i)));
}

/* One sequence's layer (layer() above with krows NULL): DecoderLayer.forward_fused's call. */
void dspark_layer(const uint16_t *x, uint16_t *x_out, int64_t t, int64_t d, const float *ln1, const float *ln2,
                  float eps, const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                  int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t,
                  const float *sin_t, float q_scale, void *pool, int64_t pool_rows, const int64_t *slot,
                  int64_t kv_start, const uint8_t *mask, int64_t s_len, uint16_t *scratch, float *q_buf,
                  int kv_bf16, int threads) {
    layer(x, x_out, t, d, ln1, ln2, eps, w_qkv, w_o, w_gu, w_down, h, hkv, hd, inter, pos, cos_t, sin_t, q_scale, pool,
          pool_rows, slot, kv_start, NULL, NULL, NULL, 1, t, mask, s_len, scratch, q_buf, kv_bf16, threads);
}

/* Every layer of one sequence's step in one call: dspark_layer for layer 0, 1, ... in turn (so the same bits as
 * calling it layer by layer). w: 6 pointers a layer (ln1 and ln2 gains, then the qkv, o, gate_up and down packed
 * weights); layer i's cache pool at pool + i * layer_stride floats. x [t, d] -> x_out [t, d]; x_tmp [t, d] holds
 * every other layer's output. taps: for each layer, -1, or the column of hidden [t, hidden_ld] bf16 where that
 * layer's output is copied (a drafter reads them). Other arguments as dspark_layer's.
 * Why: at batch 1 the Python that built ~30 arguments for each of 30 layer calls, and the calls, took ~0.5 ms
 * of a ~5 ms step while both cores waited. */
void dspark_layers(const uint16_t *x, uint16_t *x_out, uint16_t *x_tmp, int64_t n_layers, const void *const *w,
                   int64_t t, int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter,
                   const int64_t *pos, const float *cos_t, const float *sin_t, float q_scale, void *pool,
                   int64_t layer_stride, int64_t pool_rows, const int64_t *slot, int64_t kv_start,
                   const int64_t *krows, const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max,
                   const uint8_t *mask, int64_t s_len, uint16_t *scratch, float *q_buf, const int64_t *taps,
                   uint16_t *hidden, int64_t hidden_ld, int kv_bf16, int threads) {
    const uint16_t *cur = x;
    for (int64_t i = 0; i < n_layers; i++) {
        uint16_t *next = (n_layers - 1 - i) % 2 ? x_tmp : x_out;  /* the last layer writes x_out */
        const void *const *wi = w + 6 * i;
        layer(cur, next, t, d, wi[0], wi[1], eps, wi[2], wi[3], wi[4], wi[5], h, hkv, hd, inter, pos, cos_t, sin_t,
              q_scale, (char *)pool + (kv_bf16 ? 2 : 4) * i * layer_stride, pool_rows, slot, kv_start, krows, q_off,
              q_lens, b_len, q_max, mask, s_len, scratch, q_buf, kv_bf16, threads);
        if (taps && taps[i] >= 0)
            for (int64_t r = 0; r < t; r++)
                memcpy(hidden + r * hidden_ld + taps[i], next + r * d, sizeof(uint16_t) * (size_t)d);
        cur = next;
    }
}

void dspark_q8_vnni_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                       int out_bf16, int8_t *xq, float *e, int32_t *sx, int threads);

/* A drafter projection x [rows, k] bf16 -> y [rows, n] bf16: 4-bit weights (int4.pack_for_kernel) where w4,
 * else 8-bit VNNI ones (q8.pack_for_vnni; xq, e and sx its scratch). */
static void drafter_proj(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, uint16_t *y, int w4,
                         int8_t *xq, float *e, int32_t *sx, int threads) {
    if (w4)
        dspark_int4_mm(x, rows, k, w, n, y, threads);
    else
        dspark_q8_vnni_mm(x, rows, k, w, n, y, 1, xq, e, sx, threads);
}

/* Per-head RMSNorm of the q heads (gains wq) and k heads (wk) of fused qkv rows [t, h + 2 hkv, hd] bf16, in
 * place (fp32 inside, rounded once to bf16); hd a multiple of 16. */
static void qk_norm_rows(uint16_t *qkv, int64_t t, int64_t h, int64_t hkv, int64_t hd, const float *wq,
                         const float *wk, float eps) {
    for (int64_t r = 0; r < t; r++)
        for (int64_t i = 0; i < h + hkv; i++) {
            uint16_t *x = qkv + (r * (h + 2 * hkv) + i) * hd;
            const float *w = i < h ? wq : wk;
            __m512 ss = _mm512_setzero_ps();
            for (int64_t j = 0; j < hd; j += 16) {
                const __m512 v = bf16_load(x + j);
                ss = _mm512_fmadd_ps(v, v, ss);
            }
            const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hd + eps));
            for (int64_t j = 0; j < hd; j += 16)
                bf16_store(x + j, _mm512_mul_ps(_mm512_mul_ps(bf16_load(x + j), scale), _mm512_loadu_ps(w + j)));
        }
}

/* One layer of the drafter's block pass (drafters/runner.py) for R requests of g slots (t = R g rows):
 * x [t, d] bf16 and xn, its input norm, -> x_out = the layer's output and xn_out = its norm by the next
 * norm's gains (the next layer's input norm, or the final norm). Projections are 8-bit VNNI weights
 * (q8.pack_for_vnni, no biases), or 4-bit ones (int4.pack_for_kernel) where w4; RoPE writes the block's keys and
 * values into the pool [2 hkv, R ld, hd] fp32 at slot[t] and attention reads request b's keys at rows b ld ..
 * b ld + s_len - 1 of each head (ld >= s_len: a request's rows in the pool), under mask [R, g, s_len]. wq, wk:
 * the q / k norms' gains (qk_eps), or NULL without them. scratch: bf16 of t * (3 d + (h + 2 hkv + h) hd + 3 inter)
 * elements, plus xq (int8, t * max_k), e and sx (fp32, int32: t * max_k / 32) for the VNNI rows, max_k the widest
 * input. */
void dspark_drafter_layer(const uint16_t *x, const uint16_t *xn, uint16_t *x_out, uint16_t *xn_out, int64_t r_len,
                          int64_t g, int64_t d, const float *ln_post, const float *ln_next, float eps,
                          const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                          const float *wq, const float *wk, float qk_eps,
                          int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t,
                          const float *sin_t, float q_scale, float *pool, int64_t s_len, int64_t ld,
                          const int64_t *slot, const uint8_t *mask, uint16_t *scratch, float *q_buf, int8_t *xq,
                          float *e, int32_t *sx, int w4, int threads) {
    const int64_t t = r_len * g, nqkv = (h + 2 * hkv) * hd, natt = h * hd, pool_rows = r_len * ld;
    uint16_t *qkv = scratch, *att = qkv + t * nqkv, *ho = att + t * natt, *xn2 = ho + t * d, *gu = xn2 + t * d,
             *act = gu + t * 2 * inter, *m = act + t * inter;
    uint16_t *x2 = x_out;  /* x + attention, then x_out = x2 + mlp in place */
    drafter_proj(xn, t, d, w_qkv, nqkv, qkv, w4, xq, e, sx, threads);
    if (wq)
        qk_norm_rows(qkv, t, h, hkv, hd, wq, wk, qk_eps);
    dspark_rope_store(qkv, pos, cos_t, sin_t, q_scale, t, h, hkv, hd, q_buf, pool, pool_rows, slot, 0, threads);
    dspark_attention(q_buf, g * natt, hd, natt, pool, pool + hkv * pool_rows * hd, pool_rows * hd, ld * hd, mask, att,
                     1, g * natt, hd, natt, r_len, h, hkv, g, s_len, hd, 0, threads);
    drafter_proj(att, t, natt, w_o, d, ho, w4, xq, e, sx, threads);
    dspark_add_rmsnorm(ho, x, x2, ln_post, eps, xn2, t, d, threads);
    drafter_proj(xn2, t, d, w_gu, 2 * inter, gu, w4, xq, e, sx, threads);
    dspark_silu_mul(gu, act, t, inter, threads);
    drafter_proj(act, t, inter, w_down, d, m, w4, xq, e, sx, threads);
    dspark_add_rmsnorm(m, x2, x_out, ln_next, eps, xn_out, t, d, threads);
}

/* The drafter's context projection for n fed positions (drafters/runner.py, context_kv): target features
 * feats [n, k_in] bf16 -> fc -> RMSNorm (gains ln_hidden) -> every layer's K and V (8-bit VNNI weights, or
 * 4-bit where w4; packed [layers, 2, hkv, hd] per row) -> per layer the keys' RMSNorm (wk [layers, hd], or NULL) and
 * RoPE at pos[n] (fp32 tables), rounded once to bf16, into kv_out [n, layers, 2, hkv, hd]. scratch: bf16
 * of n * d; xq (int8, n * k_in), e and sx (fp32, int32: n * k_in / 32). */
void dspark_drafter_context(const uint16_t *feats, int64_t n, int64_t k_in, int64_t d, const uint8_t *w_fc,
                            const float *ln_hidden, float eps, const uint8_t *w_kv, int64_t layers, int64_t hkv,
                            int64_t hd, const float *wk, float k_eps, const int64_t *pos, const float *cos_t,
                            const float *sin_t, uint16_t *kv_out, uint16_t *scratch, int8_t *xq, float *e, int32_t *sx,
                            int w4, int threads) {
    const int64_t width = layers * 2 * hkv * hd, half = hd / 2;
    uint16_t *c = scratch;
    drafter_proj(feats, n, k_in, w_fc, d, c, w4, xq, e, sx, threads);
    dspark_add_rmsnorm(c, NULL, NULL, ln_hidden, eps, c, n, d, threads);  /* in place: a row is read first */
    drafter_proj(c, n, d, w_kv, width, kv_out, w4, xq, e, sx, threads);
    for (int64_t r = 0; r < n; r++) {
        const float *co = cos_t + pos[r] * hd, *si = sin_t + pos[r] * hd;
        for (int64_t l = 0; l < layers; l++)
            for (int64_t j = 0; j < hkv; j++) {
                uint16_t *x = kv_out + ((r * layers + l) * 2 * hkv + j) * hd;  /* a key head */
                float buf[256];
                for (int64_t i = 0; i < hd; i += 16)
                    _mm512_storeu_ps(buf + i, bf16_load(x + i));
                if (wk) {
                    __m512 ss = _mm512_setzero_ps();
                    for (int64_t i = 0; i < hd; i += 16)
                        ss = _mm512_fmadd_ps(_mm512_loadu_ps(buf + i), _mm512_loadu_ps(buf + i), ss);
                    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hd + k_eps));
                    for (int64_t i = 0; i < hd; i += 16)
                        _mm512_storeu_ps(buf + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(buf + i), scale),
                                                                _mm512_loadu_ps(wk + l * hd + i)));
                }
                for (int64_t i = 0; i < hd; i += 16) {  /* rotate-half RoPE; the sign lives in the sin table */
                    const int64_t other = i < half ? i + half : i - half;
                    bf16_store(x + i, _mm512_fmadd_ps(_mm512_loadu_ps(buf + other), _mm512_loadu_ps(si + i),
                                                      _mm512_mul_ps(_mm512_loadu_ps(buf + i), _mm512_loadu_ps(co + i))));
                }
            }
    }
}
