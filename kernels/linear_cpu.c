/* Products of a few float32 rows with int8 or int4 weights, on CPUs: y = x W^T (M <= 16 rows).

   kernels/linear_cpu.py states the contract and the layouts (quantize.py's), and builds this file at
   first use. A decode step multiplies one row per sequence (two with SpeCache's speculative row)
   by every weight, so the step's time is the time to stream the weights once: each weight is
   loaded once per call, widened to float in registers and multiplied into every row.

   - int8, one scale per output channel: y[r][n] = scale[n] * sum_k code[n][k] x[r][k].
   - int4, a scale and a zero per group of input channels, two codes a byte (the even channel in
     the low nibble): w = code * scale + zero, dequantized in registers. The vector path splits the
     16 bytes of 32 channels into their low and high nibbles (the even and the odd channels) and
     multiplies them by x's even and odd channels, which the call lays out once beforehand.

   Work is split over blocks of output channels with OpenMP (torch's thread count); every output is
   summed by one thread in one order, so results do not depend on the thread count. Within a block,
   the rows go in chunks of 16, 8, 4, 2 and 1 over the block's weights, which stay in cache between
   chunks. With AVX-512 (simd.h) the loops are vectorized, 16 channels a lane; builds without it,
   and int4 shapes off its alignment (K or the group not a multiple of 32), run the plain C loops. */
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define MAX_ROWS 16
#define BLOCK 32             /* output channels per task */
#define MIN_BYTES (64 << 10) /* weight bytes per thread, at least: waking a thread costs microseconds */
#define AHEAD 8192           /* bytes ahead of the loads to prefetch: a layer's weights stream 2x faster (measured) */

typedef struct {
    const float *x;      /* (M, K) */
    const void *w;       /* int8: (N, K) int8; int4: (N, K/2) uint8 */
    const float *scales; /* int8: (N,); int4: (N, K/group) */
    const float *zeros;  /* int4: (N, K/group); int8: unused */
    float *y;            /* (M, N) */
    int64_t m, n, k;
    int32_t group;       /* int4: input channels per group; 0: int8 */
    int32_t threads;
} Problem;

/* sizeof(Problem): the struct's Python (ctypes) and C++ copies are held to it when they load */
int64_t problem_bytes(void) { return (int64_t)sizeof(Problem); }

/* --- plain C: any shape ------------------------------------------------------------------------ */

__attribute__((unused)) static void int8_plain(const Problem *p, const float *x, int64_t rows, int64_t n0, int64_t n1) {
    const int8_t *w = p->w;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < p->k; k++) acc += (float)w[n * p->k + k] * x[r * p->k + k];
            p->y[r * p->n + n] = acc * p->scales[n];
        }
}

static void int4_plain(const Problem *p, const float *x, int64_t rows, int64_t n0, int64_t n1) {
    const uint8_t *w = p->w;
    const int64_t groups = p->k / p->group;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < p->k; k++) {
                const uint8_t byte = w[n * (p->k / 2) + k / 2];
                const float code = (float)(k % 2 ? byte >> 4 : byte & 15);
                const int64_t g = n * groups + k / p->group;
                acc += (code * p->scales[g] + p->zeros[g]) * x[r * p->k + k];
            }
            p->y[r * p->n + n] = acc;
        }
}

#ifdef VECTOR
/* --- AVX-512: R rows by C output channels at a time (R * C accumulators) ------------------------- */

#define INT8_KERNEL(R, C)                                                                                  \
    static void int8_##R##_##C(const Problem *p, const float *x, int64_t n) {                             \
        const int64_t K = p->k;                                                                            \
        const int8_t *w = (const int8_t *)p->w + n * K;                                                    \
        __m512 acc[C][R];                                                                                  \
        for (int c = 0; c < C; c++)                                                                        \
            for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k += 16) {                                                              \
            const __mmask16 lanes = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);              \
            __m512 xs[R];                                                                                  \
            for (int r = 0; r < R; r++) xs[r] = _mm512_maskz_loadu_ps(lanes, x + r * K + k);              \
            for (int c = 0; c < C; c++) {                                                                  \
                if (k % 64 == 0) _mm_prefetch((const char *)(w + c * K + k) + AHEAD, _MM_HINT_T0);         \
                const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                 \
                    _mm_maskz_loadu_epi8(lanes, w + c * K + k)));                                          \
                for (int r = 0; r < R; r++) acc[c][r] = _mm512_fmadd_ps(wv, xs[r], acc[c][r]);            \
            }                                                                                              \
        }                                                                                                  \
        for (int c = 0; c < C; c++)                                                                        \
            for (int r = 0; r < R; r++) p->y[r * p->n + n + c] = _mm512_reduce_add_ps(acc[c][r]) * p->scales[n + c]; \
    }

/* x here is the rows with each 32 channels reordered as their 16 even, then their 16 odd ones. */
#define INT4_KERNEL(R, C)                                                                                  \
    static void int4_##R##_##C(const Problem *p, const float *x, int64_t n) {                             \
        const int64_t K = p->k, groups = K / p->group;                                                    \
        const uint8_t *w = (const uint8_t *)p->w + n * (K / 2);                                           \
        const __m512i low = _mm512_set1_epi32(15);                                                         \
        __m512 acc[C][R];                                                                                  \
        for (int c = 0; c < C; c++)                                                                        \
            for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k += 32) {                                                              \
            __m512 even[R], odd[R];                                                                        \
            for (int r = 0; r < R; r++) {                                                                  \
                even[r] = _mm512_loadu_ps(x + r * K + k);                                                  \
                odd[r] = _mm512_loadu_ps(x + r * K + k + 16);                                              \
            }                                                                                              \
            const int64_t g = k / p->group;                                                                \
            for (int c = 0; c < C; c++) {                                                                  \
                if (k % 128 == 0) _mm_prefetch((const char *)(w + c * (K / 2) + k / 2) + AHEAD, _MM_HINT_T0); \
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + c * (K / 2) + k / 2))); \
                const __m512 scale = _mm512_set1_ps(p->scales[(n + c) * groups + g]);                     \
                const __m512 zero = _mm512_set1_ps(p->zeros[(n + c) * groups + g]);                        \
                const __m512 we = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), scale, zero); \
                const __m512 wo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), scale, zero); \
                for (int r = 0; r < R; r++)                                                                \
                    acc[c][r] = _mm512_fmadd_ps(wo, odd[r], _mm512_fmadd_ps(we, even[r], acc[c][r]));     \
            }                                                                                              \
        }                                                                                                  \
        for (int c = 0; c < C; c++)                                                                        \
            for (int r = 0; r < R; r++) p->y[r * p->n + n + c] = _mm512_reduce_add_ps(acc[c][r]);          \
    }

/* C channels at a time keeps 4 to 16 independent sums in flight for every row count. */
#define KERNELS(NAME)                                                                                     \
    NAME(16, 1) NAME(8, 1) NAME(8, 2) NAME(4, 1) NAME(4, 2) NAME(2, 1) NAME(2, 4) NAME(1, 1) NAME(1, 4)
KERNELS(INT8_KERNEL)
KERNELS(INT4_KERNEL)

typedef void (*Kernel)(const Problem *, const float *, int64_t);

/* Rows [0, rows) of x by channels [n0, n1): chunks of 16, 8, 4, 2 and 1 rows, C channels at a time. */
#define RUN_CHUNKS(KIND)                                                                                   \
    static void KIND##_vector(const Problem *p, const float *x, int64_t rows, int64_t n0, int64_t n1) {    \
        static const Kernel one[] = {KIND##_1_1, KIND##_2_1, KIND##_4_1, KIND##_8_1, KIND##_16_1};        \
        static const Kernel many[] = {KIND##_1_4, KIND##_2_4, KIND##_4_2, KIND##_8_2, KIND##_16_1};       \
        static const int width[] = {4, 4, 2, 2, 1};                                                        \
        for (int64_t r = 0; r < rows;) {                                                                   \
            const int size = rows - r >= 16 ? 4 : rows - r >= 8 ? 3 : rows - r >= 4 ? 2 : rows - r >= 2 ? 1 : 0; \
            Problem chunk = *p; /* the chunk's rows of y */                                                \
            chunk.y = p->y + r * p->n;                                                                     \
            int64_t n = n0;                                                                                \
            for (; n + width[size] <= n1; n += width[size]) many[size](&chunk, x + r * p->k, n);           \
            for (; n < n1; n++) one[size](&chunk, x + r * p->k, n);                                        \
            r += 1 << size;                                                                                \
        }                                                                                                  \
    }
RUN_CHUNKS(int8)
RUN_CHUNKS(int4)
#endif

static int int4_vectorizable(const Problem *p) {
#ifdef VECTOR
    return p->k % 32 == 0 && p->group % 32 == 0;
#else
    (void)p;
    return 0;
#endif
}

/* Returns 0, -1 for a problem outside what this file handles (the wrapper checks first), -2 without memory. */
int quantized_linear(const Problem *p) {
    const int int4 = p->group != 0;
    if (p->m < 1 || p->m > MAX_ROWS || p->n < 1 || p->k < 1 || p->threads < 1 ||
        (int4 && (p->group < 2 || p->group % 2 || p->k % p->group)))
        return -1;
    const int vector = int4 ? int4_vectorizable(p) : 0;
    const float *x = p->x;
    float *reordered = NULL;
    if (vector) { /* each 32 channels of x as their 16 even, then their 16 odd ones */
        reordered = malloc(p->m * p->k * sizeof(float));
        if (!reordered) return -2;
        for (int64_t i = 0; i < p->m * p->k; i += 32)
            for (int j = 0; j < 16; j++) {
                reordered[i + j] = p->x[i + 2 * j];
                reordered[i + 16 + j] = p->x[i + 2 * j + 1];
            }
        x = reordered;
    }
    const int64_t blocks = (p->n + BLOCK - 1) / BLOCK;
    const int64_t bytes = p->n * (int4 ? p->k / 2 : p->k);
    int64_t threads = bytes / MIN_BYTES < p->threads ? bytes / MIN_BYTES : p->threads;
    threads = threads < 1 ? 1 : threads < blocks ? threads : blocks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t n0 = block * BLOCK, n1 = n0 + BLOCK < p->n ? n0 + BLOCK : p->n;
#ifdef VECTOR
        if (!int4)
            int8_vector(p, x, p->m, n0, n1);
        else if (vector)
            int4_vector(p, x, p->m, n0, n1);
        else
            int4_plain(p, x, p->m, n0, n1);
#else
        if (int4)
            int4_plain(p, x, p->m, n0, n1);
        else
            int8_plain(p, x, p->m, n0, n1);
#endif
    }
    free(reordered);
    return 0;
}
