/* Greedy drafting through DSpark's vanilla Markov head: all positions of a block in one call.
 *
 * Position k of request b picks argmax_j (base[b, k, j] + W2[j] . W1[x_{k-1}]) over the draft vocabulary,
 * x_{k-1} being the previous pick mapped to a target id (the anchor for k = 0), and its confidence logit
 * conf[b, k] + w_tok . W1[x_{k-1}]. In PyTorch each position was ~8 small ops, a 16k x r product and an
 * argmax; here a position is one pass over W2 for all requests (up to 8 at a time), split between threads by
 * 16-row tiles, with one barrier to join the threads' maxima. Ties go to the lowest id, as torch.argmax does.
 *
 * W2 is packed by dspark_markov_pack's layout: tiles of 16 rows, each as r/2 vectors of 16 bf16 pairs
 * (row l of the tile in lane l, columns 2p and 2p+1 in the pair), zero rows past the vocabulary.
 */
#include <math.h>
#include <omp.h>

#include "simd.h"

#define MAX_THREADS 64
#define MAX_REQUESTS 64 /* a call with more takes them 64 at a time */

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* Requests c = 0 .. R - 1 of one position, R <= 8 a compile-time constant: the best value and lowest id of each
 * among ids [16 t0, 16 t1). Each W2 tile is loaded once for all R requests (the W2 of a 16k vocabulary at rank
 * 64 is 2 MB, more than a core's L2, so a pass per request streamed it again for every request); request c's
 * arithmetic is the same sequence whatever R: even pairs into one sum, odd into another, then the base. */
static inline __attribute__((always_inline)) void tile_range_argmax(const __m512 *w2, int64_t pairs,
                                                                    const uint32_t *e, int64_t e_stride,
                                                                    const uint16_t *const *base, int64_t vd,
                                                                    int64_t t0, int64_t t1, const int R,
                                                                    float *best_val, int64_t *best_id) {
    __m512 best[8];
    __m512i best_idx[8];
    for (int c = 0; c < R; c++) {
        best[c] = _mm512_set1_ps(-INFINITY);
        best_idx[c] = _mm512_setzero_si512();
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t t = t0; t < t1; t++) {
        const __m512 *w = w2 + t * pairs;
        __m512 a0[8], a1[8];
        for (int c = 0; c < R; c++)
            a0[c] = a1[c] = _mm512_setzero_ps();
        int64_t p = 0;
        for (; p + 1 < pairs; p += 2) {
            const __m512 w0 = w[p], w1 = w[p + 1];
            for (int c = 0; c < R; c++) {
                DPBF16_BCAST(a0[c], w0, e[c * e_stride + p]);
                DPBF16_BCAST(a1[c], w1, e[c * e_stride + p + 1]);
            }
        }
        if (p < pairs)
            for (int c = 0; c < R; c++)
                DPBF16_BCAST(a0[c], w[p], e[c * e_stride + p]);
        const int64_t live = vd - 16 * t;
        const __mmask16 m = live >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << live) - 1);
        const __m512i ids = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(16 * t)));
        for (int c = 0; c < R; c++) {
            const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, base[c] + 16 * t)), 16));
            const __m512 z = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY),
                                                  _mm512_add_ps(_mm512_add_ps(a0[c], a1[c]), b));
            const __mmask16 gt = _mm512_cmp_ps_mask(z, best[c], _CMP_GT_OQ);  /* strict: earlier tiles win ties */
            best[c] = _mm512_mask_blend_ps(gt, best[c], z);
            best_idx[c] = _mm512_mask_blend_epi32(gt, best_idx[c], ids);
        }
    }
    for (int c = 0; c < R; c++) {
        float v[16];
        int32_t id[16];
        _mm512_storeu_ps(v, best[c]);
        _mm512_storeu_si512(id, best_idx[c]);
        float bv = v[0];
        int64_t bi = id[0];
        for (int l = 1; l < 16; l++)
            if (v[l] > bv || (v[l] == bv && id[l] < bi)) {
                bv = v[l];
                bi = id[l];
            }
        best_val[c] = bv;
        best_id[c] = bi;
    }
}

/* w [vd, r] bf16 row-major -> packed [ceil(vd/16), ceil(r/2), 16, 2] bf16 (zeros where padded) */
void dspark_markov_pack(const uint16_t *w, int64_t vd, int64_t r, uint16_t *out) {
    const int64_t tiles = (vd + 15) / 16, pairs = (r + 1) / 2;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t l = 0; l < 16; l++)
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t j = 16 * t + l, c = 2 * p + h;
                    out[((t * pairs + p) * 16 + l) * 2 + h] = (j < vd && c < r) ? w[j * r + c] : 0;
                }
}

/* anchors [R] target ids; base bf16 at base + b * bsr + k * bsk ([R, n, vd], unit last stride); w1 [V, r]
 * bf16 (the Markov embedding, by target id); w2 packed as above; w_tok [r] bf16 or NULL; conf_in fp32
 * [R, n] (the confidence logit's hidden half plus bias) or NULL; d2t [vd] int64 or NULL. Out: tokens
 * [R, n] int64 (target ids), conf_out [R, n] fp32 (when conf_in). */
void dspark_markov_greedy(const int64_t *anchors, const uint16_t *base, int64_t bsr, int64_t bsk, int64_t r_len,
                          int64_t n, int64_t vd, const uint16_t *w1, int64_t rank, const uint16_t *w2,
                          const uint16_t *w_tok, const float *conf_in, const int64_t *d2t, int64_t *tokens,
                          float *conf_out, int threads) {
    const int64_t pairs = (rank + 1) / 2, tiles = (vd + 15) / 16;
    const __m512 *w2v = (const __m512 *)w2;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > tiles)
        threads = (int)tiles;
    if (threads < 1)
        threads = 1;
    if (r_len > MAX_REQUESTS) {  /* in turn, so the scratch below stays a fixed size on the stack */
        for (int64_t b = 0; b < r_len; b += MAX_REQUESTS) {
            const int64_t m = r_len - b < MAX_REQUESTS ? r_len - b : MAX_REQUESTS;
            dspark_markov_greedy(anchors + b, base + b * bsr, bsr, bsk, m, n, vd, w1, rank, w2, w_tok,
                                 conf_in ? conf_in + b * n : NULL, d2t, tokens + b * n,
                                 conf_out ? conf_out + b * n : NULL, threads);
        }
        return;
    }
    uint32_t e[MAX_REQUESTS * 128];  /* each request's previous token's W1 row as bf16 pairs (rank <= 256) */
    float vals[MAX_THREADS * MAX_REQUESTS];  /* each thread's best per request */
    int64_t ids[MAX_THREADS * MAX_REQUESTS];
    int64_t prev[MAX_REQUESTS];
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t t0 = tiles * tid / nt, t1 = tiles * (tid + 1) / nt;
        for (int64_t k = 0; k < n; k++) {
#pragma omp single
            for (int64_t b = 0; b < r_len; b++) {
                prev[b] = k == 0 ? anchors[b] : tokens[b * n + k - 1];
                const uint16_t *row = w1 + prev[b] * rank;
                for (int64_t p = 0; p < pairs; p++) {
                    const uint32_t lo = row[2 * p], hi = 2 * p + 1 < rank ? row[2 * p + 1] : 0;
                    e[b * pairs + p] = lo | (hi << 16);
                }
            }  /* implicit barrier: e is ready */
            for (int64_t b0 = 0; b0 < r_len; b0 += 8) {
                const int64_t nb = r_len - b0 < 8 ? r_len - b0 : 8;
                const uint16_t *bases[8];
                for (int64_t c = 0; c < nb; c++)
                    bases[c] = base + (b0 + c) * bsr + k * bsk;
#define ROWS(R) tile_range_argmax(w2v, pairs, e + b0 * pairs, pairs, bases, vd, t0, t1, R, vals + tid * r_len + b0, \
                                  ids + tid * r_len + b0)
                SWITCH_ROWS(nb, ROWS)
#undef ROWS
            }
#pragma omp barrier
#pragma omp single
            for (int64_t b = 0; b < r_len; b++) {
                float bv = vals[b];
                int64_t bi = ids[b];
                for (int i = 1; i < nt; i++)  /* threads hold ascending id ranges */
                    if (vals[i * r_len + b] > bv) {
                        bv = vals[i * r_len + b];
                        bi = ids[i * r_len + b];
                    }
                tokens[b * n + k] = d2t ? d2t[bi] : bi;
                if (conf_in) {
                    float c = 0.0f;
                    const uint16_t *row = w1 + prev[b] * rank;
                    for (int64_t i = 0; i < rank; i++)
                        c += bf16_to_f32(row[i]) * bf16_to_f32(w_tok[i]);
                    conf_out[b * n + k] = conf_in[b * n + k] + c;
                }
            }  /* implicit barrier: the picks are written before the next position reads them */
        }
    }
}
