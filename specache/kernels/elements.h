/* What the dense C kernels share (the full cache's decode attention, the host's kernels/dense_cpu.c,
   and SpeCache's merge, merge_cpu.c): the 16-bit element types and how a row of them is read,
   summed and maxed. */
#ifndef SPECACHE_ELEMENTS_H
#define SPECACHE_ELEMENTS_H

#include <math.h>
#include <stdint.h>

#include "simd.h"

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT16 = 2 };

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

#define INLINE static inline __attribute__((always_inline))

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

#endif
