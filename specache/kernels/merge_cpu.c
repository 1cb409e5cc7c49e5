/* SpeCache's 16-bit segments merged with the low-bit pass on CPUs: the kernel of
   `specache::merge_segments` (specache/ops.py's `merge_segments_reference` is the spec; merge_cpu.py
   states the contract and builds this file at first use).

   The rows of a KV head see three short segments of 16-bit (or float) pairs besides the low-bit
   copy: the fetched pairs (the valid slots), the residual window (its first window_len slots) and
   the new rows' own pairs (row m sees new pairs 0 .. m % S). One softmax spans the four: the
   low-bit pass brings its maximum, sum and unnormalized output, and this computes the segments'
   scores, the shared maximum, the probabilities and the output. A head is one task; at batch 1
   the whole call is a few microseconds, below what waking a thread costs. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "elements.h"

#define MAX_D 256   /* largest head_dim (bounds the stack buffers); the Python wrapper checks it */
#define MAX_ROWS 64 /* query rows per KV head; the Python wrapper checks it */

enum { FETCHED = 0, WINDOW = 1, NEW = 2, SEGMENTS = 3 };
#define MIN_MERGE_WORK (1 << 19) /* multiply-adds per thread, at least */

typedef struct {
    const float *rows;               /* (B, Hkv, M, D), already scaled */
    const float *row_max, *row_sum;  /* (B, Hkv, M): the low-bit pass's */
    const float *lowbit_out;         /* (B, Hkv, M, D), unnormalized */
    const void *k[SEGMENTS], *v[SEGMENTS];       /* (B, Hkv, N_i, D) each, channels contiguous */
    int64_t k_stride[SEGMENTS][3], v_stride[SEGMENTS][3]; /* elements between batches, heads, positions */
    const uint8_t *fetched_valid;    /* (B, Hkv, N_0) bool */
    const int64_t *window_len;       /* (B,) */
    float *out, *lowbit_scale;       /* (B, Hkv, M, D), (B, Hkv, M) */
    float *p[SEGMENTS];              /* (B, Hkv, M, N_i) */
    int64_t batch, kv_heads, m, d, n[SEGMENTS];
    int32_t dtype[SEGMENTS], threads;
} MergeProblem;

/* sizeof(Problem): the struct's Python (ctypes) and C++ copies are held to it when they load */
int64_t problem_bytes(void) { return (int64_t)sizeof(MergeProblem); }

/* score[m][j] = rows[m] . key_j for the n keys at `keys` (`step` elements apart), m < rows */
INLINE void segment_scores(const float *q, const void *keys, int64_t step, int32_t dtype, int64_t n, int64_t rows,
                           float *score, int64_t score_stride, const int64_t d) {
#ifdef VECTOR
    if (d % 16 == 0) {
        float block[16 * MAX_D]; /* 16 keys as floats, zeros past n */
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t count = min64(16, n - j0);
            for (int64_t i = 0; i < 16; i++)
                for (int64_t c = 0; c < d; c += 16)
                    _mm512_storeu_ps(block + i * d + c, i < count ? load16(keys, dtype, (j0 + i) * step + c) : _mm512_setzero_ps());
            for (int64_t m = 0; m < rows; m++) {
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < d; c += 16) {
                    const __m512 query = _mm512_loadu_ps(q + m * d + c);
                    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(query, _mm512_loadu_ps(block + i * d + c), acc[i]);
                }
                _mm512_mask_storeu_ps(score + m * score_stride + j0, tail_mask(count), sum16(acc));
            }
        }
        return;
    }
#endif
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < n; j++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++) acc += q[m * d + c] * element(keys, dtype, j * step + c);
            score[m * score_stride + j] = acc;
        }
}

/* out[m][:] += sum over j < n of w[m][j] * value_j, for the n values at `values` (`step` apart), m < rows;
   dense attention's `mix` with strided values */
INLINE void segment_mix(const void *values, int64_t step, int32_t dtype, int64_t n, int64_t rows, const float *w,
                        int64_t w_stride, float *out, const int64_t d) {
#ifdef VECTOR
    if (d % 16 == 0) {
        const int64_t blocks = d / 16, tile = blocks >= 16 ? 1 : 16 / blocks; /* rows whose sums fill 16 registers */
        for (int64_t m0 = 0; m0 < rows; m0 += tile) {
            const int64_t count = min64(tile, rows - m0);
            __m512 acc[16];
            for (int64_t r = 0; r < count; r++)
                for (int64_t c = 0; c < blocks; c++) acc[r * blocks + c] = _mm512_loadu_ps(out + (m0 + r) * d + 16 * c);
            for (int64_t j = 0; j < n; j++) {
                __m512 value[16];
                for (int64_t c = 0; c < blocks; c++) value[c] = load16(values, dtype, j * step + 16 * c);
                for (int64_t r = 0; r < count; r++) {
                    const __m512 weight = _mm512_set1_ps(w[(m0 + r) * w_stride + j]);
                    for (int64_t c = 0; c < blocks; c++) acc[r * blocks + c] = _mm512_fmadd_ps(weight, value[c], acc[r * blocks + c]);
                }
            }
            for (int64_t r = 0; r < count; r++)
                for (int64_t c = 0; c < blocks; c++) _mm512_storeu_ps(out + (m0 + r) * d + 16 * c, acc[r * blocks + c]);
        }
        return;
    }
#endif
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < d; c++) out[m * d + c] += w[m * w_stride + j] * element(values, dtype, j * step + c);
}

static const void *segment_base(const void *base, int32_t dtype, const int64_t stride[3], int64_t b, int64_t h) {
    const int64_t offset = b * stride[0] + h * stride[1];
    return dtype == FLOAT32 ? (const void *)((const float *)base + offset) : (const void *)((const uint16_t *)base + offset);
}

/* Masks a segment's scores (row r sees position j where visible(r, j)) and raises top[r] to their maximum. */
#define MASK_AND_MAX(visible)                                                                          \
    for (int64_t r = 0; r < m; r++) {                                                                  \
        float *x = score + r * n;                                                                      \
        for (int64_t j = 0; j < n; j++) x[j] = (visible) ? x[j] : -INFINITY; /* exp gives 0 there */  \
        const float best = row_max(x, n);                                                              \
        top[r] = best > top[r] ? best : top[r];                                                        \
    }

/* One KV head: scores into p, then probabilities in place, then the output. Inlined with d a
   constant for the common head sizes, so that the vector loops unroll into registers. */
INLINE void merge_head(const MergeProblem *p, int64_t bh, const int64_t d) {
    const int64_t b = bh / p->kv_heads, h = bh % p->kv_heads, m = p->m;
    const float *q = p->rows + bh * m * d;
    float top[MAX_ROWS];
    for (int64_t r = 0; r < m; r++) top[r] = p->row_max[bh * m + r];
    for (int seg = 0; seg < SEGMENTS; seg++) {
        const int64_t n = p->n[seg];
        if (n == 0) continue;
        float *score = p->p[seg] + bh * m * n;
        segment_scores(q, segment_base(p->k[seg], p->dtype[seg], p->k_stride[seg], b, h), p->k_stride[seg][2],
                       p->dtype[seg], n, m, score, n, d);
        if (seg == FETCHED) {
            const uint8_t *valid = p->fetched_valid + bh * n;
            MASK_AND_MAX(valid[j])
        } else if (seg == WINDOW) {
            const int64_t len = p->window_len[b];
            MASK_AND_MAX(j < len)
        } else {
            MASK_AND_MAX(j <= r % n) /* the new pairs: row r is new row r % S */
        }
    }
    for (int64_t r = 0; r < m; r++) {
        const float row_max = p->row_max[bh * m + r];
        float total = 0.0f;
        if (top[r] != -INFINITY) { /* else nothing is visible (no caller sends that: a row sees its own pair) */
            const float scale = row_max == -INFINITY ? 0.0f : expf(row_max - top[r]);
            total = p->row_sum[bh * m + r] * scale;
            for (int seg = 0; seg < SEGMENTS; seg++)
                total += exp_sum(p->p[seg] + (bh * m + r) * p->n[seg], p->n[seg], top[r]);
            p->lowbit_scale[bh * m + r] = scale / total;
        }
        if (!(total > 0.0f)) p->lowbit_scale[bh * m + r] = total = 0.0f;
        for (int seg = 0; seg < SEGMENTS; seg++) {
            float *w = p->p[seg] + (bh * m + r) * p->n[seg];
            if (total > 0.0f)
                for (int64_t j = 0; j < p->n[seg]; j++) w[j] /= total;
            else
                memset(w, 0, p->n[seg] * sizeof *w);
        }
    }
    float *out = p->out + bh * m * d;
    for (int64_t r = 0; r < m; r++)
        for (int64_t c = 0; c < d; c++) out[r * d + c] = p->lowbit_out[(bh * m + r) * d + c] * p->lowbit_scale[bh * m + r];
    for (int seg = 0; seg < SEGMENTS; seg++)
        if (p->n[seg])
            segment_mix(segment_base(p->v[seg], p->dtype[seg], p->v_stride[seg], b, h), p->v_stride[seg][2], p->dtype[seg],
                        p->n[seg], m, p->p[seg] + bh * m * p->n[seg], p->n[seg], out, d);
}

static void merge_one(const MergeProblem *p, int64_t bh) {
    switch (p->d) {
    case 64: merge_head(p, bh, 64); break;
    case 128: merge_head(p, bh, 128); break;
    case 256: merge_head(p, bh, 256); break;
    default: merge_head(p, bh, p->d);
    }
}

/* Returns 0, or -1 for a problem outside what this file handles (the wrapper checks first). */
int merge_segments(const MergeProblem *p) {
    if (p->batch < 1 || p->kv_heads < 1 || p->m < 1 || p->m > MAX_ROWS || p->d < 1 || p->d > MAX_D || p->n[NEW] < 1 ||
        p->n[FETCHED] < 0 || p->n[WINDOW] < 0 || p->threads < 1)
        return -1;
    for (int seg = 0; seg < SEGMENTS; seg++)
        if (p->dtype[seg] < FLOAT32 || p->dtype[seg] > FLOAT16) return -1;
    const int64_t heads = p->batch * p->kv_heads;
    const int64_t work = heads * p->m * (p->n[FETCHED] + p->n[WINDOW] + p->n[NEW]) * p->d;
    const int threads = (int)max64(1, min64(min64(p->threads, heads), work / MIN_MERGE_WORK));
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t bh = 0; bh < heads; bh++) merge_one(p, bh);
    return 0;
}
