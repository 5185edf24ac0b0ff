/* Products y = x W^T + b of a few rows x with a weight matrix W kept in a GGUF file's
 * quantized blocks, read in their own width (4, 5, 6 or 8 bits a weight plus the blocks'
 * scales), never widened into a bfloat16 or float32 copy.
 *
 * W (n, k) is given as n weight rows, each the GGUF's blocks of that output along k:
 * Q4_0, Q4_1, Q5_0, Q8_0 (32 weights a block), Q4_K and Q6_K (256 a super-block).
 * x (rows, k) and y (rows, n) are float32 or bfloat16 (rows contiguous); b (n) float32 or
 * NULL. One call may hold several matrices of one k stacked along the outputs
 * ("segments", e.g. Q, K and V, each of its own block type): they share x.
 *
 * The arithmetic. Each row of x is cut into blocks of 32 along k (the weights' blocks or
 * sub-blocks) and each block is written as 16-bit integers times one float32 scale,
 * xq = round(x * 32767 / max|x|), so a block's dot product with a block of integer
 * weights is an exact integer sum (VNNI's vpdpwssd, AVX-512BW's / AVX2's vpmaddwd, plain
 * C's int64). Every block's sum is scaled by the weights' scale times x's scale and
 * accumulated in float32; the blocks' minimums (Q4_1, Q4_K) are multiplied by the sum of
 * x over the block (float32). The weights are exact (their integers and scales as the
 * GGUF stores them); x's 16-bit rounding is at most max|x| / 65534 per element, well
 * under bfloat16's rounding of the same x (2^-9 of each element) for the elements that
 * matter. 8-bit activations (llama.cpp's q8 dot products) measured less accurate than
 * the bfloat16 path and are not used.
 *
 * Layout per pair of 32-blocks A, B along k: the weights unpack into two vectors of 32
 * int16, lo = [A0..15 B0..15] and hi = [A16..31 B16..31] (Q4's nibbles fall that way
 * directly: a block's byte i holds weights i and i + 16); x is stored in the same order
 * once per call, so one vpdpwssd pair leaves A's partial sums in lanes 0-7 and B's in
 * 8-15, scaled by one vector [sA x8 | sB x8]. The K-quants' sub-block scales (6-bit
 * Q4_K, 8-bit Q6_K) are multiplied into the int16 weights (at most 32 x 128 = 4096, so a
 * lane's four products stay below 2^31).
 *
 * Batch and thread invariance: each output (row, column) is computed by the same
 * sequence of operations whatever the number of rows in the call, which rows share it,
 * and which thread runs it: the work items are fixed blocks of output columns, the rows
 * are walked in groups of up to 4 that share each unpacked weight pair, and a row's
 * accumulator sees its pairs in k order alone (its x blocks are quantized from that row
 * only). tests/test_quant_kernel.py checks it bitwise.
 *
 * Hand-vectorized for AVX-512 (BW; VNNI where the CPU has it), for AVX2 + FMA, plain C
 * elsewhere; the three differ only in float32 summation order. Built and loaded by
 * blend/model/native.py; tests/test_quant_kernel.py holds it to float64 products of the
 * dequantized weights (dequantized by the gguf package).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

enum { KIND_F32 = 0, KIND_BF16 = 1 };
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 }; /* GGML type ids */
#define GROUP 4       /* rows sharing one unpacked weight pair */
#define ITEM_COLS 16  /* output columns per work item */
#define XQ_MAX 32767.0f

/* one segment record (int64 each): type, n (outputs), weight pointer, bytes per weight row */
typedef struct {
    int64_t type, n, w, row_bytes;
} kvb_segment;

static inline uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q4_K's 6-bit scale and minimum of sub-block j (0..7) from its 12 packed bytes */
static inline void q4k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static int block_weights(int type) { return type == T_Q4_K || type == T_Q6_K ? 256 : 32; }

static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q4_K; }

/* One unpacked pair of 32-blocks: int16 weights in the lo / hi order above, each block's
 * scale (ws) and minimum (wm: added per unit of x, 0 for the types without one). */
typedef struct {
    int16_t lo[32], hi[32];
    float ws[2], wm[2];
} pair_t;

/* Pair p (weights 64p .. 64p + 63 along k) of weight row `row`, in plain C: the reference
 * unpacking, used by the AVX2 and plain paths. */
__attribute__((unused)) static void unpack_pair(int type, const uint8_t *row, long p, pair_t *o) {
    if (type == T_Q4_K) {
        const uint8_t *blk = row + (p / 4) * 144;
        const int c = (int)(p % 4);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        const uint8_t *qs = blk + 16 + 32 * c;
        int sa, ma, sb, mb;
        q4k_scale_min(blk + 4, 2 * c, &sa, &ma);
        q4k_scale_min(blk + 4, 2 * c + 1, &sb, &mb);
        for (int i = 0; i < 16; i++) {
            o->lo[i] = (int16_t)((qs[i] & 15) * sa);
            o->lo[16 + i] = (int16_t)((qs[i] >> 4) * sb);
            o->hi[i] = (int16_t)((qs[16 + i] & 15) * sa);
            o->hi[16 + i] = (int16_t)((qs[16 + i] >> 4) * sb);
        }
        o->ws[0] = o->ws[1] = d;
        o->wm[0] = -dmin * (float)ma;
        o->wm[1] = -dmin * (float)mb;
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *blk = row + (p / 4) * 210;
        const int c = (int)(p % 4), half = c / 2, sub = c % 2;
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 4 * sub;
        const float d = f16_at(blk + 208);
        const int shift = 4 * sub, hs = 4 * sub; /* nibble and high-bit shifts of A; B's high bits 2 above */
        for (int l = 0; l < 32; l++) {
            const int a = (((ql[l] >> shift) & 15) | (((qh[l] >> hs) & 3) << 4)) - 32;
            const int b = (((ql[32 + l] >> shift) & 15) | (((qh[l] >> (hs + 2)) & 3) << 4)) - 32;
            const int half16 = l / 16, i = l % 16;
            int16_t *dst = half16 ? o->hi : o->lo;
            dst[i] = (int16_t)(a * sc[half16]);
            dst[16 + i] = (int16_t)(b * sc[2 + half16]);
        }
        o->ws[0] = o->ws[1] = d;
        o->wm[0] = o->wm[1] = 0.0f;
        return;
    }
    for (int b = 0; b < 2; b++) {
        const long blockno = 2 * p + b;
        int16_t *lo = o->lo + 16 * b, *hi = o->hi + 16 * b;
        o->wm[b] = 0.0f;
        if (type == T_Q8_0) {
            const uint8_t *blk = row + blockno * 34;
            const int8_t *qs = (const int8_t *)(blk + 2);
            o->ws[b] = f16_at(blk);
            for (int i = 0; i < 16; i++) {
                lo[i] = qs[i];
                hi[i] = qs[16 + i];
            }
        } else if (type == T_Q5_0) {
            const uint8_t *blk = row + blockno * 22;
            const uint32_t qh = read_u32(blk + 2);
            const uint8_t *qs = blk + 6;
            o->ws[b] = f16_at(blk);
            for (int i = 0; i < 16; i++) {
                lo[i] = (int16_t)(((qs[i] & 15) | (((qh >> i) & 1) << 4)) - 16);
                hi[i] = (int16_t)(((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - 16);
            }
        } else { /* Q4_0, Q4_1 */
            const int q1 = type == T_Q4_1;
            const uint8_t *blk = row + blockno * (q1 ? 20 : 18);
            const uint8_t *qs = blk + (q1 ? 4 : 2);
            const int off = q1 ? 0 : 8;
            o->ws[b] = f16_at(blk);
            if (q1) o->wm[b] = f16_at(blk + 2);
            for (int i = 0; i < 16; i++) {
                lo[i] = (int16_t)((qs[i] & 15) - off);
                hi[i] = (int16_t)((qs[i] >> 4) - off);
            }
        }
    }
}

/* x of one row, prepared: xq (k int16 in the pair order), per pair sx / xs of A and B
 * (sx: x's scale, xs: the float32 sum of the block) and, for the AVX-512 path, the same
 * as 16 lanes ([sA x8 | sB x8], [xsA / 8 x8 | xsB / 8 x8]). */
typedef struct {
    int16_t *xq;
    float *sx, *xs;   /* (pairs, 2) */
    float *sxv, *xsv; /* (pairs, 16) */
} xrow_t;

static void prepare_row(int kind, const char *x, long k, xrow_t *o) {
    const long pairs = k / 64;
    float v[64];
    for (long p = 0; p < pairs; p++) {
        if (kind == KIND_F32) {
            memcpy(v, (const float *)x + 64 * p, sizeof v);
        } else {
            const uint16_t *xb = (const uint16_t *)x + 64 * p;
            for (int i = 0; i < 64; i++) v[i] = bf16_to_f32(xb[i]);
        }
        for (int b = 0; b < 2; b++) {
            const float *blk = v + 32 * b;
            float amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(blk[i]);
                if (a > amax || a != a) amax = a; /* a NaN sticks */
                sum += blk[i];
            }
            const float inv = amax > 0.0f && amax <= 3.4e38f ? XQ_MAX / amax : 0.0f;
            const float sx = amax / XQ_MAX; /* NaN / inf carried to the outputs */
            int16_t *lo = o->xq + 64 * p + 16 * b, *hi = o->xq + 64 * p + 32 + 16 * b;
            for (int i = 0; i < 32; i++) {
                float q = nearbyintf(blk[i] * inv);
                q = q > XQ_MAX ? XQ_MAX : (q < -XQ_MAX ? -XQ_MAX : q);
                (i < 16 ? lo : hi)[i % 16] = (int16_t)q;
            }
            o->sx[2 * p + b] = sx;
            o->xs[2 * p + b] = sum;
            for (int l = 0; l < 8; l++) {
                o->sxv[16 * p + 8 * b + l] = sx;
                o->xsv[16 * p + 8 * b + l] = sum * 0.125f;
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#include <immintrin.h>

static inline __m512i dot16(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* [a x8 | b x8] and [c x8 | d x8] from the float16 pairs (a, c) at pa and (b, d) at pb */
static inline void halves_f16(const uint8_t *pa, const uint8_t *pb, __m512 *ac, __m512 *bd) {
    uint32_t ua, ub;
    memcpy(&ua, pa, 4);
    memcpy(&ub, pb, 4);
    const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128((long long)((uint64_t)ua | ((uint64_t)ub << 32)))));
    *ac = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), v);
    *bd = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1), v);
}

static inline __m512 halves(float a, float b) {
    return _mm512_mask_blend_ps((__mmask16)0xff00, _mm512_set1_ps(a), _mm512_set1_ps(b));
}

static inline __m512i halves16(int a, int b) {
    return _mm512_mask_blend_epi16((__mmask32)0xffff0000u, _mm512_set1_epi16((short)a), _mm512_set1_epi16((short)b));
}

static inline __m256i two(const uint8_t *a, const uint8_t *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* unpack_pair on AVX-512: the same integers and scales, as vectors */
static inline __attribute__((always_inline)) void unpack512(int type, const uint8_t *row, long p, __m512i *lo,
                                                             __m512i *hi, __m512 *ws, __m512 *wm) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0) {
        const int bb = type == T_Q4_0 ? 18 : (type == T_Q4_1 ? 20 : 22);
        const int qoff = type == T_Q4_0 ? 2 : (type == T_Q4_1 ? 4 : 6);
        const uint8_t *a = row + 2 * p * bb, *b = a + bb;
        const __m256i q = two(a + qoff, b + qoff);
        *lo = _mm512_cvtepu8_epi16(_mm256_and_si256(q, m4));
        *hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
        if (type == T_Q4_0) {
            *lo = _mm512_sub_epi16(*lo, _mm512_set1_epi16(8));
            *hi = _mm512_sub_epi16(*hi, _mm512_set1_epi16(8));
        } else if (type == T_Q5_0) {
            const uint32_t ha = read_u32(a + 2), hb = read_u32(b + 2);
            const __m512i sixteen = _mm512_set1_epi16(16);
            *lo = _mm512_mask_add_epi16(*lo, (__mmask32)((ha & 0xffffu) | (hb << 16)), *lo, sixteen);
            *hi = _mm512_mask_add_epi16(*hi, (__mmask32)((ha >> 16) | (hb & 0xffff0000u)), *hi, sixteen);
            *lo = _mm512_sub_epi16(*lo, sixteen);
            *hi = _mm512_sub_epi16(*hi, sixteen);
        }
        halves_f16(a, b, ws, wm); /* d and m (Q4_1) or d and the first quants (ignored) */
        if (type != T_Q4_1) *wm = _mm512_setzero_ps();
    } else if (type == T_Q8_0) {
        const uint8_t *a = row + 2 * p * 34, *b = a + 34;
        *lo = _mm512_cvtepi8_epi16(two(a + 2, b + 2));
        *hi = _mm512_cvtepi8_epi16(two(a + 18, b + 18));
        halves_f16(a, b, ws, wm);
        *wm = _mm512_setzero_ps();
    } else if (type == T_Q4_K) {
        const uint8_t *blk = row + (p / 4) * 144;
        const int c = (int)(p % 4);
        const uint8_t *qs = blk + 16 + 32 * c;
        int sa, ma, sb, mb;
        q4k_scale_min(blk + 4, 2 * c, &sa, &ma);
        q4k_scale_min(blk + 4, 2 * c + 1, &sb, &mb);
        const __m128i q0 = _mm_loadu_si128((const __m128i *)qs), q1 = _mm_loadu_si128((const __m128i *)(qs + 16));
        const __m256i l8 = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q0), _mm_srli_epi16(q0, 4), 1), m4);
        const __m256i h8 = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q1), _mm_srli_epi16(q1, 4), 1), m4);
        const __m512i sc = halves16(sa, sb);
        *lo = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(l8), sc);
        *hi = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(h8), sc);
        const float d = f16_at(blk), dmin = f16_at(blk + 2);
        *ws = _mm512_set1_ps(d);
        *wm = halves(-dmin * (float)ma, -dmin * (float)mb);
    } else { /* T_Q6_K */
        const uint8_t *blk = row + (p / 4) * 210;
        const int c = (int)(p % 4), half = c / 2, sub = c % 2;
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 4 * sub;
        const __m256i nib_lo = two(ql, ql + 32), nib_hi = two(ql + 16, ql + 48);
        const __m256i ln = sub ? _mm256_srli_epi16(nib_lo, 4) : nib_lo, hn = sub ? _mm256_srli_epi16(nib_hi, 4) : nib_hi;
        const __m512i shifts = halves16(4 * sub, 4 * sub + 2);
        const __m512i three = _mm512_set1_epi16(3), off = _mm512_set1_epi16(32);
        __m512i bl = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(two(qh, qh)), shifts);
        __m512i bh = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(two(qh + 16, qh + 16)), shifts);
        bl = _mm512_slli_epi16(_mm512_and_si512(bl, three), 4);
        bh = _mm512_slli_epi16(_mm512_and_si512(bh, three), 4);
        const __m512i vl = _mm512_sub_epi16(_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(ln, m4)), bl), off);
        const __m512i vh = _mm512_sub_epi16(_mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(hn, m4)), bh), off);
        *lo = _mm512_mullo_epi16(vl, halves16(sc[0], sc[2]));
        *hi = _mm512_mullo_epi16(vh, halves16(sc[1], sc[3]));
        *ws = _mm512_set1_ps(f16_at(blk + 208));
        *wm = _mm512_setzero_ps();
    }
}

/* nr rows (constant in each instantiation) x one weight row: out[r] = the dot products */
static inline __attribute__((always_inline)) void column512(int type, int nr, const uint8_t *wrow, long pairs,
                                                             const xrow_t *xs, float *out) {
    /* per row: even and odd pairs' sums apart (two chains of FMA latency), minimums apart */
    __m512 acc0[GROUP], acc1[GROUP], accm[GROUP];
    for (int r = 0; r < nr; r++) acc0[r] = acc1[r] = accm[r] = _mm512_setzero_ps();
#define PAIR_STEP(ACC, P)                                                                                       \
    {                                                                                                           \
        __m512i lo, hi;                                                                                         \
        __m512 ws, wm;                                                                                          \
        unpack512(type, wrow, (P), &lo, &hi, &ws, &wm);                                                         \
        for (int r = 0; r < nr; r++) {                                                                          \
            const int16_t *xq = xs[r].xq + 64 * (P);                                                            \
            const __m512i s = dot16(dot16(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq)), hi,             \
                                    _mm512_loadu_si512(xq + 32));                                               \
            const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xs[r].sxv + 16 * (P)));                      \
            ACC[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, ACC[r]);                                     \
            if (has_min(type)) accm[r] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(xs[r].xsv + 16 * (P)), accm[r]);  \
        }                                                                                                       \
    }
    long p = 0;
    for (; p + 1 < pairs; p += 2) {
        PAIR_STEP(acc0, p)
        PAIR_STEP(acc1, p + 1)
    }
    if (p < pairs) PAIR_STEP(acc0, p)
#undef PAIR_STEP
    for (int r = 0; r < nr; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), accm[r]));
}

#define COLUMN_CASE(T, N) \
    case N: column512(T, N, wrow, pairs, xs, out); break;
#define COLUMN_TYPE(T)                                                                                       \
    static void column_##T(int nr, const uint8_t *wrow, long pairs, const xrow_t *xs, float *out) {          \
        switch (nr) {                                                                                        \
            COLUMN_CASE(T, 1) COLUMN_CASE(T, 2) COLUMN_CASE(T, 3) COLUMN_CASE(T, 4)        \
        }                                                                                                    \
    }
COLUMN_TYPE(T_Q4_0)
COLUMN_TYPE(T_Q4_1)
COLUMN_TYPE(T_Q5_0)
COLUMN_TYPE(T_Q8_0)
COLUMN_TYPE(T_Q4_K)
COLUMN_TYPE(T_Q6_K)

static void column(int type, int nr, const uint8_t *wrow, long pairs, const xrow_t *xs, float *out) {
    switch (type) {
    case T_Q4_0: column_T_Q4_0(nr, wrow, pairs, xs, out); break;
    case T_Q4_1: column_T_Q4_1(nr, wrow, pairs, xs, out); break;
    case T_Q5_0: column_T_Q5_0(nr, wrow, pairs, xs, out); break;
    case T_Q8_0: column_T_Q8_0(nr, wrow, pairs, xs, out); break;
    case T_Q4_K: column_T_Q4_K(nr, wrow, pairs, xs, out); break;
    default: column_T_Q6_K(nr, wrow, pairs, xs, out); break;
    }
}
#else
#define HAVE_AVX512 0
#endif

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#include <immintrin.h>

static void column(int type, int nr, const uint8_t *wrow, long pairs, const xrow_t *xs, float *out) {
    __m256 acc[GROUP];
    float macc[GROUP];
    pair_t pr;
    for (int r = 0; r < nr; r++) {
        acc[r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    for (long p = 0; p < pairs; p++) {
        unpack_pair(type, wrow, p, &pr);
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)pr.lo), b0 = _mm256_loadu_si256((const __m256i *)(pr.lo + 16));
        const __m256i a1 = _mm256_loadu_si256((const __m256i *)pr.hi), b1 = _mm256_loadu_si256((const __m256i *)(pr.hi + 16));
        for (int r = 0; r < nr; r++) {
            const int16_t *xq = xs[r].xq + 64 * p;
            const __m256i sa = _mm256_add_epi32(_mm256_madd_epi16(a0, _mm256_loadu_si256((const __m256i *)xq)),
                                                _mm256_madd_epi16(a1, _mm256_loadu_si256((const __m256i *)(xq + 32))));
            const __m256i sb = _mm256_add_epi32(_mm256_madd_epi16(b0, _mm256_loadu_si256((const __m256i *)(xq + 16))),
                                                _mm256_madd_epi16(b1, _mm256_loadu_si256((const __m256i *)(xq + 48))));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sa), _mm256_set1_ps(pr.ws[0] * xs[r].sx[2 * p]), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sb), _mm256_set1_ps(pr.ws[1] * xs[r].sx[2 * p + 1]), acc[r]);
            if (has_min(type)) macc[r] += pr.wm[0] * xs[r].xs[2 * p] + pr.wm[1] * xs[r].xs[2 * p + 1];
        }
    }
    for (int r = 0; r < nr; r++) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        out[r] = _mm_cvtss_f32(s) + macc[r];
    }
}
#else
#define HAVE_AVX2 0
#endif

#if !HAVE_AVX512 && !HAVE_AVX2
static void column(int type, int nr, const uint8_t *wrow, long pairs, const xrow_t *xs, float *out) {
    float acc[GROUP];
    pair_t pr;
    for (int r = 0; r < nr; r++) acc[r] = 0.0f;
    for (long p = 0; p < pairs; p++) {
        unpack_pair(type, wrow, p, &pr);
        for (int r = 0; r < nr; r++) {
            const int16_t *xq = xs[r].xq + 64 * p;
            int64_t sa = 0, sb = 0;
            for (int i = 0; i < 16; i++) {
                sa += (int64_t)pr.lo[i] * xq[i] + (int64_t)pr.hi[i] * xq[32 + i];
                sb += (int64_t)pr.lo[16 + i] * xq[16 + i] + (int64_t)pr.hi[16 + i] * xq[48 + i];
            }
            acc[r] += (float)sa * (pr.ws[0] * xs[r].sx[2 * p]);
            acc[r] += (float)sb * (pr.ws[1] * xs[r].sx[2 * p + 1]);
            if (has_min(type)) acc[r] += pr.wm[0] * xs[r].xs[2 * p] + pr.wm[1] * xs[r].xs[2 * p + 1];
        }
    }
    for (int r = 0; r < nr; r++) out[r] = acc[r];
}
#endif

/* Which path this build runs: 2 AVX-512 (+VNNI: 3), 1 AVX2 + FMA, 0 plain C. */
int kvb_quant_path(void) {
#if HAVE_AVX512 && defined(__AVX512VNNI__)
    return 3;
#elif HAVE_AVX512
    return 2;
#elif HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

/* y[r, :] = x[r, :] W^T + b for every row r, W the segments stacked along the outputs.
 * kind: x's and y's dtype (KIND_F32 / KIND_BF16); x_stride, y_stride in elements; k a
 * multiple of 64 (256 with a K-quant segment); segs (nseg records). 0 done, -1 a shape
 * or type it does not take (nothing written), -2 out of memory. */
int kvb_quant_matmul(int kind, long rows, long k, const void *x, long x_stride, void *y, long y_stride,
                     const float *bias, int nseg, const int64_t *segs) {
    const kvb_segment *seg = (const kvb_segment *)segs;
    if (rows < 1 || k < 64 || k % 64 || nseg < 1 || (kind != KIND_F32 && kind != KIND_BF16)) return -1;
    long n_total = 0, items = 0;
    for (int s = 0; s < nseg; s++) {
        const int type = (int)seg[s].type, bb = block_bytes(type);
        if (!bb || k % block_weights(type) || seg[s].n < 1 || seg[s].row_bytes < (k / block_weights(type)) * bb)
            return -1;
        n_total += seg[s].n;
        items += (seg[s].n + ITEM_COLS - 1) / ITEM_COLS;
    }
    const long pairs = k / 64;
    const size_t es = kind == KIND_F32 ? 4 : 2;
    /* per row: xq (k int16), sx, xs (2 per pair), sxv, xsv (16 per pair) */
    const size_t row_bytes = (size_t)k * 2 + (size_t)pairs * (2 + 2 + 16 + 16) * sizeof(float);
    char *buf = aligned_alloc(64, ((size_t)rows * row_bytes + 63) / 64 * 64);
    xrow_t *xr = malloc((size_t)rows * sizeof(xrow_t));
    long *item_seg = malloc((size_t)items * 2 * sizeof(long));
    if (!buf || !xr || !item_seg) {
        free(buf);
        free(xr);
        free(item_seg);
        return -2;
    }
    for (long r = 0; r < rows; r++) {
        char *base = buf + (size_t)r * row_bytes;
        xr[r].xq = (int16_t *)base;
        xr[r].sx = (float *)(base + (size_t)k * 2);
        xr[r].xs = xr[r].sx + 2 * pairs;
        xr[r].sxv = xr[r].xs + 2 * pairs;
        xr[r].xsv = xr[r].sxv + 16 * pairs;
    }
    long it = 0;
    for (int s = 0; s < nseg; s++) { /* work items: (segment, first column) */
        for (long c = 0; c < seg[s].n; c += ITEM_COLS, it++) {
            item_seg[2 * it] = s;
            item_seg[2 * it + 1] = c;
        }
    }
    const double work = (double)rows * (double)k * (double)n_total;
#pragma omp parallel if (work >= 262144.0)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) prepare_row(kind, (const char *)x + (size_t)r * x_stride * es, k, &xr[r]);
#pragma omp for schedule(dynamic, 4)
        for (long i = 0; i < items; i++) {
            const int s = (int)item_seg[2 * i];
            const long c0 = item_seg[2 * i + 1];
            long first = 0; /* the segment's first output column in y */
            for (int t = 0; t < s; t++) first += seg[t].n;
            const long c1 = c0 + ITEM_COLS < seg[s].n ? c0 + ITEM_COLS : seg[s].n;
            const int type = (int)seg[s].type;
            const uint8_t *w = (const uint8_t *)(intptr_t)seg[s].w;
            float out[GROUP];
            for (long r0 = 0; r0 < rows; r0 += GROUP) {
                const int nr = (int)(rows - r0 < GROUP ? rows - r0 : GROUP);
                for (long c = c0; c < c1; c++) {
                    column(type, nr, w + c * seg[s].row_bytes, pairs, xr + r0, out);
                    const long col = first + c;
                    const float b = bias ? bias[col] : 0.0f;
                    for (int r = 0; r < nr; r++) {
                        const float v = out[r] + b;
                        if (kind == KIND_F32)
                            ((float *)y)[(r0 + r) * y_stride + col] = v;
                        else
                            ((uint16_t *)y)[(r0 + r) * y_stride + col] = f32_to_bf16(v);
                    }
                }
            }
        }
    }
    free(buf);
    free(xr);
    free(item_seg);
    return 0;
}

/* ===================================================================== the packed layout
 *
 * The same products from the blocks repacked once (kvb_qpack) into a layout that puts 16
 * output columns in the 16 lanes of a vector, so that many rows share each unpacked weight
 * vector and no lane ever needs a horizontal sum. With AVX-512 VNNI one row costs ~24 vector
 * operations per 512 weights (against ~48 above) and the unpacking, shared by the rows, is
 * and / shift only: the blocks then beat the dense bfloat16 product at every decode batch.
 *
 * A segment of n outputs and k inputs becomes ceil(n / 16) groups of 16 columns (the last
 * padded with zero weights), each a run of k / 32 records, one per 32-block along k:
 *   - the weights as unsigned integers u (0..15 for Q4_0 / Q4_1 / Q4_K, 0..31 Q5_0, 0..63
 *     Q6_K, 0..255 Q8_0: the GGUF's quants, Q8_0's moved up by 128), in "quads": quad q
 *     (k 4q .. 4q + 3 of the block) of column c is 4 bytes at lane c. 4-bit and 5-bit types
 *     store two quads per byte (vector j: quad j in the low nibbles, quad j + 4 in the high),
 *     Q5_0 its fifth bits as 8 masks of 64 bits (one per quad, bit 4c + i); Q6_K and Q8_0 one
 *     byte a weight;
 *   - the scales: the GGUF's float16 d (and Q4_1's m) as they are, or for the K-quants float32
 *     d * scale (and -dmin * min) per column, per 32-block (Q6_K: per 16-block).
 * A weight is d * (u - offset) (+ m): offset 8 (Q4_0), 16 (Q5_0), 128 (Q8_0), 32 (Q6_K), 0.
 * Records are as many bytes as the GGUF's blocks of the same weights, but for the K-quants'
 * float32 scales.
 *
 * x: each 32-block of a row becomes 15-bit integers xq = round(x * 16383 / max|x|) (one
 * float32 scale a block: rounding at most max|x| / 32766, far below bfloat16's 2^-9 of each
 * element), split xq = 128 xh + xl with xh in -128..127 and xl in 0..127, two signed bytes,
 * so that vpdpbusd (unsigned weight bytes times signed x bytes, 4 products a lane) gives the
 * exact integer sum: 128 sum(u xh) + sum(u xl) - offset sum(xq). It is scaled by the weights'
 * and x's scales and accumulated in float32 per output; minimums (Q4_1, Q4_K) times the
 * block's float32 sum of x.
 *
 * The same invariance as above: an output (row, column) is computed by the same operations
 * whatever the other rows of the call (rows share the unpacked weights in groups of up to 8;
 * a row's accumulator sees its blocks in k order alone) and whatever thread runs its group.
 * AVX2 + FMA + F16C runs the same layout 8 columns a vector (below: the same bits as VNNI); plain C
 * too (tests, AVX-512 CPUs without VNNI); kvb_qpack_path says which path.
 */
#define PK_COLS 16
#define PK_ROWS 8
#define PK_XMAX 16383.0f

static int pk_record(int type) {
    switch (type) {
    case T_Q4_0: return 256 + 32;
    case T_Q4_1: return 256 + 64;
    case T_Q5_0: return 256 + 64 + 32;
    case T_Q8_0: return 512 + 32;
    case T_Q4_K: return 256 + 128;
    case T_Q6_K: return 512 + 128;
    default: return 0;
    }
}

static inline int pk_offset(int type) {
    return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : type == T_Q6_K ? 32 : 0;
}

static inline int pk_nibbles(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q4_K; }

/* where a record's scales start */
static inline int pk_scales_at(int type) { return type == T_Q5_0 ? 320 : pk_nibbles(type) ? 256 : 512; }

/* 32-block b of weight row `row`: its unsigned integers u, and its scales (f16 bits d16 / m16
 * for the 32-block types, float32 ws[2] / wm for the K-quants; Q6_K's ws per 16-block) */
static void pk_block(int type, const uint8_t *row, long b, uint8_t u[32], uint16_t *d16, uint16_t *m16, float ws[2],
                     float *wm) {
    *d16 = *m16 = 0;
    ws[0] = ws[1] = *wm = 0.0f;
    if (type == T_Q4_K) {
        const uint8_t *blk = row + (b / 8) * 144;
        const int j = (int)(b % 8);
        const uint8_t *qs = blk + 16 + 32 * (j / 2);
        int sc, m;
        q4k_scale_min(blk + 4, j, &sc, &m);
        for (int i = 0; i < 32; i++) u[i] = j % 2 ? qs[i] >> 4 : qs[i] & 15;
        ws[0] = ws[1] = f16_at(blk) * (float)sc;
        *wm = -f16_at(blk + 2) * (float)m;
        return;
    }
    if (type == T_Q6_K) {
        const uint8_t *blk = row + (b / 8) * 210;
        const int j = (int)(b % 8), half = j / 4, quad = j % 4;
        const uint8_t *ql = blk + 64 * half + 32 * (quad & 1), *qh = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 2 * quad;
        const float d = f16_at(blk + 208);
        for (int l = 0; l < 32; l++)
            u[l] = (uint8_t)(((ql[l] >> (4 * (quad >> 1))) & 15) | (((qh[l] >> (2 * quad)) & 3) << 4));
        ws[0] = d * (float)sc[0];
        ws[1] = d * (float)sc[1];
        return;
    }
    if (type == T_Q8_0) {
        const uint8_t *blk = row + b * 34;
        *d16 = (uint16_t)(blk[0] | (blk[1] << 8));
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)((int8_t)blk[2 + i] + 128);
        return;
    }
    if (type == T_Q5_0) {
        const uint8_t *blk = row + b * 22;
        const uint32_t qh = read_u32(blk + 2);
        *d16 = (uint16_t)(blk[0] | (blk[1] << 8));
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)((blk[6 + i] & 15) | (((qh >> i) & 1) << 4));
            u[16 + i] = (uint8_t)((blk[6 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
        }
        return;
    }
    /* Q4_0, Q4_1 */
    const int q1 = type == T_Q4_1;
    const uint8_t *blk = row + b * (q1 ? 20 : 18), *qs = blk + (q1 ? 4 : 2);
    *d16 = (uint16_t)(blk[0] | (blk[1] << 8));
    if (q1) *m16 = (uint16_t)(blk[2] | (blk[3] << 8));
    for (int i = 0; i < 16; i++) {
        u[i] = qs[i] & 15;
        u[16 + i] = qs[i] >> 4;
    }
}

static int pk_takes(int type, long k) {
    return pk_record(type) && k >= 64 && k % 64 == 0 && k % block_weights(type) == 0;
}

/* Bytes of one packed record (16 columns x 32 weights) of `type`, 0 for a type it does not
 * take: n outputs x k inputs pack into ceil(n / 16) * (k / 32) records. */
int kvb_qpack_record(int type) { return pk_record(type); }

/* Repack n weight rows of `type` (row_bytes apart at src, the GGUF's blocks) into dst
 * (kvb_qpack_record bytes per 16 columns x 32 weights). 0 done, -1 a type or shape it does not take. */
int kvb_qpack(int type, long n, long k, const uint8_t *src, long row_bytes, uint8_t *dst) {
    if (!pk_takes(type, k) || n < 1 || row_bytes < (k / block_weights(type)) * block_bytes(type)) return -1;
    const long blocks = k / 32, groups = (n + PK_COLS - 1) / PK_COLS;
    const int rec = pk_record(type), at = pk_scales_at(type);
#pragma omp parallel for schedule(static) if (n * k >= 1 << 20)
    for (long g = 0; g < groups; g++) {
        uint8_t u[32];
        for (long b = 0; b < blocks; b++) {
            uint8_t *r = dst + (g * blocks + b) * rec;
            memset(r, 0, (size_t)rec);
            for (int c = 0; c < PK_COLS; c++) {
                const long col = g * PK_COLS + c;
                if (col >= n) break;
                uint16_t d16, m16;
                float ws[2], wm;
                pk_block(type, src + col * row_bytes, b, u, &d16, &m16, ws, &wm);
                for (int q = 0; q < 8; q++) {
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = u[4 * q + i];
                        if (pk_nibbles(type)) {
                            r[64 * (q % 4) + 4 * c + i] |= (uint8_t)((v & 15) << (q < 4 ? 0 : 4));
                            if (type == T_Q5_0 && (v >> 4)) r[256 + 8 * q + (4 * c + i) / 8] |= (uint8_t)(1u << ((4 * c + i) % 8));
                        } else {
                            r[64 * q + 4 * c + i] = v;
                        }
                    }
                }
                if (type == T_Q4_K || type == T_Q6_K) {
                    float *s = (float *)(r + at);
                    s[c] = ws[0];
                    s[16 + c] = type == T_Q6_K ? ws[1] : wm;
                } else {
                    uint16_t *s = (uint16_t *)(r + at);
                    s[c] = d16;
                    if (type == T_Q4_1) s[16 + c] = m16;
                }
            }
        }
    }
    return 0;
}

/* One row of x prepared for the packed products: xh, xl (k bytes each), per 32-block its
 * scale sx, float32 sum xs and integer sum sq of xq, and per 16-block sq16. */
typedef struct {
    int8_t *xh, *xl;
    float *sx, *xs;
    int32_t *sq, *sq16;
} pk_row_t;

static void pk_prepare_row(int kind, const char *x, long k, const pk_row_t *o) {
    float v[32];
    for (long b = 0; b < k / 32; b++) {
        if (kind == KIND_F32) {
            memcpy(v, (const float *)x + 32 * b, sizeof v);
        } else {
            const uint16_t *xb = (const uint16_t *)x + 32 * b;
            for (int i = 0; i < 32; i++) v[i] = bf16_to_f32(xb[i]);
        }
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(v[i]);
            if (a > amax || a != a) amax = a; /* a NaN sticks */
            sum += v[i];
        }
        const float inv = amax > 0.0f && amax <= 3.4e38f ? PK_XMAX / amax : 0.0f;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 32; i++) {
            float q = nearbyintf(v[i] * inv);
            q = q > PK_XMAX ? PK_XMAX : (q < -PK_XMAX ? -PK_XMAX : q);
            const int32_t xq = (int32_t)q;
            o->xh[32 * b + i] = (int8_t)(xq >> 7); /* floor: xq = 128 xh + xl */
            o->xl[32 * b + i] = (int8_t)(xq & 127);
            if (i < 16)
                s0 += xq;
            else
                s1 += xq;
        }
        o->sx[b] = amax / PK_XMAX; /* NaN / inf carried to the outputs */
        o->xs[b] = sum;
        o->sq[b] = s0 + s1;
        o->sq16[2 * b] = s0;
        o->sq16[2 * b + 1] = s1;
    }
}

#if HAVE_AVX512 && defined(__AVX512VNNI__)
#define PK_VNNI 1
#ifndef PK_AHEAD
#define PK_AHEAD 1024 /* bytes ahead of the record in use that the loop asks the memory for */
#endif

static inline __m512i pk_x4(const int8_t *p) { /* 4 bytes of x on every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* nr rows (constant per instantiation) through one group of 16 columns: out[r * 16 + c] */
static inline __attribute__((always_inline)) void pk_group512(int type, int nr, const uint8_t *rec0, long blocks,
                                                               const pk_row_t *xr, float *out) {
    const int rec = pk_record(type), at = pk_scales_at(type), off = pk_offset(type);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 acc[PK_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const uint8_t *rp = rec0 + b * rec;
        for (int l = 0; l < rec; l += 64) _mm_prefetch((const char *)rp + PK_AHEAD + l, _MM_HINT_T0);
        __m512i w[8];
        if (pk_nibbles(type)) {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512(rp + 64 * j);
                w[j] = _mm512_and_si512(v, m4);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            if (type == T_Q5_0) {
                const __m512i sixteen = _mm512_set1_epi8(16);
                for (int q = 0; q < 8; q++) {
                    uint64_t mk;
                    memcpy(&mk, rp + 256 + 8 * q, 8);
                    w[q] = _mm512_or_si512(w[q], _mm512_maskz_mov_epi8((__mmask64)mk, sixteen));
                }
            }
        } else {
            for (int q = 0; q < 8; q++) w[q] = _mm512_loadu_si512(rp + 64 * q);
        }
        __m512 ws, wm = _mm512_setzero_ps();
        if (type == T_Q4_K || type == T_Q6_K) {
            ws = _mm512_loadu_ps(rp + at);
            wm = _mm512_loadu_ps(rp + at + 64); /* Q6_K: the second 16-block's scales */
        } else {
            ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rp + at)));
            if (type == T_Q4_1) wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rp + at + 32)));
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *xh = xr[r].xh + 32 * b, *xl = xr[r].xl + 32 * b;
            /* two chains: quads 0-3 (a) and 4-7 (c), each high bytes, times 128, low bytes */
            __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
            for (int q = 0; q < 4; q++) {
                a = _mm512_dpbusd_epi32(a, w[q], pk_x4(xh + 4 * q));
                c = _mm512_dpbusd_epi32(c, w[q + 4], pk_x4(xh + 16 + 4 * q));
            }
            a = _mm512_slli_epi32(a, 7);
            c = _mm512_slli_epi32(c, 7);
            for (int q = 0; q < 4; q++) {
                a = _mm512_dpbusd_epi32(a, w[q], pk_x4(xl + 4 * q));
                c = _mm512_dpbusd_epi32(c, w[q + 4], pk_x4(xl + 16 + 4 * q));
            }
            const __m512 sx = _mm512_set1_ps(xr[r].sx[b]);
            if (type == T_Q6_K) {
                a = _mm512_sub_epi32(a, _mm512_set1_epi32(off * xr[r].sq16[2 * b]));
                c = _mm512_sub_epi32(c, _mm512_set1_epi32(off * xr[r].sq16[2 * b + 1]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws, sx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(wm, sx), acc[r]);
            } else {
                a = _mm512_add_epi32(a, c);
                if (off) a = _mm512_sub_epi32(a, _mm512_set1_epi32(off * xr[r].sq[b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws, sx), acc[r]);
                if (has_min(type)) acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xr[r].xs[b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out + PK_COLS * r, acc[r]);
}

#define PK_CASE(T, N) \
    case N: pk_group512(T, N, rec0, blocks, xr, out); break;
#define PK_TYPE(T)                                                                                            \
    static void pk_group_##T(int nr, const uint8_t *rec0, long blocks, const pk_row_t *xr, float *out) {      \
        switch (nr) {                                                                                         \
            PK_CASE(T, 1) PK_CASE(T, 2) PK_CASE(T, 3) PK_CASE(T, 4) PK_CASE(T, 5) PK_CASE(T, 6) PK_CASE(T, 7) \
            PK_CASE(T, 8)                                                                                     \
        }                                                                                                     \
    }
PK_TYPE(T_Q4_0)
PK_TYPE(T_Q4_1)
PK_TYPE(T_Q5_0)
PK_TYPE(T_Q8_0)
PK_TYPE(T_Q4_K)
PK_TYPE(T_Q6_K)

static void pk_group(int type, int nr, const uint8_t *rec0, long blocks, const pk_row_t *xr, float *out) {
    switch (type) {
    case T_Q4_0: pk_group_T_Q4_0(nr, rec0, blocks, xr, out); break;
    case T_Q4_1: pk_group_T_Q4_1(nr, rec0, blocks, xr, out); break;
    case T_Q5_0: pk_group_T_Q5_0(nr, rec0, blocks, xr, out); break;
    case T_Q8_0: pk_group_T_Q8_0(nr, rec0, blocks, xr, out); break;
    case T_Q4_K: pk_group_T_Q4_K(nr, rec0, blocks, xr, out); break;
    default: pk_group_T_Q6_K(nr, rec0, blocks, xr, out); break;
    }
}
#elif HAVE_AVX2 && defined(__F16C__)
#define PK_VNNI 2
#ifndef PK_AHEAD
#define PK_AHEAD 1024
#endif
#ifndef PK_ROWS2
#define PK_ROWS2 4 /* rows sharing one half's unpacked weights (16 ymm registers: 8 weights, 4 sums, temps) */
#endif

/* The packed products on AVX2: a record's 16 columns as two halves of 8 (bytes 0-31 and 32-63 of
 * each 64-byte vector), each half's 32-bit lanes one column, as the AVX-512 lanes above. vpdpbusd
 * becomes vpmaddubsw (unsigned weight byte times signed x byte, pairs summed into 16 bits, which
 * saturate) and vpmaddwd (16-bit pairs into 32 bits, times 128 for the high bytes of x). The 16-bit
 * sums stay exact by summing only as many quads as their bound allows: a quad's pair is at most
 * 2 * u_max * 128, so 8 quads of 4-bit weights (30,720), 4 of Q5_0's (31,744), 2 of Q6_K's
 * (32,256); Q8_0 (bytes up to 255) by 16-bit products instead (vpmaddwd of its signed quants and
 * xq). The integer sums are those of the VNNI path and the float32 steps the same in the same
 * order, so a row's outputs are the VNNI path's bits. */

static inline __m256i pk_x4_256(const int8_t *p) { /* 4 bytes of x on every lane */
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* the 32 bits of m as 32 bytes, 0xff where set (Q5_0's fifth bits of one half) */
static inline __m256i pk_bits256(uint32_t m) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                          3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), pick);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

/* sum over quads q0 .. q1 - 1 of w[q] times the x bytes of quad q, as 16-bit pairs */
static inline __attribute__((always_inline)) __m256i pk_pairs(const __m256i *w, const int8_t *x, int q0, int q1) {
    __m256i s = _mm256_maddubs_epi16(w[q0], pk_x4_256(x + 4 * q0));
    for (int q = q0 + 1; q < q1; q++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[q], pk_x4_256(x + 4 * q)));
    return s;
}

/* 128 sum(u xh) + sum(u xl) over quads q0 .. q1 - 1 of one row, 32-bit, `step` quads per 16-bit sum */
static inline __attribute__((always_inline)) __m256i pk_dot(const __m256i *w, const int8_t *xh, const int8_t *xl,
                                                            int q0, int q1, int step) {
    const __m256i one = _mm256_set1_epi16(1), hi = _mm256_set1_epi16(128);
    __m256i s = _mm256_setzero_si256();
    for (int q = q0; q < q1; q += step) {
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pk_pairs(w, xh, q, q + step), hi));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(pk_pairs(w, xl, q, q + step), one));
    }
    return s;
}

/* nr rows (constant per instantiation) through half `h` (columns 8h .. 8h + 7) of one group: out[r * 16 + c] */
static inline __attribute__((always_inline)) void pk_half256(int type, int nr, int h, const uint8_t *rec0,
                                                             long blocks, const pk_row_t *xr, float *out) {
    const int rec = pk_record(type), at = pk_scales_at(type), off = pk_offset(type);
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[PK_ROWS2];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const uint8_t *rp = rec0 + b * rec;
        if (h == 0)
            for (int l = 0; l < rec; l += 64) _mm_prefetch((const char *)rp + PK_AHEAD + l, _MM_HINT_T0);
        __m256i w[8], w2[8]; /* Q8_0: w, w2 its columns 0-3, 4-7 as 16-bit */
        if (pk_nibbles(type)) {
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rp + 64 * j + 32 * h));
                w[j] = _mm256_and_si256(v, m4);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            if (type == T_Q5_0) {
                const __m256i sixteen = _mm256_set1_epi8(16);
                for (int q = 0; q < 8; q++) {
                    uint32_t mk;
                    memcpy(&mk, rp + 256 + 8 * q + 4 * h, 4);
                    w[q] = _mm256_or_si256(w[q], _mm256_and_si256(pk_bits256(mk), sixteen));
                }
            }
        } else if (type == T_Q8_0) { /* the GGUF's signed quants back (u - 128), widened: columns 0-3 / 4-7 */
            for (int q = 0; q < 8; q++) {
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rp + 64 * q + 32 * h)),
                                                   _mm256_set1_epi8((char)0x80));
                w[q] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
                w2[q] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
            }
        } else {
            for (int q = 0; q < 8; q++) w[q] = _mm256_loadu_si256((const __m256i *)(rp + 64 * q + 32 * h));
        }
        __m256 ws, wm = _mm256_setzero_ps();
        if (type == T_Q4_K || type == T_Q6_K) {
            ws = _mm256_loadu_ps((const float *)(rp + at) + 8 * h);
            wm = _mm256_loadu_ps((const float *)(rp + at + 64) + 8 * h); /* Q6_K: the second 16-block's scales */
        } else {
            ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rp + at + 16 * h)));
            if (type == T_Q4_1) wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rp + at + 32 + 16 * h)));
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *xh = xr[r].xh + 32 * b, *xl = xr[r].xl + 32 * b;
            const __m256 sx = _mm256_set1_ps(xr[r].sx[b]);
            if (type == T_Q6_K) {
                __m256i a = pk_dot(w, xh, xl, 0, 4, 2), c = pk_dot(w, xh, xl, 4, 8, 2);
                a = _mm256_sub_epi32(a, _mm256_set1_epi32(off * xr[r].sq16[2 * b]));
                c = _mm256_sub_epi32(c, _mm256_set1_epi32(off * xr[r].sq16[2 * b + 1]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws, sx), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(wm, sx), acc[r]);
                continue;
            }
            __m256i a;
            if (type == T_Q8_0) {
                /* Q8_0's bytes exceed vpmaddubsw's 16-bit pairs: 16-bit quants times 16-bit xq = 128 xh + xl
                 * (vpmaddwd), each quad's 4 xq on every 64-bit lane, 2 lanes a column, then the lane pairs
                 * summed (vphaddd) and put in column order: sum((u - 128) xq), the VNNI path's integer */
                int16_t xq[32];
                for (int i = 0; i < 32; i += 16) {
                    const __m256i hx = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xh + i)));
                    const __m256i lx = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(xl + i)));
                    _mm256_storeu_si256((__m256i *)(xq + i), _mm256_add_epi16(_mm256_slli_epi16(hx, 7), lx));
                }
                __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
                for (int q = 0; q < 8; q++) {
                    long long x4;
                    memcpy(&x4, xq + 4 * q, 8);
                    const __m256i xv = _mm256_set1_epi64x(x4);
                    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(w[q], xv));
                    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(w2[q], xv));
                }
                a = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(lo, hi), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
            } else {
                a = pk_dot(w, xh, xl, 0, 8, type == T_Q5_0 ? 4 : 8);
                if (off) a = _mm256_sub_epi32(a, _mm256_set1_epi32(off * xr[r].sq[b]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(ws, sx), acc[r]);
            if (has_min(type)) acc[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xr[r].xs[b]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm256_storeu_ps(out + PK_COLS * r + 8 * h, acc[r]);
}

static inline __attribute__((always_inline)) void pk_group256(int type, int nr, const uint8_t *rec0, long blocks,
                                                              const pk_row_t *xr, float *out) {
    pk_half256(type, nr, 0, rec0, blocks, xr, out);
    pk_half256(type, nr, 1, rec0, blocks, xr, out);
}

#define PK_CASE(T, N) \
    case N: pk_group256(T, N, rec0, blocks, xr, out); break;
#define PK_TYPE(T)                                                                                       \
    static void pk_group_##T(int nr, const uint8_t *rec0, long blocks, const pk_row_t *xr, float *out) { \
        switch (nr) { PK_CASE(T, 1) PK_CASE(T, 2) PK_CASE(T, 3) PK_CASE(T, 4) }                          \
    }
PK_TYPE(T_Q4_0)
PK_TYPE(T_Q4_1)
PK_TYPE(T_Q5_0)
PK_TYPE(T_Q8_0)
PK_TYPE(T_Q4_K)
PK_TYPE(T_Q6_K)

/* rows in groups of PK_ROWS2 (each row's operations the same in any group) */
static void pk_group(int type, int nr, const uint8_t *rec0, long blocks, const pk_row_t *xr, float *out) {
    for (int r0 = 0; r0 < nr; r0 += PK_ROWS2) {
        const int n = nr - r0 < PK_ROWS2 ? nr - r0 : PK_ROWS2;
        const pk_row_t *x = xr + r0;
        float *o = out + PK_COLS * r0;
        switch (type) {
        case T_Q4_0: pk_group_T_Q4_0(n, rec0, blocks, x, o); break;
        case T_Q4_1: pk_group_T_Q4_1(n, rec0, blocks, x, o); break;
        case T_Q5_0: pk_group_T_Q5_0(n, rec0, blocks, x, o); break;
        case T_Q8_0: pk_group_T_Q8_0(n, rec0, blocks, x, o); break;
        case T_Q4_K: pk_group_T_Q4_K(n, rec0, blocks, x, o); break;
        default: pk_group_T_Q6_K(n, rec0, blocks, x, o); break;
        }
    }
}
#else
#define PK_VNNI 0

/* the packed products in plain C: the same integers, scales and per-block order */
static void pk_group(int type, int nr, const uint8_t *rec0, long blocks, const pk_row_t *xr, float *out) {
    const int rec = pk_record(type), at = pk_scales_at(type), off = pk_offset(type);
    float acc[PK_ROWS][PK_COLS];
    memset(acc, 0, sizeof acc);
    for (long b = 0; b < blocks; b++) {
        const uint8_t *rp = rec0 + b * rec;
        for (int c = 0; c < PK_COLS; c++) {
            int u[32];
            for (int q = 0; q < 8; q++) {
                for (int i = 0; i < 4; i++) {
                    const int at_byte = 4 * c + i;
                    int v;
                    if (pk_nibbles(type)) {
                        v = (rp[64 * (q % 4) + at_byte] >> (q < 4 ? 0 : 4)) & 15;
                        if (type == T_Q5_0) v |= ((rp[256 + 8 * q + at_byte / 8] >> (at_byte % 8)) & 1) << 4;
                    } else {
                        v = rp[64 * q + at_byte];
                    }
                    u[4 * q + i] = v;
                }
            }
            float ws, w2 = 0.0f, wm = 0.0f;
            if (type == T_Q4_K || type == T_Q6_K) {
                memcpy(&ws, rp + at + 4 * c, 4);
                memcpy(type == T_Q6_K ? &w2 : &wm, rp + at + 64 + 4 * c, 4);
            } else {
                uint16_t h;
                memcpy(&h, rp + at + 2 * c, 2);
                ws = f16_to_f32(h);
                if (type == T_Q4_1) {
                    memcpy(&h, rp + at + 32 + 2 * c, 2);
                    wm = f16_to_f32(h);
                }
            }
            for (int r = 0; r < nr; r++) {
                const int8_t *xh = xr[r].xh + 32 * b, *xl = xr[r].xl + 32 * b;
                int32_t a = 0, cc = 0;
                for (int i = 0; i < 16; i++) {
                    a += u[i] * xh[i];
                    cc += u[16 + i] * xh[16 + i];
                }
                a *= 128;
                cc *= 128;
                for (int i = 0; i < 16; i++) {
                    a += u[i] * xl[i];
                    cc += u[16 + i] * xl[16 + i];
                }
                const float sx = xr[r].sx[b];
                if (type == T_Q6_K) {
                    a -= off * xr[r].sq16[2 * b];
                    cc -= off * xr[r].sq16[2 * b + 1];
                    acc[r][c] += (float)a * (ws * sx);
                    acc[r][c] += (float)cc * (w2 * sx);
                } else {
                    a = a + cc - off * xr[r].sq[b];
                    acc[r][c] += (float)a * (ws * sx);
                    if (has_min(type)) acc[r][c] += wm * xr[r].xs[b];
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) memcpy(out + PK_COLS * r, acc[r], sizeof acc[r]);
}
#endif

/* Which path the packed products run: 1 AVX-512 VNNI, 2 AVX2 + FMA + F16C, 0 plain C. */
int kvb_qpack_path(void) { return PK_VNNI; }

/* y[r, :] = x[r, :] W^T + b from packed segments (records: type, n, packed pointer, unused),
 * as kvb_quant_matmul. 0 done, -1 a shape or type it does not take, -2 out of memory. */
int kvb_qpack_matmul(int kind, long rows, long k, const void *x, long x_stride, void *y, long y_stride,
                     const float *bias, int nseg, const int64_t *segs) {
    const kvb_segment *seg = (const kvb_segment *)segs;
    if (rows < 1 || nseg < 1 || (kind != KIND_F32 && kind != KIND_BF16)) return -1;
    long n_total = 0, items = 0;
    for (int s = 0; s < nseg; s++) {
        if (!pk_takes((int)seg[s].type, k) || seg[s].n < 1) return -1;
        n_total += seg[s].n;
        items += (seg[s].n + PK_COLS - 1) / PK_COLS;
    }
    const long blocks = k / 32;
    const size_t es = kind == KIND_F32 ? 4 : 2;
    const size_t row_bytes = ((size_t)k * 2 + (size_t)blocks * 20 + 63) / 64 * 64;
    char *buf = aligned_alloc(64, (size_t)rows * row_bytes);
    pk_row_t *xr = malloc((size_t)rows * sizeof(pk_row_t));
    long *item_seg = malloc((size_t)items * 3 * sizeof(long));
    if (!buf || !xr || !item_seg) {
        free(buf);
        free(xr);
        free(item_seg);
        return -2;
    }
    for (long r = 0; r < rows; r++) {
        char *base = buf + (size_t)r * row_bytes;
        xr[r].xh = (int8_t *)base;
        xr[r].xl = xr[r].xh + k;
        xr[r].sx = (float *)(base + 2 * k);
        xr[r].xs = xr[r].sx + blocks;
        xr[r].sq = (int32_t *)(xr[r].xs + blocks);
        xr[r].sq16 = xr[r].sq + blocks;
    }
    long it = 0, first = 0;
    for (int s = 0; s < nseg; s++) { /* work items: (segment, group, its first output in y) */
        for (long g = 0; g * PK_COLS < seg[s].n; g++, it++) {
            item_seg[3 * it] = s;
            item_seg[3 * it + 1] = g;
            item_seg[3 * it + 2] = first + g * PK_COLS;
        }
        first += seg[s].n;
    }
    const double work = (double)rows * (double)k * (double)n_total;
#pragma omp parallel if (work >= 262144.0)
    {
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) pk_prepare_row(kind, (const char *)x + (size_t)r * x_stride * es, k, &xr[r]);
        /* static: each thread streams one contiguous run of the packed records (items are laid out
         * in order), which the hardware prefetchers follow; handing out items two at a time broke the
         * streams into 2-item pieces: a batch-1 decode step of SmolLM2 at 1,024 positions took 11.3-12.5
         * ms with it against 6.8-7.3 with this (AMD EPYC, 2 cores). Who runs an item never changes its
         * bits. */
#pragma omp for schedule(static)
        for (long i = 0; i < items; i++) {
            const int s = (int)item_seg[3 * i];
            const long g = item_seg[3 * i + 1], col0 = item_seg[3 * i + 2];
            const int type = (int)seg[s].type;
            const long valid = seg[s].n - g * PK_COLS < PK_COLS ? seg[s].n - g * PK_COLS : PK_COLS;
            const uint8_t *rec0 = (const uint8_t *)(intptr_t)seg[s].w + (size_t)g * blocks * pk_record(type);
            float out[PK_ROWS * PK_COLS];
            for (long r0 = 0; r0 < rows; r0 += PK_ROWS) {
                const int nr = (int)(rows - r0 < PK_ROWS ? rows - r0 : PK_ROWS);
                pk_group(type, nr, rec0, blocks, xr + r0, out);
                for (int r = 0; r < nr; r++) {
                    for (long c = 0; c < valid; c++) {
                        const float v = out[PK_COLS * r + c] + (bias ? bias[col0 + c] : 0.0f);
                        if (kind == KIND_F32)
                            ((float *)y)[(r0 + r) * y_stride + col0 + c] = v;
                        else
                            ((uint16_t *)y)[(r0 + r) * y_stride + col0 + c] = f32_to_bf16(v);
                    }
                }
            }
        }
    }
    free(buf);
    free(xr);
    free(item_seg);
    return 0;
}

/* ------------------------------------------------------------------------ a decode layer
 *
 * One decoder layer of a Llama-style model (RMS norms, Q/K/V with RoPE, grouped-query
 * attention over the sequence's cache, output projection, SiLU-gated MLP) for a few decode
 * rows in one call: the four products from packed segments (kvb_qpack_matmul), the attention
 * by the decode kernel (kvb_decode_attention_batch of decode_attention.c, whose address the
 * caller gives in the layer's record), everything between them here, on the calling thread
 * (a few thousand elements a row; bfloat16 rows 16 at a time with AVX-512: the norms, RoPE,
 * SiLU and residuals took ~7% of a batch-1 decode step one element at a time, with expf).
 * It is the same arithmetic as the runner's torch ops for these rows, rounding to the compute
 * dtype where those hold a tensor of it (bfloat16: the norm's output, q/k after RoPE, each
 * product, the residual sums, silu and its product), in float32 between: not the same bits
 * (sums run in another order), but each row's bits are its own whatever else shares the call
 * (every stage is per row, the products and the attention are batch-invariant). What it saves
 * is the crossings: ~20 tensor ops a layer from Python.
 */

typedef int (*kvb_attention_fn)(int kind, int hkv, int g, int d, int n, const int64_t *seqs);

/* The layer, as 64-bit integers (pointers included) in one array the caller builds once:
 * sizes, the two norms' weights (hidden, in the compute dtype), each product's segment
 * count, kvb_segment table and float32 bias (0: none), and the attention function. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    int64_t norm1, norm2;
    int64_t qkv_n, qkv_segs, qkv_bias, o_n, o_segs, o_bias, gu_n, gu_segs, gu_bias, down_n, down_segs, down_bias;
    int64_t attention;
} kvb_layer;

/* One decode row's cache at this layer: its position, the first key it attends (a window's
 * start), the layer's K and V (kv_heads, capacity, head_dim) in the compute dtype with their
 * strides in elements, and the layer's bias (kv_heads, capacity) float32 (0: none). */
typedef struct {
    int64_t pos, lo, k, v, k_head, k_row, v_head, v_row, bias, bias_head;
} kvb_drow;

static inline float dl_get(int kind, const void *p, long i) {
    return kind == KIND_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float dl_round(int kind, float v) { return kind == KIND_F32 ? v : bf16_to_f32(f32_to_bf16(v)); }

static inline void dl_put(int kind, void *p, long i, float v) {
    if (kind == KIND_F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16(v);
}

#if HAVE_AVX512
/* bfloat16 rows 16 at a time: the same operations and rounding points as the scalar loops below
 * (bfloat16 to float32 is exact; bf16_round16 rounds as f32_to_bf16) */
static inline __m512 v_bf16(const void *p, long i) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 v_round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round16(v)), 16));
}

static inline void v_put(void *p, long i, __m512 v) {
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), bf16_round16(v));
}
#endif

/* dst = w * (x * rsqrt(mean(x^2) + eps)): float32 throughout for float32 (F.rms_norm with its
 * weight); for bfloat16 the normalized row rounded, then times the weight, rounded (as the
 * transformers module computes it). */
static void dl_norm(int kind, long n, const void *x, const void *w, float eps, void *dst) {
    double ss = 0.0;
    long i0 = 0;
#if HAVE_AVX512
    if (kind == KIND_BF16 && n >= 16) { /* squares summed in float32 lanes, then in double */
        __m512 acc = _mm512_setzero_ps();
        for (; i0 + 16 <= n; i0 += 16) {
            const __m512 v = v_bf16(x, i0);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        ss = (double)_mm512_reduce_add_ps(acc);
    }
#endif
    for (long i = i0; i < n; i++) {
        const float v = dl_get(kind, x, i);
        ss += (double)v * v;
    }
    const float s = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    i0 = 0;
#if HAVE_AVX512
    if (kind == KIND_BF16) {
        const __m512 vs = _mm512_set1_ps(s);
        for (; i0 + 16 <= n; i0 += 16)
            v_put(dst, i0, _mm512_mul_ps(v_round(_mm512_mul_ps(v_bf16(x, i0), vs)), v_bf16(w, i0)));
    }
#endif
    for (long i = i0; i < n; i++) {
        const float v = dl_get(kind, x, i) * s;
        dl_put(kind, dst, i, dl_round(kind, v) * dl_get(kind, w, i));
    }
}

/* dst = a + b, rounded to the compute dtype (a residual) */
static void dl_add(int kind, long n, const void *a, const void *b, void *dst) {
    long j = 0;
#if HAVE_AVX512
    if (kind == KIND_BF16)
        for (; j + 16 <= n; j += 16) v_put(dst, j, _mm512_add_ps(v_bf16(a, j), v_bf16(b, j)));
#endif
    for (; j < n; j++) dl_put(kind, dst, j, dl_get(kind, a, j) + dl_get(kind, b, j));
}

/* dst = silu(gate) * up, silu rounded first (as the module computes it); silu(a) = a / (1 + e^-a),
 * with e^-|a| (exp_nonpositive, exp512) for a < 0: a e^a / (1 + e^a) */
static void dl_silu_mul(int kind, long n, const void *gate, const void *up, void *dst) {
    long j = 0;
#if HAVE_AVX512
    if (kind == KIND_BF16) {
        const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            const __m512 a = v_bf16(gate, j);
            const __mmask16 neg = _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ);
            const __m512 t = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(a)));
            const __m512 act = _mm512_div_ps(_mm512_mask_mul_ps(a, neg, a, t), _mm512_add_ps(one, t));
            v_put(dst, j, _mm512_mul_ps(v_round(act), v_bf16(up, j)));
        }
    }
#endif
    for (; j < n; j++) {
        const float a = dl_get(kind, gate, j);
        const float t = exp_nonpositive(-fabsf(a));
        const float act = dl_round(kind, (a < 0.0f ? a * t : a) / (1.0f + t));
        dl_put(kind, dst, j, act * dl_get(kind, up, j));
    }
}

/* x (d) rotated: x cos + roll(x, d / 2) sin_signed, x cos rounded first (as `rotate`). */
static void dl_rope(int kind, int d, const void *x, const void *c, const void *s, float *out) {
#if HAVE_AVX512
    if (kind == KIND_BF16 && d % 32 == 0) { /* the rolled half is whole vectors */
        const int half = d / 2;
        for (int j = 0; j < d; j += 16) {
            const __m512 a = v_round(_mm512_mul_ps(v_bf16(x, j), v_bf16(c, j)));
            const __m512 r = _mm512_mul_ps(v_bf16(x, (j + half) % d), v_bf16(s, j));
            _mm512_storeu_ps(out + j, v_round(_mm512_add_ps(a, r)));
        }
        return;
    }
#endif
    for (int j = 0; j < d; j++) {
        const float a = dl_round(kind, dl_get(kind, x, j) * dl_get(kind, c, j));
        out[j] = dl_round(kind, a + dl_get(kind, x, (j + d / 2) % d) * dl_get(kind, s, j));
    }
}

/* The layer for `rows` decode rows: h (rows, hidden) in, out (rows, hidden) the layer's output
 * (both in the compute dtype `kind`, rows `h_stride` / `out_stride` apart); cos, sin_signed
 * (rows, head_dim) the rows' RoPE (`rope_stride` apart); drows (rows, 10) kvb_drow records.
 * Each row's k and v are written into its cache at its position (its bias there cleared)
 * before its attention reads positions lo..pos. 0 done; -1 a shape the kernels do not take;
 * -2 out of memory. */
int kvb_qdecode_layer(int kind, long rows, const int64_t *layer, float eps1, float eps2, float scaling,
                      const void *h, long h_stride, const void *cos, const void *sin, long rope_stride,
                      const int64_t *drows, void *out, long out_stride) {
    const kvb_layer *L = (const kvb_layer *)layer;
    const kvb_drow *R = (const kvb_drow *)drows;
    if (rows < 1 || (kind != KIND_F32 && kind != KIND_BF16)) return -1;
    const long hid = L->hidden, nh = L->heads, nkv = L->kv_heads, d = L->head_dim, inter = L->inter;
    if (nkv < 1 || nh % nkv || d < 2 || d % 2 || d > 256) return -1;
    const long g = nh / nkv, wq = nh * d, wqkv = (nh + 2 * nkv) * d;
    const size_t es = kind == KIND_F32 ? 4 : 2;
    const size_t sizes[] = {rows * hid * es, rows * wqkv * es, rows * wq * 4, rows * wq * es, rows * hid * es,
                            rows * 2 * inter * es, rows * inter * es, rows * hid * es, rows * 13 * 8};
    size_t total = 0, at[9];
    for (int i = 0; i < 9; i++) {
        at[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    char *arena = aligned_alloc(64, total);
    if (!arena) return -2;
    char *x = arena + at[0], *qkv = arena + at[1], *att = arena + at[3], *h1 = arena + at[4];
    char *gu = arena + at[5], *m = arena + at[6], *dn = arena + at[7];
    float *qs = (float *)(arena + at[2]);
    int64_t *seqs = (int64_t *)(arena + at[8]);
    int rc = 0;
    const char *hb = (const char *)h;
    for (long r = 0; r < rows; r++)
        dl_norm(kind, hid, hb + (size_t)r * h_stride * es, (const void *)(intptr_t)L->norm1, eps1, x + r * hid * es);
    rc = kvb_qpack_matmul(kind, rows, hid, x, hid, qkv, wqkv, (const float *)(intptr_t)L->qkv_bias, (int)L->qkv_n,
                          (const int64_t *)(intptr_t)L->qkv_segs);
    if (rc) goto done;
    for (long r = 0; r < rows; r++) { /* RoPE; q scaled for the kernel; k, v into the cache */
        const kvb_drow *D = &R[r];
        const char *row = qkv + r * wqkv * es;
        const char *c = (const char *)cos + (size_t)r * rope_stride * es, *s = (const char *)sin + (size_t)r * rope_stride * es;
        float rot[256];
        for (long i = 0; i < nh; i++) {
            dl_rope(kind, (int)d, row + i * d * es, c, s, rot);
            for (long j = 0; j < d; j++) qs[r * wq + i * d + j] = rot[j] * scaling;
        }
        for (long i = 0; i < nkv; i++) {
            dl_rope(kind, (int)d, row + (nh + i) * d * es, c, s, rot);
            char *kd = (char *)(intptr_t)D->k + (size_t)(i * D->k_head + D->pos * D->k_row) * es;
            char *vd = (char *)(intptr_t)D->v + (size_t)(i * D->v_head + D->pos * D->v_row) * es;
            for (long j = 0; j < d; j++) dl_put(kind, kd, j, rot[j]);
            memcpy(vd, row + (nh + nkv + i) * d * es, (size_t)d * es);
            if (D->bias) ((float *)(intptr_t)D->bias)[i * D->bias_head + D->pos] = 0.0f;
        }
        int64_t *S = seqs + 13 * r; /* decode_attention.c's kvb_seq */
        S[0] = (int64_t)(intptr_t)(qs + r * wq);
        S[1] = D->k + D->lo * D->k_row * (int64_t)es;
        S[2] = D->v + D->lo * D->v_row * (int64_t)es;
        S[3] = D->bias ? D->bias + D->lo * 4 : 0;
        S[4] = (int64_t)(intptr_t)(att + r * wq * es);
        S[5] = D->pos + 1 - D->lo;
        S[6] = D->k_head;
        S[7] = D->k_row;
        S[8] = D->v_head;
        S[9] = D->v_row;
        S[10] = D->bias_head;
        S[11] = g * d;
        S[12] = d;
        if (S[5] < 1) {
            rc = -1;
            goto done;
        }
    }
    rc = ((kvb_attention_fn)(intptr_t)L->attention)(kind, (int)nkv, (int)g, (int)d, (int)rows, seqs);
    if (rc) goto done;
    rc = kvb_qpack_matmul(kind, rows, wq, att, wq, h1, hid, (const float *)(intptr_t)L->o_bias, (int)L->o_n,
                          (const int64_t *)(intptr_t)L->o_segs);
    if (rc) goto done;
    for (long r = 0; r < rows; r++) { /* the attention's residual, then the MLP's norm */
        const char *hr = hb + (size_t)r * h_stride * es;
        char *h1r = h1 + r * hid * es;
        dl_add(kind, hid, hr, h1r, h1r);
        dl_norm(kind, hid, h1r, (const void *)(intptr_t)L->norm2, eps2, x + r * hid * es);
    }
    rc = kvb_qpack_matmul(kind, rows, hid, x, hid, gu, 2 * inter, (const float *)(intptr_t)L->gu_bias, (int)L->gu_n,
                          (const int64_t *)(intptr_t)L->gu_segs);
    if (rc) goto done;
    for (long r = 0; r < rows; r++) { /* silu(gate) * up */
        const char *gr = gu + r * 2 * inter * es;
        dl_silu_mul(kind, inter, gr, gr + inter * es, m + r * inter * es);
    }
    rc = kvb_qpack_matmul(kind, rows, inter, m, inter, dn, hid, (const float *)(intptr_t)L->down_bias,
                          (int)L->down_n, (const int64_t *)(intptr_t)L->down_segs);
    if (rc) goto done;
    for (long r = 0; r < rows; r++) {
        const char *h1r = h1 + r * hid * es, *dr = dn + r * hid * es;
        char *o = (char *)out + (size_t)r * out_stride * es;
        dl_add(kind, hid, h1r, dr, o);
    }
done:
    free(arena);
    return rc;
}

/* A step's decode rows through layers 0..n-1 in one call: each layer `kvb_qdecode_layer` with its own
 * record (layers[l], a pointer), its eps and scaling (params[3 l .. 3 l + 2]) and its row table
 * (drows + l * rows * 10: each row's K/V of that layer), its output the next layer's input (the two
 * (rows, hidden) halves of `work` in turn), the last layer's into out. The bits of n calls one after
 * the other, without a return to the caller between them. */
int kvb_qdecode_layers(int kind, long rows, long n, const int64_t *layers, const float *params, const void *h,
                       long h_stride, const void *cos, const void *sin, long rope_stride, const int64_t *drows,
                       void *work, void *out, long out_stride) {
    if (n < 1 || rows < 1 || (kind != KIND_F32 && kind != KIND_BF16)) return -1;
    const size_t es = kind == KIND_F32 ? 4 : 2;
    const long hid = ((const kvb_layer *)(intptr_t)layers[0])->hidden;
    const void *in = h;
    long in_stride = h_stride;
    for (long l = 0; l < n; l++) {
        const int last = l == n - 1;
        void *dst = last ? out : (char *)work + (size_t)(l % 2) * rows * hid * es;
        const long dst_stride = last ? out_stride : hid;
        const int rc = kvb_qdecode_layer(kind, rows, (const int64_t *)(intptr_t)layers[l], params[3 * l],
                                         params[3 * l + 1], params[3 * l + 2], in, in_stride, cos, sin, rope_stride,
                                         drows + (size_t)l * rows * (sizeof(kvb_drow) / sizeof(int64_t)), dst,
                                         dst_stride);
        if (rc) return rc;
        in = dst;
        in_stride = dst_stride;
    }
    return 0;
}
