/* A target step in one call on AVX2 CPUs (step.c's counterpart for fp32 rows): the tokens' embeddings, every decoder
 * layer (dspark_avx2_layers), and for the rows that want logits the final norm and the 8-bit LM head, the kernels
 * models/decoder.py would call one by one, in the same order on the same values, so the same bits. Of one
 * sequence reading consecutive cache rows, or of several sequences' windows (no prefill chunk), attention reading
 * the cache in place.
 *
 * Why: on a 2-core Zen 1 the Python around 30 layer calls cost ~1 ms of a ~13 ms batch-1 step, and a step of
 * several sequences ran layer by layer, ~10 PyTorch ops and a dozen kernel calls per layer.
 */
#include "avx2.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ids [t] (each in [0, vocab)) embedded from embed [vocab, d] fp32, then dspark_avx2_layers (its arguments: the
 * layers' weights w, RoPE, the fp32 cache: one sequence's keys from kv_start, or b_len sequences' windows (q_off,
 * q_lens, a mask of q_max rows each) and keys through krows; taps into hidden). x_out [t, d] fp32, if not NULL,
 * gets the last layer's output. For the n_logits rows logit_rows[], the final norm (ln_f, eps_f) and, where head is
 * not NULL, the 8-bit LM head (q8.pack_for_vnni, head_rows outputs) into logits [n_logits, head_rows] fp32.
 * Returns 0; -1 if an id is out of range, -2 if a logit row is (then nothing is computed). */
int dspark_avx2_step(const int64_t *ids, const float *embed, int64_t vocab, int64_t t, int64_t n_layers,
                     const void *const *w, int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter,
                     const int64_t *pos, const float *cos_t, const float *sin_t, float q_scale, float *pool,
                     int64_t layer_stride, int64_t pool_rows, const int64_t *slot, int64_t kv_start,
                     const int64_t *krows, const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max,
                     const uint8_t *mask, int64_t s_len, const int64_t *taps, float *hidden, int64_t hidden_ld,
                     float *x_out, const float *ln_f, float eps_f, const uint8_t *head, int64_t head_rows,
                     const int64_t *logit_rows, int64_t n_logits, float *logits, int threads) {
    for (int64_t i = 0; i < t; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return -1;
    for (int64_t i = 0; i < n_logits; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= t)
            return -2;
    const int64_t scratch_n = t * (5 * d + (2 * h + 2 * hkv) * hd + 3 * inter);
    float *buf = (float *)malloc(sizeof(float) * (size_t)(3 * t * d + scratch_n + 2 * n_logits * d + t * h * hd));
    float *x = buf, *tmp = x + t * d, *out = x_out ? x_out : tmp + t * d, *scratch = tmp + 2 * t * d,
          *rows = scratch + scratch_n, *normed = rows + n_logits * d, *q_buf = normed + n_logits * d;
    for (int64_t i = 0; i < t; i++)
        memcpy(x + i * d, embed + ids[i] * d, sizeof(float) * (size_t)d);
    dspark_avx2_layers(x, out, tmp, n_layers, w, t, d, eps, h, hkv, hd, inter, pos, cos_t, sin_t, q_scale, pool,
                       layer_stride, pool_rows, slot, kv_start, krows, q_off, q_lens, b_len, q_max, mask, s_len,
                       scratch, q_buf, taps, hidden, hidden_ld, threads);
    if (n_logits > 0 && head) {
        for (int64_t i = 0; i < n_logits; i++)
            memcpy(rows + i * d, out + logit_rows[i] * d, sizeof(float) * (size_t)d);
        dspark_avx2_add_rmsnorm(rows, NULL, NULL, ln_f, eps_f, normed, n_logits, d, threads);
        dspark_avx2_q8_mm(normed, n_logits, d, head, head_rows, logits, threads);
    }
    free(buf);
    return 0;
}
