/* Attention of fp32 queries over fp32 keys and values, one row at a time, for CPUs with AVX2 and FMA: the
 * AVX2 library's counterpart of attention.c (same arguments, fp32 out), so that a model in fp32 gets
 * window-invariant attention without PyTorch's padded matmuls.
 *
 * Every (sequence, head, query) row runs the same loop whatever the other rows of the call: a score per key
 * the row may see (a dot product over head_dim in two 8-lane accumulators, reduced in a fixed tree), a
 * maximum, probabilities 8 keys at a time by absolute key index with an exponential of fixed polynomial form
 * (keys the row may not see, and keys past the end, exactly 0), their sum in the same 8 lanes, and
 * probs @ values summed in key order over the keys it may see. So the result is the same however far S is
 * padded and however many queries share the call, which keeps a verify window's rows bit-identical to the
 * same positions decoded one at a time. A row that may see no key gets zeros.
 */
#include "avx2.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x), x clamped to [-87, 88]: 2^n * p(r), r = x - n ln2, p of degree 6 (relative error ~2e-7) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* kr: key / value s is row kr[s] of k / v (the cache itself), or row s where kr is NULL. nv = hd / 8; inlined with
 * a constant nv for the usual head sizes, so that q and the output stay in registers (with nv known only at run
 * time they lived on the stack, and each key's output update waited on a store and a load: ~4x the FMAs' time). */
static inline __attribute__((always_inline)) void attend_row_nv(const float *q, const float *k, const float *v,
                                                                const int64_t *kr, const uint8_t *mask, int64_t s_len,
                                                                const int64_t nv, float *out, float *sc) {
    const int64_t hd = 8 * nv;
    __m256 qv[32], o[32];
    for (int64_t j = 0; j < nv; j++) {
        qv[j] = _mm256_loadu_ps(q + 8 * j);
        o[j] = _mm256_setzero_ps();
    }
    float mx = -INFINITY;
    for (int64_t s = 0; s < s_len; s++) {
        if (!mask[s])
            continue;
        const float *ks = k + (kr ? kr[s] : s) * hd;
        __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(ks)), a1 = _mm256_setzero_ps();
        for (int64_t j = 1; j < nv; j++) {
            if (j & 1)
                a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(ks + 8 * j), a1);
            else
                a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(ks + 8 * j), a0);
        }
        sc[s] = hsum8(_mm256_add_ps(a0, a1));
        mx = sc[s] > mx ? sc[s] : mx;
    }
    if (mx == -INFINITY) { /* sees no key: a padding row */
        for (int64_t j = 0; j < nv; j++)
            _mm256_storeu_ps(out + 8 * j, o[j]);
        return;
    }
    /* probabilities 8 keys at a time; keys the row may not see, and keys past S, exactly 0 */
    __m256 sum = _mm256_setzero_ps();
    const __m256 vmx = _mm256_set1_ps(mx);
    for (int64_t s0 = 0; s0 < s_len; s0 += 8) {
        const int64_t n = s_len - s0 < 8 ? s_len - s0 : 8;
        uint8_t m8[8] = {0};
        memcpy(m8, mask + s0, (size_t)n);
        int64_t bits;
        memcpy(&bits, m8, 8);
        const __m256i live = _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bits)), _mm256_setzero_si256());
        const __m256 x = _mm256_and_ps(_mm256_loadu_ps(sc + s0), _mm256_castsi256_ps(live)); /* no stale NaN */
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, vmx)), _mm256_castsi256_ps(live));
        _mm256_storeu_ps(sc + s0, p); /* sc has 8 floats of slack */
        sum = _mm256_add_ps(sum, p);
    }
    for (int64_t s = 0; s < s_len; s++) {
        if (!mask[s])
            continue;
        const __m256 p = _mm256_set1_ps(sc[s]);
        const float *vs = v + (kr ? kr[s] : s) * hd;
        for (int64_t j = 0; j < nv; j++)
            o[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vs + 8 * j), o[j]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / hsum8(sum));
    for (int64_t j = 0; j < nv; j++)
        _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(o[j], inv));
}

static void attend_row(const float *q, const float *k, const float *v, const int64_t *kr, const uint8_t *mask,
                       int64_t s_len, int64_t hd, float *out, float *sc) {
    if (hd == 64)
        attend_row_nv(q, k, v, kr, mask, s_len, 8, out, sc);
    else if (hd == 128)
        attend_row_nv(q, k, v, kr, mask, s_len, 16, out, sc);
    else
        attend_row_nv(q, k, v, kr, mask, s_len, hd / 8, out, sc);
}

/* Row (b, h, i) of q at q + b * qsb + h * qsh + i * qsq (scaled by 1/sqrt(hd)), written to out at
 * b * osb + h * osh + i * osq (elements, fp32); keys / values of kv head j of sequence b at k / v + j * kvsh + b * kvsb,
 * S rows of hd floats each, or with krows their key s at row krows[b * S + s] of k / v + j * kvsh; mask [B, Q, S]
 * bool. With q_off and q_lens (krows only; else NULL), sequence b has q_lens[b] <= Q rows, the first at row
 * q_off[b] of q and out (qsb and osb unused), mask rows b * Q .. b * Q + q_lens[b] - 1. hd a multiple of 8, at most
 * 256; H a multiple of Hkv. */
static void attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                      int64_t kvsh, int64_t kvsb, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                      const uint8_t *mask, float *out, int64_t osb, int64_t osh, int64_t osq, int64_t b_len,
                      int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len, int64_t hd, int threads) {
    const int64_t group = h_len / hkv;
    /* both threads from a few hundred keys on (a batch-1 decode step of the embedded model: 9 heads x 256 keys,
     * 70 -> 55 us a call on a 2-core Zen 1); a row is computed by one thread whatever the count */
#pragma omp parallel num_threads(threads) if (b_len * h_len * q_len * s_len >= 512)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(s_len + 8));
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < b_len * h_len; bh++) {
            const int64_t b = bh / h_len, h = bh % h_len;
            const int64_t kv_off = (h / group) * kvsh + (krows ? 0 : b * kvsb);
            const int64_t *kr = krows ? krows + b * s_len : NULL;
            const int64_t len = q_off ? q_lens[b] : q_len;
            const float *qb = q_off ? q + q_off[b] * qsq : q + b * qsb;
            float *ob = q_off ? out + q_off[b] * osq : out + b * osb;
            for (int64_t i = 0; i < len; i++)
                attend_row(qb + h * qsh + i * qsq, k + kv_off, v + kv_off, kr, mask + (b * q_len + i) * s_len, s_len,
                           hd, ob + h * osh + i * osq, sc);
        }
        free(sc);
    }
}

void dspark_avx2_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                           int64_t kvsh, int64_t kvsb, const uint8_t *mask, float *out, int64_t osb, int64_t osh,
                           int64_t osq, int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len,
                           int64_t hd, int threads) {
    attention(q, qsb, qsh, qsq, k, v, kvsh, kvsb, NULL, NULL, NULL, mask, out, osb, osh, osq, b_len, h_len, hkv, q_len,
              s_len, hd, threads);
}

/* dspark_avx2_attention over the cache itself: sequence b's key / value s is row krows[b * s_len + s] of each kv
 * head's rows (k / v + j * kvsh), a padding key any row there (masked); with q_off and q_lens (else NULL), windows of
 * their own lengths, unpadded (see attention() above). The same arithmetic per row, so the same bits as over the
 * keys gathered into a copy. Why: a step of several sequences gathered every layer's keys and values first, ~25%
 * of a step of 8 or 32 sequences x 256 cached tokens on a 2-core Zen 1. */
void dspark_avx2_attention_paged(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                                 int64_t kvsh, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                                 const uint8_t *mask, float *out, int64_t osb, int64_t osh, int64_t osq, int64_t b_len,
                                 int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len, int64_t hd, int threads) {
    attention(q, qsb, qsh, qsq, k, v, kvsh, 0, krows, q_off, q_lens, mask, out, osb, osh, osq, b_len, h_len, hkv, q_len,
              s_len, hd, threads);
}
