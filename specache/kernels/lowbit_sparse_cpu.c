/* SpeCache's sparse low-bit pass on CPUs (ours, specache/sparse.py): the integer pass's scores and
   softmax, then a value mix that reads, value by value, only the positions some row of the KV head
   weighs at least min_weight, and gives the rest of each key group's weight that group's mean value.
   specache/ops.py's lowbit_partial_attention_sparse_reference is the spec; lowbit_sparse_cpu.py
   builds this file at first use and states the contract.

   Phase 1 is the integer pass's own code (int_scores.h), and the exp lowbit_driver.h's, so weights,
   row_max and row_sum are the integer kernel's bit for bit. Phase 2, per sub-chunk of positions
   (its weights still in L1 from the exp):
   - kept: per 16 positions, the OR over the rows of (w > 0 and w >= min_weight), written as bytes
     and compressed into a list of the kept positions;
   - skipped weight: per row and key group, the sum of the weights not kept, times the group's mean
     value (v_mean) into the row's accumulator;
   - kept values: each kept position's value is dequantized once per block of 64 channels
     (code * scale + zero, as specache/lowbit.py) and multiplied into the accumulators of up to 6
     rows at once (FMA, 4 vectors a row, in registers across the whole list); the skipped weights'
     mean values go through the same accumulators, the means converted once for all rows;
   - where at least 3/4 of the sub-chunk is kept, the float pass's table mix (value_tables.h) with
     the weights not kept masked to 0 instead: a lookup per 16 channels takes 4 / bits tokens where
     an FMA takes one, but it reads every position.
   An FMA per kept position, channel and row is the bound of the list (one 512-bit FMA a cycle on
   Zen 4): that mix beats the integer pass's (4 tokens per VPDPBUSD, plus its tiles' widening and
   rounding) below about a third of the positions kept, and the tables lose to it below about 3/4
   (measured, scripts/bench/bench_lowbit_cpu.py). Splitting the FMAs with masked adds of w * scale
   (1 bit, the FP add pipes) was slower, and dropped. Only float summation order differs from the
   twin.

   Paths: AVX512 where int_scores.h's INT_VECTOR is (compress and mask registers), AVX2 where
   INT_AVX2 is (8 lanes, the kept list by bit scan, no tables), plain C elsewhere and for other
   shapes. */
#include "int_scores.h"
#include "value_tables.h"

/* ------------------------------------------------------------------------------------------
   Plain C
   ------------------------------------------------------------------------------------------ */

/* acc[m] += skipped * v_mean[j] for each row's weight of [g0, g1) (in key group j) not kept */
static void mix_skipped_plain(const Problem *p, int64_t bh, int64_t g0, int64_t g1, float *acc) {
    const int d = (int)p->d;
    const uint16_t *mean = p->v_mean + (bh * ((p->t + p->group - 1) / p->group) + g0 / p->group) * d;
    for (int64_t m = 0; m < p->m; m++) {
        const float *w = p->weights + (bh * p->m + m) * p->t;
        float skipped = 0.0f;
        for (int64_t t = g0; t < g1; t++) skipped += p->kept[bh * p->t + t] ? 0.0f : w[t];
        if (skipped != 0.0f) /* a group all kept adds nothing */
            for (int c = 0; c < d; c++) acc[m * d + c] += skipped * scale_to_float(mean[c], p->bf16);
    }
}

static void mix_sparse_plain(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {
    const int bits = p->bits, d = (int)p->d, nv = p->value_groups, gv = d / nv, bytes = d * bits / 8;
    const float threshold = (float)p->min_weight;
    uint8_t *kept = p->kept + bh * p->t;
    float value[MAX_D];
    for (int64_t t = a; t < e; t++) {
        int keep = 0;
        for (int64_t m = 0; m < p->m; m++) {
            const float w = p->weights[(bh * p->m + m) * p->t + t];
            keep |= w > 0.0f && w >= threshold;
        }
        kept[t] = (uint8_t)keep;
    }
    for (int64_t g0 = a; g0 < e; g0 = min64((g0 / p->group + 1) * p->group, e))
        mix_skipped_plain(p, bh, g0, min64((g0 / p->group + 1) * p->group, e), acc);
    for (int64_t t = a; t < e; t++) {
        if (!kept[t]) continue;
        const uint8_t *token = p->v_packed + (bh * p->t + t) * bytes;
        for (int c = 0; c < d; c++) {
            const int64_t at = (bh * p->t + t) * nv + c / gv;
            value[c] = (float)code_at(token, c, bits) * scale_to_float(p->v_scale[at], p->bf16) +
                       scale_to_float(p->v_zero[at], p->bf16);
        }
        for (int64_t m = 0; m < p->m; m++) {
            const float w = p->weights[(bh * p->m + m) * p->t + t];
            for (int c = 0; c < d; c++) acc[m * d + c] += w * value[c];
        }
    }
}

#if defined(INT_VECTOR) || defined(INT_AVX2)
/* The kept positions' codes, scales and zeros, asked of memory at once: read in the order the
   list gives, few and scattered, they would wait for DRAM one by one (the prefetchers see no
   stream); the skipped weights' sums run meanwhile. */
static inline void prefetch_kept(const Problem *p, int64_t bh, int64_t a, const int32_t *index, int64_t count,
                                 const int bits, const int d) {
    const int nv = p->value_groups, bytes = d * bits / 8;
    for (int64_t x = 0; x < count; x++) {
        const int64_t t = bh * p->t + a + index[x];
        __builtin_prefetch(p->v_packed + t * bytes);
        __builtin_prefetch(p->v_scale + t * nv);
        __builtin_prefetch(p->v_zero + t * nv);
    }
}
#endif

/* ------------------------------------------------------------------------------------------
   AVX512
   ------------------------------------------------------------------------------------------ */
#if defined(INT_VECTOR)
#define KEPT_ROWS 6 /* rows whose accumulators (4 vectors each) stay in registers together */

/* kept of [a, e) into p->kept, masks[i] (positions a + 16i ..), and the kept offsets from a into
   `index` (room for e - a + 16); returns how many are kept. */
static inline int64_t keep_positions(const Problem *p, int64_t bh, int64_t a, int64_t e, __mmask16 *masks,
                                     int32_t *index) {
    const __m512 threshold = _mm512_set1_ps((float)p->min_weight), zero = _mm512_setzero_ps();
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t count = 0;
    for (int64_t i = 0; i < e - a; i += 16) {
        const __mmask16 lanes = tail_mask(e - a - i);
        __mmask16 keep = 0;
        for (int64_t m = 0; m < p->m; m++) {
            const __m512 w = _mm512_maskz_loadu_ps(lanes, p->weights + (bh * p->m + m) * p->t + a + i);
            keep |= _mm512_mask_cmp_ps_mask(_mm512_cmp_ps_mask(w, zero, _CMP_GT_OQ), w, threshold, _CMP_GE_OQ);
        }
        masks[i / 16] = keep;
        _mm_mask_storeu_epi8(p->kept + bh * p->t + a + i, lanes, _mm_maskz_mov_epi8(keep, _mm_set1_epi8(1)));
        /* compressed in a register: Zen 4 compresses to memory slowly */
        _mm512_storeu_si512(index + count,
                            _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i))));
        count += __builtin_popcount(keep);
    }
    return count;
}

/* The sub-chunk [a, e) spans key groups j0 .. j0 + segments - 1 (segments of whole 16s from a). */
#define SEGMENTS (SUB / 16 + 1)

/* skipped[s][r]: the weight of row m0 + r in segment s not kept, 0 where it keeps all */
static inline void skipped_weights(const Problem *p, int64_t bh, int64_t a, int64_t e, const __mmask16 *masks,
                                   int64_t m0, int rows, float (*skipped)[KEPT_ROWS]) {
    for (int64_t g0 = a, s = 0; g0 < e; g0 = min64((g0 / p->group + 1) * p->group, e), s++) {
        const int64_t g1 = min64((g0 / p->group + 1) * p->group, e);
        __mmask16 all = 0xffff;
        for (int64_t i = g0 - a; i < g1 - a; i += 16) all &= masks[i / 16] | (__mmask16)~tail_mask(g1 - a - i);
        for (int r = 0; r < rows; r++) {
            const float *w = p->weights + (bh * p->m + m0 + r) * p->t + a;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = g0 - a; all != 0xffff && i < g1 - a; i += 16)
                sum = _mm512_add_ps(
                    sum, _mm512_maskz_loadu_ps(tail_mask(g1 - a - i) & (__mmask16)~masks[i / 16], w + i));
            skipped[s][r] = all == 0xffff ? 0.0f : _mm512_reduce_add_ps(sum);
        }
    }
}

/* acc[m][c0 .. c0 + 64) += for rows [m0, m0 + rows): the kept positions' weighted values, and each
   segment's skipped weight times its key group's mean value. */
static inline __attribute__((always_inline)) void
mix_kept_rows(const Problem *p, int64_t bh, int64_t a, const int32_t *index, int64_t count,
              const float (*skipped)[KEPT_ROWS], int segments, int64_t m0, int c0, float *acc_out, const int rows,
              const int bits, const int d) {
    const int nv = p->value_groups, gv = d / nv, bytes = d * bits / 8;
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const uint8_t *codes = p->v_packed + (bh * p->t + a) * bytes + c0 * bits / 8;
    const uint16_t *scale = p->v_scale + (bh * p->t + a) * nv, *zero = p->v_zero + (bh * p->t + a) * nv;
    const uint16_t *mean = p->v_mean + (bh * ((p->t + p->group - 1) / p->group) + a / p->group) * d + c0;
    const float *w = p->weights + (bh * p->m + m0) * p->t + a;
    int group[4];
    for (int c = 0; c < 4; c++) group[c] = (c0 + 16 * c) / gv; /* value groups are >= 16 channels */
    __m512 acc[KEPT_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int s = 0; s < segments; s++) { /* the means are converted once for all rows */
        __m512 value[4];
        for (int c = 0; c < 4; c++) value[c] = scales16(mean + s * d + 16 * c, p->bf16);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(skipped[s][r]), value[c], acc[r][c]);
    }
    for (int64_t x = 0; x < count; x++) {
        const int64_t t = index[x];
        __m512 value[4], s = _mm512_setzero_ps(), z = _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            if (c == 0 || group[c] != group[c - 1]) {
                s = _mm512_set1_ps(scale_vector(scale[t * nv + group[c]], p->bf16));
                z = _mm512_set1_ps(scale_vector(zero[t * nv + group[c]], p->bf16));
            }
            if (bits == 1) { /* the code word is the mask of the channels whose code is 1 */
                uint16_t word;
                memcpy(&word, codes + t * bytes + 2 * c, 2);
                value[c] = _mm512_mask_add_ps(z, (__mmask16)word, z, s);
            } else { /* each lane shifts its channel's code down */
                uint32_t word;
                memcpy(&word, codes + t * bytes + 4 * c, 4);
                const __m512i code = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)word), shifts),
                                                      _mm512_set1_epi32(3));
                value[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), s, z);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m512 weight = _mm512_set1_ps(w[r * p->t + t]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_fmadd_ps(weight, value[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) {
            float *dst = acc_out + (m0 + r) * d + c0 + 16 * c;
            _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][c]));
        }
}

static inline __attribute__((always_inline)) void
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    __mmask16 masks[SUB / 16] = {0}; /* whole tiles of them are read */
    int32_t index[SUB + 16];
    float skipped[SEGMENTS][KEPT_ROWS];
    const int64_t count = keep_positions(p, bh, a, e, masks, index);
    const int segments = (int)((e - 1) / p->group - a / p->group + 1);
    const int dense = 4 * count >= 3 * (e - a); /* mostly kept: the float pass's tables (see above) */
    if (dense)
        mix_tables(p, bh, a, e, acc, masks, bits, d);
    else
        prefetch_kept(p, bh, a, index, count, bits, d);
    for (int64_t m0 = 0; m0 < p->m; m0 += KEPT_ROWS) {
        const int rows = (int)min64(p->m - m0, KEPT_ROWS);
        skipped_weights(p, bh, a, e, masks, m0, rows, skipped);
        for (int c0 = 0; c0 < d; c0 += 64)
            switch (rows) { /* constant row counts keep the accumulators in registers */
#define KEPT(R) mix_kept_rows(p, bh, a, index, dense ? 0 : count, skipped, segments, m0, c0, acc, R, bits, d)
                case 6: KEPT(6); break;
                case 5: KEPT(5); break;
                case 4: KEPT(4); break;
                case 3: KEPT(3); break;
                case 2: KEPT(2); break;
                default: KEPT(1);
#undef KEPT
            }
    }
}

/* ------------------------------------------------------------------------------------------
   AVX2: the same in 8 lanes, 2 rows of 4 vectors (32 channels) at a time
   ------------------------------------------------------------------------------------------ */
#elif defined(INT_AVX2)

/* the 8 lanes whose bit of `bits` is set, as a mask vector */
static inline __m256 lanes_of(int bits) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), bit), bit));
}

static inline __m256 load8(const float *x, int64_t left) { /* 0 past `left` lanes */
    return _mm256_maskload_ps(x, _mm256_castps_si256(lanes_of(left >= 8 ? 255 : (1 << left) - 1)));
}

static inline int64_t keep_positions(const Problem *p, int64_t bh, int64_t a, int64_t e, uint8_t *masks,
                                     int32_t *index) {
    const __m256 threshold = _mm256_set1_ps((float)p->min_weight), zero = _mm256_setzero_ps();
    int64_t count = 0;
    for (int64_t i = 0; i < e - a; i += 8) {
        int keep = 0;
        for (int64_t m = 0; m < p->m; m++) {
            const __m256 w = load8(p->weights + (bh * p->m + m) * p->t + a + i, e - a - i);
            const __m256 positive = _mm256_cmp_ps(w, zero, _CMP_GT_OQ);
            keep |= _mm256_movemask_ps(_mm256_and_ps(positive, _mm256_cmp_ps(w, threshold, _CMP_GE_OQ)));
        }
        masks[i / 8] = (uint8_t)keep;
        for (int l = 0; l < 8 && i + l < e - a; l++) p->kept[bh * p->t + a + i + l] = (uint8_t)(keep >> l & 1);
        for (; keep; keep &= keep - 1) index[count++] = (int32_t)(i + __builtin_ctz(keep));
    }
    return count;
}

static inline void mix_skipped(const Problem *p, int64_t bh, int64_t a, int64_t g0, int64_t g1, const uint8_t *masks,
                               float *acc, const int d) {
    const uint16_t *mean = p->v_mean + (bh * ((p->t + p->group - 1) / p->group) + g0 / p->group) * d;
    int all = 255;
    for (int64_t i = g0 - a; i < g1 - a; i += 8) all &= masks[i / 8] | (g1 - a - i >= 8 ? 0 : 255 << (g1 - a - i));
    if (all == 255) return; /* a group all kept adds nothing */
    for (int64_t m = 0; m < p->m; m++) {
        const float *w = p->weights + (bh * p->m + m) * p->t + a;
        __m256 sum = _mm256_setzero_ps();
        for (int64_t i = g0 - a; i < g1 - a; i += 8) /* load8 gives 0 past g1 */
            sum = _mm256_add_ps(sum, _mm256_andnot_ps(lanes_of(masks[i / 8]), load8(w + i, g1 - a - i)));
        const __m256 skipped = _mm256_set1_ps(hsum8(sum));
        for (int c = 0; c < d; c += 8) {
            float *dst = acc + m * d + c;
            _mm256_storeu_ps(dst, _mm256_fmadd_ps(skipped, scales8(mean + c, p->bf16), _mm256_loadu_ps(dst)));
        }
    }
}

static inline __attribute__((always_inline)) void
mix_kept_rows(const Problem *p, int64_t bh, int64_t a, const int32_t *index, int64_t count, int64_t m0, int c0,
              float *acc_out, const int rows, const int bits, const int d) {
    const int nv = p->value_groups, gv = d / nv, bytes = d * bits / 8;
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const uint8_t *codes = p->v_packed + (bh * p->t + a) * bytes + c0 * bits / 8;
    const uint16_t *scale = p->v_scale + (bh * p->t + a) * nv, *zero = p->v_zero + (bh * p->t + a) * nv;
    const float *w = p->weights + (bh * p->m + m0) * p->t + a;
    int group[4];
    for (int c = 0; c < 4; c++) group[c] = (c0 + 8 * c) / gv; /* value groups are >= 8 channels */
    __m256 acc[2][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t x = 0; x < count; x++) {
        const int64_t t = index[x];
        __m256 value[4], s = _mm256_setzero_ps(), z = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            if (c == 0 || group[c] != group[c - 1]) {
                s = _mm256_set1_ps(scale_to_float(scale[t * nv + group[c]], p->bf16));
                z = _mm256_set1_ps(scale_to_float(zero[t * nv + group[c]], p->bf16));
            }
            if (bits == 1)
                value[c] = _mm256_add_ps(z, _mm256_and_ps(lanes_of(codes[t * bytes + c]), s));
            else {
                uint16_t word;
                memcpy(&word, codes + t * bytes + 2 * c, 2);
                const __m256i code =
                    _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(3));
                value[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), s, z);
            }
        }
        for (int r = 0; r < rows; r++) {
            const __m256 weight = _mm256_set1_ps(w[r * p->t + t]);
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_fmadd_ps(weight, value[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) {
            float *dst = acc_out + (m0 + r) * d + c0 + 8 * c;
            _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), acc[r][c]));
        }
}

static inline __attribute__((always_inline)) void
mix_vector(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc, const int bits, const int d) {
    uint8_t masks[SUB / 8];
    int32_t index[SUB];
    const int64_t count = keep_positions(p, bh, a, e, masks, index);
    prefetch_kept(p, bh, a, index, count, bits, d);
    for (int64_t g0 = a; g0 < e; g0 = min64((g0 / p->group + 1) * p->group, e))
        mix_skipped(p, bh, a, g0, min64((g0 / p->group + 1) * p->group, e), masks, acc, d);
    if (count == 0) return;
    for (int c0 = 0; c0 < d; c0 += 32)
        for (int64_t m0 = 0; m0 < p->m; m0 += 2) { /* constant row counts keep the accumulators in registers */
            if (p->m - m0 >= 2)
                mix_kept_rows(p, bh, a, index, count, m0, c0, acc, 2, bits, d);
            else
                mix_kept_rows(p, bh, a, index, count, m0, c0, acc, 1, bits, d);
        }
}
#endif

#if defined(INT_VECTOR) || defined(INT_AVX2)
VECTOR_SHAPES()
#endif /* INT_VECTOR || INT_AVX2 */

static void pick(const Problem *p, ScoreFn *score, MixFn *mix) {
    *score = score_int_plain; /* the integer pass's choice of scores, so that they are its own */
    *mix = mix_sparse_plain;
#if defined(INT_VECTOR) || defined(INT_AVX2)
    if (int_vector_takes(p)) PICK_SHAPE(p, score, mix);
#else
    (void)p;
#endif
}

/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int lowbit_partial_attention_sparse(const Problem *p) {
    if (!valid_problem(p) || !p->v_mean || !p->kept) return -1;
    ScoreFn score;
    MixFn mix;
    pick(p, &score, &mix);
    for (int64_t bh = 0; bh < p->batch * p->heads; bh++) { /* the mix writes kept where it is visible */
        const int64_t seen = visible(p, bh);
        memset(p->kept + bh * p->t + seen, 0, p->t - seen);
    }
    return run_tasks(p, score, mix);
}
