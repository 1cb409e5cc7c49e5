/* SpeCache's choice of positions on CPUs: the k positions of the history where one new row of the
   mixed-precision attention puts the most weight, per sequence and KV head, in one pass.

   rank_cpu.py states the contract and builds this file at first use. The plain-PyTorch
   version (specache/ops.py's top_positions_reference and position_weights) runs
   six to eight ops over (B, Hkv, G, T) tensors, scatter-adds among them, then a top-k; this reads
   each query head's low-bit weights once, only over the candidate range, adds the few 16-bit
   weights in place, and keeps the best k in a heap.

   - Tasks are (sequence, KV head); each keeps its KV head's ranking in a buffer of the candidate
     range [lower, upper), built query head by query head (max or sum over them).
   - The heap holds the k best so far, the worst at its root: a position enters only if it beats
     the root, and blocks of positions none of which does are skipped after one vectorized
     comparison; the scan goes from the most recent block back. Ties go to the earlier position.
   - From k = SELECT_MIN on (a shortlist lists hundreds), a radix pass over the weights' bits first
     finds a floor that the k-th best reaches; positions below it never enter the heap, which
     would otherwise take thousands of replacements on a flat ranking.
   - Positions the call excludes, and positions outside the range, are never chosen. Fewer
     candidates than k leave the last entries at position 0, marked invalid. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64       /* positions the heap's root is compared with at once */
#define SELECT_MIN 128 /* from this k on, radix_floor bounds what enters the heap */

typedef struct {
    const float *weights;         /* (B, Hkv, M, T): the low-bit weights exp(score - row_max) */
    const float *scale;           /* (B, Hkv, M): the factor that makes them probabilities */
    const float *p_fetched;       /* (B, Hkv, M, K): the fetched pairs' probabilities */
    const int64_t *fetched_pos;   /* (B, Hkv, K) */
    const float *p_window;        /* (B, Hkv, M, R): the window's probabilities */
    const int64_t *window_start;  /* (B,): the window's first position (the quantized length) */
    const int64_t *upper;         /* (B,): candidates are lower <= t < upper[b] */
    const int64_t *excluded_pos;  /* (B, Hkv, E): never chosen where excluded_valid */
    const uint8_t *excluded_valid;
    int64_t *indices;             /* (B, Hkv, k) out: best first */
    uint8_t *valid;               /* (B, Hkv, k) out */
    int64_t batch, heads, m, t, n_fetched, n_window, n_excluded, k, lower;
    int32_t s, row, max_over_heads, threads;
} Problem;

/* sizeof(Problem): the struct's Python (ctypes) and C++ copies are held to it when they load */
int64_t problem_bytes(void) { return (int64_t)sizeof(Problem); }

typedef struct {
    float value;
    int64_t pos;
} Entry;

static inline int worse(Entry a, Entry b) { return a.value < b.value || (a.value == b.value && a.pos > b.pos); }

static void sift_down(Entry *heap, int64_t n, int64_t i) {
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) return;
        if (child + 1 < n && worse(heap[child + 1], heap[child])) child++;
        if (!worse(heap[child], heap[i])) return;
        const Entry swap = heap[i];
        heap[i] = heap[child];
        heap[child] = swap;
        i = child;
    }
}

static void sift_up(Entry *heap, int64_t i) {
    while (i > 0) {
        const int64_t parent = (i - 1) / 2;
        if (!worse(heap[i], heap[parent])) return;
        const Entry swap = heap[i];
        heap[i] = heap[parent];
        heap[parent] = swap;
        i = parent;
    }
}

static uint32_t bits_of(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* A floor that the k-th best of ranking[0, n) reaches: its value with the pattern's low 12 bits
   cleared, found by a histogram of the top 12 bits and one of the next 8 within the bin that holds
   the k-th best (non-negative floats order as their bit patterns; excluded positions, at -1, are
   not counted). 0 where fewer than k positions are candidates. */
static float radix_floor(const float *ranking, int64_t n, int64_t k) {
    uint32_t count[4096];
    memset(count, 0, sizeof count);
    for (int64_t i = 0; i < n; i++)
        if (ranking[i] >= 0.0f) count[bits_of(ranking[i]) >> 20]++;
    int64_t above = 0, high = 4095;
    for (; high >= 0 && above + count[high] < k; high--) above += count[high];
    if (high < 0) return 0.0f;
    memset(count, 0, 256 * sizeof count[0]);
    for (int64_t i = 0; i < n; i++)
        if (ranking[i] >= 0.0f && bits_of(ranking[i]) >> 20 == (uint32_t)high) count[(bits_of(ranking[i]) >> 12) & 255]++;
    int64_t low = 255;
    for (; low > 0 && above + count[low] < k; low--) above += count[low];
    const uint32_t floor_bits = (uint32_t)high << 20 | (uint32_t)low << 12;
    float floor;
    memcpy(&floor, &floor_bits, sizeof floor);
    return floor;
}

/* One query head's weights of the range [lo, hi) into `row`: low-bit weight times its scale, plus the
   fetched and window probabilities at their positions, added in that order (as the reference does). */
static void query_head_row(const Problem *p, int64_t b, int64_t h, int64_t mi, int64_t lo, int64_t hi, float *row) {
    const int64_t bh = b * p->heads + h, bhm = bh * p->m + mi;
    const float *w = p->weights + bhm * p->t;
    const float sc = p->scale[bhm];
    for (int64_t i = lo; i < hi; i++) row[i - lo] = w[i] * sc;
    for (int64_t j = 0; j < p->n_fetched; j++) {
        int64_t pos = p->fetched_pos[bh * p->n_fetched + j];
        pos = pos < 0 ? 0 : pos > p->t - 1 ? p->t - 1 : pos;
        if (pos >= lo && pos < hi) row[pos - lo] += p->p_fetched[bhm * p->n_fetched + j];
    }
    for (int64_t r = 0; r < p->n_window; r++) {
        const int64_t pos = p->window_start[b] + r;
        if (pos < p->t && pos >= lo && pos < hi) row[pos - lo] += p->p_window[bhm * p->n_window + r];
    }
}

static int rank_one(const Problem *p, int64_t b, int64_t h, float *ranking, float *row, Entry *heap) {
    const int64_t lo = p->lower < 0 ? 0 : p->lower;
    int64_t hi = p->upper[b] < p->t ? p->upper[b] : p->t;
    if (hi < lo) hi = lo;
    const int64_t n = hi - lo, groups = p->m / p->s;
    for (int64_t g = 0; g < groups; g++) {
        float *target = g == 0 ? ranking : row;
        query_head_row(p, b, h, g * p->s + p->row, lo, hi, target);
        if (g == 0) continue;
        if (p->max_over_heads)
            for (int64_t i = 0; i < n; i++) ranking[i] = row[i] > ranking[i] ? row[i] : ranking[i];
        else
            for (int64_t i = 0; i < n; i++) ranking[i] += row[i];
    }
    if (!p->max_over_heads)
        for (int64_t i = 0; i < n; i++) ranking[i] /= (float)groups;
    const int64_t bh = b * p->heads + h;
    for (int64_t j = 0; j < p->n_excluded; j++) {
        const int64_t pos = p->excluded_pos[bh * p->n_excluded + j];
        if (p->excluded_valid[bh * p->n_excluded + j] && pos >= lo && pos < hi) ranking[pos - lo] = -1.0f;
    }
    int64_t size = 0;
    const float least = p->k >= SELECT_MIN ? radix_floor(ranking, n, p->k) : 0.0f;
    /* From the most recent block back: attention favours recent positions, so the heap fills with
       high weights first and most older blocks are skipped (in position order, a weight that grows
       with recency would replace the root at nearly every position). The heap's order is total, so
       the result does not depend on the order of the scan. */
    for (int64_t start = (n - 1) / BLOCK * BLOCK; start >= 0; start -= BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        /* a block none of whose positions beats the full heap's root, or reaches the floor, is skipped whole */
        const float floor = size < p->k ? least : p->k ? heap[0].value : INFINITY;
        int beats = 0;
        for (int64_t i = start; i < end; i++) beats |= ranking[i] >= floor;  /* vectorized; >=: a tie at an earlier position wins */
        if (!beats) continue;
        for (int64_t i = start; i < end; i++) {
            if (!(ranking[i] >= least)) continue;  /* excluded, or below the floor */
            const Entry e = {ranking[i], lo + i};
            if (size < p->k) {
                heap[size] = e;
                sift_up(heap, size++);
            } else if (size && worse(heap[0], e)) {
                heap[0] = e;
                sift_down(heap, size, 0);
            }
        }
    }
    int64_t *indices = p->indices + bh * p->k;
    uint8_t *valid = p->valid + bh * p->k;
    for (int64_t j = size - 1; j >= 0; j--) {  /* popping the worst first fills the output from its end */
        indices[j] = heap[0].pos;
        valid[j] = 1;
        heap[0] = heap[j];
        sift_down(heap, j, 0);
    }
    for (int64_t j = size; j < p->k; j++) {
        indices[j] = 0;
        valid[j] = 0;
    }
    return 0;
}

int top_positions(const Problem *p) {
    if (p->batch < 1 || p->heads < 1 || p->s < 1 || p->m < p->s || p->m % p->s || p->row < 0 || p->row >= p->s || p->k < 0 ||
        p->t < 0)
        return 1;
    const int64_t tasks = p->batch * p->heads, span = p->t > 0 ? p->t : 1;
    int failed = 0;
    /* a KV head's ranking is a few microseconds: threads pay only for long histories */
#pragma omp parallel for num_threads(p->threads) if (tasks > 1 && p->t * (p->m / p->s) >= (1 << 15)) \
    reduction(| : failed)
    for (int64_t task = 0; task < tasks; task++) {
        float *buffers = malloc(sizeof(float) * 2 * span);
        Entry *heap = malloc(sizeof(Entry) * (p->k > 0 ? p->k : 1));
        if (!buffers || !heap)
            failed |= 1;
        else
            failed |= rank_one(p, task / p->heads, task % p->heads, buffers, buffers + span, heap);
        free(buffers);
        free(heap);
    }
    return failed;
}
