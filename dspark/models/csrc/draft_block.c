/* A DSpark drafting block for R requests in one call: the block's embeddings, the first layer's input norm,
 * every drafter layer (dspark_drafter_layer), the LM head with the confidence's hidden row, and the greedy picks
 * through the vanilla Markov head (dspark_markov_greedy): the kernels drafters/runner.py calls one by one on
 * this route, in the same order on the same values, so the same drafts.
 *
 * Why: at batch 1 the Python around those ~6 calls (tensor allocation, views, ~40 ctypes arguments a layer)
 * took ~0.8 ms of a ~2.3 ms round, while the other core waited.
 */
#include <stdlib.h>
#include <string.h>

#include "simd.h"

void dspark_add_rmsnorm(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const float *w, float eps,
                        uint16_t *out, int64_t rows, int64_t d, int threads);
void dspark_drafter_layer(const uint16_t *x, const uint16_t *xn, uint16_t *x_out, uint16_t *xn_out, int64_t r_len,
                          int64_t g, int64_t d, const float *ln_post, const float *ln_next, float eps,
                          const uint8_t *w_qkv, const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down,
                          const float *wq, const float *wk, float qk_eps, int64_t h, int64_t hkv, int64_t hd,
                          int64_t inter, const int64_t *pos, const float *cos_t, const float *sin_t, float q_scale,
                          float *pool, int64_t s_len, int64_t ld, const int64_t *slot, const uint8_t *mask,
                          uint16_t *scratch, float *q_buf, int8_t *xq, float *e, int32_t *sx, int w4, int threads);
void dspark_q8_vnni_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, void *y,
                       int out_bf16, int8_t *xq, float *e, int32_t *sx, int threads);
void dspark_int4_mm(const uint16_t *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, uint16_t *y,
                    int threads);
void dspark_markov_greedy(const int64_t *anchors, const uint16_t *base, int64_t bsr, int64_t bsk, int64_t r_len,
                          int64_t n, int64_t vd, const uint16_t *w1, int64_t rank, const uint16_t *w2,
                          const uint16_t *w_tok, const float *conf_in, const int64_t *d2t, int64_t *tokens,
                          float *conf_out, int threads);

/* The drafter's fixed weights and shapes (drafters/runner.py, DraftRunner._block_plan). layers: 7 pointers a
 * layer (post-attention norm gain, the next norm's gain (the last layer's: the final norm), packed qkv, o,
 * gate_up and down, then the q norm's gain and the k norm's gain as one more pair: 8 in all, the last two NULL
 * without q/k norms). */
struct draft_weights {
    const uint16_t *embed;       /* [vocab, d] bf16: the target's embedding */
    const float *ln_in;          /* the first layer's input norm gain */
    const void *const *layers;   /* 8 a layer, see above */
    const uint8_t *head;         /* the LM head with the confidence's hidden row, packed, head_rows outputs */
    const uint16_t *w1;          /* Markov W1 [vocab, rank] bf16 */
    const uint16_t *w2;          /* Markov W2, markov_pack's tiles */
    const uint16_t *w_tok;       /* the confidence's token half [rank] bf16, or NULL */
    const int64_t *d2t;          /* [vd] draft -> target ids, or NULL */
    int64_t n_layers, d, h, hkv, hd, inter, vd, head_rows, rank, mask_id;
    float eps, qk_eps, q_scale;
    int64_t w4;
};

/* Requests r = 0 .. r_len - 1, with lengths[r] positions of context, each drafting a block of g slots from its
 * anchor anchors[r] (a target id) at position anchor_pos[r]: the first n drafts of each (target ids) into tokens
 * [r_len, n] and their confidence logits into conf_out (the hidden half plus conf_bias plus the token half;
 * untouched without a confidence row). pool: the context as dspark_drafter_layer reads it, layer after layer
 * ([layers, 2, hkv, r_len, ld, hd] fp32, request r's keys in its first lengths[r] rows, zeros up to the longest
 * length L, and room for the block's g rows after L: ld >= L + g). cos_t / sin_t: RoPE tables covering the block. */
void dspark_draft_block(const struct draft_weights *w, const int64_t *anchors, const int64_t *anchor_pos,
                        const int64_t *lengths, int64_t r_len, int64_t g, int64_t n, const float *cos_t,
                        const float *sin_t, float *pool, int64_t ld, float conf_bias, int64_t *tokens, float *conf_out,
                        int threads) {
    const int64_t t = r_len * g, d = w->d, natt = w->h * w->hd;
    const int64_t widest_in = d > natt ? (d > w->inter ? d : w->inter) : (natt > w->inter ? natt : w->inter);
    int64_t longest = 0;
    for (int64_t r = 0; r < r_len; r++)
        longest = lengths[r] > longest ? lengths[r] : longest;
    const int64_t s_len = longest + g, layer_scratch = t * (3 * d + (2 * w->h + 2 * w->hkv) * w->hd + 3 * w->inter);
    uint16_t *buf =
        (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(4 * t * d + layer_scratch + r_len * n * w->head_rows));
    float *q_buf = (float *)malloc(sizeof(float) * (size_t)(t * w->h * w->hd));
    int8_t *xq = (int8_t *)malloc((size_t)(t * widest_in));
    float *e = (float *)malloc(sizeof(float) * (size_t)(t * widest_in / 32 + 1));
    int32_t *sx = (int32_t *)malloc(sizeof(int32_t) * (size_t)(t * widest_in / 32 + 1));
    float *conf_in = w->w_tok ? (float *)malloc(sizeof(float) * (size_t)(r_len * n)) : NULL;
    int64_t *pos = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * t)), *slot = pos + t;
    uint8_t *mask = (uint8_t *)malloc((size_t)(t * s_len));
    uint16_t *x = buf, *xn = x + t * d, *x2 = xn + t * d, *xn2 = x2 + t * d, *scratch = xn2 + t * d,
             *logits = scratch + layer_scratch;
    for (int64_t i = 0; i < t; i++) {  /* slot k of request r: [embed anchor, mask, ..., mask] at anchor_pos + k */
        const int64_t r = i / g, k = i % g;
        memcpy(x + i * d, w->embed + (k ? w->mask_id : anchors[r]) * d, sizeof(uint16_t) * (size_t)d);
        pos[i] = anchor_pos[r] + k;
        slot[i] = r * ld + longest + k;  /* the block's keys and values right after the longest context */
        for (int64_t s = 0; s < s_len; s++)  /* its own context, then the whole block (drafters/blocks.py draft_mask) */
            mask[i * s_len + s] = s < lengths[r] || s >= longest;
    }
    dspark_add_rmsnorm(x, NULL, NULL, w->ln_in, w->eps, xn, t, d, threads);
    for (int64_t l = 0; l < w->n_layers; l++) {
        const void *const *p = w->layers + 8 * l;
        dspark_drafter_layer(x, xn, x2, xn2, r_len, g, d, p[0], p[1], w->eps, p[2], p[3], p[4], p[5], p[6], p[7],
                             w->qk_eps, w->h, w->hkv, w->hd, w->inter, pos, cos_t, sin_t, w->q_scale,
                             pool + l * 2 * w->hkv * r_len * ld * w->hd, s_len, ld, slot, mask, scratch, q_buf, xq, e,
                             sx, (int)w->w4, threads);
        uint16_t *tx = x, *txn = xn;
        x = x2, xn = xn2, x2 = tx, xn2 = txn;
    }
    const uint16_t *rows = xn;  /* the final-normed hidden of the first n slots of each request */
    if (n < g) {
        for (int64_t r = 0; r < r_len; r++)
            memcpy(x2 + r * n * d, xn + r * g * d, sizeof(uint16_t) * (size_t)(n * d));
        rows = x2;
    }
    if (w->w4)
        dspark_int4_mm(rows, r_len * n, d, w->head, w->head_rows, logits, threads);
    else
        dspark_q8_vnni_mm(rows, r_len * n, d, w->head, w->head_rows, logits, 1, xq, e, sx, threads);
    if (conf_in)
        for (int64_t i = 0; i < r_len * n; i++) {
            uint32_t bits = (uint32_t)logits[i * w->head_rows + w->vd] << 16;  /* bf16 -> fp32, exact */
            float hidden_half;
            memcpy(&hidden_half, &bits, sizeof(float));
            conf_in[i] = hidden_half + conf_bias;
        }
    dspark_markov_greedy(anchors, logits, n * w->head_rows, w->head_rows, r_len, n, w->vd, w->w1, w->rank, w->w2,
                         w->w_tok, conf_in, w->d2t, tokens, conf_in ? conf_out : NULL, threads);
    free(buf), free(q_buf), free(xq), free(e), free(sx), free(conf_in), free(pos), free(mask);
}
