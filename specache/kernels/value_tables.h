/* The float pass's value mix (lowbit_cpu.c states the algorithm): per tile of 64 positions, the
   nibbles of each channel's codes in 4/bits consecutive tokens, and per row the 16-entry tables of
   the partial weighted sums those tokens can give a channel, one vpermps per 16 channels. The
   float pass mixes every position this way; the sparse pass (lowbit_sparse_cpu.c) where most of a
   sub-chunk is kept, its weights masked by the positions kept. AVX-512 only (VECTOR). */
#ifndef SPECACHE_VALUE_TABLES_H
#define SPECACHE_VALUE_TABLES_H

#include "lowbit_driver.h"

#ifdef VECTOR

#define TILE 64  /* tokens whose value nibbles are built once for all rows */

static inline void nibble_parts(__m512 part[4], int bits) {
    const __m512i v = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    for (int i = 0; i < 4 / bits; i++)
        part[i] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, i * bits), mask));
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

/* acc[m][:] += the tile's weighted values for rows [m0, m0 + rows), but the positions not in
   `keep` (a mask per 16 positions of the tile; NULL: all); channels go in blocks of 64 so that the
   rows' 24 accumulators stay in registers. */
static inline __attribute__((always_inline)) void
mix_rows(const Problem *p, const ValueTile *tile, const __mmask16 *keep, int64_t bh, int64_t t0, int n, int64_t m0,
         float *acc_out, const int rows, const int bits, const int d) {
    const int nv = p->value_groups, chunks_per_group = d / 16 / nv, per = 4 / bits;
    __m512 part[4];
    nibble_parts(part, bits);
    float scaled[6 * 16 * TILE] __attribute__((aligned(64))), zero_sum[6][16]; /* [row][value group][token] */
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < nv; g++) {
            const float *w = p->weights + (bh * p->m + m0 + r) * p->t + t0;
            __m512 zs = _mm512_setzero_ps();
            for (int i = 0; i < TILE; i += 16) {
                const __m512 wv = _mm512_maskz_loadu_ps(tail_mask(n - i) & (keep ? keep[i / 16] : 0xffff), w + i);
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

/* acc[m][:] += the weighted values of positions [a, e) (from a multiple of 64), but those not in
   `keep` (a mask per 16 positions from a; NULL: all) */
static inline __attribute__((always_inline)) void
mix_tables(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const __mmask16 *keep, const int bits,
           const int d) {
    ValueTile tile __attribute__((aligned(64)));
    for (int64_t t0 = a; t0 < e; t0 += TILE) {
        const int n = (int)min64(e - t0, TILE);
        const __mmask16 *masks = keep ? keep + (t0 - a) / 16 : NULL;
        prepare_tile(p, &tile, bh, t0, n, bits, d);
        for (int64_t m0 = 0; m0 < p->m; m0 += 6)
            switch (min64(p->m - m0, 6)) { /* constant row counts keep the accumulators in registers */
                case 6: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 6, bits, d); break;
                case 5: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 5, bits, d); break;
                case 4: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 4, bits, d); break;
                case 3: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 3, bits, d); break;
                case 2: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 2, bits, d); break;
                default: mix_rows(p, &tile, masks, bh, t0, n, m0, acc, 1, bits, d);
            }
    }
}
#endif /* VECTOR */

#endif
