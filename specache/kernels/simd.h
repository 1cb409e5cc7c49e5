/* What the C kernels beside this file share: the AVX-512 switch, float conversions and exp.

   VECTOR is defined where AVX-512 (F, BW, VL) and F16C are: the kernels' vectorized paths; builds
   without them run each kernel's plain C loops. cpu_build.py hashes this file into every
   kernel's build. */
#ifndef SPECACHE_SIMD_H
#define SPECACHE_SIMD_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define VECTOR 1
#include <immintrin.h>
#endif

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000 | (mantissa << 13));
    if (exponent) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
    const float subnormal = (float)mantissa * 5.9604644775390625e-8f; /* mantissa * 2**-24 */
    return sign ? -subnormal : subnormal;
}

/* exp(x) for x <= 0, exactly 0 at -inf: 2**n * e**r with n = round(x / ln 2), |r| <= ln(2) / 2, and
   Cephes' polynomial for e**r (within ~1e-7 of expf). 0 below -87, where 2**n would leave the
   normal floats (at most 1e-38 from expf). Plain arithmetic, so that the loops around it vectorize. */
static inline float exp_plain(float x) {
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* 1.5 * 2**23 rounds */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    const float two_n = bits_to_float((uint32_t)((int32_t)(x >= -87.0f ? n : 0.0f) + 127) << 23);
    return x >= -87.0f ? y * two_n : 0.0f;
}

#ifdef VECTOR
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* the exp_plain recipe; scalef also covers the subnormal results */
static inline __m512 exp_vector(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* below, expf is 0; a NaN x stays NaN */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif

/* w[i] = exp(w[i] - top) in place; returns their sum */
static inline float exp_sum(float *w, int64_t n, float top) {
#ifdef VECTOR
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = tail_mask(n - i);
        const __m512 x = _mm512_maskz_mov_ps(lanes, exp_vector(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, w + i),
                                                                              _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(w + i, lanes, x);
        sum = _mm512_add_ps(sum, x);
    }
    return _mm512_reduce_add_ps(sum);
#else
    float sum[8] = {0}; /* eight partial sums, so that the loop vectorizes */
    for (int64_t i = 0; i < n; i++) w[i] = exp_plain(w[i] - top);
    for (int64_t i = 0; i < n; i++) sum[i % 8] += w[i];
    return ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
#endif
}

#endif
