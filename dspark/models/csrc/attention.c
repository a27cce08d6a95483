/* Attention of fp32 queries over fp32 keys and values, one row at a time, on AVX-512 CPUs.
 *
 * Every (sequence, head, query) row runs the same loop whatever the other rows of the call: scores
 * over all S keys, 16 at a time (an AVX-512 dot product over head_dim per key, the 16 reduced together
 * in a tree that adds every key's lanes in the same order), masked keys left out, an exponential of
 * fixed polynomial form, and probs @ values summed in key order. A key the row may not see contributes nothing (not even a rounding), so the result is the
 * same however far S is padded and however many queries share the call: what keeps a verify window's
 * rows bit-identical to the same positions decoded one at a time. A row that may see no key gets zeros.
 * Keys and values are fp32, or bf16 (kv16: the target's cache, half the bytes to read; each is widened to
 * fp32 exactly as it is loaded, so the arithmetic is the same).
 * dspark_attention_paged reads a sequence's keys and values where the cache keeps them (a row index per key)
 * instead of from a gathered copy: the same values in the same order, so the same bits as gathering first.
 */
#include <math.h>
#include <stdlib.h>

#include "simd.h"

static inline void store_row(void *out, int64_t j, __m512 x, int bf16) {
    if (bf16)
        bf16_store((uint16_t *)out + 16 * j, x);
    else
        _mm512_storeu_ps((float *)out + 16 * j, x);
}

/* 16 keys' or values' elements at index i of k: fp32, or bf16 widened exactly (kv16, a constant where it matters) */
static inline __attribute__((always_inline)) __m512 kv_load(const void *k, int64_t i, const int kv16) {
    return kv16 ? bf16_load((const uint16_t *)k + i) : _mm512_loadu_ps((const float *)k + i);
}

/* 16 vectors of lane-wise partial sums, one key each, -> the 16 keys' sums in one vector (in the order
 * key_order() undoes). Each key's 16 lanes are added in the same tree whatever its slot: lanes i and
 * i + 8, then pairs, so a score never depends on which keys share its vector. */
static inline __m512 sum16(const __m512 *a) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The permutation that puts sum16's lanes back in key order (found by running it on key numbers). */
static __m512i key_order(void) {
    __m512 a[16];
    for (int j = 0; j < 16; j++)
        a[j] = _mm512_set1_ps((float)j);
    float lanes[16];
    int32_t idx[16];
    _mm512_storeu_ps(lanes, sum16(a));
    for (int l = 0; l < 16; l++)
        idx[(int)(lanes[l] / 16.0f)] = l;
    return _mm512_loadu_si512(idx);
}

/* The keys s0 .. s0 + n - 1 (n <= 16) the row may see, as a bit mask (a masked load: never past the mask's end) */
static inline __mmask16 live_keys(const uint8_t *mask, int64_t s0, int64_t n) {
    const __mmask16 in = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1);
    return _mm_mask_cmpneq_epi8_mask(in, _mm_maskz_loadu_epi8(in, mask + s0), _mm_setzero_si128());
}

/* A row's scores and then probabilities over the S keys into sc (masked keys exactly 0), 16 keys at a time
 * (groups the row may not see at all are skipped), and the reciprocal of their sum; returns 0 where the
 * row sees no key (a padding row, whose output is zeros). nv = hd / 16 is a constant where the callers
 * know it (hd 64 and 128), so that the row's query vectors stay in registers. */
static inline __attribute__((always_inline)) int row_probs(const float *q, const void *k, const int64_t *krow,
                                                           const uint8_t *mask, int64_t s_len, const int64_t nv,
                                                           float *sc, __m512i order, float *inv, const int kv16,
                                                           const int paged) {
    const int64_t hd = nv * 16;
    __m512 qv[16];
    for (int64_t j = 0; j < nv; j++)
        qv[j] = _mm512_loadu_ps(q + 16 * j);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t s0 = 0; s0 < s_len; s0 += 16) {
        const int64_t n = s_len - s0 < 16 ? s_len - s0 : 16;
        const __mmask16 live = live_keys(mask, s0, n);
        if (!live)
            continue;
        __m512 acc[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i >= n) {
                acc[i] = _mm512_setzero_ps();
                continue;
            }
            const int64_t ks = (paged ? krow[s0 + i] : s0 + i) * hd;
            acc[i] = _mm512_mul_ps(qv[0], kv_load(k, ks, kv16));
            for (int64_t j = 1; j < nv; j++)
                acc[i] = _mm512_fmadd_ps(qv[j], kv_load(k, ks + 16 * j, kv16), acc[i]);
        }
        const __m512 dots = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                               _mm512_permutexvar_ps(order, sum16(acc)));
        _mm512_storeu_ps(sc + s0, dots);  /* sc has 16 floats of slack */
        vmax = _mm512_max_ps(vmax, dots);
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    if (mx == -INFINITY)
        return 0;
    __m512 sum = _mm512_setzero_ps();
    const __m512 vmx = _mm512_set1_ps(mx);
    for (int64_t s0 = 0; s0 < s_len; s0 += 16) {
        const int64_t n = s_len - s0 < 16 ? s_len - s0 : 16;
        const __mmask16 live = live_keys(mask, s0, n);
        const __m512 x = _mm512_maskz_loadu_ps(live, sc + s0);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_clamped(_mm512_sub_ps(x, vmx)));
        _mm512_storeu_ps(sc + s0, p);  /* sc has 16 floats of slack */
        sum = _mm512_add_ps(sum, p);
    }
    *inv = 1.0f / _mm512_reduce_add_ps(sum);
    return 1;
}

/* R query rows of one (sequence, head), which read the same keys and values: q rows qsq floats apart, mask
 * rows s_len apart, out rows osq elements apart; sc holds R * (s_len + 16) floats. Each row's probabilities
 * come from row_probs, and then probs @ values runs for the R rows together, each value vector loaded once
 * for all of them (one row at a time read every value again from L2 for every row of a verify window, and
 * took ~16% of an 8-token step). Each row's sums are its own, over the keys in order, masked keys skipped,
 * as for a row alone: the same bits whatever R. nv and R are constants (R * nv <= 16 vectors of sums) where
 * attend_head tiles; other head sizes come one row at a time with a run-time nv. */
static inline __attribute__((always_inline)) void attend_rows(const float *q, int64_t qsq, const void *k,
                                                              const void *v, const int64_t *krow, const uint8_t *mask,
                                                              int64_t s_len, const int64_t nv, const int R, void *out,
                                                              int64_t osq, int bf16, float *sc, __m512i order,
                                                              const int kv16, const int paged) {
    const int64_t hd = nv * 16, ld = s_len + 16;
    float inv[4];
    int seen[4];  /* o: up to 16 vectors a row for any head_dim (kept in registers where R * nv <= 16) */
    for (int r = 0; r < R; r++)
        seen[r] = row_probs(q + r * qsq, k, krow, mask + r * s_len, s_len, nv, sc + r * ld, order, &inv[r], kv16,
                            paged);
    __m512 o[4][16];
    for (int r = 0; r < R; r++)
        for (int64_t j = 0; j < nv; j++)
            o[r][j] = _mm512_setzero_ps();
    for (int64_t s = 0; s < s_len; s++) {
        __m512 vv[16];
        const int64_t vs = (paged ? krow[s] : s) * hd;
        for (int64_t j = 0; j < nv; j++)
            vv[j] = kv_load(v, vs + 16 * j, kv16);
        for (int r = 0; r < R; r++) {
            if (!seen[r] || !mask[r * s_len + s])
                continue;
            const __m512 p = _mm512_set1_ps(sc[r * ld + s]);
            for (int64_t j = 0; j < nv; j++)
                o[r][j] = _mm512_fmadd_ps(p, vv[j], o[r][j]);
        }
    }
    for (int r = 0; r < R; r++) {
        void *row = (char *)out + r * osq * (bf16 ? 2 : 4);
        const __m512 scale = _mm512_set1_ps(seen[r] ? inv[r] : 0.0f);
        for (int64_t j = 0; j < nv; j++)
            store_row(row, j, seen[r] ? _mm512_mul_ps(o[r][j], scale) : _mm512_setzero_ps(), bf16);
    }
}

/* The q_len rows of one (sequence, head) (strides as in attend_rows): hd 64 in tiles of 4, 2 and 1 rows,
 * hd 128 in tiles of 2 and 1, other head sizes a row at a time. paged: key / value s is row krow[s] of k / v. */
static inline __attribute__((always_inline)) void attend_head(const float *q, int64_t qsq, const void *k,
                                                              const void *v, const int64_t *krow, const uint8_t *mask,
                                                              int64_t s_len, int64_t hd, void *out, int64_t osq,
                                                              int bf16, int64_t q_len, float *sc, __m512i order,
                                                              const int kv16, const int paged) {
    const int64_t ob = bf16 ? 2 : 4;
    int64_t i = 0;
#define TILE(NV, R)                                                                                                 \
    for (; i + (R) <= q_len; i += (R))                                                                              \
        attend_rows(q + i * qsq, qsq, k, v, krow, mask + i * s_len, s_len, NV, R, (char *)out + i * osq * ob, osq, \
                    bf16, sc, order, kv16, paged)
    if (hd == 64) {
        TILE(4, 4);
        TILE(4, 2);
        TILE(4, 1);
    } else if (hd == 128) {
        TILE(8, 2);
        TILE(8, 1);
    }
#undef TILE
    for (; i < q_len; i++)
        attend_rows(q + i * qsq, qsq, k, v, krow, mask + i * s_len, s_len, hd / 16, 1, (char *)out + i * osq * ob,
                    osq, bf16, sc, order, kv16, paged);
}

/* Row (b, h, i) of q at q + b * qsb + h * qsh + i * qsq (scaled by 1/sqrt(hd)), written to out at
 * b * osb + h * osh + i * osq (elements; fp32, or bf16 with out_bf16); keys / values of kv head j of sequence b at
 * k / v + j * kvsh + b * kvsb (elements), S rows of hd each, or with paged (dspark_attention_paged) its key s at row
 * krows[b * S + s] of k / v + j * kvsh; fp32 or bf16 (kv_bf16); mask [B, Q, S] bool. With q_off (paged only),
 * sequence b has q_lens[b] <= Q rows, the first at row q_off[b] of q and out (qsb and osb unused) and mask row
 * b * Q. hd a multiple of 16, at most 256; H a multiple of Hkv. */
static inline __attribute__((always_inline)) void attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq,
                                                            const void *k, const void *v, int64_t kvsh, int64_t kvsb,
                                                            const int64_t *krows, const int64_t *q_off,
                                                            const int64_t *q_lens, const uint8_t *mask, void *out,
                                                            int out_bf16, int64_t osb, int64_t osh, int64_t osq,
                                                            int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len,
                                                            int64_t s_len, int64_t hd, int kv_bf16, int threads,
                                                            const int paged) {
    const int64_t group = h_len / hkv, ob = out_bf16 ? 2 : 4;
    /* work items: a (sequence, head)'s query rows in tiles of attend_head's widest (4 rows at hd 64), so that a
     * verify window's rows spread over the threads evenly (9 heads of 8 rows: 18 items, not 5 heads against 4) */
    const int64_t tile = hd == 64 ? 4 : hd == 128 ? 2 : 1, tiles = (q_len + tile - 1) / tile;
    const __m512i order = key_order();
#pragma omp parallel num_threads(threads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(4 * (s_len + 16)));
#pragma omp for schedule(static)
        for (int64_t item = 0; item < b_len * h_len * tiles; item++) {
            const int64_t bh = item / tiles, b = bh / h_len, h = bh % h_len, i0 = item % tiles * tile;
            const int64_t len = q_off ? q_lens[b] : q_len, rows = len - i0 < tile ? len - i0 : tile;
            if (rows <= 0)
                continue;  /* past a shorter window's rows */
            const int64_t kv_off = ((h / group) * kvsh + (paged ? 0 : b * kvsb)) * (kv_bf16 ? 2 : 4);  /* bytes */
            const char *kh = (const char *)k + kv_off, *vh = (const char *)v + kv_off;
            const int64_t *kr = paged ? krows + b * s_len : NULL;
            const int64_t qrow = q_off ? (q_off[b] + i0) * qsq : b * qsb + i0 * qsq,
                          orow = q_off ? (q_off[b] + i0) * osq : b * osb + i0 * osq;
            const float *qh = q + qrow + h * qsh;
            const uint8_t *mh = mask + (b * q_len + i0) * s_len;
            void *oh = (char *)out + (orow + h * osh) * ob;
            if (kv_bf16)
                attend_head(qh, qsq, kh, vh, kr, mh, s_len, hd, oh, osq, out_bf16, rows, sc, order, 1, paged);
            else
                attend_head(qh, qsq, kh, vh, kr, mh, s_len, hd, oh, osq, out_bf16, rows, sc, order, 0, paged);
        }
        free(sc);
    }
}

void dspark_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const void *k, const void *v,
                      int64_t kvsh, int64_t kvsb, const uint8_t *mask, void *out, int out_bf16, int64_t osb,
                      int64_t osh, int64_t osq, int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len,
                      int64_t hd, int kv_bf16, int threads) {
    attention(q, qsb, qsh, qsq, k, v, kvsh, kvsb, NULL, NULL, NULL, mask, out, out_bf16, osb, osh, osq, b_len, h_len,
              hkv, q_len, s_len, hd, kv_bf16, threads, 0);
}

/* dspark_attention over the cache itself: sequence b's key / value s is row krows[b * s_len + s] of each kv head's
 * rows (k / v + j * kvsh), a padding key any row there (masked); with q_off and q_lens (else NULL), windows of
 * their own lengths, unpadded (see attention() above). Why: a step of several sequences gathered every layer's
 * keys and values into a copy first, ~40% of a step of 8 sequences x 256 cached tokens. */
void dspark_attention_paged(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const void *k, const void *v,
                            int64_t kvsh, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                            const uint8_t *mask, void *out, int out_bf16, int64_t osb, int64_t osh, int64_t osq,
                            int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len, int64_t hd,
                            int kv_bf16, int threads) {
    attention(q, qsb, qsh, qsq, k, v, kvsh, 0, krows, q_off, q_lens, mask, out, out_bf16, osb, osh, osq, b_len, h_len,
              hkv, q_len, s_len, hd, kv_bf16, threads, 1);
}

/* One bf16 query row (scaled here by `scale`) over the first n keys / values of a bf16 cache (rows of hd),
 * out bf16. Two passes over the keys' scores as in row_probs, without a mask: the keys past n are
 * never read. */
static inline __attribute__((always_inline)) void decode_row_bf16_nv(const uint16_t *q, float scale, const uint16_t *k,
                                                                     const uint16_t *v, int64_t n, const int64_t nv,
                                                                     uint16_t *out, float *sc, __m512i order) {
    const int64_t hd = nv * 16;
    __m512 qv[16], o[16];
    for (int64_t j = 0; j < nv; j++) {
        qv[j] = _mm512_mul_ps(bf16_load(q + 16 * j), _mm512_set1_ps(scale));
        o[j] = _mm512_setzero_ps();
    }
    if (n <= 0) {
        for (int64_t j = 0; j < nv; j++)
            bf16_store(out + 16 * j, o[j]);
        return;
    }
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t s0 = 0; s0 < n; s0 += 16) {
        const int64_t m = n - s0 < 16 ? n - s0 : 16;
        __m512 acc[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i >= m) {
                acc[i] = _mm512_setzero_ps();
                continue;
            }
            const uint16_t *ks = k + (s0 + i) * hd;
            acc[i] = _mm512_mul_ps(qv[0], bf16_load(ks));
            for (int64_t j = 1; j < nv; j++)
                acc[i] = _mm512_fmadd_ps(qv[j], bf16_load(ks + 16 * j), acc[i]);
        }
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        const __m512 dots = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                               _mm512_permutexvar_ps(order, sum16(acc)));
        _mm512_storeu_ps(sc + s0, dots);  /* sc has 16 floats of slack */
        vmax = _mm512_max_ps(vmax, dots);
    }
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s0 = 0; s0 < n; s0 += 16) {
        const int64_t m = n - s0 < 16 ? n - s0 : 16;
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_clamped(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + s0), vmx)));
        _mm512_storeu_ps(sc + s0, p);
        sum = _mm512_add_ps(sum, p);
    }
    for (int64_t s = 0; s < n; s++) {
        const __m512 p = _mm512_set1_ps(sc[s]);
        const uint16_t *vs = v + s * hd;
        for (int64_t j = 0; j < nv; j++)
            o[j] = _mm512_fmadd_ps(p, bf16_load(vs + 16 * j), o[j]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < nv; j++)
        bf16_store(out + 16 * j, _mm512_mul_ps(o[j], inv));
}

/* decode_row_bf16_nv with nv a constant for hd 64 and 128 (see row_probs) */
static void decode_row_bf16(const uint16_t *q, float scale, const uint16_t *k, const uint16_t *v, int64_t n,
                            int64_t hd, uint16_t *out, float *sc, __m512i order) {
    if (hd == 64)
        decode_row_bf16_nv(q, scale, k, v, n, 4, out, sc, order);
    else if (hd == 128)
        decode_row_bf16_nv(q, scale, k, v, n, 8, out, sc, order);
    else
        decode_row_bf16_nv(q, scale, k, v, n, hd / 16, out, sc, order);
}

/* Decode attention of a batched generator over a static bf16 cache: row r's H query heads (q + r * qsr +
 * h * hd) attend over the first lengths[r] keys and values of cache slot slots[r] (kv head j of slot s
 * at k / v + s * ksb + j * ksh, rows of hd); out [R, H, hd] bf16. The query heads of one KV head run in
 * turn, so its keys and values are read from memory once. Not bit-stable across shapes (the serving
 * path's attention above is); the training data generator uses it. hd a multiple of 16, at most 256. */
void dspark_decode_attention_bf16(const uint16_t *q, int64_t qsr, const uint16_t *k, const uint16_t *v,
                                  int64_t ksb, int64_t ksh, const int64_t *slots, const int64_t *lengths,
                                  uint16_t *out, int64_t rows, int64_t h_len, int64_t hkv, int64_t s_max,
                                  int64_t hd, float scale, int threads) {
    const int64_t group = h_len / hkv;
    const __m512i order = key_order();
#pragma omp parallel num_threads(threads)
    {
        float *sc = (float *)malloc(sizeof(float) * (size_t)(s_max + 16));
#pragma omp for schedule(dynamic, 1)
        for (int64_t rj = 0; rj < rows * hkv; rj++) {
            const int64_t r = rj / hkv, j = rj % hkv;
            const int64_t off = slots[r] * ksb + j * ksh;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = j * group + g;
                decode_row_bf16(q + r * qsr + h * hd, scale, k + off, v + off, lengths[r], hd,
                                out + (r * h_len + h) * hd, sc, order);
            }
        }
        free(sc);
    }
}
