/* The integer low-bit pass's scores (lowbit_int_cpu.c states the arithmetic), which the integer
   pass and the sparse one (lowbit_sparse_cpu.c) share, so that both compute the same weights bit
   for bit: per row and key group j, q8 = round(q * s_j * (127 / top)) with top = max |q * s_j|, and
   score = (top / 127) * (q8 . code) + q . z_j. INT_VECTOR is defined where AVX512-VNNI, VBMI and
   BITALG are, INT_AVX2 where AVX2 alone is; `int_vector_takes` says which shapes their vector
   functions take. A file that includes this defines score_vector (and its own mix_vector) there. */
#ifndef SPECACHE_INT_SCORES_H
#define SPECACHE_INT_SCORES_H

#include "lowbit_driver.h"

/* ------------------------------------------------------------------------------------------
   Plain C
   ------------------------------------------------------------------------------------------ */

/* x[i] * (127 / top) rounded half to even (the default rounding mode), 0 where top is 0 */
static void round_int8(const float *x, int n, float top, int8_t *out) {
    const float inverse = 127.0f / top;
    for (int i = 0; i < n; i++) out[i] = top > 0.0f ? (int8_t)nearbyintf(x[i] * inverse) : 0;
}

static void score_int_plain(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {
    const int bits = p->bits, d = (int)p->d, bytes = d * bits / 8;
    const int64_t at = (bh * ((p->t + p->group - 1) / p->group) + j) * d;
    float qs[MAX_D];
    int8_t q8[MAX_D];
    for (int64_t m = 0; m < p->m; m++) {
        const float *q = p->rows + (bh * p->m + m) * d;
        float top = 0.0f, bias = 0.0f;
        for (int c = 0; c < d; c++) {
            qs[c] = q[c] * scale_to_float(p->k_scale[at + c], p->bf16);
            top = fabsf(qs[c]) > top ? fabsf(qs[c]) : top;
            bias += q[c] * scale_to_float(p->k_zero[at + c], p->bf16);
        }
        const float alpha = top / 127.0f;
        round_int8(qs, d, top, q8);
        float *score = p->weights + (bh * p->m + m) * p->t;
        for (int64_t t = a; t < e; t++) {
            const uint8_t *codes = p->k_packed + (bh * p->t + t) * bytes;
            int32_t sum = 0;
            for (int c = 0; c < d; c++) sum += q8[c] * code_at(codes, c, bits);
            score[t] = alpha * (float)sum + bias;
        }
    }
}

/* ------------------------------------------------------------------------------------------
   AVX512-VNNI and VBMI
   ------------------------------------------------------------------------------------------ */
#if defined(VECTOR) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define INT_VECTOR 1
#define INT_ROWS 8 /* rows that share one widening of the key codes */

/* x * inverse rounded half to even into 16 int8 (MXCSR's default rounding) */
static inline __m128i round16(__m512 x, float inverse) {
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inverse))));
}

/* q8 (as dwords of 4 channels), alpha and bias of one row for key group `at` (its offset) */
static inline void quantize_row(const Problem *p, const float *q, int64_t at, int d, int32_t *q8, float *alpha,
                                float *bias) {
    float qs[MAX_D] __attribute__((aligned(64)));
    __m512 top = _mm512_setzero_ps(), dot = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 16) {
        const __m512 qv = _mm512_loadu_ps(q + c), x = _mm512_mul_ps(qv, scales16(p->k_scale + at + c, p->bf16));
        _mm512_store_ps(qs + c, x);
        top = _mm512_max_ps(top, _mm512_abs_ps(x));
        dot = _mm512_fmadd_ps(qv, scales16(p->k_zero + at + c, p->bf16), dot);
    }
    const float largest = _mm512_reduce_max_ps(top), inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    *alpha = largest / 127.0f;
    *bias = _mm512_reduce_add_ps(dot);
    for (int c = 0; c < d; c += 16) _mm_storeu_si128((__m128i *)(q8 + c / 4), round16(_mm512_load_ps(qs + c), inverse));
}

/* Scores of `rows` rows for n tokens from their transposed code words. Pattern k of a word takes
   its channels 4k .. 4k+3: for a qword of two tokens' words, byte b selects bits
   32 * (b / 4) + (4k + b % 4) * bits. */
static inline __attribute__((always_inline)) void
dot_rows(const uint32_t (*words)[SUB], int64_t n, const int32_t (*q8)[MAX_D / 4], const float *alpha,
         const float *bias, float *score, int64_t stride, const int rows, const int n_words, const int bits) {
    const int patterns = 8 / bits;
    const __m512i low = _mm512_set1_epi8((char)((1 << bits) - 1));
    __m512i control[8];
    for (int k = 0; k < patterns; k++) {
        uint64_t offsets = 0;
        for (int b = 0; b < 8; b++) offsets |= (uint64_t)(32 * (b / 4) + (4 * k + b % 4) * bits) << (8 * b);
        control[k] = _mm512_set1_epi64((long long)offsets);
    }
    for (int64_t i = 0; i < n; i += 16) {
        __m512i acc[INT_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_si512();
        for (int w = 0; w < n_words; w++) {
            const __m512i word = _mm512_load_si512(&words[w][i]);
            for (int k = 0; k < patterns; k++) {
                const __m512i codes = _mm512_and_si512(_mm512_multishift_epi64_epi8(control[k], word), low);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_dpbusd_epi32(acc[r], codes, _mm512_set1_epi32(q8[r][w * patterns + k]));
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(alpha[r]));
            _mm512_mask_storeu_ps(score + r * stride + i, tail_mask(n - i), _mm512_add_ps(s, _mm512_set1_ps(bias[r])));
        }
    }
}

static inline __attribute__((always_inline)) void
score_vector(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e, const int bits, const int d) {
    const int n_words = d * bits / 32;
    const int64_t at = (bh * ((p->t + p->group - 1) / p->group) + j) * d;
    uint32_t words[MAX_D * 2 / 32][SUB] __attribute__((aligned(64)));
    int32_t q8[INT_ROWS][MAX_D / 4];
    float alpha[INT_ROWS], bias[INT_ROWS];
    transpose_words(p, bh, a, e, words, bits, d);
    for (int64_t m0 = 0; m0 < p->m; m0 += INT_ROWS) {
        const int rows = (int)min64(p->m - m0, INT_ROWS);
        for (int r = 0; r < rows; r++)
            quantize_row(p, p->rows + (bh * p->m + m0 + r) * d, at, d, q8[r], alpha + r, bias + r);
        float *score = p->weights + (bh * p->m + m0) * p->t + a;
#define DOT(R) dot_rows(words, e - a, q8, alpha, bias, score, p->t, R, n_words, bits)
        switch (rows) { /* constant row counts keep the accumulators in registers */
            case 8: DOT(8); break;
            case 7: DOT(7); break;
            case 6: DOT(6); break;
            case 5: DOT(5); break;
            case 4: DOT(4); break;
            case 3: DOT(3); break;
            case 2: DOT(2); break;
            default: DOT(1);
        }
#undef DOT
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT_AVX2 1
#include <immintrin.h>
/* AVX2: no byte dot products, so VPMADDUBSW (u8 x s8, adjacent pairs summed to int16) and
   VPMADDWD (int16 pairs to int32) stand in for VPDPBUSD. Keys: lanes over channels, one token at
   a time, 8 tokens' sums reduced together. */

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

static inline __m256 scales8(const uint16_t *x, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)x);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

/* 32 int32 (as 4 vectors) rounded against `inverse` into 32 int8, in order */
static inline __m256i round32(const __m256 *x, float inverse) {
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], _mm256_set1_ps(inverse)));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* the codes of 32 channels of one token, from its packed bytes, one byte each */
static inline __m256i widen32(const uint8_t *codes, const int bits) {
    if (bits == 1) {
        int32_t word;
        memcpy(&word, codes, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(word), _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                   0x0202020202020202LL, 0x0303030303030303LL));
        return _mm256_min_epu8(_mm256_and_si256(spread, _mm256_set1_epi64x((long long)0x8040201008040201ULL)),
                               _mm256_set1_epi8(1));
    }
    long long word;
    memcpy(&word, codes, 8);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi64x(word), _mm256_setr_epi64x(0x0101010100000000LL,
                                          0x0303030302020202LL, 0x0505050504040404LL, 0x0707070706060606LL));
    __m256i out = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) /* byte j takes bits 2 (j % 4) of its source byte */
        out = _mm256_or_si256(out, _mm256_and_si256(_mm256_srli_epi16(x, 2 * i), _mm256_set1_epi32(3 << 8 * i)));
    return out;
}

static inline __attribute__((always_inline)) void
score_vector(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e, const int bits, const int d) {
    const int chunks = d / 32, bytes = d * bits / 8;
    const int64_t at = (bh * ((p->t + p->group - 1) / p->group) + j) * d;
    int8_t q8[64][MAX_D] __attribute__((aligned(32))); /* pick() sends 64 rows at most */
    float alpha[64], bias[64];
    __m256i codes[8][MAX_D / 32];
    for (int64_t m = 0; m < p->m; m++) {
        const float *q = p->rows + (bh * p->m + m) * d;
        __m256 x[MAX_D / 8], top = _mm256_setzero_ps(), dot = _mm256_setzero_ps();
        for (int c = 0; c < d; c += 8) {
            const __m256 qv = _mm256_loadu_ps(q + c);
            x[c / 8] = _mm256_mul_ps(qv, scales8(p->k_scale + at + c, p->bf16));
            top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x[c / 8]));
            dot = _mm256_fmadd_ps(qv, scales8(p->k_zero + at + c, p->bf16), dot);
        }
        const float largest = hmax8(top), inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        alpha[m] = largest / 127.0f;
        bias[m] = hsum8(dot);
        for (int c = 0; c < d; c += 32) _mm256_store_si256((__m256i *)(q8[m] + c), round32(x + c / 8, inverse));
    }
    for (int64_t t0 = a; t0 < e; t0 += 8) {
        for (int i = 0; i < 8; i++) /* past e: no codes, a sum that is never stored */
            for (int c = 0; c < chunks; c++)
                codes[i][c] = t0 + i < e ? widen32(p->k_packed + (bh * p->t + t0 + i) * bytes + c * 4 * bits, bits)
                                         : _mm256_setzero_si256();
        const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)min64(e - t0, 8)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int64_t m = 0; m < p->m; m++) {
            __m256i sums[8];
            for (int i = 0; i < 8; i++) {
                __m256i pairs = _mm256_setzero_si256();
                for (int c = 0; c < chunks; c++)
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(codes[i][c], _mm256_load_si256((const __m256i *)(q8[m] + 32 * c))));
                sums[i] = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            }
            const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
            const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[4], sums[5]), _mm256_hadd_epi32(sums[6], sums[7]));
            const __m256i total = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
            const __m256 score = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(alpha[m])),
                                               _mm256_set1_ps(bias[m]));
            _mm256_maskstore_ps(p->weights + (bh * p->m + m) * p->t + t0, lanes, score);
        }
    }
}
#endif

/* Whether the vector functions of this build take the shape (else the plain C ones serve). */
static inline int int_vector_takes(const Problem *p) {
#if defined(INT_VECTOR)
    /* as the float pass: whole words of 32 code bits and whole blocks of 64 channels */
    return (p->d == 64 || p->d == 128 || p->d == 256) && p->group % 16 == 0;
#elif defined(INT_AVX2)
    return p->d % 64 == 0 && p->m <= 64; /* whole blocks of 64 channels; q8 for 64 rows at most */
#else
    (void)p;
    return 0;
#endif
}

/* The path this build runs for the shapes it vectorizes: 2 AVX512 (with VNNI), 1 AVX2, 0 plain C;
   each kernel built on this header exports it (lowbit_int_cpu.py's path_of reads it). */
int lowbit_int_path(void) {
#if defined(INT_VECTOR)
    return 2;
#elif defined(INT_AVX2)
    return 1;
#else
    return 0;
#endif
}

#endif
