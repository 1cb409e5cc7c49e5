/* Decode attention over dense keys and values on CPUs (float32, bfloat16 or float16): a few query
   rows of each sequence over the full cache, each row up to its own position
   (dense_decode_attention).

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

   With AVX-512 (specache/kernels/simd.h) and head_dim a multiple of 16 the loops are vectorized, 16 channels a lane;
   other shapes, and builds without it, run the plain C loops. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "elements.h" /* specache/kernels: the element types, simd.h */

#define SUB 128         /* positions per sub-chunk: their scores stay in L1 */
#define MAX_D 256       /* largest head_dim (bounds the stack buffers); the Python wrapper checks it */
#define MAX_ROWS 64     /* query rows per KV head; the Python wrapper checks it */
#define MIN_CHUNK 512   /* positions per task, at least */
#define TASKS 32        /* tasks per call to aim for */
#define MIN_BYTES (64 << 10) /* cache bytes per thread, at least: waking a thread costs microseconds */
#define AHEAD 4096      /* bytes ahead of the loads to prefetch: 1.1-1.5x faster from memory (measured) */

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

/* sizeof(Problem): the struct's Python (ctypes) and C++ copies are held to it when they load */
int64_t problem_bytes(void) { return (int64_t)sizeof(Problem); }

/* score[m][i] = q[m] . key(c0 + i) * scale, for n positions and `rows` rows */

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
