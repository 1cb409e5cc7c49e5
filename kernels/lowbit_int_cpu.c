/* SpeCache's integer low-bit pass on CPUs: the attention of float query rows over packed 1-/2-bit
   keys and values with both products on int8 operands. specache.py's
   lowbit_partial_attention_int8_reference is the spec; kernels/lowbit_int_cpu.py builds this file
   at first use and states the contract.

   - Keys: per row and key group j, q8 = round(q * s_j / alpha) with alpha = max |q * s_j| / 127,
     and score = alpha * (q8 . code) + q . z_j.
   - Values: per row, tile of 64 positions and value group g, w8 = round(w * s_g / beta) with
     beta = max |w * s_g| / 127, and out += beta * (w8 . code) + w . z_g.
   The roundings use the twin's division and round-half-to-even, so q8 and w8 are the twin's own
   given the same float inputs, and the integer sums are exact: only float sums (the biases, the
   tiles' terms) and exp (kernels/simd.h's polynomial) differ from the twin, in their last bits.

   With AVX512-VNNI and AVX512-VBMI (Ice Lake, Zen 4 and later), 16 lanes of 4 bytes each go per
   VPDPBUSD, codes as the unsigned operand and q8 or w8 as the signed one:
   - keys, lanes over tokens: the transposed code words of 16 tokens (words[w][i]) go through a
     multishift that widens 4 channels of each token to one byte each, shared by every row; then
     one VPDPBUSD per row adds those 4 channels' products for the 16 tokens;
   - values, lanes over channels: a tile's codes are widened once, for all rows, to a dword per
     channel holding its codes in 4 consecutive tokens; one VPDPBUSD per row then adds 4 tokens'
     products for 16 channels.
   Other builds and shapes run the plain C functions, the same arithmetic one product at a time.
   The softmax, the tasks and the threads are kernels/lowbit_driver.h's, as for the float pass. */
#include "lowbit_driver.h"

#define INT8_TILE 64 /* specache.INT8_BLOCK: positions whose weights round against one largest */

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

static void mix_int_plain(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {
    const int bits = p->bits, d = (int)p->d, nv = p->value_groups, gv = d / nv, bytes = d * bits / 8;
    float scaled[INT8_TILE];
    int8_t w8[INT8_TILE];
    for (int64_t t0 = a; t0 < e; t0 += INT8_TILE) {
        const int n = (int)min64(e - t0, INT8_TILE);
        for (int64_t m = 0; m < p->m; m++) {
            const float *w = p->weights + (bh * p->m + m) * p->t + t0;
            for (int g = 0; g < nv; g++) {
                float top = 0.0f, zero_sum = 0.0f;
                for (int i = 0; i < n; i++) {
                    const int64_t at = (bh * p->t + t0 + i) * nv + g;
                    scaled[i] = w[i] * scale_to_float(p->v_scale[at], p->bf16);
                    top = fabsf(scaled[i]) > top ? fabsf(scaled[i]) : top;
                    zero_sum += w[i] * scale_to_float(p->v_zero[at], p->bf16);
                }
                const float beta = top / 127.0f;
                round_int8(scaled, n, top, w8);
                for (int c = g * gv; c < (g + 1) * gv; c++) {
                    int32_t sum = 0;
                    for (int i = 0; i < n; i++) sum += w8[i] * code_at(p->v_packed + (bh * p->t + t0 + i) * bytes, c, bits);
                    acc[m * d + c] += beta * (float)sum + zero_sum;
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------
   AVX512-VNNI and VBMI
   ------------------------------------------------------------------------------------------ */
#if defined(VECTOR) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define INT_VECTOR 1
#define INT_ROWS 8 /* rows that share one widening of the key codes */
#define MIX_ROWS 4 /* rows whose value accumulators stay in registers together */

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
score_int_vector(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e, const int bits, const int d) {
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

typedef struct {
    __m512i codes[INT8_TILE / 4 * MAX_D / 16]; /* [token quad][16 channels]: 4 tokens' codes as bytes */
    float scale[16 * INT8_TILE], zero[16 * INT8_TILE]; /* [value group][token], 0 past the end */
} IntTile;

/* The tile's codes widened to bytes, for all rows. First, per quad k of tokens, slices[k][x] packs
   16-bit slice x of the 4 tokens' codes into a qword (token i in bits 16i .. 16i+15); then a bit
   shuffle picks, for each channel of a chunk and each token, its code bits into a byte mask. */
static inline __attribute__((always_inline)) void
widen_tile(const Problem *p, IntTile *tile, int64_t bh, int64_t t0, int n, const int bits, const int d) {
    const int chunks = d / 16, nv = p->value_groups, bytes = d * bits / 8, n_slices = bytes / 2;
    const uint8_t *codes = p->v_packed + (bh * p->t + t0) * bytes;
    uint64_t slices[INT8_TILE / 4 * MAX_D * 2 / 16] __attribute__((aligned(64))); /* [quad][slice] */
    if (n_slices <= 8) { /* 64 bytes hold 8 / n_slices quads: one word permute makes 8 slices */
        __m512i index = _mm512_setzero_si512();
        uint16_t order[32];
        for (int y = 0; y < 32; y++) /* qword y / 4 = slice x of quad y / 4 / n_slices, token y % 4 */
            order[y] = (uint16_t)((y / 4 / n_slices) * 4 * n_slices + (y % 4) * n_slices + y / 4 % n_slices);
        memcpy(&index, order, sizeof order);
        for (int k = 0; k < (n + 3) / 4; k += 8 / n_slices) {
            const int64_t left = (int64_t)(n - 4 * k) * bytes;
            const __m512i block = _mm512_maskz_loadu_epi8(left >= 64 ? ~0ULL : (1ULL << left) - 1, codes + 4 * k * bytes);
            _mm512_store_si512(slices + k * n_slices, _mm512_permutexvar_epi16(index, block));
        }
    } else {
        for (int k = 0; k < (n + 3) / 4; k++)
            for (int x = 0; x < n_slices; x++) {
                uint64_t slice = 0;
                for (int i = 0; i < 4 && 4 * k + i < n; i++) {
                    uint16_t word;
                    memcpy(&word, codes + (4 * k + i) * bytes + 2 * x, 2);
                    slice |= (uint64_t)word << 16 * i;
                }
                slices[k * n_slices + x] = slice;
            }
    }
    /* byte 4l + i of a chunk's quad: channel l, token i; 2 bits: slots 0-3 hold slice 2c (channels
       0-7), slots 4-7 slice 2c + 1 */
    uint8_t pick[2][64];
    for (int j = 0; j < 64; j++)
        for (int b = 0; b < bits; b++)
            pick[b][j] = (uint8_t)(16 * (j % 4) + (bits == 1 ? j / 4 : 2 * (j / 4 % 8) + b));
    __m512i low, high;
    memcpy(&low, pick[0], 64);
    memcpy(&high, pick[1], 64);
    const __m512i one = _mm512_set1_epi8(1), two = _mm512_set1_epi8(2);
    for (int k = 0; k < (n + 3) / 4; k++)
        for (int c = 0; c < chunks; c++) {
            if (bits == 1) {
                const __m512i source = _mm512_set1_epi64((long long)slices[k * n_slices + c]);
                tile->codes[k * chunks + c] = _mm512_maskz_mov_epi8(_mm512_bitshuffle_epi64_mask(source, low), one);
            } else {
                const __m512i source = _mm512_inserti64x4(_mm512_set1_epi64((long long)slices[k * n_slices + 2 * c]),
                                                          _mm256_set1_epi64x((long long)slices[k * n_slices + 2 * c + 1]), 1);
                const __m512i quad = _mm512_maskz_mov_epi8(_mm512_bitshuffle_epi64_mask(source, low), one);
                tile->codes[k * chunks + c] =
                    _mm512_mask_add_epi8(quad, _mm512_bitshuffle_epi64_mask(source, high), quad, two);
            }
        }
    const uint16_t *scale = p->v_scale + (bh * p->t + t0) * nv, *zero = p->v_zero + (bh * p->t + t0) * nv;
    if (nv == 1 && n == INT8_TILE) {
        for (int i = 0; i < INT8_TILE; i += 16) {
            _mm512_store_ps(tile->scale + i, scales16(scale + i, p->bf16));
            _mm512_store_ps(tile->zero + i, scales16(zero + i, p->bf16));
        }
        return;
    }
    for (int g = 0; g < nv; g++)
        for (int i = 0; i < INT8_TILE; i++) {
            tile->scale[g * INT8_TILE + i] = i < n ? scale_vector(scale[i * nv + g], p->bf16) : 0.0f;
            tile->zero[g * INT8_TILE + i] = i < n ? scale_vector(zero[i * nv + g], p->bf16) : 0.0f;
        }
}

/* acc[m][:] += the tile's weighted values for rows [m0, m0 + rows); channels go in blocks of 64,
   16 accumulators for 4 rows. */
static inline __attribute__((always_inline)) void
mix_int_rows(const Problem *p, const IntTile *tile, int64_t bh, int64_t t0, int n, int64_t m0, float *acc_out,
             const int rows, const int d) {
    const int nv = p->value_groups, chunks_per_group = d / 16 / nv;
    int8_t w8[MIX_ROWS][16][INT8_TILE] __attribute__((aligned(64))); /* [row][value group][token] */
    float beta[MIX_ROWS][16], zero_sum[MIX_ROWS][16];
    for (int r = 0; r < rows; r++) {
        const float *w = p->weights + (bh * p->m + m0 + r) * p->t + t0;
        for (int g = 0; g < nv; g++) {
            __m512 scaled[INT8_TILE / 16], top = _mm512_setzero_ps(), zs = _mm512_setzero_ps();
            for (int i = 0; i < INT8_TILE; i += 16) {
                const __m512 wv = _mm512_maskz_loadu_ps(tail_mask(n - i), w + i);
                scaled[i / 16] = _mm512_mul_ps(wv, _mm512_load_ps(tile->scale + g * INT8_TILE + i));
                top = _mm512_max_ps(top, _mm512_abs_ps(scaled[i / 16]));
                zs = _mm512_fmadd_ps(wv, _mm512_load_ps(tile->zero + g * INT8_TILE + i), zs);
            }
            const float largest = _mm512_reduce_max_ps(top), inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
            beta[r][g] = largest / 127.0f;
            zero_sum[r][g] = _mm512_reduce_add_ps(zs);
            for (int i = 0; i < INT8_TILE; i += 16)
                _mm_store_si128((__m128i *)(w8[r][g] + i), round16(scaled[i / 16], inverse));
        }
    }
    for (int c0 = 0; c0 < d / 16; c0 += 4) {
        int group[4];
        for (int c = 0; c < 4; c++) group[c] = (c0 + c) / chunks_per_group;
        const int uniform = group[0] == group[3]; /* one value group: one broadcast per row */
        __m512i acc[MIX_ROWS][4];
        for (int r = 0; r < MIX_ROWS; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_si512();
        for (int k = 0; k < (n + 3) / 4; k++) {
            __m512i codes[4];
            for (int c = 0; c < 4; c++) codes[c] = tile->codes[k * (d / 16) + c0 + c];
#pragma GCC unroll 4
            for (int r = 0; r < rows; r++) {
                int32_t quad[4];
                for (int c = 0; c < 4; c++) memcpy(quad + c, w8[r][group[uniform ? 0 : c]] + 4 * k, 4);
                const __m512i first = _mm512_set1_epi32(quad[0]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], codes[c], uniform ? first : _mm512_set1_epi32(quad[c]));
            }
        }
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++) {
                float *dst = acc_out + (m0 + r) * d + 16 * (c0 + c);
                const __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_set1_ps(beta[r][group[c]]));
                const __m512 term = _mm512_add_ps(sum, _mm512_set1_ps(zero_sum[r][group[c]]));
                _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), term));
            }
    }
}

static inline __attribute__((always_inline)) void
mix_int_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    IntTile tile __attribute__((aligned(64)));
    for (int64_t t0 = a; t0 < e; t0 += INT8_TILE) {
        const int n = (int)min64(e - t0, INT8_TILE);
        widen_tile(p, &tile, bh, t0, n, bits, d);
        for (int64_t m0 = 0; m0 < p->m; m0 += MIX_ROWS)
            switch (min64(p->m - m0, MIX_ROWS)) { /* constant row counts keep the accumulators in registers */
                case 4: mix_int_rows(p, &tile, bh, t0, n, m0, acc, 4, d); break;
                case 3: mix_int_rows(p, &tile, bh, t0, n, m0, acc, 3, d); break;
                case 2: mix_int_rows(p, &tile, bh, t0, n, m0, acc, 2, d); break;
                default: mix_int_rows(p, &tile, bh, t0, n, m0, acc, 1, d);
            }
    }
}

/* One function per common shape, so that the compiler sees d and bits as constants. */
#define SHAPES(X) X(1, 64) X(2, 64) X(1, 128) X(2, 128)
#define DEFINE(B, D)                                                                                   \
    static void score_##B##_##D(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {     \
        score_int_vector(p, bh, j, a, e, B, D);                                                        \
    }                                                                                                  \
    static void mix_##B##_##D(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {      \
        mix_int_vector(p, bh, a, e, acc, B, D);                                                        \
    }
SHAPES(DEFINE)
static void score_any(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {
    score_int_vector(p, bh, j, a, e, p->bits, (int)p->d);
}
static void mix_any(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {
    mix_int_vector(p, bh, a, e, acc, p->bits, (int)p->d);
}
#endif /* INT_VECTOR */

static void pick(const Problem *p, ScoreFn *score, MixFn *mix) {
    *score = score_int_plain;
    *mix = mix_int_plain;
#ifndef INT_VECTOR
    (void)p;
#else
    /* as the float pass: whole words of 32 code bits and whole blocks of 64 channels */
    if ((p->d != 64 && p->d != 128 && p->d != 256) || p->group % 16) return;
    *score = score_any;
    *mix = mix_any;
#define PICK(B, D) if (p->bits == B && p->d == D) *score = score_##B##_##D, *mix = mix_##B##_##D;
    SHAPES(PICK)
#endif
}

/* 1 where this build has the integer vector path, 0 where it runs the plain C functions */
int lowbit_int_vector_build(void) {
#ifdef INT_VECTOR
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int lowbit_partial_attention_int8(const Problem *p) {
    if (!valid_problem(p)) return -1;
    ScoreFn score;
    MixFn mix;
    pick(p, &score, &mix);
    return run_tasks(p, score, mix);
}
