/* Helpers shared by the AVX2 kernels (avx2_*.c): horizontal reductions of 8 lanes, each in one fixed order, so
 * a row's result never depends on what else a call computes; and the declarations of the kernels the files call
 * across. */
#ifndef DSPARK_AVX2_H
#define DSPARK_AVX2_H
#include <immintrin.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* The library's kernels that other files of it call (avx2_layer.c, avx2_step.c, avx2_drafter.c): one declaration
 * each, here. */
void dspark_avx2_int4_mm(const float *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, float *y,
                         int threads);
void dspark_avx2_q8_mm(const float *x, int64_t rows, int64_t k, const uint8_t *packed, int64_t n, float *y,
                       int threads);
void dspark_avx2_add_rmsnorm(const float *x, const float *residual, float *sum, const float *w, float eps, float *out,
                             int64_t rows, int64_t d, int threads);
void dspark_avx2_silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int threads);
void dspark_avx2_rope_store(const float *qkv, const int64_t *pos, const float *cos_t, const float *sin_t,
                            float q_scale, int64_t t_len, int64_t h, int64_t hkv, int64_t hd, float *q_out,
                            float *pool, int64_t pool_rows, const int64_t *slot, int threads);
void dspark_avx2_attention(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                           int64_t kvsh, int64_t kvsb, const uint8_t *mask, float *out, int64_t osb, int64_t osh,
                           int64_t osq, int64_t b_len, int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len,
                           int64_t hd, int threads);
void dspark_avx2_attention_paged(const float *q, int64_t qsb, int64_t qsh, int64_t qsq, const float *k, const float *v,
                                 int64_t kvsh, const int64_t *krows, const int64_t *q_off, const int64_t *q_lens,
                                 const uint8_t *mask, float *out, int64_t osb, int64_t osh, int64_t osq, int64_t b_len,
                                 int64_t h_len, int64_t hkv, int64_t q_len, int64_t s_len, int64_t hd, int threads);
void dspark_avx2_layers(const float *x, float *x_out, float *x_tmp, int64_t n_layers, const void *const *w, int64_t t,
                        int64_t d, float eps, int64_t h, int64_t hkv, int64_t hd, int64_t inter, const int64_t *pos,
                        const float *cos_t, const float *sin_t, float q_scale, float *pool, int64_t layer_stride,
                        int64_t pool_rows, const int64_t *slot, int64_t kv_start, const int64_t *krows,
                        const int64_t *q_off, const int64_t *q_lens, int64_t b_len, int64_t q_max, const uint8_t *mask,
                        int64_t s_len, float *scratch, float *q_buf, const int64_t *taps, float *hidden,
                        int64_t hidden_ld, int threads);

#endif
