/* SpeCache's integer low-bit pass on CPUs: the attention of float query rows over packed 1-/2-bit
   keys and values with both products on int8 operands. specache/ops.py's
   lowbit_partial_attention_int8_reference is the spec; lowbit_int_cpu.py builds this file
   at first use and states the contract.

   - Keys: per row and key group j, with top = max |q * s_j|, q8 = round(q * s_j * (127 / top)),
     and score = (top / 127) * (q8 . code) + q . z_j.
   - Values: per row, tile of 64 positions and value group g, with top = max |w * s_g|,
     w8 = round(w * s_g * (127 / top)), and out += (top / 127) * (w8 . code) + w . z_g.
   The roundings use the twin's operations (one true division for 127 / top, round half to even),
   so q8 and w8 are the twin's own given the same float inputs, and the integer sums are exact:
   only float sums (the biases, the tiles' terms) and exp (simd.h's polynomial) differ from
   the twin, in their last bits.

   With AVX512-VNNI, VBMI and BITALG (Ice Lake, Zen 4 and later), 16 lanes of 4 bytes each go per
   VPDPBUSD, codes as the unsigned operand and q8 or w8 as the signed one:
   - keys, lanes over tokens: the transposed code words of 16 tokens (words[w][i]) go through a
     multishift that widens 4 channels of each token to one byte each, shared by every row; then
     one VPDPBUSD per row adds those 4 channels' products for the 16 tokens;
   - values, lanes over channels: a tile's codes are widened once, for all rows, to a dword per
     channel holding its codes in 4 consecutive tokens; one VPDPBUSD per row then adds 4 tokens'
     products for 16 channels.
   With AVX2 alone, VPMADDUBSW and VPMADDWD do the same work in 8 lanes (see there). Other builds
   and shapes run the plain C functions, the same arithmetic one product at a time. The softmax,
   the tasks and the threads are lowbit_driver.h's, as for the float pass. */
#include "int_scores.h"

#define INT8_TILE 64 /* specache.INT8_BLOCK: positions whose weights round against one largest */

/* ------------------------------------------------------------------------------------------
   Plain C
   ------------------------------------------------------------------------------------------ */

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
#if defined(INT_VECTOR)
#define MIX_ROWS 4 /* rows whose value accumulators stay in registers together */

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
    if (nv == 2 && n == INT8_TILE) { /* 16 tokens' two groups in two registers: split even and odd */
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int i = 0; i < INT8_TILE; i += 16) {
            const __m512 s0 = scales16(scale + 2 * i, p->bf16), s1 = scales16(scale + 2 * i + 16, p->bf16);
            const __m512 z0 = scales16(zero + 2 * i, p->bf16), z1 = scales16(zero + 2 * i + 16, p->bf16);
            _mm512_store_ps(tile->scale + i, _mm512_permutex2var_ps(s0, even, s1));
            _mm512_store_ps(tile->scale + INT8_TILE + i, _mm512_permutex2var_ps(s0, odd, s1));
            _mm512_store_ps(tile->zero + i, _mm512_permutex2var_ps(z0, even, z1));
            _mm512_store_ps(tile->zero + INT8_TILE + i, _mm512_permutex2var_ps(z0, odd, z1));
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
                int32_t quad;
                if (uniform) { /* one broadcast for the 4 chunks */
                    memcpy(&quad, w8[r][group[0]] + 4 * k, 4);
                    const __m512i weights = _mm512_set1_epi32(quad);
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], codes[c], weights);
                } else
                    for (int c = 0; c < 4; c++) {
                        memcpy(&quad, w8[r][group[c]] + 4 * k, 4);
                        acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], codes[c], _mm512_set1_epi32(quad));
                    }
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
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
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

#elif defined(INT_AVX2)
/* AVX2 (int_scores.h has the scores): values, lanes over channels, 4 tokens per dword. Code
   pairs sum to at most 2 * 3 * 127 in int16, and a tile's 16 quads to 16 times that. */

/* A tile's value codes for all rows: codes[k][c] holds, for the 8 channels of chunk c, their codes
   in tokens 4k .. 4k+3 as the 4 bytes of a dword; scale and zero as the VNNI path's. */
typedef struct {
    __m256i codes[INT8_TILE / 4 * MAX_D / 8];
    float scale[16 * INT8_TILE], zero[16 * INT8_TILE];
} IntTile;

static inline __attribute__((always_inline)) void
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    const int chunks = d / 8, nv = p->value_groups, chunks_per_group = d / 8 / nv, bytes = d * bits / 8;
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i channel_bit = _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x10101010,
                                                  0x20202020, 0x40404040, (int)0x80808080);
    IntTile tile __attribute__((aligned(32)));
    int8_t w8[16][INT8_TILE] __attribute__((aligned(32)));
    float beta[16], zero_sum[16];
    for (int64_t t0 = a; t0 < e; t0 += INT8_TILE) {
        const int n = (int)min64(e - t0, INT8_TILE), quads = (n + 3) / 4;
        const uint8_t *v = p->v_packed + (bh * p->t + t0) * bytes;
        for (int k = 0; k < quads; k++)
            for (int c = 0; c < chunks; c++) {
                __m256i quad = _mm256_setzero_si256();
                if (bits == 1) { /* byte c of the 4 tokens: lane l keeps bit l of each */
                    uint32_t word = 0;
                    for (int i = 0; i < 4 && 4 * k + i < n; i++) word |= (uint32_t)v[(4 * k + i) * bytes + c] << 8 * i;
                    quad = _mm256_min_epu8(_mm256_and_si256(_mm256_set1_epi32((int)word), channel_bit), _mm256_set1_epi8(1));
                } else
                    for (int i = 0; i < 4 && 4 * k + i < n; i++) {
                        uint16_t word;
                        memcpy(&word, v + (4 * k + i) * bytes + 2 * c, 2);
                        const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(3));
                        quad = _mm256_or_si256(quad, _mm256_slli_epi32(code, 8 * i));
                    }
                tile.codes[k * chunks + c] = quad;
            }
        const uint16_t *scale = p->v_scale + (bh * p->t + t0) * nv, *zero = p->v_zero + (bh * p->t + t0) * nv;
        for (int g = 0; g < nv; g++)
            for (int i = 0; i < INT8_TILE; i++) {
                tile.scale[g * INT8_TILE + i] = i < n ? scale_to_float(scale[i * nv + g], p->bf16) : 0.0f;
                tile.zero[g * INT8_TILE + i] = i < n ? scale_to_float(zero[i * nv + g], p->bf16) : 0.0f;
            }
        for (int64_t m = 0; m < p->m; m++) {
            const float *w = p->weights + (bh * p->m + m) * p->t + t0;
            for (int g = 0; g < nv; g++) {
                __m256 scaled[INT8_TILE / 8], top = _mm256_setzero_ps(), zs = _mm256_setzero_ps();
                for (int i = 0; i < INT8_TILE; i += 8) {
                    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                    const __m256 wv = _mm256_maskload_ps(w + i, lanes);
                    scaled[i / 8] = _mm256_mul_ps(wv, _mm256_load_ps(tile.scale + g * INT8_TILE + i));
                    top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), scaled[i / 8]));
                    zs = _mm256_fmadd_ps(wv, _mm256_load_ps(tile.zero + g * INT8_TILE + i), zs);
                }
                const float largest = hmax8(top), inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
                beta[g] = largest / 127.0f;
                zero_sum[g] = hsum8(zs);
                for (int i = 0; i < INT8_TILE; i += 32)
                    _mm256_store_si256((__m256i *)(w8[g] + i), round32(scaled + i / 8, inverse));
            }
            for (int c0 = 0; c0 < chunks; c0 += 8) { /* 8 chunks of 8 channels: 8 accumulators */
                __m256i pairs[8];
                for (int c = 0; c < 8; c++) pairs[c] = _mm256_setzero_si256();
                for (int k = 0; k < quads; k++)
                    for (int c = 0; c < 8; c++) {
                        int32_t quad;
                        memcpy(&quad, w8[(c0 + c) / chunks_per_group] + 4 * k, 4);
                        pairs[c] = _mm256_add_epi16(pairs[c], _mm256_maddubs_epi16(tile.codes[k * chunks + c0 + c], _mm256_set1_epi32(quad)));
                    }
                for (int c = 0; c < 8; c++) {
                    const int g = (c0 + c) / chunks_per_group;
                    const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[c], _mm256_set1_epi16(1)));
                    float *dst = acc + m * d + 8 * (c0 + c);
                    const __m256 term = _mm256_add_ps(_mm256_mul_ps(sum, _mm256_set1_ps(beta[g])), _mm256_set1_ps(zero_sum[g]));
                    _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), term));
                }
            }
        }
    }
}
#endif

#if defined(INT_VECTOR) || defined(INT_AVX2)
VECTOR_SHAPES()
#endif /* INT_VECTOR || INT_AVX2 */

static void pick(const Problem *p, ScoreFn *score, MixFn *mix) {
    *score = score_int_plain;
    *mix = mix_int_plain;
#if defined(INT_VECTOR) || defined(INT_AVX2)
    if (int_vector_takes(p)) PICK_SHAPE(p, score, mix);
#else
    (void)p;
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
