/* A target step in one call, of one sequence or of several windows (no prefill chunk): the tokens' embeddings, every decoder layer (dspark_layers), and for
 * the rows that want logits the final norm and the 8-bit LM head: the kernels models/decoder.py would call one by
 * one, in the same order on the same values, so the same bits.
 *
 * Why: after the layers became one call, the Python around them (the embedding, RoPE tables, scratch tensors,
 * the norm and the head's call) still took ~0.5 ms of a ~5 ms batch-1 step, while the other core waited.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"

void dspark_layers(const uint16_t *x, uint16_t *x_out, uint16_t *x_tmp, int64_t n_layers, const void *const *w,
                   int64_t t, int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter,
                   const int64_t *pos, const float *cos_t, const float *sin_t, float q_scale, void *pool,
                   int64_t layer_stride, int64_t pool_rows, const int64_t *slot, int64_t kv_start,
                   const int64_t *krows, const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max,
                   const uint8_t *mask, int64_t s_len, uint16_t *scratch, float *q_buf, const int64_t *taps,
                   uint16_t *hidden, int64_t hidden_ld, int kv_bf16, int threads);
void dspark_add_rmsnorm(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const float *w, float eps,
                        uint16_t *out, int64_t rows, int64_t d, int threads);
void dspark_q8_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                  int out_bf16, int threads);
void dspark_q8_vnni_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                       int out_bf16, int8_t *xq, float *e, int32_t *sx, int threads);

/* ids [t] (each in [0, vocab)) embedded from embed [vocab, d] bf16, then dspark_layers (its arguments: the
 * layers' weights w, RoPE, the cache: one sequence's keys from kv_start, or b_len sequences' windows (q_off, q_lens,
 * a mask of q_max rows each) and keys through krows; taps into hidden). x_out [t, d] bf16, if not NULL, gets the last layer's
 * output. For the n_logits rows logit_rows[], the final norm (ln_f, eps_f) and the LM head (packed q8 weights of
 * head_rows outputs: on VNNI with head_vnni, else q8_mm.c) into logits [n_logits, head_rows] fp32.
 * Returns 0; -1 if an id is out of range, -2 if a logit row is (then nothing is computed). */
int dspark_step(const int64_t *ids, const uint16_t *embed, int64_t vocab, int64_t t, int64_t n_layers,
                const void *const *w, int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter,
                const int64_t *pos, const float *cos_t, const float *sin_t, float q_scale, void *pool,
                int64_t layer_stride, int64_t pool_rows, const int64_t *slot, int64_t kv_start, const int64_t *krows,
                const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max, const uint8_t *mask,
                int64_t s_len, const int64_t *taps, uint16_t *hidden, int64_t hidden_ld, int kv_bf16, uint16_t *x_out,
                const float *ln_f, float eps_f, const uint8_t *head, int64_t head_rows, int head_vnni,
                const int64_t *logit_rows, int64_t n_logits, float *logits, int threads) {
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return -1;
    for (int64_t i = 0; i < n_logits; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= t)
            return -2;
    const int64_t scratch_n = t * (5 * d + (2 * h + 2 * hkv) * hd + 3 * inter);
    uint16_t *buf = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(3 * t * d + scratch_n + 2 * n_logits * d));
    float *q_buf = (float *)malloc(sizeof(float) * (size_t)(t * h * hd));
    uint16_t *x = buf, *tmp = x + t * d, *out = x_out ? x_out : tmp + t * d, *scratch = tmp + 2 * t * d,
             *rows = scratch + scratch_n, *normed = rows + n_logits * d;
    for (int64_t i = 0; i < t; i++)
        memcpy(x + i * d, embed + ids[i] * d, sizeof(uint16_t) * (size_t)d);
    dspark_layers(x, out, tmp, n_layers, w, t, d, eps, h, hkv, hd, inter, pos, cos_t, sin_t, q_scale, pool,
                  layer_stride, pool_rows, slot, kv_start, krows, q_off, q_lens, b_len, q_max, mask, s_len, scratch,
                  q_buf, taps, hidden, hidden_ld, kv_bf16, threads);
    if (n_logits > 0) {
        for (int64_t i = 0; i < n_logits; i++)
            memcpy(rows + i * d, out + logit_rows[i] * d, sizeof(uint16_t) * (size_t)d);
        dspark_add_rmsnorm(rows, NULL, NULL, ln_f, eps_f, normed, n_logits, d, threads);
        if (head_vnni) {
            int8_t *xq = (int8_t *)malloc((size_t)(n_logits * d));
            float *e = (float *)malloc(sizeof(float) * (size_t)(n_logits * d / 32 + 1));
            int32_t *sx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n_logits * d / 32 + 1));
            dspark_q8_vnni_mm(normed, n_logits, d, head, head_rows, logits, 0, xq, e, sx, threads);
            free(xq), free(e), free(sx);
        } else {
            dspark_q8_mm(normed, n_logits, d, head, head_rows, logits, 0, threads);
        }
    }
    free(buf), free(q_buf);
    return 0;
}
