/* Decode attention over dense keys and values on CPUs (float32, bfloat16 or float16): a few query
   rows of each sequence over the full cache, each row up to its own position
   (dense_decode_attention), and SpeCache's merge of its 16-bit segments with the low-bit pass
   (merge_segments, at the end of this file).

   kernels/dense_cpu.py states the contract, and builds this file at first use. A decode step reads
   every cached key and value once, so its time is the time to stream them: each task reads a chunk
   of positions of one KV head once for all the query rows that share it (grouped-query attention:
   the query heads of the KV head, times the rows of the sequence), converting 16-bit elements to
   float in registers.

   - Tasks are (sequence, KV head, chunk of positions), chosen without regard to the thread count.
     A task goes through its chunk in sub-chunks of SUB positions: scores of every row, then per row
     the running maximum, exp and sum (the online softmax), then the weighted values. Positions past
     a row's own position get weight exactly 0 (they are a suffix: the mask is causal).
   - A second pass merges each KV head's chunks in chunk order by the log-sum-exp rule, so results
     do not depend on the thread count.

   With AVX-512 (simd.h) and head_dim a multiple of 16 the loops are vectorized, 16 channels a lane;
   other shapes, and builds without it, run the plain C loops. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define SUB 128         /* positions per sub-chunk: their scores stay in L1 */
#define MAX_D 256       /* largest head_dim (bounds the stack buffers); the Python wrapper checks it */
#define MAX_ROWS 64     /* query rows per KV head; the Python wrapper checks it */
#define MIN_CHUNK 512   /* positions per task, at least */
#define TASKS 32        /* tasks per call to aim for */
#define MIN_BYTES (64 << 10) /* cache bytes per thread, at least: waking a thread costs microseconds */
#define AHEAD 4096      /* bytes ahead of the loads to prefetch: 1.1-1.5x faster from memory (measured) */

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };

typedef struct {
    const float *q;           /* (B, H, S, D) */
    const void *k, *v;        /* (B, Hkv, T, D) */
    const int64_t *input_pos; /* (B, S): row s of sequence b sees positions 0 .. input_pos[b][s] */
    float *out;               /* (B, H, S, D) */
    int64_t batch, heads, kv_heads, s, d, t;
    float scale;              /* scores are q . k * scale */
    int32_t dtype;            /* of k and v: FLOAT32, BFLOAT16 or FLOAT16 */
    int32_t threads;
} Problem;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline float element(const void *base, int32_t dtype, int64_t i) {
    if (dtype == FLOAT32) return ((const float *)base)[i];
    const uint16_t h = ((const uint16_t *)base)[i];
    return dtype == BFLOAT16 ? bits_to_float((uint32_t)h << 16) : half_to_float(h);
}

#ifdef VECTOR
static inline __m512 load16(const void *base, int32_t dtype, int64_t i) {
    if (dtype == FLOAT32) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return dtype == BFLOAT16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                             : _mm512_cvtph_ps(h);
}

/* lane i = the sum of a[i]'s lanes: a tree of shuffles and adds, a third of the work of 16 reductions */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: x[i] = a[2i] in lanes 0-7, a[2i+1] in lanes 8-15 */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit blocks: four inputs, four lanes each */
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* pairs within each block */
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44), _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    /* lane l now holds a[4 (l % 4) + l / 4], a permutation that is its own inverse */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
#endif

/* score[m][i] = q[m] . key(c0 + i) * scale, for n positions and `rows` rows */
#define INLINE static inline __attribute__((always_inline))

INLINE void score(const Problem *p, const float *q, const void *keys, int64_t c0, int64_t n, int64_t rows,
                  float score[][SUB], const int64_t d) {
#ifdef VECTOR
    if (d % 16 == 0) {
        const int64_t size = p->dtype == FLOAT32 ? 4 : 2;
        float block[16 * MAX_D]; /* 16 positions' keys as floats (zeros past n), read once per row */
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t count = min64(16, n - i0);
            const float *key = (const float *)keys + (c0 + i0) * d;
            for (int64_t x = 0; x < 16 * d * size; x += 64) /* the next block's lines, AHEAD bytes on */
                _mm_prefetch((const char *)keys + (c0 + i0) * d * size + AHEAD + x, _MM_HINT_T0);
            if (p->dtype != FLOAT32 || count < 16) {
                for (int64_t x = 0; x < 16 * d; x += 16)
                    _mm512_storeu_ps(block + x, x < count * d ? load16(keys, p->dtype, (c0 + i0) * d + x) : _mm512_setzero_ps());
                key = block;
            }
            for (int64_t m = 0; m < rows; m++) {
                __m512 acc[16]; /* one per position: 16 independent sums */
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t j = 0; j < d; j += 16) {
                    const __m512 query = _mm512_loadu_ps(q + m * d + j);
                    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(query, _mm512_loadu_ps(key + i * d + j), acc[i]);
                }
                _mm512_mask_storeu_ps(score[m] + i0, tail_mask(count), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(p->scale)));
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++)
        for (int64_t m = 0; m < rows; m++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < d; j++) acc += q[m * d + j] * element(keys, p->dtype, (c0 + i) * d + j);
            score[m][i] = acc * p->scale;
        }
}

/* acc(m)[0..d) += sum over i < n of w[m][i] * value(c0 + i), for `rows` rows; acc(m) = part + m * stride */
INLINE void mix(const Problem *p, const void *values, int64_t c0, int64_t n, int64_t rows, float w[][SUB],
                float *part, int64_t stride, const int64_t d) {
#ifdef VECTOR
    if (d % 16 == 0) {
        /* a tile of rows whose sums fill 16 registers, each value block loaded once for the tile */
        const int64_t size = p->dtype == FLOAT32 ? 4 : 2;
        const int64_t blocks = d / 16, tile = blocks >= 16 ? 1 : 16 / blocks;
        for (int64_t m0 = 0; m0 < rows; m0 += tile) {
            const int64_t count = min64(tile, rows - m0);
            __m512 acc[16];
            for (int64_t r = 0; r < count; r++)
                for (int64_t j = 0; j < blocks; j++) acc[r * blocks + j] = _mm512_loadu_ps(part + (m0 + r) * stride + 16 * j);
            for (int64_t i = 0; i < n; i++) {
                __m512 value[16];
                for (int64_t x = 0; x < d * size; x += 64)
                    _mm_prefetch((const char *)values + (c0 + i) * d * size + AHEAD + x, _MM_HINT_T0);
                for (int64_t j = 0; j < blocks; j++) value[j] = load16(values, p->dtype, (c0 + i) * d + 16 * j);
                for (int64_t r = 0; r < count; r++) {
                    const __m512 weight = _mm512_set1_ps(w[m0 + r][i]);
                    for (int64_t j = 0; j < blocks; j++) acc[r * blocks + j] = _mm512_fmadd_ps(weight, value[j], acc[r * blocks + j]);
                }
            }
            for (int64_t r = 0; r < count; r++)
                for (int64_t j = 0; j < blocks; j++) _mm512_storeu_ps(part + (m0 + r) * stride + 16 * j, acc[r * blocks + j]);
        }
        return;
    }
#endif
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < d; j++) part[m * stride + j] += w[m][i] * element(values, p->dtype, (c0 + i) * d + j);
}

static float row_max(const float *w, int64_t n) {
#ifdef VECTOR
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) best = _mm512_mask_max_ps(best, tail_mask(n - i), best, _mm512_loadu_ps(w + i));
    return _mm512_reduce_max_ps(best);
#else
    float best = -INFINITY;
    for (int64_t i = 0; i < n; i++) best = w[i] > best ? w[i] : best;
    return best;
#endif
}

/* One task: rows of KV head `bh` over positions [c0, c1); part holds per row max, sum, acc[d]. Inlined
   with d a constant for the common head sizes, so that the vector loops unroll into registers. */
INLINE void attend(const Problem *p, int64_t bh, int64_t c0, int64_t c1, float *part, const int64_t d) {
    const int64_t b = bh / p->kv_heads, group = p->heads / p->kv_heads, rows = group * p->s;
    const int64_t stride = 2 + d;
    const float *q = p->q + bh * rows * d; /* the KV head's query heads are consecutive, S rows each */
    const int64_t offset = bh * p->t * d;
    const void *keys = p->dtype == FLOAT32 ? (const void *)((const float *)p->k + offset)
                                           : (const void *)((const uint16_t *)p->k + offset);
    const void *values = p->dtype == FLOAT32 ? (const void *)((const float *)p->v + offset)
                                             : (const void *)((const uint16_t *)p->v + offset);
    float scores[MAX_ROWS][SUB]; /* 32 KiB */
    for (int64_t m = 0; m < rows; m++) {
        part[m * stride] = -INFINITY;
        part[m * stride + 1] = 0.0f;
        for (int64_t j = 0; j < d; j++) part[m * stride + 2 + j] = 0.0f;
    }
    for (int64_t s0 = c0; s0 < c1; s0 += SUB) {
        const int64_t n = min64(SUB, c1 - s0);
        score(p, q, keys, s0, n, rows, scores, d);
        for (int64_t m = 0; m < rows; m++) {
            float *row = part + m * stride;
            const int64_t visible = min64(n, max64(0, p->input_pos[b * p->s + m % p->s] + 1 - s0));
            if (visible > 0) {
                const float top = row_max(scores[m], visible);
                if (top > row[0]) { /* a new maximum: rescale what the row has summed so far */
                    const float factor = row[0] == -INFINITY ? 0.0f : expf(row[0] - top);
                    row[1] *= factor;
                    for (int64_t j = 0; j < d; j++) row[2 + j] *= factor;
                    row[0] = top;
                }
                row[1] += exp_sum(scores[m], visible, row[0]); /* scores become weights */
            }
            for (int64_t i = visible; i < n; i++) scores[m][i] = 0.0f;
        }
        mix(p, values, s0, n, rows, scores, part + 2, stride, d);
    }
}

static void attend_chunk(const Problem *p, int64_t bh, int64_t c0, int64_t c1, float *part) {
    switch (p->d) {
    case 64: attend(p, bh, c0, c1, part, 64); break;
    case 128: attend(p, bh, c0, c1, part, 128); break;
    case 256: attend(p, bh, c0, c1, part, 256); break;
    default: attend(p, bh, c0, c1, part, p->d);
    }
}

/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int dense_decode_attention(const Problem *p) {
    if (p->d < 1 || p->d > MAX_D || p->kv_heads < 1 || p->heads % p->kv_heads || p->s < 1 || p->t < 1 ||
        p->heads / p->kv_heads * p->s > MAX_ROWS || p->threads < 1 || p->dtype < FLOAT32 || p->dtype > FLOAT16)
        return -1;
    const int64_t heads = p->batch * p->kv_heads, rows = p->heads / p->kv_heads * p->s, d = p->d;
    int64_t longest = 0; /* positions any row sees */
    for (int64_t i = 0; i < p->batch * p->s; i++) longest = max64(longest, min64(p->t, p->input_pos[i] + 1));
    const int64_t want = (TASKS + heads - 1) / heads;
    const int64_t chunk = (max64(MIN_CHUNK, (longest + want - 1) / want) + SUB - 1) / SUB * SUB;
    const int64_t chunks = max64(1, (longest + chunk - 1) / chunk), tasks = heads * chunks;
    const int64_t stride = rows * (2 + d);
    float *partial = malloc(tasks * stride * sizeof(float));
    if (!partial) return -2;
    const int64_t bytes = 2 * heads * longest * d * (p->dtype == FLOAT32 ? 4 : 2);
    const int threads = (int)max64(1, min64(min64(p->threads, tasks), bytes / MIN_BYTES));

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) { /* a chunk past its sequence's rows' reach is empty */
            const int64_t bh = task / chunks, b = bh / p->kv_heads, c0 = task % chunks * chunk;
            int64_t reach = 0;
            for (int64_t s = 0; s < p->s; s++) reach = max64(reach, min64(p->t, p->input_pos[b * p->s + s] + 1));
            attend_chunk(p, bh, c0, min64(c0 + chunk, reach), partial + task * stride);
        }
#pragma omp for schedule(static)
        for (int64_t hr = 0; hr < heads * rows; hr++) { /* merge the chunks of (KV head, row) in order */
            const int64_t bh = hr / rows, m = hr % rows;
            const float *first = partial + bh * chunks * stride + m * (2 + d);
            float top = -INFINITY, sum = 0.0f;
            for (int64_t c = 0; c < chunks; c++) top = first[c * stride] > top ? first[c * stride] : top;
            float *o = p->out + (bh * rows + m) * d;
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
            if (top == -INFINITY) continue; /* nothing visible: zeros */
            for (int64_t c = 0; c < chunks; c++) {
                const float *part = first + c * stride;
                if (part[0] == -INFINITY) continue;
                const float factor = expf(part[0] - top);
                sum += part[1] * factor;
                for (int64_t j = 0; j < d; j++) o[j] += part[2 + j] * factor;
            }
            for (int64_t j = 0; j < d; j++) o[j] /= sum;
        }
    }
    free(partial);
    return 0;
}

/* ------------------------------------------------------------------------------------------
   SpeCache's 16-bit segments merged with the low-bit pass (kernels/dense_cpu.py: merge_segments)

   The rows of a KV head see three short segments of 16-bit (or float) pairs besides the low-bit
   copy: the fetched pairs (the valid slots), the residual window (its first window_len slots) and
   the new rows' own pairs (row m sees new pairs 0 .. m % S). One softmax spans the four: the
   low-bit pass brings its maximum, sum and unnormalized output, and this computes the segments'
   scores, the shared maximum, the probabilities and the output. A head is one task; at batch 1
   the whole call is a few microseconds, below what waking a thread costs.
   ------------------------------------------------------------------------------------------ */

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
