/* Attention of float query rows over SpeCache's packed 1-/2-bit keys and values, on CPUs.

   kernels/lowbit_cpu.py states the contract and the layout, and builds this file at first use
   (gcc -O3 -march=native -fopenmp). Neither keys nor values are ever dequantized: both products
   are table lookups on nibbles (4 bits) of the packed codes.

   - Keys: a nibble of one token holds 4/bits channels. Per row and key group, the 16-entry table
     T_p[v] = sum over those channels of (q * s_j)[c] * code_c(v) holds every partial dot product the
     nibble can give (q . (code * s_j + z_j) = (q * s_j) . code + q . z_j; the bias q . z_j rides in
     T_0). Scoring 16 tokens then takes, per nibble, one vpermps (16 lanes, 4-bit indices) and an add.
   - Values: a nibble of one channel holds its codes in 4/bits consecutive tokens. With the scale
     folded into the weight (w' = w * s per token and value group) and the zero summed apart
     (w . z), the table L[v] = sum over those tokens of w'_t * code_t(v) holds every partial sum the
     tokens can give one channel; each 16 channels take one vpermps and an add per row.
   - Softmax: phase 1 writes the scores into `weights` and takes each task's row maxima; after one
     barrier, phase 2 exponentiates in place against the row maximum and mixes the values.

   Work is split into tasks of (batch, head, chunk of positions), chosen without regard to the
   thread count, and a head's last task adds its tasks' sums in chunk order, so results do not
   depend on the thread count. Positions go in sub-chunks of SUB tokens, so that a sub-chunk's
   scores stay in L1 from scoring to the maximum, and from exp to the mix.

   With AVX-512 (F, BW, VL) and F16C, head_dim 64, 128 or 256 and group a multiple of 16 take the
   vectorized paths; other shapes, and builds without them, take the plain C functions, which run
   the same algorithm one lookup at a time. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define SUB 256          /* positions per sub-chunk, a multiple of 16 */
#define MAX_D 256        /* largest head_dim (bounds the stack buffers); the Python wrapper checks it */
#define MIN_WORK 8192    /* token-rows per thread, at least: waking a thread costs microseconds */
#define TASKS 32         /* tasks per call to aim for */

typedef struct {
    const float *rows;                         /* (B, H, M, D), already scaled by D**-0.5 */
    const uint8_t *k_packed, *v_packed;        /* (B, H, T, D*bits/8) */
    const uint16_t *k_scale, *k_zero;          /* (B, H, ceil(T/group), D), fp16 or bf16 bits */
    const uint16_t *v_scale, *v_zero;          /* (B, H, T, NV) */
    const int64_t *visible_len;                /* (B,) */
    const int64_t *excluded_pos;               /* (B, H, K) */
    const uint8_t *excluded_valid;             /* (B, H, K) bool */
    float *weights, *row_max, *row_sum, *out;  /* (B, H, M, T), (B, H, M), (B, H, M), (B, H, M, D) */
    int64_t batch, heads, m, d, t, k;
    int32_t bits, group, value_groups, bf16, threads;
} Problem;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline float scale_to_float(uint16_t h, int bf16) {
    return bf16 ? bits_to_float((uint32_t)h << 16) : half_to_float(h);
}

static inline int code_at(const uint8_t *token, int i, int bits) {
    return (token[i * bits / 8] >> (i * bits % 8)) & ((1 << bits) - 1);
}

/* ------------------------------------------------------------------------------------------
   Plain C: the algorithm one lookup at a time
   ------------------------------------------------------------------------------------------ */

/* table[v] = base + sum_i ((v >> i*bits) & mask) * x[i] for the 16 nibbles v, digit by digit */
static void nibble_table(float table[16], float base, const float *x, int bits) {
    const int levels = 1 << bits;
    table[0] = base;
    for (int i = 0, size = 1; size < 16; i++, size *= levels)
        for (int level = 1; level < levels; level++)
            for (int v = 0; v < size; v++) table[level * size + v] = table[v] + (float)level * x[i];
}

/* Scores of positions [a, e), all in key group j. Eight tokens go at once so that their sums do
   not wait on each other. */
static void score_plain(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {
    const int bits = p->bits, d = (int)p->d, per = 4 / bits, bytes = d * bits / 8;
    const int64_t at = (bh * ((p->t + p->group - 1) / p->group) + j) * d;
    float qs[MAX_D], table[MAX_D / 2][16];
    for (int64_t m = 0; m < p->m; m++) {
        const float *q = p->rows + (bh * p->m + m) * d;
        float bias = 0.0f;
        for (int c = 0; c < d; c++) {
            qs[c] = q[c] * scale_to_float(p->k_scale[at + c], p->bf16);
            bias += q[c] * scale_to_float(p->k_zero[at + c], p->bf16);
        }
        for (int nib = 0; nib < 2 * bytes; nib++)
            nibble_table(table[nib], nib == 0 ? bias : 0.0f, qs + nib * per, bits);
        float *score = p->weights + (bh * p->m + m) * p->t;
        for (int64_t t = a; t < e; t += 8) {
            const int n = (int)min64(e - t, 8);
            const uint8_t *codes = p->k_packed + (bh * p->t + t) * bytes;
            float sum[8] = {0};
            for (int b = 0; b < bytes; b++)
                for (int k = 0; k < n; k++)
                    sum[k] += table[2 * b][codes[k * bytes + b] & 15] + table[2 * b + 1][codes[k * bytes + b] >> 4];
            for (int k = 0; k < n; k++) score[t + k] = sum[k];
        }
    }
}

/* acc[m][:] += sum over t in [a, e) of weights[m][t] * value_t */
static void mix_plain(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {
    const int bits = p->bits, d = (int)p->d, nv = p->value_groups, gv = d / nv, per = 4 / bits, bytes = d * bits / 8;
    uint8_t nibble[MAX_D];
    float scale[4][MAX_D / 8], zero[4][MAX_D / 8], table[MAX_D / 8][16], zero_sum[MAX_D / 8], scaled[4];
    for (int64_t t0 = a; t0 < e; t0 += per) {
        const int n = (int)min64(e - t0, per);
        for (int i = 0; i < per; i++)
            for (int g = 0; g < nv; g++) { /* zero past e: those tokens get no weight */
                const int64_t at = (bh * p->t + t0 + i) * nv + g;
                scale[i][g] = i < n ? scale_to_float(p->v_scale[at], p->bf16) : 0.0f;
                zero[i][g] = i < n ? scale_to_float(p->v_zero[at], p->bf16) : 0.0f;
            }
        memset(nibble, 0, sizeof nibble);
        for (int i = 0; i < n; i++) {
            const uint8_t *token = p->v_packed + (bh * p->t + t0 + i) * bytes;
            for (int c = 0; c < d; c++) nibble[c] |= code_at(token, c, bits) << (i * bits);
        }
        for (int64_t m = 0; m < p->m; m++) {
            const float *w = p->weights + (bh * p->m + m) * p->t + t0;
            for (int g = 0; g < nv; g++) {
                zero_sum[g] = 0.0f;
                for (int i = 0; i < per; i++) {
                    scaled[i] = i < n ? w[i] * scale[i][g] : 0.0f;
                    zero_sum[g] += i < n ? w[i] * zero[i][g] : 0.0f;
                }
                nibble_table(table[g], 0.0f, scaled, bits);
            }
            for (int g = 0; g < nv; g++)
                for (int c = g * gv; c < (g + 1) * gv; c++) acc[m * d + c] += table[g][nibble[c]] + zero_sum[g];
        }
    }
}

/* ------------------------------------------------------------------------------------------
   AVX-512: the same, 16 lanes at a time
   ------------------------------------------------------------------------------------------ */
#ifdef VECTOR

#define ROWS 4   /* rows whose key lookups share one shift of the code words */
#define TILE 64  /* tokens whose value nibbles are built once for all rows */

static inline __m512 scales16(const uint16_t *x, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)x);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

static inline float scale_vector(uint16_t h, int bf16) {
    return bf16 ? bits_to_float((uint32_t)h << 16) : _cvtsh_ss(h);
}

/* part[i][v] = (v >> i*bits) & mask: the code of a nibble's i-th element, for tables built by FMAs */
static inline void nibble_parts(__m512 part[4], int bits) {
    const __m512i v = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int i = 0; i < 4 / bits; i++)
        part[i] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, i * bits), mask));
}

/* Scores of `rows` rows for n tokens from their tables (lut[r][nibble]) and transposed code words
   (words[w][i]: word w of token i). The nibble shift is shared by the rows. */
static inline __attribute__((always_inline)) void
lookup_rows(const __m512 *lut, const uint32_t (*words)[SUB], int64_t n, float *score, int64_t stride,
            const int rows, const int n_words) {
    for (int64_t i = 0; i < n; i += 16) {
        __m512 acc[ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int w = 0; w < n_words; w++) {
            const __m512i word = _mm512_load_si512(&words[w][i]);
            for (int nib = 0; nib < 8; nib++) {
                const __m512i index = _mm512_srli_epi32(word, 4 * nib); /* vpermps reads the low 4 bits */
                for (int r = 0; r < rows; r++)
                    acc[r][nib & 1] = _mm512_add_ps(acc[r][nib & 1],
                                                    _mm512_permutexvar_ps(index, lut[(r * n_words + w) * 8 + nib]));
            }
        }
        for (int r = 0; r < rows; r++)
            _mm512_mask_storeu_ps(score + r * stride + i, tail_mask(n - i), _mm512_add_ps(acc[r][0], acc[r][1]));
    }
}

static inline __attribute__((always_inline)) void
score_vector(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e, const int bits, const int d) {
    const int n_words = d * bits / 32, nibbles = 8 * n_words, per = 4 / bits;
    const int64_t n = e - a, at = (bh * ((p->t + p->group - 1) / p->group) + j) * d;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    uint32_t words[MAX_D * 2 / 32][SUB] __attribute__((aligned(64)));
    float qs[MAX_D] __attribute__((aligned(64)));
    __m512 lut[ROWS * MAX_D / 2], part[4];
    nibble_parts(part, bits);

    /* Transpose the code words: 16 tokens' words fill n_words registers, and a two-source permute
       collects word w of the 32 / n_words tokens that each pair of registers holds. */
    const int32_t *codes = (const int32_t *)(p->k_packed + (bh * p->t + a) * (d * bits / 8));
    for (int64_t i = 0; i < n; i += 16) {
        __m512i src[MAX_D * 2 / 32];
        for (int x = 0; x < n_words; x++)
            src[x] = _mm512_maskz_loadu_epi32(tail_mask((n - i) * n_words - 16 * x), codes + i * n_words + 16 * x);
        for (int w = 0; w < n_words; w++) {
            const __m512i index = _mm512_and_si512(
                _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(n_words)), _mm512_set1_epi32(w)),
                _mm512_set1_epi32(31));
            __m512i word = _mm512_setzero_si512();
            for (int pair = 0; pair < n_words / 2; pair++)
                word = _mm512_mask_mov_epi32(word, (__mmask16)(((1u << (32 / n_words)) - 1) << (pair * 32 / n_words)),
                                             _mm512_permutex2var_epi32(src[2 * pair], index, src[2 * pair + 1]));
            _mm512_store_si512(&words[w][i], word);
        }
    }
    for (int64_t m0 = 0; m0 < p->m; m0 += ROWS) {
        const int rows = (int)min64(p->m - m0, ROWS);
        for (int r = 0; r < rows; r++) {
            const float *q = p->rows + (bh * p->m + m0 + r) * d;
            __m512 bias = _mm512_setzero_ps();
            for (int c = 0; c < d; c += 16) {
                const __m512 qv = _mm512_loadu_ps(q + c);
                _mm512_store_ps(qs + c, _mm512_mul_ps(qv, scales16(p->k_scale + at + c, p->bf16)));
                bias = _mm512_fmadd_ps(qv, scales16(p->k_zero + at + c, p->bf16), bias);
            }
            __m512 *table = lut + r * nibbles;
            for (int nib = 0; nib < nibbles; nib++) {
                table[nib] = _mm512_mul_ps(part[0], _mm512_set1_ps(qs[nib * per]));
                for (int i = 1; i < per; i++)
                    table[nib] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(qs[nib * per + i]), table[nib]);
            }
            table[0] = _mm512_add_ps(table[0], _mm512_set1_ps(_mm512_reduce_add_ps(bias)));
        }
        float *score = p->weights + (bh * p->m + m0) * p->t + a;
        switch (rows) { /* constant row counts keep the accumulators in registers */
            case 4: lookup_rows(lut, words, n, score, p->t, 4, n_words); break;
            case 3: lookup_rows(lut, words, n, score, p->t, 3, n_words); break;
            case 2: lookup_rows(lut, words, n, score, p->t, 2, n_words); break;
            default: lookup_rows(lut, words, n, score, p->t, 1, n_words);
        }
    }
}

typedef struct { /* sized by the actual shape, so that a tile stays in few cache lines */
    __m512i nibbles[TILE / 2 * MAX_D / 16]; /* [token group][16 channels] */
    float scale[16 * TILE], zero[16 * TILE]; /* [value group][token], 0 past the end */
} ValueTile;

static inline __attribute__((always_inline)) void
prepare_tile(const Problem *p, ValueTile *tile, int64_t bh, int64_t t0, int n, const int bits, const int d) {
    const int chunks = d / 16, nv = p->value_groups, per = 4 / bits, bytes = d * bits / 8;
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const uint8_t *codes = p->v_packed + (bh * p->t + t0) * bytes;
    for (int k = 0; k < TILE / per; k++)
        for (int c = 0; c < chunks; c++) {
            __m512i nibble = _mm512_setzero_si512();
            for (int i = 0; i < per && per * k + i < n; i++) {
                const uint8_t *token = codes + (per * k + i) * bytes;
                uint32_t word = 0;
                memcpy(&word, token + c * 16 * bits / 8, 2 * bits); /* little-endian, as x86 is */
                if (bits == 1) /* the code word is the mask of the lanes whose bit i is set */
                    nibble = _mm512_mask_or_epi32(nibble, (__mmask16)word, nibble, _mm512_set1_epi32(1 << i));
                else /* each lane shifts its channel's code down */
                    nibble = _mm512_or_si512(nibble, _mm512_slli_epi32(_mm512_and_si512(
                        _mm512_srlv_epi32(_mm512_set1_epi32((int)word), shifts), _mm512_set1_epi32(3)), 2 * i));
            }
            tile->nibbles[k * chunks + c] = nibble;
        }
    const uint16_t *scale = p->v_scale + (bh * p->t + t0) * nv, *zero = p->v_zero + (bh * p->t + t0) * nv;
    for (int g = 0; g < nv; g++)
        for (int i = 0; i < TILE; i++) {
            tile->scale[g * TILE + i] = i < n ? scale_vector(scale[i * nv + g], p->bf16) : 0.0f;
            tile->zero[g * TILE + i] = i < n ? scale_vector(zero[i * nv + g], p->bf16) : 0.0f;
        }
}

/* acc[m][:] += the tile's weighted values for rows [m0, m0 + rows); channels go in blocks of 64 so
   that the rows' 24 accumulators stay in registers. */
static inline __attribute__((always_inline)) void
mix_rows(const Problem *p, const ValueTile *tile, int64_t bh, int64_t t0, int n, int64_t m0, float *acc_out,
         const int rows, const int bits, const int d) {
    const int nv = p->value_groups, chunks_per_group = d / 16 / nv, per = 4 / bits;
    __m512 part[4];
    nibble_parts(part, bits);
    float scaled[6 * 16 * TILE] __attribute__((aligned(64))), zero_sum[6][16]; /* [row][value group][token] */
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < nv; g++) {
            const float *w = p->weights + (bh * p->m + m0 + r) * p->t + t0;
            __m512 zs = _mm512_setzero_ps();
            for (int i = 0; i < TILE; i += 16) {
                const __m512 wv = _mm512_maskz_loadu_ps(tail_mask(n - i), w + i);
                _mm512_store_ps(scaled + (r * nv + g) * TILE + i,
                                _mm512_mul_ps(wv, _mm512_load_ps(tile->scale + g * TILE + i)));
                zs = _mm512_fmadd_ps(wv, _mm512_load_ps(tile->zero + g * TILE + i), zs);
            }
            zero_sum[r][g] = _mm512_reduce_add_ps(zs);
        }
    for (int c0 = 0; c0 < d / 16; c0 += 4) {
        int group[4];
        for (int c = 0; c < 4; c++) group[c] = (c0 + c) / chunks_per_group;
        __m512 acc[6][4];
        for (int r = 0; r < 6; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int k = 0; k < (n + per - 1) / per; k++)
#pragma GCC unroll 6
            for (int r = 0; r < rows; r++) {
                __m512 table = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    if (c == 0 || group[c] != group[c - 1]) {
                        const float *w = scaled + (r * nv + group[c]) * TILE + per * k;
                        table = _mm512_mul_ps(part[0], _mm512_set1_ps(w[0]));
                        for (int i = 1; i < per; i++) table = _mm512_fmadd_ps(part[i], _mm512_set1_ps(w[i]), table);
                    }
                    const __m512i nibble = tile->nibbles[k * (d / 16) + c0 + c];
                    acc[r][c] = _mm512_add_ps(acc[r][c], _mm512_permutexvar_ps(nibble, table));
                }
            }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) {
                float *dst = acc_out + (m0 + r) * d + 16 * (c0 + c);
                const __m512 sum = _mm512_add_ps(acc[r][c], _mm512_set1_ps(zero_sum[r][group[c]]));
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), sum));
            }
    }
}

static inline __attribute__((always_inline)) void
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    ValueTile tile __attribute__((aligned(64)));
    for (int64_t t0 = a; t0 < e; t0 += TILE) {
        const int n = (int)min64(e - t0, TILE);
        prepare_tile(p, &tile, bh, t0, n, bits, d);
        for (int64_t m0 = 0; m0 < p->m; m0 += 6)
            switch (min64(p->m - m0, 6)) { /* constant row counts keep the accumulators in registers */
                case 6: mix_rows(p, &tile, bh, t0, n, m0, acc, 6, bits, d); break;
                case 5: mix_rows(p, &tile, bh, t0, n, m0, acc, 5, bits, d); break;
                case 4: mix_rows(p, &tile, bh, t0, n, m0, acc, 4, bits, d); break;
                case 3: mix_rows(p, &tile, bh, t0, n, m0, acc, 3, bits, d); break;
                case 2: mix_rows(p, &tile, bh, t0, n, m0, acc, 2, bits, d); break;
                default: mix_rows(p, &tile, bh, t0, n, m0, acc, 1, bits, d);
            }
    }
}

/* One function per common shape, so that the compiler sees d and bits as constants. */
#define SHAPES(X) X(1, 64) X(2, 64) X(1, 128) X(2, 128)
#define DEFINE(B, D)                                                                                   \
    static void score_##B##_##D(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {     \
        score_vector(p, bh, j, a, e, B, D);                                                            \
    }                                                                                                  \
    static void mix_##B##_##D(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {      \
        mix_vector(p, bh, a, e, acc, B, D);                                                            \
    }
SHAPES(DEFINE)
static void score_any(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {
    score_vector(p, bh, j, a, e, p->bits, (int)p->d);
}
static void mix_any(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {
    mix_vector(p, bh, a, e, acc, p->bits, (int)p->d);
}
#endif /* VECTOR */

/* ------------------------------------------------------------------------------------------
   The two phases
   ------------------------------------------------------------------------------------------ */

typedef void (*ScoreFn)(const Problem *, int64_t, int64_t, int64_t, int64_t);
typedef void (*MixFn)(const Problem *, int64_t, int64_t, int64_t, float *);

static void pick(const Problem *p, ScoreFn *score, MixFn *mix) {
    *score = score_plain;
    *mix = mix_plain;
#ifndef VECTOR
    (void)p;
#else
    /* a power-of-two number of code words per token and whole blocks of 64 channels; the value
       group, min(group, d), is then a multiple of 16 channels too */
    if ((p->d != 64 && p->d != 128 && p->d != 256) || p->group % 16) return;
    *score = score_any;
    *mix = mix_any;
#define PICK(B, D) if (p->bits == B && p->d == D) *score = score_##B##_##D, *mix = mix_##B##_##D;
    SHAPES(PICK)
#endif
}

static float max_of(const float *w, int64_t n, float top) {
#ifdef VECTOR
    __m512 best = _mm512_set1_ps(top);
    for (int64_t i = 0; i < n; i += 16) best = _mm512_mask_max_ps(best, tail_mask(n - i), best, _mm512_loadu_ps(w + i));
    return _mm512_reduce_max_ps(best);
#else
    float best[8] = {top, top, top, top, top, top, top, top}; /* eight partial maxima, so that it vectorizes */
    for (int64_t i = 0; i < n; i++) best[i % 8] = w[i] > best[i % 8] ? w[i] : best[i % 8];
    for (int k = 0; k < 8; k++) top = best[k] > top ? best[k] : top;
    return top;
#endif
}

static int64_t visible(const Problem *p, int64_t bh) {
    const int64_t len = p->visible_len[bh / p->heads];
    return len < 0 ? 0 : min64(len, p->t);
}

/* Phase 1 for positions [c0, c1) of head bh: scores, exclusions, and the rows' maxima into top[M]. */
static void score_chunk(const Problem *p, ScoreFn score, int64_t bh, int64_t c0, int64_t c1, float *top) {
    const int64_t end = min64(c1, visible(p, bh));
    for (int64_t m = 0; m < p->m; m++) top[m] = -INFINITY;
    for (int64_t s0 = c0; s0 < end; s0 += SUB) {
        const int64_t s1 = min64(s0 + SUB, end);
        for (int64_t j = s0 / p->group; j * p->group < s1; j++)
            score(p, bh, j, j * p->group > s0 ? j * p->group : s0, min64((j + 1) * p->group, s1));
        for (int64_t x = 0; x < p->k; x++) {
            const int64_t pos = p->excluded_pos[bh * p->k + x];
            if (p->excluded_valid[bh * p->k + x] && pos >= s0 && pos < s1)
                for (int64_t m = 0; m < p->m; m++) p->weights[(bh * p->m + m) * p->t + pos] = -INFINITY;
        }
        for (int64_t m = 0; m < p->m; m++) top[m] = max_of(p->weights + (bh * p->m + m) * p->t + s0, s1 - s0, top[m]);
    }
}

/* Phase 2 for positions [c0, c1) of head bh, given the rows' maxima top[M]: weights in place,
   their sums into sum[M] and the weighted values into acc[M][D] (both zeroed here). */
static void mix_chunk(const Problem *p, MixFn mix, int64_t bh, int64_t c0, int64_t c1, const float *top,
                      float *sum, float *acc) {
    const int64_t end = min64(c1, visible(p, bh));
    memset(sum, 0, p->m * sizeof *sum);
    memset(acc, 0, p->m * p->d * sizeof *acc);
    for (int64_t m = 0; m < p->m; m++) {
        float *w = p->weights + (bh * p->m + m) * p->t;
        const int64_t zero_from = top[m] == -INFINITY ? c0 : end > c0 ? end : c0; /* nothing visible: all 0 */
        memset(w + zero_from, 0, (c1 - zero_from) * sizeof *w);
    }
    for (int64_t s0 = c0; s0 < end; s0 += SUB) {
        const int64_t s1 = min64(s0 + SUB, end);
        for (int64_t m = 0; m < p->m; m++)
            if (top[m] != -INFINITY) sum[m] += exp_sum(p->weights + (bh * p->m + m) * p->t + s0, s1 - s0, top[m]);
        mix(p, bh, s0, s1, acc);
    }
}

/* row_max, row_sum and out of head bh from its chunks' partial results, in chunk order */
static void finish_head(const Problem *p, int64_t bh, int64_t chunks, const float *partial, int64_t stride) {
    const int64_t m = p->m, d = p->d;
    for (int64_t r = 0; r < m; r++) {
        float total = 0.0f, *o = p->out + (bh * m + r) * d;
        memset(o, 0, d * sizeof *o);
        for (int64_t c = 0; c < chunks; c++) {
            const float *part = partial + (bh * chunks + c) * stride;
            total += part[2 * m + r];
            for (int64_t x = 0; x < d; x++) o[x] += part[3 * m + r * d + x];
        }
        p->row_max[bh * m + r] = partial[bh * chunks * stride + m + r];
        p->row_sum[bh * m + r] = total;
    }
}

/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int lowbit_partial_attention(const Problem *p) {
    if (p->batch < 1 || p->heads < 1 || (p->bits != 1 && p->bits != 2) || p->d % 16 || p->d > MAX_D || p->group <= 0 || p->group % 8 ||
        p->value_groups <= 0 || p->d % p->value_groups || p->d / p->value_groups < 8 || p->threads <= 0 || p->t <= 0)
        return -1;
    const int64_t heads = p->batch * p->heads, m = p->m, d = p->d;
    const int threads = (int)min64(p->threads, heads * p->t * m / MIN_WORK > 1 ? heads * p->t * m / MIN_WORK : 1);
    /* About TASKS tasks to balance the threads, each a whole number of sub-chunks and key groups;
       chosen without the thread count, so that the sums do not depend on it. */
    const int64_t align = p->group % SUB == 0 ? p->group : SUB % p->group == 0 ? SUB : (int64_t)SUB * p->group;
    const int64_t want = (TASKS + heads - 1) / heads;
    const int64_t chunk = ((p->t + want - 1) / want + align - 1) / align * align;
    const int64_t chunks = (p->t + chunk - 1) / chunk, tasks = heads * chunks;
    const int64_t stride = m * (3 + d); /* per task: its max[M], the head's max[M], sum[M], acc[M][D] */
    float *partial = malloc(tasks * stride * sizeof(float));
    int *done = calloc(heads, sizeof(int));
    if (!partial || !done) {
        free(partial);
        free(done);
        return -2;
    }
    ScoreFn score;
    MixFn mix;
    pick(p, &score, &mix);

    /* one barrier, between the phases; each head is finished by whichever of its tasks ends last */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t c0 = task % chunks * chunk;
            score_chunk(p, score, task / chunks, c0, min64(c0 + chunk, p->t), partial + task * stride);
        }
#pragma omp for schedule(dynamic) nowait
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t bh = task / chunks, c0 = task % chunks * chunk;
            float *part = partial + task * stride;
            for (int64_t r = 0; r < m; r++) {
                part[m + r] = -INFINITY;
                for (int64_t c = 0; c < chunks; c++) {
                    const float x = partial[(bh * chunks + c) * stride + r];
                    part[m + r] = x > part[m + r] ? x : part[m + r];
                }
            }
            mix_chunk(p, mix, bh, c0, min64(c0 + chunk, p->t), part + m, part + 2 * m, part + 3 * m);
            if (__atomic_add_fetch(&done[bh], 1, __ATOMIC_ACQ_REL) == chunks)
                finish_head(p, bh, chunks, partial, stride);
        }
    }
    free(partial);
    free(done);
    return 0;
}
