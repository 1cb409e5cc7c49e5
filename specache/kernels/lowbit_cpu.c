/* Attention of float query rows over SpeCache's packed 1-/2-bit keys and values, on CPUs.

   lowbit_cpu.py states the contract and the layout, and builds this file at first use
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
   - Softmax, tasks and threads: lowbit_driver.h, which lowbit_int_cpu.c shares; the vector value
     mix is in value_tables.h, which the sparse pass (lowbit_sparse_cpu.c) shares.

   With AVX-512 (F, BW, VL) and F16C, head_dim 64, 128 or 256 and group a multiple of 16 take the
   vectorized paths; other shapes, and builds without them, take the plain C functions, which run
   the same algorithm one lookup at a time. */
#include "value_tables.h"

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
    uint32_t words[MAX_D * 2 / 32][SUB] __attribute__((aligned(64)));
    float qs[MAX_D] __attribute__((aligned(64)));
    __m512 lut[ROWS * MAX_D / 2], part[4];
    nibble_parts(part, bits);

    transpose_words(p, bh, a, e, words, bits, d);
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

static inline __attribute__((always_inline)) void
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    mix_tables(p, bh, a, e, acc, NULL, bits, d); /* value_tables.h */
}

VECTOR_SHAPES()
#endif /* VECTOR */

/* ------------------------------------------------------------------------------------------
   The two phases
   ------------------------------------------------------------------------------------------ */

static void pick(const Problem *p, ScoreFn *score, MixFn *mix) {
    *score = score_plain;
    *mix = mix_plain;
#ifndef VECTOR
    (void)p;
#else
    /* a power-of-two number of code words per token and whole blocks of 64 channels; the value
       group, min(group, d), is then a multiple of 16 channels too */
    if ((p->d != 64 && p->d != 128 && p->d != 256) || p->group % 16) return;
    PICK_SHAPE(p, score, mix);
#endif
}
/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int lowbit_partial_attention(const Problem *p) {
    if (!valid_problem(p)) return -1;
    ScoreFn score;
    MixFn mix;
    pick(p, &score, &mix);
    return run_tasks(p, score, mix);
}
