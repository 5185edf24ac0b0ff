/* Decode attention on a CPU: a few query rows per KV head over every cached key, read once.
 *
 *   out[h, i] = softmax_t(q[h, i] . k[h, t] + bias[h, t]) . v[h, t]
 *
 * q (hkv, g, d) float32, already scaled; k, v (hkv, t, d) float32 or bfloat16, rows
 * contiguous (any head and row strides); bias (hkv, t) float32 or NULL; out (hkv, g, d) in
 * K/V's dtype. Scores, softmax and the weighted sum are float32 throughout; a bfloat16
 * key or value is widened in registers as it is read, so K and V cross the memory bus once,
 * in their own width (torch's CPU kernels either widen the keys into a new float32 tensor
 * or read bfloat16 at a fraction of memory speed for a handful of query rows).
 *
 * Hand-vectorized for AVX-512 and for AVX2 + FMA (whichever the compiler targets, for
 * head dimensions that are multiples of 64 / 32), plain C elsewhere.
 *
 * One call takes a whole decode batch (kvb_decode_attention_batch): each sequence's keys
 * are split into blocks of BLOCK keys from its key 0, and every (sequence, head, block) is
 * one work item, shared among the calling thread's OpenMP threads (the library is linked
 * against torch's own libgomp, so it uses the same thread pool as torch's ops on that
 * thread). Each block keeps its own maximum, sum of exponentials and weighted sum of
 * values; a head's blocks are merged at the end in key order, the same arithmetic as
 * flash-decoding.
 *
 * Batch-invariant: the blocks are fixed by key position, never by the number of sequences
 * or threads in the call, and each merge runs in key order on one thread, so a sequence's
 * output is the same bits alone or beside any others, on any number of threads
 * (tests/test_kernel_invariance.py).
 *
 * Built and loaded by blend/model/native.py; tests/test_native_attention.py holds it to a
 * float64 reference and to the torch path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"

#define BLOCK 256 /* key rows per work item */
#define MAX_G 16  /* query rows per KV head */
#define MAX_D 256 /* head dimension */
#define AHEAD 16   /* key / value rows ahead that the AVX-512 loops prefetch */

enum { KIND_F32 = 0, KIND_BF16 = 1 };

/* One (head, block) work item: keys lo..hi-1 of a head, g query rows of dimension d.
 * Writes the block's per-row maximum m[g], sum of exponentials l[g] and unnormalised
 * weighted values acc[g][d]. Always inlined: called with constant kind, g and d for the
 * usual shapes, so that its loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_block(
    int kind, const float *q, const char *k, const char *v, const float *bias, int g, int d, long lo, long hi,
    long k_row, long v_row, float *m, float *l, float *acc) {
    float s[MAX_G][BLOCK];
    float row[MAX_D];
    const int es = kind == KIND_F32 ? 4 : 2;
    const int n = (int)(hi - lo);
    for (int j = 0; j < n; j++) {
        const char *kr = k + (lo + j) * k_row * es;
        if (kind == KIND_F32) {
            memcpy(row, kr, (size_t)d * sizeof(float));
        } else {
            const uint16_t *kb = (const uint16_t *)kr;
#pragma omp simd
            for (int x = 0; x < d; x++) row[x] = bf16_to_f32(kb[x]);
        }
        const float b = bias ? bias[lo + j] : 0.0f;
        for (int i = 0; i < g; i++) {
            const float *qi = q + (long)i * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int x = 0; x < d; x++) dot += qi[x] * row[x];
            s[i][j] = dot + b;
        }
    }
    float a[MAX_G * MAX_D];
    for (int i = 0; i < g; i++) {
        float top = s[i][0];
#pragma omp simd reduction(max : top)
        for (int j = 1; j < n; j++) top = s[i][j] > top ? s[i][j] : top;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int j = 0; j < n; j++) {
            s[i][j] = exp_nonpositive(s[i][j] - top);
            total += s[i][j];
        }
        m[i] = top;
        l[i] = total;
    }
    for (int x = 0; x < g * d; x++) a[x] = 0.0f;
    for (int j = 0; j < n; j++) {
        const char *vr = v + (lo + j) * v_row * es;
        if (kind == KIND_F32) {
            memcpy(row, vr, (size_t)d * sizeof(float));
        } else {
            const uint16_t *vb = (const uint16_t *)vr;
#pragma omp simd
            for (int x = 0; x < d; x++) row[x] = bf16_to_f32(vb[x]);
        }
        for (int i = 0; i < g; i++) {
            const float p = s[i][j];
#pragma omp simd
            for (int x = 0; x < d; x++) a[i * d + x] += p * row[x];
        }
    }
    memcpy(acc, a, (size_t)(g * d) * sizeof(float));
}

#if defined(__AVX512F__)
#include <immintrin.h>
#include <math.h>

/* 16 keys' or values' elements widened to float32. */
static inline __m512 load16(int kind, const char *p) {
    if (kind == KIND_F32) return _mm512_loadu_ps((const float *)p);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* The lane sums of 16 vectors as one vector: lane j = the sum of v[j]'s 16 lanes. */
static inline __m512 sum16(const __m512 *v) {
    __m512 w[8], x[4], y[2];
    for (int p = 0; p < 8; p++) /* per 128-bit lane: a0+a2 b0+b2 a1+a3 b1+b3 */
        w[p] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * p], v[2 * p + 1]), _mm512_unpackhi_ps(v[2 * p], v[2 * p + 1]));
    for (int p = 0; p < 4; p++) /* per 128-bit lane: one partial of each of 4 vectors */
        x[p] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * p], w[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int p = 0; p < 2; p++) /* 128-bit lanes pairwise */
        y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* attend_block with AVX-512 for d a multiple of 64 (see attend_block): per key, the g dot
 * products accumulate in registers and are summed once; the weighted values accumulate in
 * registers, 4 query rows x 64 dimensions at a time. */
static inline __attribute__((always_inline)) void attend_block_avx512(
    int kind, const float *q, const char *k, const char *v, const float *bias, int g, int d, long lo, long hi,
    long k_row, long v_row, float *m, float *l, float *acc) {
    float s[MAX_G][BLOCK];
    const int es = kind == KIND_F32 ? 4 : 2;
    const int n = (int)(hi - lo);
    /* scores 16 keys at a time: each key's g dot products as 16-lane partial sums, then
     * one transposing reduction per row turns 16 partial vectors into 16 scores */
    int j0 = 0;
    for (; j0 + 16 <= n; j0 += 16) {
        __m512 part[MAX_G][16];
        for (int jj = 0; jj < 16; jj++) {
            const char *kr = k + (lo + j0 + jj) * k_row * es;
            /* the memory asked for the key AHEAD rows on (a stream's own prefetcher keeps fewer
             * misses in flight than a decode step's bandwidth wants) */
            _mm_prefetch(kr + AHEAD * k_row * es, _MM_HINT_T0);
            _mm_prefetch(kr + AHEAD * k_row * es + 64, _MM_HINT_T0);
            __m512 dot[MAX_G];
            for (int i = 0; i < g; i++) dot[i] = _mm512_setzero_ps();
            for (int c = 0; c < d; c += 16) {
                const __m512 kc = load16(kind, kr + (long)c * es);
                for (int i = 0; i < g; i++) dot[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (long)i * d + c), kc, dot[i]);
            }
            for (int i = 0; i < g; i++) part[i][jj] = dot[i];
        }
        const __m512 b = bias ? _mm512_loadu_ps(bias + lo + j0) : _mm512_setzero_ps();
        for (int i = 0; i < g; i++) _mm512_storeu_ps(&s[i][j0], _mm512_add_ps(sum16(part[i]), b));
    }
    for (int j = j0; j < n; j++) {
        const char *kr = k + (lo + j) * k_row * es;
        __m512 dot[MAX_G];
        for (int i = 0; i < g; i++) dot[i] = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 16) {
            const __m512 kc = load16(kind, kr + (long)c * es);
            for (int i = 0; i < g; i++) dot[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (long)i * d + c), kc, dot[i]);
        }
        const float b = bias ? bias[lo + j] : 0.0f;
        for (int i = 0; i < g; i++) s[i][j] = _mm512_reduce_add_ps(dot[i]) + b;
    }
    for (int i = 0; i < g; i++) {
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < n; j += 16) {
            const __mmask16 in = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            most = _mm512_max_ps(most, _mm512_mask_loadu_ps(most, in, &s[i][j]));
        }
        const float top = _mm512_reduce_max_ps(most);
        const __m512 vtop = _mm512_set1_ps(top);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < n; j += 16) {
            const __mmask16 in = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, &s[i][j]), vtop));
            _mm512_mask_storeu_ps(&s[i][j], in, e);
            total = _mm512_mask_add_ps(total, in, total, e);
        }
        m[i] = top;
        l[i] = _mm512_reduce_add_ps(total);
    }
    for (int i0 = 0; i0 < g; i0 += 4) {
        const int rows = g - i0 < 4 ? g - i0 : 4;
        for (int c0 = 0; c0 < d; c0 += 64) {
            __m512 a[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
            for (int j = 0; j < n; j++) {
                const char *vr = v + ((lo + j) * v_row + c0) * es;
                _mm_prefetch(vr + AHEAD * v_row * es, _MM_HINT_T0);
                _mm_prefetch(vr + AHEAD * v_row * es + 64, _MM_HINT_T0);
                __m512 vc[4];
                for (int c = 0; c < 4; c++) vc[c] = load16(kind, vr + (long)c * 16 * es);
                for (int i = 0; i < rows; i++) {
                    const __m512 p = _mm512_set1_ps(s[i0 + i][j]);
                    for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(p, vc[c], a[i][c]);
                }
            }
            for (int i = 0; i < rows; i++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (long)(i0 + i) * d + c0 + c * 16, a[i][c]);
        }
    }
}
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

/* 8 keys' or values' elements widened to float32. */
static inline __m256 load8(int kind, const char *p) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)p);
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* attend_block with AVX2 + FMA for d a multiple of 32 (see attend_block): per key, the g
 * dot products accumulate in registers and are summed once; the weighted values accumulate
 * in registers, 2 query rows x 32 dimensions at a time. */
static inline __attribute__((always_inline)) void attend_block_avx2(
    int kind, const float *q, const char *k, const char *v, const float *bias, int g, int d, long lo, long hi,
    long k_row, long v_row, float *m, float *l, float *acc) {
    float s[MAX_G][BLOCK];
    const int es = kind == KIND_F32 ? 4 : 2;
    const int n = (int)(hi - lo);
    for (int j = 0; j < n; j++) {
        const char *kr = k + (lo + j) * k_row * es;
        __m256 dot[MAX_G];
        for (int i = 0; i < g; i++) dot[i] = _mm256_setzero_ps();
        for (int c = 0; c < d; c += 8) {
            const __m256 kc = load8(kind, kr + (long)c * es);
            for (int i = 0; i < g; i++) dot[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (long)i * d + c), kc, dot[i]);
        }
        const float b = bias ? bias[lo + j] : 0.0f;
        for (int i = 0; i < g; i++) s[i][j] = hsum8(dot[i]) + b;
    }
    const int full = n - n % 8;
    for (int i = 0; i < g; i++) {
        float top = s[i][0];
        for (int j = 1; j < n; j++) top = s[i][j] > top ? s[i][j] : top;
        const __m256 vtop = _mm256_set1_ps(top);
        __m256 total8 = _mm256_setzero_ps();
        for (int j = 0; j < full; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(&s[i][j]), vtop));
            _mm256_storeu_ps(&s[i][j], e);
            total8 = _mm256_add_ps(total8, e);
        }
        float total = hsum8(total8);
        for (int j = full; j < n; j++) {
            s[i][j] = exp_nonpositive(s[i][j] - top);
            total += s[i][j];
        }
        m[i] = top;
        l[i] = total;
    }
    for (int i0 = 0; i0 < g; i0 += 2) {
        const int rows = g - i0 < 2 ? g - i0 : 2;
        for (int c0 = 0; c0 < d; c0 += 32) {
            __m256 a[2][4];
            for (int i = 0; i < 2; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) {
                const char *vr = v + ((lo + j) * v_row + c0) * es;
                __m256 vc[4];
                for (int c = 0; c < 4; c++) vc[c] = load8(kind, vr + (long)c * 8 * es);
                for (int i = 0; i < rows; i++) {
                    const __m256 p = _mm256_set1_ps(s[i0 + i][j]);
                    for (int c = 0; c < 4; c++) a[i][c] = _mm256_fmadd_ps(p, vc[c], a[i][c]);
                }
            }
            for (int i = 0; i < rows; i++)
                for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + (long)(i0 + i) * d + c0 + c * 8, a[i][c]);
        }
    }
}
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* the hand-vectorized block function the compiler's target allows, and the head dimensions it takes */
#if HAVE_AVX512
#define ATTEND_FAST attend_block_avx512
#define FAST_DIM_MULTIPLE 64
#elif HAVE_AVX2
#define ATTEND_FAST attend_block_avx2
#define FAST_DIM_MULTIPLE 32
#endif

/* One sequence of a batch: where its query rows, keys, values, bias and output live, as
 * 64-bit integers (pointers included) so that the caller fills one int64 array. Strides
 * are in elements of K/V's (or out's) dtype, of bias in float32 elements; q is contiguous
 * (hkv, g, d) float32; bias may be 0 (none). */
typedef struct {
    int64_t q, k, v, bias, out, t, k_head, k_row, v_head, v_row, bias_head, out_head, out_row;
} kvb_seq;

/* Decode attention of n sequences at once: every (sequence, head, block of keys) is one
 * work item, shared among the threads; then each sequence's blocks are merged. Returns 0,
 * or -1 when the shapes are outside the kernel's limits (nothing written: the caller falls
 * back). */
int kvb_decode_attention_batch(int kind, int hkv, int g, int d, int n, const kvb_seq *seqs) {
    if (g < 1 || g > MAX_G || d < 1 || d > MAX_D || hkv < 1 || n < 1) return -1;
    if (kind != KIND_F32 && kind != KIND_BF16) return -1;
    for (int s = 0; s < n; s++)
        if (seqs[s].t < 1) return -1;
    const int es = kind == KIND_F32 ? 4 : 2;
    long *blocks = malloc((size_t)n * 2 * sizeof(long));
    if (!blocks) return -1;
    long *first = blocks + n; /* each sequence's first item */
    long items = 0, work = 0;
    for (int s = 0; s < n; s++) {
        const long t = seqs[s].t;
        /* blocks of BLOCK keys from key 0 (the last one shorter): fixed by position, never by
         * how many sequences or threads share the call, so a sequence's arithmetic is its own */
        blocks[s] = (t + BLOCK - 1) / BLOCK;
        first[s] = items;
        items += hkv * blocks[s];
        work += t * hkv * d;
    }
    const long per_item = 2L * g + (long)g * d;
    float *part = malloc((size_t)(items * per_item) * sizeof(float));
    int *seq_of = malloc((size_t)items * sizeof(int));
    if (!part || !seq_of) {
        free(part);
        free(seq_of);
        free(blocks);
        return -1;
    }
    for (int s = 0; s < n; s++)
        for (long it = first[s]; it < first[s] + hkv * blocks[s]; it++) seq_of[it] = s;
#pragma omp parallel for schedule(static) if (items > 1 && work >= 16384)
    for (long it = 0; it < items; it++) {
        const int sq = seq_of[it];
        const kvb_seq *S = &seqs[sq];
        const long local = it - first[sq], h = local / blocks[sq], blk = local % blocks[sq];
        const long lo = blk * BLOCK, hi = lo + BLOCK < S->t ? lo + BLOCK : S->t;
        float *p = part + it * per_item;
        const float *qh = (const float *)(intptr_t)S->q + h * g * d;
        const float *bh = S->bias ? (const float *)(intptr_t)S->bias + h * S->bias_head : NULL;
        const char *kh = (const char *)(intptr_t)S->k + h * S->k_head * es;
        const char *vh = (const char *)(intptr_t)S->v + h * S->v_head * es;
        const long k_row = S->k_row, v_row = S->v_row;
#ifdef ATTEND_FAST
        /* the head dimensions of the usual models as constants: their loops unroll */
#define SHAPE(K, G, D) \
    if (kind == K && g == G && d == D) \
        ATTEND_FAST(K, qh, kh, vh, bh, G, D, lo, hi, k_row, v_row, p, p + G, p + 2 * G); \
    else
        SHAPE(KIND_BF16, 3, 64) SHAPE(KIND_BF16, 4, 64) SHAPE(KIND_BF16, 4, 128) SHAPE(KIND_BF16, 4, 256)
        SHAPE(KIND_F32, 3, 64) SHAPE(KIND_F32, 4, 64) SHAPE(KIND_F32, 4, 128)
        if (d % FAST_DIM_MULTIPLE == 0)
            ATTEND_FAST(kind, qh, kh, vh, bh, g, d, lo, hi, k_row, v_row, p, p + g, p + 2 * g);
        else
#endif
            attend_block(kind, qh, kh, vh, bh, g, d, lo, hi, k_row, v_row, p, p + g, p + 2 * g);
    }
    for (int sq = 0; sq < n; sq++) {
        const kvb_seq *S = &seqs[sq];
        const long nb = blocks[sq];
        for (long h = 0; h < hkv; h++) {
            const float *base = part + (first[sq] + h * nb) * per_item;
            for (int i = 0; i < g; i++) {
                float top = base[i];
                for (long blk = 1; blk < nb; blk++) {
                    const float mb = base[blk * per_item + i];
                    top = mb > top ? mb : top;
                }
                float row[MAX_D];
                float total = 0.0f;
                memset(row, 0, (size_t)d * sizeof(float));
                for (long blk = 0; blk < nb; blk++) {
                    const float *p = base + blk * per_item;
                    const float w = exp_nonpositive(p[i] - top);
                    total += w * p[g + i];
                    const float *a = p + 2 * g + (long)i * d;
                    for (int x = 0; x < d; x++) row[x] += w * a[x];
                }
                const float inv = 1.0f / total;
                if (kind == KIND_F32) {
                    float *o = (float *)(intptr_t)S->out + h * S->out_head + (long)i * S->out_row;
                    for (int x = 0; x < d; x++) o[x] = row[x] * inv;
                } else {
                    uint16_t *o = (uint16_t *)(intptr_t)S->out + h * S->out_head + (long)i * S->out_row;
                    for (int x = 0; x < d; x++) o[x] = f32_to_bf16(row[x] * inv);
                }
            }
        }
    }
    free(part);
    free(seq_of);
    free(blocks);
    return 0;
}
