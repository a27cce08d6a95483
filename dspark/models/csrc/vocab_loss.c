/* Training's vocabulary-sized row work (train/losses.py, train/features.py), one pass or two over a row
 * while it sits in cache, rows split between threads.
 *
 * In PyTorch each of these is ~10-14 elementwise ops over [rows, V] tensors (a softmax, |p - q|, the
 * gradient), each a trip through memory: ~2.5 s of a ~13 s training step on 2 cores. A row of the draft
 * vocabulary (16k fp32, 64 KB) fits in L2, so here a row is read once to find its maximum and once more
 * to produce everything else.
 *
 * dspark_vocab_loss_fwd / _bwd: the drafter's per-row NLL of its label, the exact total variation against
 * the target's distribution q over the draft vocabulary (q normalised over the FULL vocabulary, so
 * 1 - sum(q) is the target's mass where the drafter has none), and whether the label is the row's
 * maximum; then the gradient of g_tv * TV + g_nll * NLL in the logits:
 *     p = softmax(x), s_j = sign(p_j - q_j)
 *     dTV/dx_j = p_j s_j - p_j sum_i p_i s_i,   dNLL/dx_j = p_j - [j == label]
 * dspark_soft_labels: the target's logits row -> its probabilities on the draft vocabulary (normalised over
 * the full vocabulary) and its argmax (the lowest id among equal maxima, as torch.argmax).
 *
 * The exponential is simd.h's exp_clamped (relative error ~2e-7), so results match PyTorch's to fp32
 * rounding, not bit for bit; tests/test_vocab_kernels.py holds them to the PyTorch reference.
 */
#include <math.h>
#include <stdlib.h>

#include "simd.h"

static inline float bf16_scalar(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* fp32 -> bf16, rounded to nearest even (as bf16_store) */
static inline uint16_t bf16_round(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* row i of x (fp32, or bf16 when bf16) as fp32: the row itself, or converted into buf */
static const float *row_f32(const void *x, int bf16, int64_t i, int64_t v, float *buf) {
    if (!bf16)
        return (const float *)x + i * v;
    const uint16_t *r = (const uint16_t *)x + i * v;
    int64_t j = 0;
    for (; j + 16 <= v; j += 16)
        _mm512_storeu_ps(buf + j, bf16_load(r + j));
    for (; j < v; j++)
        buf[j] = bf16_scalar(r[j]);
    return buf;
}

static float row_max(const float *x, int64_t v) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= v; j += 16)
        m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
    float out = _mm512_reduce_max_ps(m);
    for (; j < v; j++)
        out = x[j] > out ? x[j] : out;
    return out;
}

/* log sum_j exp(x_j) given the row's maximum m */
static float row_lse(const float *x, int64_t v, float m) {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 s = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= v; j += 16)
        s = _mm512_add_ps(s, exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv)));
    float out = _mm512_reduce_add_ps(s);
    for (; j < v; j++)
        out += expf(x[j] - m);
    return m + logf(out);
}

/* logits [n, v] (fp32, or bf16 when bf16); pt [*, v] fp32 with pt_rows [n] picking each row's q; lab [n]
 * (>= 0) and ok [n] (0: no NLL, no hit) -> lse, nll, tv (clamped to 2), hit [n]. */
void dspark_vocab_loss_fwd(const void *logits, int bf16, int64_t n, int64_t v, const float *pt,
                           const int64_t *pt_rows, const int64_t *lab, const uint8_t *ok, float *lse, float *nll,
                           float *tv, uint8_t *hit, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *buf = bf16 ? (float *)aligned_alloc(64, (size_t)((v + 15) / 16 * 16) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float *x = row_f32(logits, bf16, i, v, buf), *q = pt + pt_rows[i] * v;
            const float m = row_max(x, v), l = row_lse(x, v, m);
            const __m512 lv = _mm512_set1_ps(l);
            __m512 d = _mm512_setzero_ps(), qs = _mm512_setzero_ps();
            int64_t j = 0;
            for (; j + 16 <= v; j += 16) {
                const __m512 qj = _mm512_loadu_ps(q + j);
                const __m512 p = exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(x + j), lv));
                d = _mm512_add_ps(d, _mm512_abs_ps(_mm512_sub_ps(p, qj)));
                qs = _mm512_add_ps(qs, qj);
            }
            float dist = _mm512_reduce_add_ps(d), qsum = _mm512_reduce_add_ps(qs);
            for (; j < v; j++) {
                dist += fabsf(expf(x[j] - l) - q[j]);
                qsum += q[j];
            }
            const float t = dist + (1.0f - qsum > 0.0f ? 1.0f - qsum : 0.0f);
            const float xl = x[lab[i]];
            lse[i] = l;
            tv[i] = t < 2.0f ? t : 2.0f;
            nll[i] = ok[i] ? l - xl : 0.0f;
            hit[i] = ok[i] && xl >= m;
        }
        free(buf);
    }
}

/* The gradient of sum_i g_tv[i] TV_i + g_nll[i] ok[i] NLL_i in logits (inputs as in the forward, lse
 * from it) -> grad [n, v], fp32 or bf16 as the logits. */
void dspark_vocab_loss_bwd(const void *logits, int bf16, int64_t n, int64_t v, const float *pt,
                           const int64_t *pt_rows, const int64_t *lab, const uint8_t *ok, const float *lse,
                           const float *g_nll, const float *g_tv, void *grad, int threads) {
    const int64_t width = (v + 15) / 16 * 16;
#pragma omp parallel num_threads(threads)
    {
        float *buf = bf16 ? (float *)aligned_alloc(64, (size_t)width * sizeof(float)) : NULL;
        float *p = (float *)aligned_alloc(64, (size_t)width * sizeof(float));
        float *ps = (float *)aligned_alloc(64, (size_t)width * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float *x = row_f32(logits, bf16, i, v, buf), *q = pt + pt_rows[i] * v;
            const float l = lse[i], gt = g_tv[i], gn = ok[i] ? g_nll[i] : 0.0f;
            const __m512 lv = _mm512_set1_ps(l), zero = _mm512_setzero_ps();
            __m512 s = zero;
            int64_t j = 0;
            for (; j + 16 <= v; j += 16) {
                const __m512 pj = exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(x + j), lv));
                const __m512 dj = _mm512_sub_ps(pj, _mm512_loadu_ps(q + j));
                const __m512 sj = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(dj, zero, _CMP_GT_OQ),
                                                       _mm512_mask_blend_ps(_mm512_cmp_ps_mask(dj, zero, _CMP_LT_OQ),
                                                                            zero, _mm512_set1_ps(-1.0f)),
                                                       _mm512_set1_ps(1.0f));
                const __m512 psj = _mm512_mul_ps(pj, sj);
                _mm512_storeu_ps(p + j, pj);
                _mm512_storeu_ps(ps + j, psj);
                s = _mm512_add_ps(s, psj);
            }
            float total = _mm512_reduce_add_ps(s);
            for (; j < v; j++) {
                p[j] = expf(x[j] - l);
                const float dj = p[j] - q[j];
                ps[j] = dj > 0.0f ? p[j] : dj < 0.0f ? -p[j] : 0.0f;
                total += ps[j];
            }
            const __m512 sv = _mm512_set1_ps(total), gtv = _mm512_set1_ps(gt), gnv = _mm512_set1_ps(gn);
            float *gf = bf16 ? buf : (float *)grad + i * v;  /* bf16: built in buf (x is no longer read), then stored */
            for (j = 0; j + 16 <= v; j += 16) {
                const __m512 pj = _mm512_loadu_ps(p + j);
                const __m512 g = _mm512_fmadd_ps(gnv, pj,
                                                 _mm512_mul_ps(gtv, _mm512_fnmadd_ps(pj, sv, _mm512_loadu_ps(ps + j))));
                _mm512_storeu_ps(gf + j, g);
            }
            for (; j < v; j++)
                gf[j] = gt * (ps[j] - p[j] * total) + gn * p[j];
            gf[lab[i]] -= gn;
            if (bf16) {
                uint16_t *gb = (uint16_t *)grad + i * v;
                for (j = 0; j + 16 <= v; j += 16)
                    bf16_store(gb + j, _mm512_loadu_ps(gf + j));
                for (; j < v; j++)
                    gb[j] = bf16_round(gf[j]);
            }
        }
        free(buf), free(p), free(ps);
    }
}

/* The target's logits [n, v] bf16 -> probs [n, vd] fp32 on the draft vocabulary d2t [vd] (NULL: vd = v,
 * every id), normalised over all v; greedy [n] the argmax, lowest id among ties. */
void dspark_soft_labels(const uint16_t *logits, int64_t n, int64_t v, const int64_t *d2t, int64_t vd, float *probs,
                        int64_t *greedy, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *x = (float *)aligned_alloc(64, (size_t)((v + 15) / 16 * 16) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            row_f32(logits, 1, i, v, x);
            const float m = row_max(x, v);
            int64_t arg = 0;
            while (x[arg] != m)  /* the first maximum (a NaN-free row has one) */
                arg++;
            const float l = row_lse(x, v, m);
            float *out = probs + i * vd;
            if (d2t == NULL) {
                const __m512 lv = _mm512_set1_ps(l);
                int64_t j = 0;
                for (; j + 16 <= vd; j += 16)
                    _mm512_storeu_ps(out + j, exp_clamped(_mm512_sub_ps(_mm512_loadu_ps(x + j), lv)));
                for (; j < vd; j++)
                    out[j] = expf(x[j] - l);
            } else {
                const __m512 lv = _mm512_set1_ps(l);
                int64_t j = 0;
                for (; j + 16 <= vd; j += 16) {
                    const __m256i lo = _mm512_cvtepi64_epi32(_mm512_loadu_si512(d2t + j));
                    const __m256i hi = _mm512_cvtepi64_epi32(_mm512_loadu_si512(d2t + j + 8));
                    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                    _mm512_storeu_ps(out + j, exp_clamped(_mm512_sub_ps(_mm512_i32gather_ps(idx, x, 4), lv)));
                }
                for (; j < vd; j++)
                    out[j] = expf(x[d2t[j]] - l);
            }
            greedy[i] = arg;
        }
        free(x);
    }
}
