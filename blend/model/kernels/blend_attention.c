/* Blended attention on a CPU: query rows at scattered, sorted positions over every key up
 * to their own, with an additive bias per (KV head, key): the shape CacheBlend's recomputed
 * rows and its query pass attend in.
 *
 *   out[r, h*g + i] = softmax_{j visible to pos[r]}(q[h*g + i, r] . k[h, j] * scale + bias[h, j]) . v[h, j]
 *
 * A row at position p sees the keys lo(p) .. p, lo(p) = 0, or max(0, p - window + 1) in a
 * sliding-window layer. q (hkv*g, tq, d), k, v (hkv, tk, d), all float32 or all bfloat16,
 * rows contiguous (any head and row strides); bias (hkv, tk) float32 or NULL; out
 * (tq, hkv*g*d) in q's dtype, rows contiguous. With `colsum` (hkv, tk) float32, also each
 * key's attention probabilities summed over the query vectors of its KV head (the query
 * pass's scores: blend/recompute/layers.py), in the same one pass: each key block's probabilities
 * are kept with the running maximum they are of, and rescaled to the final maximum and sum after.
 *
 * Flash attention, cut the way this shape needs: the rows of a KV head come in row blocks
 * (at most MAX_M query vectors: the g query heads of up to MAX_M / g rows, all scored
 * against one read of each key), and each row block walks its keys in blocks of BK keys,
 * keeping per query vector its running maximum, sum of exponentials and weighted sum of
 * values (online softmax, float32). A row block's keys are cut into ranges at the
 * multiples of RANGE, and the ranges' partial results are folded by their log-sum-exp in
 * key order. Work items are whole (head, row block)s, each thread folding a block's ranges
 * in its own buffers, where there are enough of them for the threads; else single ranges,
 * folded by whichever thread finishes a block's last one (so that a few rows over many keys
 * still keep every thread busy). Masks are computed, never stored: a key block that every
 * row of a block sees whole takes no mask at all.
 *
 * Batch-invariant: key blocks start at the multiples of BK and ranges at the multiples of
 * RANGE, whatever rows share the call and however many threads run it; each query vector's
 * scores, online softmax and weighted sums are its own (a key it does not see adds an exact
 * zero, a block or range it does not see is skipped), and the fold runs in key order on one
 * thread; the thread count only chooses who runs a range. So a row's output is the same bits
 * alone or among any other rows, on any number of threads, and the column sums the same bits
 * on any number of threads (tests/test_kernel_invariance.py).
 *
 * Before the row blocks, each head's keys are packed once for the dot products (shared by
 * every row block of the head): with AVX-512 BF16, bfloat16 keys as pairs of dimensions
 * (VNNI layout) for vdpbf16ps, whose products of bfloat16 numbers are exact and whose sums
 * are float32; otherwise keys transposed to float32 (dimension-major) for FMA. Values are
 * read as float32 rows (bfloat16 widened once, at packing). Scores, softmax, probabilities
 * and the weighted sums are float32 throughout.
 *
 * Hand-vectorized for AVX-512 (and its BF16 dot products where the CPU has them) and AVX2 +
 * FMA; plain C elsewhere. The OpenMP regions run on torch's own libgomp (see
 * blend/model/native.py); tests/test_native_attention.py holds the kernel to float64 and to
 * the torch path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define BK 64           /* keys per key block */
#define MAX_M 64        /* query vectors per row block */
#define BLEND_MAX_D 256 /* head dimension */
#define RANGE 512       /* key ranges start at the multiples of this (a multiple of BK) */

enum { BKIND_F32 = 0, BKIND_BF16 = 1, BKIND_F16 = 2 }; /* float16: only a rotation's source */

#define AI inline __attribute__((always_inline))

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PACK_PAIRS 1 /* bfloat16 keys as dimension pairs for vdpbf16ps */
#else
#define PACK_PAIRS 0
#endif

/* AMX (Sapphire Rapids and later): with its tiles, bfloat16 scores and weighted values run
 * as tile products (tdpbf16ps: 16 x 16 float32 sums of 32 bfloat16 products each), in place
 * of the vector dot products. Taken for bfloat16 with a head dimension a multiple of 64,
 * where the CPU has the tiles and Linux grants them to this process (arch_prctl), unless
 * turned off (`kvb_blend_path`); the choice depends on nothing else, so it is the same for a
 * row alone or among any rows. The probabilities enter P V as two bfloat16 parts (hi + lo, about
 * 16 bits: rounding them once to bfloat16 moved blend@0.05's first-token KL on 20 MuSiQue
 * questions by +0.003); scores, softmax, the sums and the weighted sums stay float32. Each tile
 * row (query vector) is its own: the tile products are row-invariant. */
#if PACK_PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KVB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16 /* query vectors per tile */
static int amx_state = 0; /* 0: not asked yet, 1: granted, -1: refused */
static int amx_wanted = 1;

static int amx_ready(void) {
    if (!amx_state) { /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process */
        const long r = syscall(SYS_arch_prctl, 0x1023, 18);
        __atomic_store_n(&amx_state, r == 0 ? 1 : -1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE) > 0;
}

/* Every tile 16 rows of 64 bytes (palette 1): this thread's tiles, before its first product. */
static void amx_config(void) {
    _Alignas(64) unsigned char cfg[64];
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;
    for (int t = 0; t < 8; t++) {
        cfg[16 + 2 * t] = 64; /* bytes per row */
        cfg[48 + t] = AMX_ROWS;
    }
    _tile_loadconfig(cfg);
}

/* s[i][0..BK) = q_i . k_{j0 + 0..BK) for the 16 query vectors at q (bfloat16 rows of d),
 * from the head's key pairs kp (d/2 rows of tpad int32); d a multiple of 32. */
static AI void amx_scores(const uint16_t *q, int d, const int32_t *kp, long tpad, long j0, float *s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int x = 0; x < d; x += 32) {
        const int32_t *kr = kp + (long)(x / 2) * tpad + j0;
        _tile_loadd(4, q + x, d * 2);
        _tile_loadd(5, kr, tpad * 4);
        _tile_loadd(6, kr + 16, tpad * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, kr + 32, tpad * 4);
        _tile_loadd(5, kr + 48, tpad * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, s, BK * 4);
    _tile_stored(1, s + 16, BK * 4);
    _tile_stored(2, s + 32, BK * 4);
    _tile_stored(3, s + 48, BK * 4);
}

/* o[i][0..d) += sum_j p[i][j] v_{j0 + j} for the 16 query vectors at o (float32 rows of d),
 * p as two bfloat16 parts (hi, lo: rows of BK each, p = hi + lo to 16 bits), from the head's value
 * pairs vp (row j/2 holds keys j, j+1 of every dimension: tpad/2 rows of d int32) at key pair
 * j0/2; d a multiple of 64. */
static AI void amx_values(const uint16_t *hi, const uint16_t *lo, int d, const int32_t *vp, float *o) {
    for (int x = 0; x < d; x += 64) {
        _tile_loadd(0, o + x, d * 4);
        _tile_loadd(1, o + x + 16, d * 4);
        _tile_loadd(2, o + x + 32, d * 4);
        _tile_loadd(3, o + x + 48, d * 4);
        for (int j = 0; j < BK; j += 32) {
            const int32_t *vr = vp + (long)(j / 2) * d + x;
            _tile_loadd(4, hi + j, BK * 2);
            _tile_loadd(7, lo + j, BK * 2);
            _tile_loadd(5, vr, d * 4);
            _tile_loadd(6, vr + 16, d * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_dpbf16ps(0, 7, 5);
            _tile_dpbf16ps(1, 7, 6);
            _tile_loadd(5, vr + 32, d * 4);
            _tile_loadd(6, vr + 48, d * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_dpbf16ps(3, 4, 6);
            _tile_dpbf16ps(2, 7, 5);
            _tile_dpbf16ps(3, 7, 6);
        }
        _tile_stored(0, o + x, d * 4);
        _tile_stored(1, o + x + 16, d * 4);
        _tile_stored(2, o + x + 32, d * 4);
        _tile_stored(3, o + x + 48, d * 4);
    }
}

/* probabilities p[0..BK) (float32) as two bfloat16 parts: hi = p rounded to nearest even, lo =
 * (p - hi) rounded (exact in float32): hi + lo holds p to about 16 bits, so P V through the
 * tiles loses about what float32 products would */
static AI void amx_split_row(const float *p, uint16_t *hi, uint16_t *lo) {
    for (int c = 0; c < BK; c += 16) {
        const __m512 x = _mm512_loadu_ps(p + c);
        const __m256bh h = _mm512_cvtneps_pbh(x);
        const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        _mm256_storeu_si256((__m256i *)(void *)(hi + c), (__m256i)h);
        _mm256_storeu_si256((__m256i *)(void *)(lo + c), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
    }
}
#else
#define KVB_AMX 0
#endif

/* ------------------------------------------------------------------ dot products
 * scores s[i][0..BK) = q_i . k_{j0 + 0..BK) for qt query vectors (qt <= QT_MAX), from the
 * packed keys of one head: pairs (kp[x/2][j] holds dimensions x, x+1 of key j, d/2 rows of
 * `tpad` int32) or float32 transposed (kt[x][j], d rows of `tpad`). */
#if defined(__AVX512F__)
#define QT_MAX 6

#if PACK_PAIRS
static AI void qk_pairs(const uint16_t *q, int qt, int d, const int32_t *kp, long tpad, long j0, float *s) {
    __m512 acc[QT_MAX][4];
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int x2 = 0; x2 < d / 2; x2++) {
        const int32_t *kr = kp + x2 * tpad + j0;
        __m512i kv[4];
        for (int c = 0; c < 4; c++) kv[c] = _mm512_loadu_si512((const void *)(kr + 16 * c));
        for (int i = 0; i < qt; i++) {
            int32_t pair;
            memcpy(&pair, q + (long)i * d + 2 * x2, sizeof pair);
            const __m512i qb = _mm512_set1_epi32(pair);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)kv[c], (__m512bh)qb);
        }
    }
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + i * BK + 16 * c, acc[i][c]);
}
#endif

static AI void qk_f32(const float *q, int qt, int d, const float *kt, long tpad, long j0, float *s) {
    __m512 acc[QT_MAX][4];
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
    for (int x = 0; x < d; x++) {
        const float *kr = kt + x * tpad + j0;
        __m512 kv[4];
        for (int c = 0; c < 4; c++) kv[c] = _mm512_loadu_ps(kr + 16 * c);
        for (int i = 0; i < qt; i++) {
            const __m512 qb = _mm512_set1_ps(q[(long)i * d + x]);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_fmadd_ps(qb, kv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + i * BK + 16 * c, acc[i][c]);
}

/* o[i][0..16W) += sum_j p[i][j] v[j0 + j][0..16W) for qt query vectors, n keys; v rows of `vrow` floats */
static AI void pv_cols(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o, const int w) {
    __m512 acc[QT_MAX][4];
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < w; c++) acc[i][c] = _mm512_loadu_ps(o + (long)i * d + 16 * c);
    for (int j = 0; j < n; j++) {
        const float *vr = v + (j0 + j) * vrow;
        __m512 vv[4];
        for (int c = 0; c < w; c++) vv[c] = _mm512_loadu_ps(vr + 16 * c);
        for (int i = 0; i < qt; i++) {
            const __m512 pb = _mm512_set1_ps(p[i * BK + j]);
            for (int c = 0; c < w; c++) acc[i][c] = _mm512_fmadd_ps(pb, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < w; c++) _mm512_storeu_ps(o + (long)i * d + 16 * c, acc[i][c]);
}

/* o[i][0..d) += sum_j p[i][j] v[j0 + j] (d a multiple of 16) */
static AI void pv_f32(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o) {
    int c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) pv_cols(p, qt, d, v + c0, vrow, j0, n, o + c0, 4);
    for (; c0 < d; c0 += 16) pv_cols(p, qt, d, v + c0, vrow, j0, n, o + c0, 1);
}

/* One query vector's scores of a key block into probabilities: sr[j] * scale + bias[j] for
 * the visible keys [lo, hi) (all BK when masked is 0), exp(. - mnew) with mnew = max(old
 * maximum, this block's), 0 for hidden keys. Returns the block's maximum (-inf: none
 * visible) in *top and the sum of the probabilities. */
static inline float softmax_block(float *sr, const float *bias, float scale, int masked, int lo, int hi, float old,
                                  float *top) {
    __m512 t[4];
    __mmask16 in[4];
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; c++) {
        t[c] = _mm512_fmadd_ps(_mm512_loadu_ps(sr + 16 * c), vs, _mm512_loadu_ps(bias + 16 * c));
        if (masked) {
            const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(16 * c), _mm512_setr_epi32(
                0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
            in[c] = _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(lo)) & _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(hi));
            most = _mm512_mask_max_ps(most, in[c], most, t[c]);
        } else {
            in[c] = (__mmask16)0xffff;
            most = _mm512_max_ps(most, t[c]);
        }
    }
    const float blk = _mm512_reduce_max_ps(most);
    *top = blk;
    const float mnew = blk > old ? blk : old;
    const __m512 vm = _mm512_set1_ps(mnew);
    __m512 total = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) {
        const __m512 e = _mm512_maskz_mov_ps(in[c], exp512(_mm512_sub_ps(t[c], vm)));
        _mm512_storeu_ps(sr + 16 * c, e);
        total = _mm512_add_ps(total, e);
    }
    return _mm512_reduce_add_ps(total);
}
#define HAVE_SOFTMAX_BLOCK 1
#define VEC_D 16 /* head dimensions the vector paths take: multiples of this */

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (8 lanes, 16 vector registers): tiles of up to 6 query vectors by 16 keys (or 16
 * value dimensions), 12 accumulators, as a 6 x 16 matrix product's inner loop. Keys packed
 * one key block at a time (KT_BLOCKED: d rows of BK floats, the block's 16 KB contiguous): rows
 * of the whole padded key count apart would sit a multiple of 4 KB apart and share one set of
 * the L1 cache. */
#define QT_MAX 6
#define KT_BLOCKED 1
#define STRIPE QT_MAX /* query vectors scored, weighed and summed together (run_pass) */

static AI float hmax256(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static AI float hsum256(__m256 x) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* s[i][0..BK) = q_i . k_{0..BK) for qt query vectors, from one packed key block kt: its keys in
 * chunks of 16, each chunk d rows of 16 (key j's dimension x at kt[(j / 16) * 16 d + 16 x + j % 16]) */
static AI void qk_f32(const float *q, int qt, int d, const float *kt, float *s) {
    for (int jj = 0; jj < BK; jj += 16) {
        __m256 acc[QT_MAX][2];
        for (int i = 0; i < qt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        const float *kr = kt + (long)jj * d;
        for (int x = 0; x < d; x++, kr += 16) {
            const __m256 k0 = _mm256_loadu_ps(kr), k1 = _mm256_loadu_ps(kr + 8);
            for (int i = 0; i < qt; i++) {
                const __m256 qb = _mm256_broadcast_ss(q + (long)i * d + x);
                acc[i][0] = _mm256_fmadd_ps(qb, k0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(qb, k1, acc[i][1]);
            }
        }
        for (int i = 0; i < qt; i++) {
            _mm256_storeu_ps(s + i * BK + jj, acc[i][0]);
            _mm256_storeu_ps(s + i * BK + jj + 8, acc[i][1]);
        }
    }
}

/* o[i][0..8w) += sum_j p[i][j] v[j0 + j][0..8w) for qt query vectors, n keys, w 1 or 2 */
static AI void pv_cols(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o, const int w) {
    __m256 acc[QT_MAX][2];
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < w; c++) acc[i][c] = _mm256_loadu_ps(o + (long)i * d + 8 * c);
    const float *vr = v + j0 * vrow;
    for (int j = 0; j < n; j++, vr += vrow) {
        __m256 vv[2];
        for (int c = 0; c < w; c++) vv[c] = _mm256_loadu_ps(vr + 8 * c);
        for (int i = 0; i < qt; i++) {
            const __m256 pb = _mm256_broadcast_ss(p + i * BK + j);
            for (int c = 0; c < w; c++) acc[i][c] = _mm256_fmadd_ps(pb, vv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < qt; i++)
        for (int c = 0; c < w; c++) _mm256_storeu_ps(o + (long)i * d + 8 * c, acc[i][c]);
}

/* o[i][0..d) += sum_j p[i][j] v[j0 + j] (d a multiple of 8) */
static AI void pv_f32(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o) {
    int c0 = 0;
    for (; c0 + 16 <= d; c0 += 16) pv_cols(p, qt, d, v + c0, vrow, j0, n, o + c0, 2);
    if (c0 < d) pv_cols(p, qt, d, v + c0, vrow, j0, n, o + c0, 1);
}

/* softmax_block (see the AVX-512 form) on 8 lanes: the scores stored back with hidden keys at
 * -inf, then their exponentials (0 where the score is -inf) */
static inline float softmax_block(float *sr, const float *bias, float scale, int masked, int lo, int hi, float old,
                                  float *top) {
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i vlo = _mm256_set1_epi32(lo - 1), vhi = _mm256_set1_epi32(hi);
    __m256 most = ninf;
    for (int c = 0; c < BK; c += 8) {
        __m256 t = _mm256_fmadd_ps(_mm256_loadu_ps(sr + c), vs, _mm256_loadu_ps(bias + c));
        if (masked) {
            const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(c));
            const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, vlo), _mm256_cmpgt_epi32(vhi, idx));
            t = _mm256_blendv_ps(ninf, t, _mm256_castsi256_ps(in));
        }
        _mm256_storeu_ps(sr + c, t);
        most = _mm256_max_ps(most, t);
    }
    const float blk = hmax256(most);
    *top = blk;
    const __m256 vm = _mm256_set1_ps(blk > old ? blk : old);
    __m256 total = _mm256_setzero_ps();
    for (int c = 0; c < BK; c += 8) {
        const __m256 t = _mm256_loadu_ps(sr + c);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(t, vm)), _mm256_cmp_ps(t, ninf, _CMP_NEQ_OQ));
        _mm256_storeu_ps(sr + c, e);
        total = _mm256_add_ps(total, e);
    }
    return hsum256(total);
}
#define HAVE_SOFTMAX_BLOCK 1
#define VEC_D 8

#else
#define QT_MAX 4

static AI void qk_f32(const float *q, int qt, int d, const float *kt, long tpad, long j0, float *s) {
    for (int i = 0; i < qt; i++) {
        float acc[BK];
        for (int j = 0; j < BK; j++) acc[j] = 0.0f;
        for (int x = 0; x < d; x++) {
            const float qx = q[(long)i * d + x];
            const float *kr = kt + x * tpad + j0;
#pragma omp simd
            for (int j = 0; j < BK; j++) acc[j] += qx * kr[j];
        }
        memcpy(s + i * BK, acc, sizeof acc);
    }
}

static AI void pv_f32(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o) {
    for (int i = 0; i < qt; i++) {
        float *oi = o + (long)i * d;
        for (int j = 0; j < n; j++) {
            const float pj = p[i * BK + j];
            const float *vr = v + (j0 + j) * vrow;
#pragma omp simd
            for (int x = 0; x < d; x++) oi[x] += pj * vr[x];
        }
    }
}
#define VEC_D 1
#endif
#ifndef KT_BLOCKED
#define KT_BLOCKED 0 /* float32 keys transposed over the whole padded key count: kt[x * tpad + j] */
#endif
#ifndef STRIPE
#define STRIPE MAX_M /* every query vector of a row block at once */
#endif

/* Generic (any d) forms, for head dimensions the vector paths do not take. */
#if !KT_BLOCKED
static void qk_any(const float *q, int qt, int d, const float *kt, long tpad, long j0, float *s) {
    for (int i = 0; i < qt; i++)
        for (int j = 0; j < BK; j++) {
            float acc = 0.0f;
            for (int x = 0; x < d; x++) acc += q[(long)i * d + x] * kt[x * tpad + j0 + j];
            s[i * BK + j] = acc;
        }
}
#else
/* qk_any over one key block packed in chunks of 16 keys (qk_f32's layout) */
static void qk_chunked(const float *q, int qt, int d, const float *kt, float *s) {
    for (int i = 0; i < qt; i++)
        for (int j = 0; j < BK; j++) {
            float acc = 0.0f;
            for (int x = 0; x < d; x++) acc += q[(long)i * d + x] * kt[(long)(j / 16) * 16 * d + 16 * x + j % 16];
            s[i * BK + j] = acc;
        }
}
#endif

static void pv_any(const float *p, int qt, int d, const float *v, long vrow, long j0, int n, float *o) {
    for (int i = 0; i < qt; i++)
        for (int j = 0; j < n; j++) {
            const float pj = p[i * BK + j];
            for (int x = 0; x < d; x++) o[(long)i * d + x] += pj * v[(j0 + j) * vrow + x];
        }
}

/* ------------------------------------------------------------------ the call */
typedef struct {
    int h, r0, r1;  /* KV head, rows r0..r1-1 */
    long k0, k1;    /* keys k0..k1-1 (absolute) */
    long part;      /* index of its partial result, -1: writes the output itself */
    long group, ranges; /* its (head, row block): items group..group + ranges - 1, its key ranges */
} item_t;

typedef struct {
    int kind, hkv, g, d, tq, window, pairs, amx; /* amx: the tile path (KVB_AMX) */
    float scale;
    const int64_t *pos;
    const char *q;
    long q_head, q_row;
    char *out;
    long out_row;
    long kmin, tpad;          /* packed keys: absolute key kmin is packed index 0; tpad per head */
    const void *kpack;        /* per head: pairs (d/2 x tpad int32) or transposed (d x tpad float) */
    const float *vbase;       /* per head values as float32 rows (amx: key pairs, int32 rows of d) */
    long v_head, v_row;       /* in floats */
    const float *bpack;       /* per head tpad biases (0 past the keys), or NULL */
} call_t;

static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline long lo_of(const call_t *C, long p) {
    return C->window > 0 && p - C->window + 1 > 0 ? p - C->window + 1 : 0;
}

/* The first key block a row at p reads: its first visible key rounded down to a multiple of
 * BK. Key blocks start at the multiples of BK whatever rows share the call, so a row walks
 * the same blocks (and sums the same lanes) alone or in any row block. */
static inline long key_block_start(const call_t *C, long p) { return lo_of(C, p) / BK * BK; }

/* How many key ranges the row block of rows at first..last (positions) takes: its keys cut
 * at the multiples of RANGE; 1 with column sums (their normalisation needs every key). */
static inline long ranges_of(const call_t *C, long first, long last, int sums) {
    return sums ? 1 : last / RANGE - key_block_start(C, first) / RANGE + 1;
}

/* The query vectors of rows r0..r1-1 of head h as a packed matrix (row-major, vector
 * m = (r - r0) * g + i): bfloat16 for pairs, else float32. */
static void load_queries(const call_t *C, int h, int r0, int r1, void *qbuf) {
    const int es = C->kind == BKIND_F32 ? 4 : 2, g = C->g, d = C->d;
    if (C->amx) { /* a tile reads whole groups of AMX_ROWS vectors: the ones past the rows are zeros */
        const long nm = (long)(r1 - r0) * g, padded = (nm + 15) / 16 * 16;
        memset((uint16_t *)qbuf + nm * d, 0, (size_t)(padded - nm) * d * 2);
    }
    for (int r = r0; r < r1; r++)
        for (int i = 0; i < g; i++) {
            const char *src = C->q + ((long)(h * g + i) * C->q_head + (long)r * C->q_row) * es;
            const long m = (long)(r - r0) * g + i;
            if (C->pairs) {
                memcpy((uint16_t *)qbuf + m * d, src, (size_t)d * 2);
            } else if (C->kind == BKIND_F32) {
                memcpy((float *)qbuf + m * d, src, (size_t)d * 4);
            } else {
                float *dst = (float *)qbuf + m * d;
                for (int x = 0; x < d; x++) dst[x] = bf16_to_f32(((const uint16_t *)src)[x]);
            }
        }
}

/* One pass over an item's keys (online softmax). With `keep` (nm x nkb x BK floats, nkb = the
 * item's key blocks) and `kmax` (nm x nkb), each query vector's probabilities of each key block
 * before the rescaling (exp(score - the running maximum then)) and that maximum are kept, for the
 * column sums (`run_item`). */
static void run_pass(const call_t *C, const item_t *it, const void *qbuf, float *mx, float *l, float *o,
                     float *keep, float *kmax);

/* One work item: rows r0..r1-1 of head h over keys k0..k1-1. Leaves per query vector the
 * running maximum mx[m], sum l[m] and unnormalised weighted values o[m][d]; with `colsum`
 * (tpad floats, indexed by packed key) also each key's probabilities (normalised: exp(score -
 * final maximum) / final sum, as the kept ones rescaled) added to its column sum, vector by
 * vector in order: one pass over the keys, one exponential a score. `keep`: this thread's buffer
 * of MAX_M x (tpad / BK) x (BK + 1) floats (column sums only). */
static __attribute__((noinline)) void run_item(const call_t *C, const item_t *it, float *mx, float *l, float *o,
                                               float *colsum, float *keep) {
    _Alignas(64) float qbuf[MAX_M * BLEND_MAX_D]; /* float32, or bfloat16 in its first half */
    load_queries(C, it->h, it->r0, it->r1, qbuf);
    const int nm = (it->r1 - it->r0) * C->g;
    for (int m = 0; m < nm; m++) {
        mx[m] = -INFINITY;
        l[m] = 0.0f;
    }
    memset(o, 0, (size_t)nm * C->d * sizeof(float));
    if (!colsum) {
        run_pass(C, it, qbuf, mx, l, o, NULL, NULL);
        return;
    }
    const long k0 = it->k0 - C->kmin, nkb = (it->k1 - it->k0 + BK - 1) / BK;
    float *kmax = keep + (long)nm * nkb * BK;
    run_pass(C, it, qbuf, mx, l, o, keep, kmax);
    for (int m = 0; m < nm; m++) {
        if (mx[m] == -INFINITY || !(l[m] > 0.0f)) continue;
        const float inv = 1.0f / l[m];
        for (long b = 0; b < nkb; b++) {
            const float top = kmax[(long)m * nkb + b];
            if (top == -INFINITY) continue; /* a block this vector sees nothing of */
            const float f = exp_nonpositive(top - mx[m]) * inv;
            const float *e = keep + ((long)m * nkb + b) * BK;
            float *cs = colsum + k0 + b * BK;
#pragma omp simd
            for (int j = 0; j < BK; j++) cs[j] += e[j] * f;
        }
    }
}

static void run_pass(const call_t *C, const item_t *it, const void *qbuf_, float *mx, float *l, float *o,
                     float *keep, float *kmax) {
    const float *qbuf = (const float *)qbuf_;
    const int g = C->g, d = C->d, h = it->h;
    const int nm = (it->r1 - it->r0) * g;
    _Alignas(64) float s[MAX_M * BK];
    const long first = C->pos[it->r0], last = C->pos[it->r1 - 1];
    const long lo_last = lo_of(C, last);
    const long nkb = (it->k1 - it->k0 + BK - 1) / BK; /* the item's key blocks (`keep`'s rows) */
    const char *kp = (const char *)C->kpack + (long)h * C->tpad * d * (C->pairs ? 2 : 4);
    const float *vh = C->vbase + h * C->v_head;
    const float *bh = C->bpack ? C->bpack + (long)h * C->tpad : NULL;
#if KVB_AMX
    _Alignas(64) uint16_t pb[MAX_M * BK], pl[MAX_M * BK]; /* the probabilities as two bfloat16 parts */
    if (C->amx) {
        amx_config();
        memset(pb + (long)nm * BK, 0, (size_t)(MAX_M - nm) * BK * 2); /* a tile's rows past the vectors */
        memset(pl + (long)nm * BK, 0, (size_t)(MAX_M - nm) * BK * 2);
    }
#endif
    for (long j0 = it->k0; j0 < it->k1; j0 += BK) {
        const int n = it->k1 - j0 < BK ? (int)(it->k1 - j0) : BK;
        const long pj = j0 - C->kmin; /* packed index */
        /* masks only where some row of the block does not see the whole key block */
        const int masked = !(n == BK && j0 + n - 1 <= first && j0 >= lo_last);
        _Alignas(64) float bias[BK];
        for (int j = 0; j < BK; j++) bias[j] = bh && j < n ? bh[pj + j] : 0.0f;
        /* the query vectors in stripes of STRIPE: each stripe's scores, probabilities and weighted
         * values one after the other (a stripe's scores, at the start of s, stay in the L1 cache) */
        for (int v0 = 0; v0 < nm; v0 += STRIPE) {
            const int v1 = nm - v0 < STRIPE ? nm : v0 + STRIPE;
            /* a key block no row of the stripe sees (past its last row, before its first row's
             * window): skipped, as it is for those rows alone (never, in a stripe of the whole row block) */
            if (j0 > C->pos[it->r0 + (v1 - 1) / g] || j0 + n - 1 < lo_of(C, C->pos[it->r0 + v0 / g])) {
                for (int m = v0; keep && m < v1; m++) kmax[(long)m * nkb + (j0 - it->k0) / BK] = -INFINITY;
                continue;
            }
            /* scores of every query vector of the block, in tiles of QT_MAX (or AMX_ROWS) */
#if KVB_AMX
            for (int m0 = v0; C->amx && m0 < v1; m0 += AMX_ROWS)
                amx_scores((const uint16_t *)(const void *)qbuf + (long)m0 * d, d, (const int32_t *)(const void *)kp,
                           C->tpad, pj, s + (m0 - v0) * BK);
#endif
            for (int m0 = v0; !C->amx && m0 < v1; m0 += QT_MAX) {
                const int qt = v1 - m0 < QT_MAX ? v1 - m0 : QT_MAX;
                float *sm = s + (m0 - v0) * BK;
#if PACK_PAIRS
                if (C->pairs) {
                    const uint16_t *qm = (const uint16_t *)(const void *)qbuf + (long)m0 * d;
#define QKP(QT) qk_pairs(qm, QT, d, (const int32_t *)(const void *)kp, C->tpad, pj, sm)
                    switch (qt) {
                    case 6: QKP(6); break;
                    case 5: QKP(5); break;
                    case 4: QKP(4); break;
                    case 3: QKP(3); break;
                    case 2: QKP(2); break;
                    default: QKP(1); break;
                    }
#undef QKP
                    continue;
                }
#endif
                const float *qm = qbuf + (long)m0 * d;
#if KT_BLOCKED /* this key block, in chunks of 16 keys */
                const float *kt = (const float *)(const void *)kp + (pj / BK) * d * BK;
                if (d % VEC_D) {
                    qk_chunked(qm, qt, d, kt, sm);
                    continue;
                }
#define QKF(QT) qk_f32(qm, QT, d, kt, sm)
#else
                const float *kt = (const float *)(const void *)kp;
                if (d % VEC_D) {
                    qk_any(qm, qt, d, kt, C->tpad, pj, sm);
                    continue;
                }
#define QKF(QT) qk_f32(qm, QT, d, kt, C->tpad, pj, sm)
#endif
                switch (qt) {
#if QT_MAX >= 6
                case 6: QKF(6); break;
                case 5: QKF(5); break;
#endif
                case 4: QKF(4); break;
                case 3: QKF(3); break;
                case 2: QKF(2); break;
                default: QKF(1); break;
                }
#undef QKF
            }
            for (int m = v0; m < v1; m++) {
                float *sr = s + (m - v0) * BK;
                int vis_lo = 0, vis_hi = BK; /* visible keys of this block: [vis_lo, vis_hi) */
                if (masked) {
                    const long p = C->pos[it->r0 + m / g];
                    const long lo = lo_of(C, p) - j0, hi = p + 1 - j0;
                    vis_lo = lo > 0 ? (int)lo : 0;
                    vis_hi = hi < n ? (int)hi : n;
                    if (vis_hi <= vis_lo) { /* nothing visible here */
                        memset(sr, 0, BK * sizeof(float));
                        if (keep) kmax[(long)m * nkb + (j0 - it->k0) / BK] = -INFINITY;
                        continue;
                    }
                }
#ifdef HAVE_SOFTMAX_BLOCK
                float top;
                const float total = softmax_block(sr, bias, C->scale, masked, vis_lo, vis_hi, mx[m], &top);
                const float mnew = top > mx[m] ? top : mx[m];
#else
                float top = -INFINITY;
#pragma omp simd reduction(max : top)
                for (int j = 0; j < BK; j++) {
                    const float t = sr[j] * C->scale + bias[j];
                    const int in = j >= vis_lo && j < vis_hi;
                    sr[j] = in ? t : -INFINITY;
                    top = sr[j] > top ? sr[j] : top;
                }
                const float mnew = top > mx[m] ? top : mx[m];
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int j = 0; j < BK; j++) {
                    const float e = exp_nonpositive(sr[j] - mnew);
                    sr[j] = sr[j] == -INFINITY ? 0.0f : e;
                    total += sr[j];
                }
#endif
                if (keep) { /* for the column sums: this block's probabilities and the maximum they are of */
                    const long b = (long)m * nkb + (j0 - it->k0) / BK;
                    memcpy(keep + b * BK, sr, BK * sizeof(float));
                    kmax[b] = mnew;
                }
                if (mnew > mx[m] && mx[m] != -INFINITY) {
                    const float corr = exp_nonpositive(mx[m] - mnew);
                    l[m] *= corr;
                    float *om = o + (long)m * d;
#pragma omp simd
                    for (int x = 0; x < d; x++) om[x] *= corr;
                }
                mx[m] = mnew;
                l[m] += total;
            }
            /* o += p . v */
#if KVB_AMX
            if (C->amx) {
                for (int m = v0; m < v1; m++) amx_split_row(s + (m - v0) * BK, pb + m * BK, pl + m * BK);
                for (int m0 = v0; m0 < v1; m0 += AMX_ROWS)
                    amx_values(pb + m0 * BK, pl + m0 * BK, d, (const int32_t *)(const void *)vh + (pj / 2) * d,
                               o + (long)m0 * d);
                continue;
            }
#endif
            for (int m0 = v0; m0 < v1; m0 += QT_MAX) {
                const int qt = v1 - m0 < QT_MAX ? v1 - m0 : QT_MAX;
                const float *sm = s + (m0 - v0) * BK;
                float *om = o + (long)m0 * d;
                if (d % VEC_D) {
                    pv_any(sm, qt, d, vh, C->v_row, pj, n, om);
                    continue;
                }
#define PVF(QT) pv_f32(sm, QT, d, vh, C->v_row, pj, n, om)
                switch (qt) {
#if QT_MAX >= 6
                case 6: PVF(6); break;
                case 5: PVF(5); break;
#endif
                case 4: PVF(4); break;
                case 3: PVF(3); break;
                case 2: PVF(2); break;
                default: PVF(1); break;
                }
#undef PVF
            }
        }
    }
}

/* out rows r0..r1-1 of head h from the normalised sums */
static void write_rows(const call_t *C, int h, int r0, int r1, const float *l, const float *o) {
    const int g = C->g, d = C->d;
    for (int r = r0; r < r1; r++)
        for (int i = 0; i < g; i++) {
            const long m = (long)(r - r0) * g + i;
            const float inv = l[m] > 0.0f ? 1.0f / l[m] : 0.0f;
            const float *om = o + m * d;
            const long at = (long)r * C->out_row + (long)(h * g + i) * d;
            if (C->kind == BKIND_F32) {
                float *dst = (float *)(void *)C->out + at;
                for (int x = 0; x < d; x++) dst[x] = om[x] * inv;
            } else {
                uint16_t *dst = (uint16_t *)(void *)C->out + at;
                for (int x = 0; x < d; x++) dst[x] = f32_to_bf16(om[x] * inv);
            }
        }
}

/* Fold one key range's partial result (rmx, rl, ro: per query vector its maximum, sum of
 * exponentials and unnormalised values) into a row block's running one (mx, l, o; mx -inf:
 * nothing yet, which takes the range as it is). A row block's ranges are folded in key
 * order, whichever thread runs them; one compiled copy (noinline), so every fold is the same
 * arithmetic. */
static __attribute__((noinline)) void fold_range(int nm, int d, float *mx, float *l, float *o, const float *rmx,
                                                 const float *rl, const float *ro) {
    for (int m = 0; m < nm; m++) {
        if (rmx[m] == -INFINITY) continue; /* a range this vector sees nothing of */
        float *om = o + (long)m * d;
        const float *rm = ro + (long)m * d;
        if (mx[m] == -INFINITY) {
            mx[m] = rmx[m], l[m] = rl[m];
            memcpy(om, rm, (size_t)d * sizeof(float));
            continue;
        }
        const float top = rmx[m] > mx[m] ? rmx[m] : mx[m];
        const float a = exp_nonpositive(mx[m] - top), b = exp_nonpositive(rmx[m] - top);
        l[m] = a * l[m] + b * rl[m];
        for (int x = 0; x < d; x++) om[x] = a * om[x] + b * rm[x];
        mx[m] = top;
    }
}

/* Range x of the ranges of a row block's item `it` (keys it->k0..it->k1-1 cut at the
 * multiples of RANGE). */
static item_t range_of(const item_t *it, long x) {
    item_t r = *it;
    r.k0 = x ? (it->k0 / RANGE + x) * RANGE : it->k0;
    r.k1 = x == it->ranges - 1 ? it->k1 : (it->k0 / RANGE + x + 1) * RANGE;
    return r;
}

/* Pack head h's keys k0..k1-1 (absolute) for the dot products and widen its values. */
static void pack_keys(const call_t *C, int h, const char *k, long k_head, long k_row, const char *v, long v_head,
                      long v_row, const float *bias, long bias_head, long tk, long k0, long k1, float *vwide,
                      float *bpack) {
    const int d = C->d, es = C->kind == BKIND_F32 ? 4 : 2;
    for (long j = k0; j < k1; j++) {
        const long pj = j - C->kmin;
        const int real = j < tk;
        const char *kr = k + (h * k_head + j * k_row) * es;
        if (C->pairs) {
            int32_t *kp = (int32_t *)(void *)C->kpack + (long)h * C->tpad * (d / 2);
            for (int x2 = 0; x2 < d / 2; x2++) {
                int32_t pair = 0;
                if (real) memcpy(&pair, kr + 4L * x2, 4);
                kp[x2 * C->tpad + pj] = pair;
            }
        } else {
            float *kt = (float *)(void *)C->kpack + (long)h * C->tpad * d;
#if KT_BLOCKED /* key block pj / BK, chunk (pj % BK) / 16: d rows of 16 */
            kt += (pj / BK) * d * BK + (pj % BK) / 16 * 16 * d + pj % 16;
            const long ks = 16;
#else
            kt += pj;
            const long ks = C->tpad;
#endif
            for (int x = 0; x < d; x++)
                kt[x * ks] = !real ? 0.0f
                    : C->kind == BKIND_F32 ? ((const float *)(const void *)kr)[x]
                    : bf16_to_f32(((const uint16_t *)(const void *)kr)[x]);
        }
        const uint16_t *src = (const uint16_t *)(const void *)(v + (h * v_head + j * v_row) * es);
        if (vwide && C->amx) { /* values as key pairs: (pj/2, x) holds keys pj & ~1 and pj | 1 */
            uint16_t *vp = (uint16_t *)(void *)(vwide + h * C->v_head) + ((pj / 2) * d) * 2 + (pj & 1);
            for (int x = 0; x < d; x++) vp[2 * x] = real ? src[x] : 0;
        } else if (vwide) {
            float *vr = vwide + h * C->v_head + pj * C->v_row;
            for (int x = 0; x < d; x++) vr[x] = real ? bf16_to_f32(src[x]) : 0.0f;
        }
        if (bpack) bpack[(long)h * C->tpad + pj] = real && bias ? bias[h * bias_head + j] : 0.0f;
    }
}

/* Returns 0, or -1 when the shapes are outside the kernel's limits or memory is short
 * (nothing written: the caller falls back). Strides in elements of the tensor's dtype. */
int kvb_blend_attention(int kind, int hkv, int g, int d, int tq, long tk, float scale, int window,
                        const int64_t *pos, const void *q, long q_head, long q_row, const void *k, long k_head,
                        long k_row, const void *v, long v_head, long v_row, const float *bias, long bias_head,
                        void *out, long out_row, float *colsum) {
    if ((kind != BKIND_F32 && kind != BKIND_BF16) || hkv < 1 || g < 1 || g > MAX_M || d < 2 || d % 2 ||
        d > BLEND_MAX_D || tq < 1 || tk < 1 || window < 0)
        return -1;
    for (int r = 0; r < tq; r++)
        if (pos[r] < 0 || pos[r] >= tk || (r && pos[r] <= pos[r - 1])) return -1;
    call_t C = {0};
    C.kind = kind, C.hkv = hkv, C.g = g, C.d = d, C.tq = tq, C.window = window, C.scale = scale, C.pos = pos;
    C.q = (const char *)q, C.q_head = q_head, C.q_row = q_row, C.out = (char *)out, C.out_row = out_row;
    C.pairs = PACK_PAIRS && kind == BKIND_BF16;
#if KVB_AMX
    C.amx = C.pairs && d % 64 == 0 && __atomic_load_n(&amx_wanted, __ATOMIC_RELAXED) && amx_ready();
#endif
    C.kmin = key_block_start(&C, pos[0]);
    const long kend = pos[tq - 1] + 1;
    C.tpad = ((kend - C.kmin + BK - 1) / BK) * BK;
    /* row blocks: at most MAX_M / g rows; in a sliding layer spanning under half a window */
    const int per_block = MAX_M / g;
    int nblocks = 0;
    int *starts = malloc((size_t)(tq + 1) * sizeof(int));
    if (!starts) return -1;
    for (int r = 0; r < tq;) {
        int e = r + 1;
        while (e < tq && e - r < per_block && (!window || pos[e] - pos[r] < (window + 1) / 2)) e++;
        starts[nblocks++] = r;
        r = e;
    }
    starts[nblocks] = tq;
    /* key ranges: each row block's keys cut at the multiples of RANGE (none with column sums).
     * Work items: whole row blocks (a thread runs a block's ranges one after the other and
     * folds them in its own buffers) where heads x row blocks give each thread several,
     * else single ranges (their partial results kept in `parts`, folded by the thread that
     * finishes a block's last range). Only who runs a range depends on the threads: its
     * arithmetic and the order of the fold do not. */
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    const int whole = colsum || (long)hkv * nblocks >= 4L * threads;
    long nitems = 0, nparts = 0;
    for (int b = 0; b < nblocks; b++) {
        const long c = ranges_of(&C, pos[starts[b]], pos[starts[b + 1] - 1], colsum != NULL);
        nitems += whole ? hkv : hkv * c;
        if (!whole && c > 1) nparts += hkv * c;
    }
    item_t *items = malloc((size_t)nitems * sizeof(item_t));
    const int vwiden = kind == BKIND_BF16;
    const size_t kbytes = (size_t)hkv * C.tpad * d * (C.pairs ? 2 : 4);
    const size_t vbytes = vwiden ? (size_t)hkv * C.tpad * d * (C.amx ? 2 : 4) : 0; /* amx: bfloat16 pairs */
    const size_t bbytes = bias ? (size_t)hkv * C.tpad * 4 : 0;
    const size_t pbytes = (size_t)nparts * MAX_M * (d + 2) * 4;
    const size_t cbytes = colsum ? (size_t)nitems * C.tpad * 4 : 0; /* each item's column sums */
    /* with column sums, per thread: a row block's kept probabilities and block maxima (run_item) */
    const size_t keep_floats = (size_t)MAX_M * (C.tpad / BK) * (BK + 1);
    const size_t kpbytes = colsum ? (size_t)threads * keep_floats * 4 : 0;
    char *pool = malloc(kbytes + vbytes + bbytes + pbytes + cbytes + kpbytes + 64);
    long *left = malloc((size_t)(nitems + 1) * sizeof(long)); /* per (head, row block): ranges not done */
    if (!items || !pool || !left) {
        free(items), free(pool), free(left), free(starts);
        return -1;
    }
    C.kpack = pool;
    float *vwide = vwiden ? (float *)(void *)(pool + kbytes) : NULL;
    C.bpack = bias ? (float *)(void *)(pool + kbytes + vbytes) : NULL;
    float *parts = (float *)(void *)(pool + kbytes + vbytes + bbytes);
    float *sums = colsum ? (float *)(void *)(pool + kbytes + vbytes + bbytes + pbytes) : NULL;
    float *kept = colsum ? (float *)(void *)(pool + kbytes + vbytes + bbytes + pbytes + cbytes) : NULL;
    if (sums) memset(sums, 0, cbytes);
    if (vwiden) { /* v_head in floats: amx pairs take half as many */
        C.vbase = vwide, C.v_head = C.tpad * d / (C.amx ? 2 : 1), C.v_row = d;
    } else { /* float32 values read where they are; packed index 0 is key kmin */
        C.vbase = (const float *)v + C.kmin * v_row, C.v_head = v_head, C.v_row = v_row;
    }
    /* items, the latest row blocks (the most keys) first */
    long n = 0, np = 0;
    for (int b = nblocks - 1; b >= 0; b--) {
        const int r0 = starts[b], r1 = starts[b + 1];
        const long k0 = key_block_start(&C, pos[r0]), k1 = pos[r1 - 1] + 1;
        const long c = ranges_of(&C, pos[r0], pos[r1 - 1], colsum != NULL);
        for (int h = 0; h < hkv; h++) {
            const item_t block = {h, r0, r1, k0, k1, -1, n, c};
            if (whole || c == 1) {
                items[n++] = block;
                continue;
            }
            left[n] = c;
            for (long x = 0; x < c; x++) { /* in key order: the fold's order */
                items[n] = range_of(&block, x);
                items[n++].part = np++;
            }
        }
    }
    /* pack every head's keys (and widen bfloat16 values) once */
    const long chunk = 256, chunks = (C.tpad + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if ((long)hkv * C.tpad * d >= 65536)
    for (long w = 0; w < hkv * chunks; w++) {
        const int h = (int)(w / chunks);
        const long a = C.kmin + (w % chunks) * chunk, e = a + chunk < C.kmin + C.tpad ? a + chunk : C.kmin + C.tpad;
        pack_keys(&C, h, (const char *)k, k_head, k_row, (const char *)v, v_head, v_row, bias, bias_head, tk, a, e,
                  vwide, (float *)C.bpack);
    }
    long work = 0;
    for (long i = 0; i < n; i++) work += (items[i].k1 - items[i].k0) * (items[i].r1 - items[i].r0);
#pragma omp parallel if (n > 1 && work * g * d >= 65536)
    {
        _Alignas(64) float mx[MAX_M], l[MAX_M], fmx[MAX_M], fl[MAX_M];
        float *o = malloc((size_t)MAX_M * d * sizeof(float) * 2), *fo = o + (long)MAX_M * d;
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < n; i++) {
            const item_t *it = &items[i];
            const int nm = (it->r1 - it->r0) * g;
            if (it->part >= 0) { /* one range: the thread that finishes its row block's last one folds them */
                float *p = parts + it->part * MAX_M * (d + 2);
                run_item(&C, it, p, p + MAX_M, p + 2 * MAX_M, NULL, NULL);
                if (__atomic_sub_fetch(&left[it->group], 1, __ATOMIC_ACQ_REL)) continue;
                for (int m = 0; m < nm; m++) fmx[m] = -INFINITY;
                for (long x = it->group; x < it->group + it->ranges; x++) {
                    const float *px = parts + items[x].part * MAX_M * (d + 2);
                    fold_range(nm, d, fmx, fl, fo, px, px + MAX_M, px + 2 * MAX_M);
                }
                write_rows(&C, it->h, it->r0, it->r1, fl, fo);
            } else if (it->ranges == 1) { /* a row block within one range */
                run_item(&C, it, mx, l, o, sums ? sums + i * C.tpad : NULL,
                         kept ? kept + (size_t)thread_index() * keep_floats : NULL);
                write_rows(&C, it->h, it->r0, it->r1, l, o);
            } else { /* a whole row block: its ranges one after the other, folded here */
                for (int m = 0; m < nm; m++) fmx[m] = -INFINITY;
                for (long x = 0; x < it->ranges; x++) {
                    const item_t r = range_of(it, x);
                    run_item(&C, &r, mx, l, o, NULL, NULL);
                    fold_range(nm, d, fmx, fl, fo, mx, l, o);
                }
                write_rows(&C, it->h, it->r0, it->r1, fl, fo);
            }
        }
        free(o);
#if KVB_AMX
        if (C.amx) _tile_release(); /* this thread's tiles back to their initial state */
#endif
    }
    if (colsum) { /* each head's column sums over its row blocks, at the keys' own indices */
        memset(colsum, 0, (size_t)hkv * tk * sizeof(float));
        for (long i = 0; i < n; i++) {
            float *dst = colsum + (long)items[i].h * tk + C.kmin;
            const float *src = sums + i * C.tpad;
            const long upto = C.tpad < tk - C.kmin ? C.tpad : tk - C.kmin;
            for (long j = 0; j < upto; j++) dst[j] += src[j];
        }
    }
    free(items), free(pool), free(left), free(starts);
    return 0;
}

/* The stale rows' K/V offset (blend/recompute/stale.py, `stale_shift`): for each row r,
 *   k[h, rows[r]] += R(rows[r]) dk[h],   v[h, rows[r]] += dv[h]
 * with R(p) the row's RoPE rotation given as cos, sin (n, d) float32 (rotate-half layout:
 * [x1 c - x2 s, x2 c + x1 s]), dk, dv (hkv, d) float32; K/V float32 or bfloat16 (rounded
 * once, after the sum), rows contiguous. One pass over the rows, shared by the threads. */
int kvb_shift_rows(int kind, int hkv, int d, long n, const int64_t *rows, void *k, long k_head, long k_row, void *v,
                   long v_head, long v_row, const float *dk, const float *dv, const float *cos, const float *sin) {
    if ((kind != BKIND_F32 && kind != BKIND_BF16) || hkv < 1 || d < 2 || d % 2 || d > BLEND_MAX_D || n < 0) return -1;
    const int half = d / 2, es = kind == BKIND_F32 ? 4 : 2;
#pragma omp parallel for schedule(static) if (n * hkv * d >= 65536)
    for (long r = 0; r < n; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < hkv; h++) {
            const float *a = dk + (long)h * d, *b = dv + (long)h * d;
            float add[BLEND_MAX_D];
            for (int x = 0; x < half; x++) {
                add[x] = a[x] * c[x] - a[x + half] * s[x];
                add[x + half] = a[x + half] * c[x + half] + a[x] * s[x + half];
            }
            char *kr = (char *)k + (h * k_head + rows[r] * k_row) * es;
            char *vr = (char *)v + (h * v_head + rows[r] * v_row) * es;
            if (kind == BKIND_F32) {
                float *kf = (float *)(void *)kr, *vf = (float *)(void *)vr;
                for (int x = 0; x < d; x++) kf[x] += add[x];
                for (int x = 0; x < d; x++) vf[x] += b[x];
            } else {
                uint16_t *kb = (uint16_t *)(void *)kr, *vb = (uint16_t *)(void *)vr;
                for (int x = 0; x < d; x++) kb[x] = f32_to_bf16(bf16_to_f32(kb[x]) + add[x]);
                for (int x = 0; x < d; x++) vb[x] = f32_to_bf16(bf16_to_f32(vb[x]) + b[x]);
            }
        }
    }
    return 0;
}

/* Loaded keys moved to their new positions (the loader's placement: Runner.rotate_into):
 *   dst[h, j] = [x1 c_j - x2 s_j, x2 c_j + x1 s_j]   (x1, x2: the halves of src[h, j], rotate-half)
 * in float32, each product and each sum rounded as torch rounds them (no fused multiply-add),
 * rounded once into dst's dtype (nearest even). src and dst float32 or bfloat16 (kinds), rows
 * contiguous (any head and row strides, in elements); cos, sin (t, d/2) float32 with row
 * stride cs_row (0: one rotation for every row). One pass, on the calling thread. */
__attribute__((optimize("fp-contract=off"))) int kvb_rotate_into(int src_kind, int dst_kind, int hkv, int d, long t,
                                                                 const void *src, long s_head, long s_row, void *dst,
                                                                 long d_head, long d_row, const float *cos,
                                                                 const float *sin, long cs_row) {
    if ((src_kind != BKIND_F32 && src_kind != BKIND_BF16 && src_kind != BKIND_F16) ||
        (dst_kind != BKIND_F32 && dst_kind != BKIND_BF16) ||
        hkv < 1 || d < 2 || d % 2 || d > BLEND_MAX_D || t < 0 || cs_row < 0)
        return -1;
    const int half = d / 2;
    for (int h = 0; h < hkv; h++)
        for (long j = 0; j < t; j++) {
            const float *c = cos + j * cs_row, *sn = sin + j * cs_row;
            float x[BLEND_MAX_D], y[BLEND_MAX_D];
#if defined(__AVX512F__)
            if (half % 16 == 0) { /* 16 lanes at a time: the same arithmetic, the same rounding */
                const float *xf = (const float *)src + h * s_head + j * s_row;
                const uint16_t *xb = (const uint16_t *)src + h * s_head + j * s_row;
                for (int i = 0; i < half; i += 16) {
                    __m512 x1, x2;
                    if (src_kind == BKIND_F32) {
                        x1 = _mm512_loadu_ps(xf + i), x2 = _mm512_loadu_ps(xf + i + half);
                    } else if (src_kind == BKIND_F16) { /* exact widening */
                        x1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(xb + i)));
                        x2 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(xb + i + half)));
                    } else {
                        x1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(xb + i))), 16));
                        x2 = _mm512_castsi512_ps(_mm512_slli_epi32(
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(xb + i + half))),
                            16));
                    }
                    const __m512 vc = _mm512_loadu_ps(c + i), vs = _mm512_loadu_ps(sn + i);
                    const __m512 y1 = _mm512_sub_ps(_mm512_mul_ps(x1, vc), _mm512_mul_ps(x2, vs));
                    const __m512 y2 = _mm512_add_ps(_mm512_mul_ps(x2, vc), _mm512_mul_ps(x1, vs));
                    if (dst_kind == BKIND_F32) {
                        float *yr = (float *)dst + h * d_head + j * d_row;
                        _mm512_storeu_ps(yr + i, y1);
                        _mm512_storeu_ps(yr + i + half, y2);
                    } else {
                        uint16_t *yr = (uint16_t *)dst + h * d_head + j * d_row;
                        _mm256_storeu_si256((__m256i *)(void *)(yr + i), bf16_round16(y1));
                        _mm256_storeu_si256((__m256i *)(void *)(yr + i + half), bf16_round16(y2));
                    }
                }
                continue;
            }
#endif
            if (src_kind == BKIND_F32) {
                memcpy(x, (const float *)src + h * s_head + j * s_row, (size_t)d * 4);
            } else {
                const uint16_t *xr = (const uint16_t *)src + h * s_head + j * s_row;
                for (int i = 0; i < d; i++) x[i] = src_kind == BKIND_F16 ? f16_to_f32(xr[i]) : bf16_to_f32(xr[i]);
            }
            for (int i = 0; i < half; i++) {
                const float a = x[i] * c[i], b = x[i + half] * sn[i];
                const float e = x[i + half] * c[i], f = x[i] * sn[i];
                y[i] = a - b;
                y[i + half] = e + f;
            }
            if (dst_kind == BKIND_F32) {
                memcpy((float *)dst + h * d_head + j * d_row, y, (size_t)d * 4);
            } else {
                uint16_t *yr = (uint16_t *)dst + h * d_head + j * d_row;
                for (int i = 0; i < d; i++) yr[i] = f32_to_bf16(y[i]);
            }
        }
    return 0;
}

/* codes i..i+cnt-1 of n as floats (`bits` 8: byte i; 4: the low nibbles hold the first n/2 codes,
 * the high ones the rest) */
static inline void codes_at(const uint8_t *codes, int bits, long n, long i, int cnt, float *out) {
    if (bits == 8) {
        for (int x = 0; x < cnt; x++) out[x] = (float)codes[i + x];
    } else if (i + cnt <= n / 2) {
        for (int x = 0; x < cnt; x++) out[x] = (float)(codes[i + x] & 15u);
    } else if (i >= n / 2) {
        for (int x = 0; x < cnt; x++) out[x] = (float)(codes[i - n / 2 + x] >> 4);
    } else {
        for (int x = 0; x < cnt; x++) out[x] = (float)(i + x < n / 2 ? codes[i + x] & 15u : codes[i + x - n / 2] >> 4);
    }
}

/* One stored layer in an integer codec (storage/codec.py) decoded into float32 K and V (h, t, d),
 * contiguous: the same bits as `storage.codec.decode_into` (each product and sum rounded to
 * float32 in the same order; no fused multiply-add). K: per head and channel, groups of
 * `key_group` tokens, asymmetric (code x scale + minimum) or symmetric ((code - 2^(bits-1)) x
 * scale); V: per head and token, groups of `value_group` channels (a divisor of d). Scales and
 * minimums float16, after the codes (rounded up to even bytes). On the calling thread. */
__attribute__((optimize("fp-contract=off"))) int kvb_decode_codes(int bits, int key_group, int key_zero,
                                                                  int value_group, int value_zero, int h, long t,
                                                                  int d, const uint8_t *kpart, const uint8_t *vpart,
                                                                  float *k_out, float *v_out) {
    if ((bits != 8 && bits != 4) || key_group < 1 || value_group < 1 || d % value_group || h < 1 || t < 1 || d < 1 ||
        d > BLEND_MAX_D)
        return -1;
    const long n = (long)h * t * d, codes = (n * bits / 8 + 1) / 2 * 2;
    const float mid = (float)(1 << (bits - 1));
    const long groups = (t + key_group - 1) / key_group;
    const uint8_t *ks = kpart + codes, *vs = vpart + codes; /* float16 scales (then minimums) */
    const long kcount = (long)h * groups * d, vcount = (long)h * t * (d / value_group);
    for (int hh = 0; hh < h; hh++)
        for (long gi = 0; gi < groups; gi++) {
            float sc[BLEND_MAX_D], mn[BLEND_MAX_D];
            for (int x = 0; x < d; x++) {
                const long at = ((long)hh * groups + gi) * d + x;
                sc[x] = f16_at(ks + 2 * at), mn[x] = key_zero ? f16_at(ks + 2 * (kcount + at)) : 0.0f;
            }
            const long t1 = (gi + 1) * key_group < t ? (gi + 1) * key_group : t;
            for (long j = gi * key_group; j < t1; j++) {
                const long row = ((long)hh * t + j) * d;
                float *o = k_out + row, c[BLEND_MAX_D];
                codes_at(kpart, bits, n, row, d, c);
                if (key_zero) {
                    for (int x = 0; x < d; x++) {
                        const float p = c[x] * sc[x];
                        o[x] = p + mn[x];
                    }
                } else {
                    for (int x = 0; x < d; x++) o[x] = (c[x] - mid) * sc[x];
                }
            }
        }
    const int per = d / value_group;
    for (long r = 0; r < (long)h * t; r++) {
        float *o = v_out + r * d, cv[BLEND_MAX_D];
        codes_at(vpart, bits, n, r * d, d, cv);
        for (int gx = 0; gx < per; gx++) {
            const float sc = f16_at(vs + 2 * (r * per + gx)),
                        mn = value_zero ? f16_at(vs + 2 * (vcount + r * per + gx)) : 0.0f;
            for (int x = gx * value_group; x < (gx + 1) * value_group; x++) {
                const float c = cv[x];
                if (value_zero) {
                    const float p = c * sc;
                    o[x] = p + mn;
                } else {
                    o[x] = (c - mid) * sc;
                }
            }
        }
    }
    return 0;
}

/* The blend kernel's dot products: 2 where bfloat16 rows take AMX tiles (the CPU has them, Linux
 * grants them, not turned off), 1 for AVX-512 BF16 dot products, 3 for the AVX2 + FMA build's
 * float32 ones, 0 otherwise. `want` 0 turns the
 * tiles off for this process, 1 back on, -1 only asks. */
int kvb_blend_path(int want) {
#if KVB_AMX
    if (want >= 0) __atomic_store_n(&amx_wanted, want ? 1 : 0, __ATOMIC_RELAXED);
    return amx_wanted && amx_ready() ? 2 : 1;
#elif PACK_PAIRS
    (void)want;
    return 1;
#else
    (void)want;
    return KT_BLOCKED ? 3 : 0; /* 3: the AVX2 + FMA path (float32 keys) */
#endif
}
