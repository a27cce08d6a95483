/* The drafter's fused calls on AVX2 CPUs, on fp32 rows with 8-bit projections (q8.pack_for_vnni, no biases):
 * layer.c's dspark_drafter_layer and dspark_drafter_context, built from the AVX2 library's kernels.
 *
 * Why: an fp32 drafter ran its block pass op by op, and on a 2-core Zen 1 the Python and PyTorch ops around its
 * matmuls took ~7.6 ms of an ~11.3 ms drafting round, as long as a target step.
 */
#include "avx2.h"
#include <stdint.h>

/* Per-head RMSNorm of the q heads (gains wq) and k heads (wk) of fused qkv rows [t, h + 2 hkv, hd] fp32, in place:
 * the RMSNorm kernel over each row's heads, as the drafter's q_norm / k_norm modules run it op by op. */
static void qk_norm_rows(float *qkv, int64_t t, int64_t h, int64_t hkv, int64_t hd, const float *wq, const float *wk,
                         float eps) {
    for (int64_t r = 0; r < t; r++) {
        float *row = qkv + r * (h + 2 * hkv) * hd;
        dspark_avx2_add_rmsnorm(row, 0, 0, wq, eps, row, h, hd, 1);
        dspark_avx2_add_rmsnorm(row + h * hd, 0, 0, wk, eps, row + h * hd, hkv, hd, 1);
    }
}

/* One layer of the drafter's block pass for R requests of g slots (t = R g rows): x [t, d] fp32 and xn, its input
 * norm, -> x_out = the layer's output and xn_out = its norm by the next norm's gains (the next layer's input
 * norm, or the final norm). RoPE writes the block's keys and values into the pool [2 hkv, R ld, hd] fp32 at
 * slot[t]; attention reads request b's keys at rows b ld .. b ld + s_len - 1 of each head, under mask
 * [R, g, s_len]. wq, wk: the q / k norms' gains (qk_eps), or NULL without them. scratch: fp32 of
 * t * (3 d + (h + 2 hkv + h) hd + 3 inter); q_buf: fp32 of t * h * hd. */
void dspark_avx2_drafter_layer(const float *x, const float *xn, float *x_out, float *xn_out, int64_t r_len, int64_t g,
                               int64_t d, const float *ln_post, const float *ln_next, float eps, const uint8_t *w_qkv,
                               const uint8_t *w_o, const uint8_t *w_gu, const uint8_t *w_down, const float *wq,
                               const float *wk, float qk_eps, int64_t h, int64_t hkv,
                               int64_t hd, int64_t inter, const int64_t *pos, const float *cos_t, const float *sin_t,
                               float q_scale, float *pool, int64_t s_len, int64_t ld, const int64_t *slot,
                               const uint8_t *mask, float *scratch, float *q_buf, int threads) {
    const int64_t t = r_len * g, nqkv = (h + 2 * hkv) * hd, natt = h * hd, pool_rows = r_len * ld;
    float *qkv = scratch, *att = qkv + t * nqkv, *ho = att + t * natt, *xn2 = ho + t * d, *gu = xn2 + t * d,
          *act = gu + t * 2 * inter, *m = act + t * inter;
    float *x2 = x_out; /* x + attention, then x_out = x2 + mlp in place (a row is read before it is written) */
    dspark_avx2_q8_mm(xn, t, d, w_qkv, nqkv, qkv, threads);
    if (wq)
        qk_norm_rows(qkv, t, h, hkv, hd, wq, wk, qk_eps);
    dspark_avx2_rope_store(qkv, pos, cos_t, sin_t, q_scale, t, h, hkv, hd, q_buf, pool, pool_rows, slot, threads);
    dspark_avx2_attention(q_buf, g * natt, hd, natt, pool, pool + hkv * pool_rows * hd, pool_rows * hd, ld * hd, mask,
                          att, g * natt, hd, natt, r_len, h, hkv, g, s_len, hd, threads);
    dspark_avx2_q8_mm(att, t, natt, w_o, d, ho, threads);
    dspark_avx2_add_rmsnorm(ho, x, x2, ln_post, eps, xn2, t, d, threads);
    dspark_avx2_q8_mm(xn2, t, d, w_gu, 2 * inter, gu, threads);
    dspark_avx2_silu_mul(gu, act, t, inter, threads);
    dspark_avx2_q8_mm(act, t, inter, w_down, d, m, threads);
    dspark_avx2_add_rmsnorm(m, x2, x_out, ln_next, eps, xn_out, t, d, threads);
}

/* The drafter's context projection for n fed positions: target features feats [n, k_in] fp32 -> fc -> RMSNorm
 * (gains ln_hidden) -> every layer's K and V (packed [layers, 2, hkv, hd] per row) -> per layer the keys' RMSNorm
 * (wk [layers, hd], k_eps; or NULL) -> RoPE on the keys at pos[n]
 * (fp32 tables: cos, and sin signed for rotate-half), into kv_out [n, layers, 2, hkv, hd] fp32. scratch: fp32 of
 * n * d. */
void dspark_avx2_drafter_context(const float *feats, int64_t n, int64_t k_in, int64_t d, const uint8_t *w_fc,
                                 const float *ln_hidden, float eps, const uint8_t *w_kv, int64_t layers, int64_t hkv,
                                 int64_t hd, const float *wk, float k_eps, const int64_t *pos, const float *cos_t, const float *sin_t,
                                 float *kv_out, float *scratch, int threads) {
    const int64_t width = layers * 2 * hkv * hd, half = hd / 2;
    float *c = scratch;
    dspark_avx2_q8_mm(feats, n, k_in, w_fc, d, c, threads);
    dspark_avx2_add_rmsnorm(c, 0, 0, ln_hidden, eps, c, n, d, threads); /* in place: a row is read first */
    dspark_avx2_q8_mm(c, n, d, w_kv, width, kv_out, threads);
    for (int64_t r = 0; r < n; r++) {
        const float *co = cos_t + pos[r] * hd, *si = sin_t + pos[r] * hd;
        for (int64_t l = 0; l < layers; l++)
            for (int64_t j = 0; j < hkv; j++) {
                float *x = kv_out + ((r * layers + l) * 2 * hkv + j) * hd; /* a key head */
                if (wk)
                    dspark_avx2_add_rmsnorm(x, 0, 0, wk + l * hd, k_eps, x, 1, hd, 1);
                float buf[512];
                for (int64_t i = 0; i < hd; i++)
                    buf[i] = x[i];
                for (int64_t i = 0; i < hd; i++) /* rotate-half RoPE; the sign lives in the sin table */
                    x[i] = buf[i < half ? i + half : i - half] * si[i] + buf[i] * co[i];
            }
    }
}

/* Greedy drafts of every block position through the vanilla Markov head (markov.c's job on fp32 rows), as the
 * drafter's step() computes them op by op: position k of request b picks argmax_j (base[b, k, j] + rows[b, j]) over
 * the draft vocabulary (ties to the lowest id, as torch.argmax), rows = [W2; w_tok] W1[x_{k-1}] on the 8-bit AVX2
 * matmul (packed [rows_n] outputs: the Markov bias, then the confidence's token half at column vd), x_{k-1} the
 * previous pick as a target id (d2t[j], or j without d2t; the anchor for k = 0); its confidence logit
 * conf[b, k] + rows[b, vd] where conf is not NULL. base: request b's position k at base + b bsr + k bsk; w1 [V, rank]
 * fp32. tokens [R, n] int64, conf_out [R, n] fp32. scratch: fp32 of R * (rank + rows_n). */
void dspark_avx2_markov_greedy(const int64_t *anchors, const float *base, int64_t bsr, int64_t bsk, int64_t r_len,
                               int64_t n, int64_t vd, const float *w1, int64_t rank, const uint8_t *rows_packed,
                               int64_t rows_n, const float *conf, const int64_t *d2t, int64_t *tokens,
                               float *conf_out, float *scratch, int threads) {
    float *e = scratch, *rows = e + r_len * rank;
    for (int64_t k = 0; k < n; k++) {
        for (int64_t b = 0; b < r_len; b++) {
            const int64_t prev = k ? tokens[b * n + k - 1] : anchors[b];
            for (int64_t i = 0; i < rank; i++)
                e[b * rank + i] = w1[prev * rank + i];
        }
        dspark_avx2_q8_mm(e, r_len, rank, rows_packed, rows_n, rows, threads);
        for (int64_t b = 0; b < r_len; b++) {
            const float *z = base + b * bsr + k * bsk, *bias = rows + b * rows_n;
            float best = z[0] + bias[0];
            int64_t id = 0;
            for (int64_t j = 1; j < vd; j++) {
                const float v = z[j] + bias[j];
                if (v > best)
                    best = v, id = j;
            }
            tokens[b * n + k] = d2t ? d2t[id] : id;
            if (conf)
                conf_out[b * n + k] = conf[b * n + k] + bias[vd];
        }
    }
}
