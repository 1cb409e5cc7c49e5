/* What SpeCache's three CPU low-bit kernels share (lowbit_cpu.c, the float pass, lowbit_int_cpu.c,
   the integer one, and lowbit_sparse_cpu.c, the sparse one): the Problem struct, the split of a
   call into tasks, the two phases around the softmax, and the transposition of key code words.

   Work is split into tasks of (batch, head, chunk of positions), chosen without regard to the
   thread count, and a head's last task adds its tasks' sums in chunk order, so results do not
   depend on the thread count. Positions go in sub-chunks of SUB tokens, so that a sub-chunk's
   scores stay in L1 from scoring to the maximum, and from exp to the mix. Phase 1 writes the
   scores into `weights` and takes each task's row maxima; after one barrier, phase 2 exponentiates
   in place against the row maximum and mixes the values. A kernel brings its two functions:
   `score` (positions [a, e) of one key group) and `mix` (weighted values of positions [a, e)).
   Chunks, sub-chunks and value tiles start at multiples of 64 positions. */
#ifndef SPECACHE_LOWBIT_DRIVER_H
#define SPECACHE_LOWBIT_DRIVER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define SUB 256          /* positions per sub-chunk, a multiple of 16 */
#define MAX_D 256        /* largest head_dim (bounds the stack buffers); the Python wrapper checks it */
#define MIN_WORK 8192    /* token-rows per thread, at least: waking a thread costs microseconds */
#define TASKS 32         /* tasks per call to aim for */
#define RANK_BLOCK 64    /* positions per block of `block_max`, rank_cpu.c's BLOCK */

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
    /* the sparse pass's alone (lowbit_sparse_cpu.c; NULL and 0 for the others): */
    const uint16_t *v_mean;                    /* (B, H, ceil(T/group), D) each key group's mean value */
    uint8_t *kept;                             /* (B, H, T) bool, written: mixed by its own value */
    double min_weight;                         /* a position is kept where some row weighs it this much */
    /* optional, NULL in the ops' calls: the one-op step's ranking bounds whole blocks by it */
    float *block_max; /* (B, H, M, ceil(T/RANK_BLOCK)): each row's largest weight per block */
} Problem;

/* sizeof(Problem): the struct's Python (ctypes) and C++ copies are held to it when they load */
int64_t problem_bytes(void) { return (int64_t)sizeof(Problem); }

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

static inline float scale_to_float(uint16_t h, int bf16) {
    return bf16 ? bits_to_float((uint32_t)h << 16) : half_to_float(h);
}

static inline int code_at(const uint8_t *token, int i, int bits) {
    return (token[i * bits / 8] >> (i * bits % 8)) & ((1 << bits) - 1);
}

typedef void (*ScoreFn)(const Problem *, int64_t bh, int64_t j, int64_t a, int64_t e);
typedef void (*MixFn)(const Problem *, int64_t bh, int64_t a, int64_t e, float *acc);

#ifdef VECTOR
static inline __m512 scales16(const uint16_t *x, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)x);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}

static inline float scale_vector(uint16_t h, int bf16) {
    return bf16 ? bits_to_float((uint32_t)h << 16) : _cvtsh_ss(h);
}


/* words[w][i] = 32-bit word w of the codes of key a + i, for i < e - a (at most SUB). 16 tokens'
   words fill n_words registers, and a two-source permute collects word w of the 32 / n_words
   tokens that each pair of registers holds. */
static inline __attribute__((always_inline)) void
transpose_words(const Problem *p, int64_t bh, int64_t a, int64_t e, uint32_t (*words)[SUB], const int bits,
                const int d) {
    const int n_words = d * bits / 32;
    const int64_t n = e - a;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
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
}
#endif /* VECTOR */

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

/* Each row's largest weight in each block of [s0, s1) (s0 a multiple of RANK_BLOCK; weights past
   s1 in its last block are 0), while the sub-chunk's weights are in L1. */
static void block_maxima(const Problem *p, int64_t bh, int64_t s0, int64_t s1) {
    const int64_t blocks = (p->t + RANK_BLOCK - 1) / RANK_BLOCK;
    for (int64_t m = 0; m < p->m; m++) {
        const float *w = p->weights + (bh * p->m + m) * p->t;
        for (int64_t a = s0; a < s1; a += RANK_BLOCK)
            p->block_max[(bh * p->m + m) * blocks + a / RANK_BLOCK] = max_of(w + a, min64(a + RANK_BLOCK, s1) - a, 0.0f);
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
        if (p->block_max) block_maxima(p, bh, s0, s1);
        mix(p, bh, s0, s1, acc);
    }
    if (p->block_max) /* the chunk's blocks past what is visible: all weights 0 */
        for (int64_t m = 0; m < p->m; m++)
            for (int64_t blk = (end > c0 ? end + RANK_BLOCK - 1 : c0) / RANK_BLOCK; blk * RANK_BLOCK < c1; blk++)
                p->block_max[(bh * p->m + m) * ((p->t + RANK_BLOCK - 1) / RANK_BLOCK) + blk] = 0.0f;
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


/* Whether this file's driver takes the problem (the wrappers check first). */
static int valid_problem(const Problem *p) {
    return !(p->batch < 1 || p->heads < 1 || (p->bits != 1 && p->bits != 2) || p->d % 16 || p->d > MAX_D ||
             p->group <= 0 || p->group % 8 || p->value_groups <= 0 || p->d % p->value_groups ||
             p->d / p->value_groups < 8 || p->threads <= 0 || p->t <= 0);
}

/* Both phases over every task. Returns 0, or -2 without memory. */
static int run_tasks(const Problem *p, ScoreFn score, MixFn mix) {
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

/* One function per common shape, so that the compiler sees d and bits as constants. A kernel that
   defines score_vector(p, bh, j, a, e, bits, d) and mix_vector(p, bh, a, e, acc, bits, d) writes
   VECTOR_SHAPES() after them, for score_B_D, mix_B_D and the general score_any, mix_any; then
   PICK_SHAPE(p, score, mix), in a shape its vector functions take, chooses among them. */
#define SHAPES(X) X(1, 64) X(2, 64) X(1, 128) X(2, 128)
#define DEFINE_SHAPE(B, D)                                                                             \
    static void score_##B##_##D(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {     \
        score_vector(p, bh, j, a, e, B, D);                                                            \
    }                                                                                                  \
    static void mix_##B##_##D(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {      \
        mix_vector(p, bh, a, e, acc, B, D);                                                            \
    }
#define VECTOR_SHAPES()                                                                                \
    SHAPES(DEFINE_SHAPE)                                                                               \
    static void score_any(const Problem *p, int64_t bh, int64_t j, int64_t a, int64_t e) {           \
        score_vector(p, bh, j, a, e, p->bits, (int)p->d);                                              \
    }                                                                                                  \
    static void mix_any(const Problem *p, int64_t bh, int64_t a, int64_t e, float *acc) {            \
        mix_vector(p, bh, a, e, acc, p->bits, (int)p->d);                                              \
    }
#define PICK_ONE(B, D)                                                                                 \
    if (p_->bits == B && p_->d == D) *score_ = score_##B##_##D, *mix_ = mix_##B##_##D;
#define PICK_SHAPE(p, score, mix)                                                                      \
    do {                                                                                               \
        const Problem *p_ = (p);                                                                       \
        ScoreFn *score_ = (score);                                                                     \
        MixFn *mix_ = (mix);                                                                           \
        *score_ = score_any;                                                                           \
        *mix_ = mix_any;                                                                               \
        SHAPES(PICK_ONE)                                                                               \
    } while (0)

#endif
