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
   - From k = SELECT_MIN on (a shortlist lists hundreds) there is no heap (select_many): a floor
     that the k-th best reaches, from a sample of the ranking or a radix pass over its bits, leaves
     about k positions, which a radix sort orders (a heap took thousands of replacements on a flat
     ranking, and as many sifts again to give its entries in order).
   - Positions the call excludes, and positions outside the range, are never chosen. Fewer
     candidates than k leave the last entries at position 0, marked invalid.
   - Given each row's largest low-bit weight per block of BLOCK positions (block_max, which the
     one-op step's low-bit pass writes as it exponentiates), it need not build the whole ranking:
     a bound per block says which blocks cannot beat the full heap's root, and those are never
     read (rank_bounded). From k = SELECT_MIN on, a bound rarely skips a block, and the whole
     ranking serves. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64       /* positions the heap's root is compared with at once */
#define SELECT_MIN 128 /* from this k on, select_many ranks without a heap */

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
    const float *block_max;       /* (B, Hkv, M, ceil(T / BLOCK)) or NULL: see rank_bounded */
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

/* The k best so far: e enters if the heap has room or e beats its root. */
static inline void offer(Entry *heap, int64_t *size, int64_t k, Entry e) {
    if (*size < k) {
        heap[*size] = e;
        sift_up(heap, (*size)++);
    } else if (*size && worse(heap[0], e)) {
        heap[0] = e;
        sift_down(heap, *size, 0);
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

/* The heap's `size` entries, best first, into KV head bh's output; the rest invalid, at 0. */
static void write_top(const Problem *p, int64_t bh, Entry *heap, int64_t size) {
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
}

/* The entries of ranking[0, n) (offset lo) that reach floor, in position order, into out; their count. */
static int64_t collect(const float *ranking, int64_t n, int64_t lo, float floor, Entry *out) {
    int64_t count = 0;
    for (int64_t start = 0; start < n; start += BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        int any = 0;
        for (int64_t i = start; i < end; i++) any |= ranking[i] >= floor; /* vectorized */
        if (!any) continue;
        for (int64_t i = start; i < end; i++)
            if (ranking[i] >= floor) /* + 0: a -0 would sort above every weight by its bits */
                out[count++] = (Entry){ranking[i] + 0.0f, lo + i};
    }
    return count;
}

/* rank_one's choice for k >= SELECT_MIN, without a heap: a floor that the k-th best reaches, the
   entries that reach it in position order, and a stable radix sort of them by value, largest
   first, so that ties stay in position order, as the heap's order has them. The floor comes from a
   sample of every SAMPLE-th position where the sample has enough candidates, checked against the
   whole ranking (a floor only counts if at least k positions reach it), else from the whole
   ranking. `spare` holds 2 n entries. */
#define SAMPLE 16
static int select_many(const Problem *p, int64_t bh, int64_t lo, float *ranking, int64_t n, Entry *spare) {
    Entry *entries = spare, *sorted = spare + n;
    float floor = -1.0f;
    const int64_t n_sample = n / SAMPLE, wanted = 2 * p->k / SAMPLE;
    if (wanted >= 8 && n_sample >= 4 * wanted) {
        float *sample = (float *)sorted; /* free until the sort */
        for (int64_t i = 0; i < n_sample; i++) sample[i] = ranking[i * SAMPLE];
        const float guess = radix_floor(sample, n_sample, wanted);
        int64_t reach = 0;
        for (int64_t i = 0; i < n; i++) reach += ranking[i] >= guess; /* vectorized */
        if (guess > 0.0f && reach >= p->k) floor = guess;
    }
    int64_t count = collect(ranking, n, lo, floor >= 0.0f ? floor : 0.0f, entries);
    if (floor < 0.0f || count > 2 * p->k) { /* narrow to about k: a floor from the collected alone */
        float *values = (float *)sorted;
        for (int64_t i = 0; i < count; i++) values[i] = entries[i].value;
        const float tight = radix_floor(values, count, p->k);
        int64_t kept = 0;
        for (int64_t i = 0; i < count; i++)
            if (entries[i].value >= tight) entries[kept++] = entries[i];
        count = kept;
    }
    /* LSD radix sort on the value's bits (non-negative floats order as their patterns), a byte a
       pass, descending; a byte all entries share needs no pass */
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t start[257] = {0};
        for (int64_t i = 0; i < count; i++) start[256 - (bits_of(entries[i].value) >> shift & 255)]++;
        int shared = 0;
        for (int b = 0; b < 257; b++) shared |= start[b] == count;
        if (shared) continue;
        for (int b = 1; b < 257; b++) start[b] += start[b - 1];
        for (int64_t i = 0; i < count; i++) {
            const uint32_t bucket = 255 - (bits_of(entries[i].value) >> shift & 255);
            sorted[start[bucket]++] = entries[i];
        }
        Entry *swap = entries;
        entries = sorted;
        sorted = swap;
    }
    int64_t *indices = p->indices + bh * p->k;
    uint8_t *valid = p->valid + bh * p->k;
    for (int64_t j = 0; j < p->k; j++) {
        indices[j] = j < count ? entries[j].pos : 0;
        valid[j] = j < count;
    }
    return 0;
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
    if (p->k >= SELECT_MIN) return select_many(p, bh, lo, ranking, n, heap);
    int64_t size = 0;
    /* From the most recent block back: attention favours recent positions, so the heap fills with
       high weights first and most older blocks are skipped (in position order, a weight that grows
       with recency would replace the root at nearly every position). The heap's order is total, so
       the result does not depend on the order of the scan. */
    for (int64_t start = (n - 1) / BLOCK * BLOCK; start >= 0; start -= BLOCK) {
        const int64_t end = start + BLOCK < n ? start + BLOCK : n;
        /* a block none of whose positions beats the full heap's root is skipped whole */
        const float floor = size < p->k ? 0.0f : p->k ? heap[0].value : INFINITY;
        int beats = 0;
        for (int64_t i = start; i < end; i++) beats |= ranking[i] >= floor;  /* vectorized; >=: a tie at an earlier position wins */
        if (!beats) continue;
        for (int64_t i = start; i < end; i++)
            if (ranking[i] >= 0.0f) offer(heap, &size, p->k, (Entry){ranking[i], lo + i});  /* else excluded */
    }
    write_top(p, bh, heap, size);
    return 0;
}

/* The fetched and window probabilities that fall in [lo, hi), by block of BLOCK positions from
   lo / BLOCK, each block's in the order query_head_row adds them (fetched slot by slot, then the
   window): at[i] is the position, from[i] its slot (>= 0) or -1 - its window offset, and the
   block's entries are first[b] .. first[b + 1]. */
typedef struct {
    int64_t *at, *from, *first;
} Extras;

static int extras_by_block(const Problem *p, int64_t b, int64_t h, int64_t lo, int64_t hi, int64_t blocks,
                           Extras *x) {
    const int64_t bh = b * p->heads + h, n = p->n_fetched + p->n_window, base = lo / BLOCK;
    x->at = malloc(sizeof(int64_t) * (n > 0 ? n : 1));
    x->from = malloc(sizeof(int64_t) * (n > 0 ? n : 1));
    x->first = calloc(blocks + 1, sizeof(int64_t));
    int64_t *next = malloc(sizeof(int64_t) * (blocks + 1));
    if (!x->at || !x->from || !x->first || !next) {
        free(next);
        return 1;
    }
    for (int pass = 0; pass < 2; pass++) { /* count, then place: a stable bucket sort */
        for (int64_t e = 0; e < n; e++) {
            int64_t pos;
            if (e < p->n_fetched) {
                pos = p->fetched_pos[bh * p->n_fetched + e];
                pos = pos < 0 ? 0 : pos > p->t - 1 ? p->t - 1 : pos;
            } else {
                pos = p->window_start[b] + e - p->n_fetched;
                if (pos >= p->t) continue;
            }
            if (pos < lo || pos >= hi) continue;
            const int64_t blk = pos / BLOCK - base;
            if (pass == 0) {
                x->first[blk + 1]++;
            } else {
                x->at[next[blk]] = pos;
                x->from[next[blk]++] = e < p->n_fetched ? e : -1 - (e - p->n_fetched);
            }
        }
        if (pass == 0) {
            for (int64_t blk = 0; blk < blocks; blk++) x->first[blk + 1] += x->first[blk];
            memcpy(next, x->first, sizeof(int64_t) * (blocks + 1));
        }
    }
    free(next);
    return 0;
}

static inline float extra_of(const Problem *p, int64_t bhm, int64_t from) {
    return from >= 0 ? p->p_fetched[bhm * p->n_fetched + from] : p->p_window[bhm * p->n_window - 1 - from];
}

/* order[0, n) as a max-heap of blocks by their bound, from i down */
static void sift_down_blocks(int64_t *order, int64_t n, int64_t i, const float *bounds) {
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) return;
        if (child + 1 < n && bounds[order[child + 1]] > bounds[order[child]]) child++;
        if (!(bounds[order[child]] > bounds[order[i]])) return;
        const int64_t swap = order[i];
        order[i] = order[child];
        order[child] = swap;
        i = child;
    }
}

/* rank_one with block_max: the same k positions, found by reading only the blocks that can hold
   them. The positions that fetched slots or the window add probabilities to are ranked first, each
   exactly as query_head_row and rank_one compute it (few, and often the best). Every other position
   of a block weighs what query_head_row computes for its weight alone, so what it computes for
   block_max bounds them all (float products, maxima and sums are monotone, and the step's drop only
   lowers weights after block_max was taken). The blocks go best bound first; once the heap is full,
   the first whose bound is below its root ends the scan, as every block left is no better. The
   heap's order is total, so the result is rank_one's. */
static int rank_bounded(const Problem *p, int64_t b, int64_t h, Entry *heap) {
    const int64_t lo = p->lower < 0 ? 0 : p->lower;
    int64_t hi = p->upper[b] < p->t ? p->upper[b] : p->t;
    if (hi < lo) hi = lo;
    const int64_t groups = p->m / p->s, bh = b * p->heads + h, all_blocks = (p->t + BLOCK - 1) / BLOCK;
    const int64_t base = lo / BLOCK, blocks = hi > lo ? (hi - 1) / BLOCK - base + 1 : 0;
    Extras x = {0};
    float *bounds = malloc(sizeof(float) * (blocks > 0 ? blocks : 1));
    int64_t *order = malloc(sizeof(int64_t) * (blocks > 0 ? blocks : 1));
    uint8_t *done = calloc(blocks * BLOCK + 1, 1); /* excluded, or ranked with its probabilities */
    int failed = !bounds || !order || !done || extras_by_block(p, b, h, lo, hi, blocks, &x);
    if (!failed) {
        for (int64_t j = 0; j < p->n_excluded; j++) {
            const int64_t pos = p->excluded_pos[bh * p->n_excluded + j];
            if (p->excluded_valid[bh * p->n_excluded + j] && pos >= lo && pos < hi) done[pos - base * BLOCK] = 1;
        }
        int64_t size = 0;
        float values[BLOCK], row[BLOCK];
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (x.first[blk] == x.first[blk + 1]) continue;
            const int64_t a = (base + blk) * BLOCK;
            uint8_t touched[BLOCK] = {0};
            for (int64_t g = 0; g < groups; g++) { /* query_head_row at these positions */
                const int64_t bhm = bh * p->m + g * p->s + p->row;
                const float *w = p->weights + bhm * p->t, sc = p->scale[bhm];
                float *target = g == 0 ? values : row;
                for (int64_t e = x.first[blk]; e < x.first[blk + 1]; e++) target[x.at[e] - a] = w[x.at[e]] * sc;
                for (int64_t e = x.first[blk]; e < x.first[blk + 1]; e++) target[x.at[e] - a] += extra_of(p, bhm, x.from[e]);
                if (g == 0) continue;
                for (int64_t e = x.first[blk]; e < x.first[blk + 1]; e++) {
                    const int64_t i = x.at[e] - a;
                    if (touched[i] == (uint8_t)g) continue; /* a position with two entries: once per query head */
                    touched[i] = (uint8_t)g;
                    values[i] = p->max_over_heads ? (row[i] > values[i] ? row[i] : values[i]) : values[i] + row[i];
                }
            }
            for (int64_t e = x.first[blk]; e < x.first[blk + 1]; e++) {
                const int64_t i = x.at[e] - a;
                if (done[x.at[e] - base * BLOCK]) continue;
                done[x.at[e] - base * BLOCK] = 1;
                const float value = p->max_over_heads ? values[i] : values[i] / (float)groups;
                if (value >= 0.0f) offer(heap, &size, p->k, (Entry){value, x.at[e]});
            }
        }
        for (int64_t g = 0; g < groups; g++) {
            const int64_t bhm = bh * p->m + g * p->s + p->row;
            const float sc = p->scale[bhm];
            for (int64_t blk = 0; blk < blocks; blk++) {
                const float bound = p->block_max[bhm * all_blocks + base + blk] * sc;
                if (g == 0)
                    bounds[blk] = bound;
                else if (p->max_over_heads)
                    bounds[blk] = bound > bounds[blk] ? bound : bounds[blk];
                else
                    bounds[blk] += bound;
            }
        }
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (!p->max_over_heads) bounds[blk] /= (float)groups;
            if (bounds[blk] != bounds[blk]) bounds[blk] = INFINITY; /* NaN: read it, first */
        }
        for (int64_t i = 0; i < blocks; i++) order[i] = i;
        for (int64_t i = blocks / 2 - 1; i >= 0; i--) sift_down_blocks(order, blocks, i, bounds);
        for (int64_t left = blocks; left > 0 && p->k > 0;) {
            const int64_t blk = order[0];
            order[0] = order[--left];
            sift_down_blocks(order, left, 0, bounds);
            if (size == p->k && bounds[blk] < heap[0].value) break;
            const int64_t a = (base + blk) * BLOCK > lo ? (base + blk) * BLOCK : lo;
            const int64_t e = (base + blk + 1) * BLOCK < hi ? (base + blk + 1) * BLOCK : hi;
            for (int64_t g = 0; g < groups; g++) { /* query_head_row and rank_one on this block */
                const int64_t bhm = bh * p->m + g * p->s + p->row;
                const float *w = p->weights + bhm * p->t, sc = p->scale[bhm];
                float *target = g == 0 ? values : row;
                for (int64_t i = a; i < e; i++) target[i - a] = w[i] * sc;
                if (g == 0) continue;
                if (p->max_over_heads)
                    for (int64_t i = 0; i < e - a; i++) values[i] = row[i] > values[i] ? row[i] : values[i];
                else
                    for (int64_t i = 0; i < e - a; i++) values[i] += row[i];
            }
            if (!p->max_over_heads)
                for (int64_t i = 0; i < e - a; i++) values[i] /= (float)groups;
            const float root = size < p->k ? -INFINITY : heap[0].value;
            int reaches = 0;
            for (int64_t i = 0; i < e - a; i++) reaches |= values[i] >= root; /* vectorized */
            if (!reaches) continue;
            for (int64_t i = a; i < e; i++)
                if (!done[i - base * BLOCK] && values[i - a] >= 0.0f) offer(heap, &size, p->k, (Entry){values[i - a], i});
        }
        write_top(p, bh, heap, size);
    }
    free(x.at);
    free(x.from);
    free(x.first);
    free(bounds);
    free(order);
    free(done);
    return failed;
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
        /* the heap, or select_many's 2 T entries */
        Entry *heap = malloc(sizeof(Entry) * (p->k >= SELECT_MIN ? 2 * span : p->k > 0 ? p->k : 1));
        if (!buffers || !heap)
            failed |= 1;
        else if (p->block_max && p->k < SELECT_MIN)
            failed |= rank_bounded(p, task / p->heads, task % p->heads, heap);
        else
            failed |= rank_one(p, task / p->heads, task % p->heads, buffers, buffers + span, heap);
        free(buffers);
        free(heap);
    }
    return failed;
}
