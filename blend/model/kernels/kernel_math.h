/* Shared by the native CPU kernels (decode_attention.c, blend_attention.c): bfloat16 <-> float32
 * and e^x for x <= 0, scalar and on 16 AVX-512 lanes. Included by each kernel's source; the
 * build's hash covers this file too (blend/model/native.py). */
#ifndef KVBLEND_KERNEL_MATH_H
#define KVBLEND_KERNEL_MATH_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

/* e^x for x <= 0 (scores minus their maximum), vectorizable: x = n ln2 + r, e^r by a
 * degree-7 polynomial (Taylor terms; |r| <= ln2 / 2 keeps it within a few ulp of expf),
 * times 2^n built in the exponent bits. Below -87 the result flushes to 0. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    float fn = (float)(int)(x * 1.44269504088896341f - 0.5f); /* round half down; x <= 0 */
    float r = x - fn * 0.693359375f - fn * -2.12194440e-4f;  /* ln2 split in two for exactness */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int)fn + 127) << 23;
    return p * scale.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_nonpositive on 16 lanes: the same reduction and polynomial, 2^n by scalef. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 fn = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, fn);
}
#endif

#endif
