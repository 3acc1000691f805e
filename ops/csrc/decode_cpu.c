/* One decode step of model.py's decoder (Qwen2/Llama: RMSNorm, GQA attention with RoPE, SwiGLU MLP)
 * for B rows of one new token each, as a single call: the GEMMs go to the BLAS torch itself links
 * (sgemm_), everything between them runs as loops over the rows, with no allocation and no per-op
 * dispatch. Float32, row-major, contiguous buffers; built and loaded by ops/decode_cpu.py.
 *
 * The loops use GCC's vector extensions (8 floats), which the compiler lowers to the machine's SIMD
 * (AVX2 here) or to scalar code; exp is a Cephes-style polynomial with the same ~1 ulp accuracy as
 * the vectorised exp torch's CPU kernels use, not libm's scalar expf.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

extern void sgemm_(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                   const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                   const float *beta, float *c, const int *ldc);

/* MKL's packed GEMM (in the MKL torch links on x86): a weight packed once per generate call instead of
 * inside every multi-row sgemm_, which re-packs the whole weight panel at each call. Weak, so that the
 * library still loads against a BLAS without them; mf_pack_available says which it got. */
extern size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
extern void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                             const float *src, int ld, float *dest) __attribute__((weak));
extern void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float *a, int lda,
                                const float *b, int ldb, float beta, float *c, int ldc) __attribute__((weak));
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, PACKED = 151, B_MATRIX = 162 };

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
#define MAX_HEAD_DIM 1024  /* rope's scratch; Python reads it from mf_max_head_dim */

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, vocab, layers, max_len, n_new;
    float eps;
    const float *embed, *final_norm, *lm_head;
    /* per layer: wqkv [nq + 2 nkv, H] (q, k, v stacked), bqkv (NULL without biases), wgu [2 I, H] (gate, up) */
    const float **attn_norm, **wqkv, **bqkv, **wo, **mlp_norm, **wgu, **w_down;
    float **k_cache, **v_cache;          /* per layer [B, Hkv, S, D] */
    const uint8_t *key_valid;            /* [B, S]: 0 at left padding */
    const float *cos, *sin;              /* [B, n_new, D]: rope_tables' cos and signed sin */
    float *x, *h, *qkv, *att, *gu, *scores;  /* scratch: [BT,H] [BT,H] [BT,nq+2nkv] [BT,nq] [BT,2I] [S] */
    /* mf_pack'ed copies of the matrices for B*T rows, or NULL (then sgemm_ or gemm_few_rows on the plain ones) */
    const float *lm_head_p;
    const float **wqkv_p, **wo_p, **wgu_p, **w_down_p;
    int64_t block;                       /* T: tokens per row a step carries (scratch and packing are for B*T rows) */
    int64_t small_rows;                  /* products of up to this many rows take gemm_few_rows (<= SMALL_ROWS) or,
                                          * on the pairs, gemm_blocked (<= BLOCKED_ROWS) */
    /* the matrices in pairs of rows (interleave_pairs), or NULL: gemm_few_rows then reads the plain ones */
    const float *lm_head_i;
    const float **wqkv_i, **wo_i, **wgu_i, **w_down_i;
} Model;

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat(float a) { return (v8){a, a, a, a, a, a, a, a}; }
static inline float hsum(v8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

/* The 8 lane-wise partial sums of q . k over d (a multiple of 32) in four independent chains. */
static inline v8 dot_lanes(const float *q, const float *k, int64_t d) {
    v8 a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < d; c += 32) {
        a0 += load8(q + c) * load8(k + c);
        a1 += load8(q + c + 8) * load8(k + c + 8);
        a2 += load8(q + c + 16) * load8(k + c + 16);
        a3 += load8(q + c + 24) * load8(k + c + 24);
    }
    return (a0 + a1) + (a2 + a3);
}

/* e^x on 8 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-5 polynomial, 2^n into the exponent;
 * 0 below -87.34 (so e^-inf = 0), +inf clamped to e^88.38, NaN kept NaN. */
static inline v8 exp8(v8 x) {
    const i8 keep = x > splat(-87.3365447505531f);  /* below: e^x < 2^-126, returned as exactly 0 */
    const i8 nan = x != x;
    const v8 hi = splat(88.3762626647949f), lo = splat(-87.3365447505531f);
    x = (v8)(((i8)x & (x < hi)) | ((i8)hi & ~(x < hi)));  /* min(x, hi) */
    x = (v8)(((i8)x & (x > lo)) | ((i8)lo & ~(x > lo)));  /* max(x, lo) */
    const v8 t = x * splat(1.44269504088896341f);
    const i8 sign = (i8)t & (i8){INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
    const v8 half = (v8)((i8)splat(0.5f) | sign);           /* +-0.5: round half away from zero */
    const i8 n = __builtin_convertvector(t + half, i8);
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = (x - nf * splat(0.693359375f)) + nf * splat(2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    const v8 y = p * (r * r) + r + splat(1.0f);
    return (v8)((((i8)y + (n << 23)) & keep) | nan);  /* all bits set: a NaN */
}

/* acc + a*b on 8 lanes: one fused multiply-add where the machine has it (explicitly: -ffp-contract=off
 * keeps the compiler from fusing anything on its own), else a multiply and an add. */
static inline v8 fma8(v8 a, v8 b, v8 acc) {
#if defined(__AVX2__) && defined(__FMA__)
    return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* y[R, n] (+)= x[R, k] w[n, k]^T for few rows (R <= SMALL_ROWS): each weight row is read once, in one
 * stream, and used for all R rows; KK accumulators a row over interleaved 8-float chunks of k make R*KK
 * independent add chains, enough to hide the FMA latency. At 1-8 rows a decode step or a speculative
 * verify then only streams its weights (BLAS's small-M kernels took a 4-row product to ~1.8x a 1-row one
 * here). Each output sums its KK accumulators in order, then the 8 lanes (hsum), then the k % 8 tail:
 * a fixed order, the same at every call. */
#define SMALL_ROWS 8
static inline __attribute__((always_inline)) void gemm_small(const float *x, int64_t ldx, const float *w, float *y,
                                                             int64_t ldy, int64_t n, int64_t k, int accumulate,
                                                             const int R, const int KK) {
    const int64_t kb = k - k % (8 * KK), k8 = k & ~(int64_t)7;
    for (int64_t j = 0; j < n; j++) {
        const float *wj = w + j * k;
        v8 a[SMALL_ROWS][8];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < KK; u++) a[r][u] = splat(0.0f);
        for (int64_t c = 0; c < kb; c += 8 * KK)
            for (int u = 0; u < KK; u++) {
                const v8 wv = load8(wj + c + 8 * u);
                for (int r = 0; r < R; r++) a[r][u] = fma8(wv, load8(x + r * ldx + c + 8 * u), a[r][u]);
            }
        for (int64_t c = kb; c < k8; c += 8) {
            const v8 wv = load8(wj + c);
            for (int r = 0; r < R; r++) a[r][0] = fma8(wv, load8(x + r * ldx + c), a[r][0]);
        }
        for (int r = 0; r < R; r++) {
            v8 t = a[r][0];
            for (int u = 1; u < KK; u++) t += a[r][u];
            float s = hsum(t);
            for (int64_t c = k8; c < k; c++) s += x[r * ldx + c] * wj[c];
            float *out = y + r * ldy + j;
            *out = accumulate ? *out + s : s;
        }
    }
}

/* The 4 sums of A..D's lanes, each in hsum's order: hadd's pairs, then pairs of pairs, then the two halves. */
static inline void hsum4(v8 A, v8 B, v8 C, v8 D, float *s) {
#if defined(__AVX2__)
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps((__m256)A, (__m256)B), _mm256_hadd_ps((__m256)C, (__m256)D));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
#else
    s[0] = hsum(A), s[1] = hsum(B), s[2] = hsum(C), s[3] = hsum(D);
#endif
}

/* gemm_small over w in pairs of rows (interleave_pairs: rows 2i and 2i+1 as [k/8][2][8]), k a multiple of
 * 8. Two weight rows a pass halve the loads of x per FMA, and the pairs make the weights one sequential
 * stream (two rows read side by side from the plain layout ran at half the speed here). From 3 rows of x
 * the compute no longer hides the stream, so it is prefetched 2 KiB ahead (at 2 rows it cost more than it
 * gave). Each output's order is gemm_small's: its KK accumulators, then hsum (hsum4 sums 4 outputs at
 * once in that order), so the results are bitwise those of gemm_small on the plain w. An odd last row is
 * stored plainly at the end. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 16384  /* bytes; 2 KiB (as before 2026-12-07 evening) left the stream stalled at 4-8 rows here */
#endif
static inline __attribute__((always_inline)) void gemm_pairs(const float *x, int64_t ldx, const float *wi, float *y,
                                                             int64_t ldy, int64_t n, int64_t k, int accumulate,
                                                             const int R, const int KK) {
    const int64_t n2 = n & ~(int64_t)1, kb = k - k % (8 * KK);
    for (int64_t j = 0; j < n2; j += 2) {
        const float *wp = wi + j * k;
        v8 a[SMALL_ROWS][2][8];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < 2; q++)
                for (int u = 0; u < KK; u++) a[r][q][u] = splat(0.0f);
        for (int64_t c = 0; c < kb; c += 8 * KK) {
            if (R > 2)
                for (int p = 0; p < 2 * KK * 32; p += 64)
                    __builtin_prefetch((const char *)(wp + 2 * c) + p + PREFETCH_AHEAD, 0, 0);
            for (int u = 0; u < KK; u++) {
                const v8 w0 = load8(wp + 2 * (c + 8 * u)), w1 = load8(wp + 2 * (c + 8 * u) + 8);
                for (int r = 0; r < R; r++) {
                    const v8 xv = load8(x + r * ldx + c + 8 * u);
                    a[r][0][u] = fma8(w0, xv, a[r][0][u]);
                    a[r][1][u] = fma8(w1, xv, a[r][1][u]);
                }
            }
        }
        for (int64_t c = kb; c < k; c += 8) {  /* as gemm_small: the chunks past kb into the first accumulator */
            const v8 w0 = load8(wp + 2 * c), w1 = load8(wp + 2 * c + 8);
            for (int r = 0; r < R; r++) {
                const v8 xv = load8(x + r * ldx + c);
                a[r][0][0] = fma8(w0, xv, a[r][0][0]);
                a[r][1][0] = fma8(w1, xv, a[r][1][0]);
            }
        }
        v8 t[2 * SMALL_ROWS];
        for (int o = 0; o < 2 * R; o++) {
            t[o] = a[o / 2][o % 2][0];
            for (int u = 1; u < KK; u++) t[o] += a[o / 2][o % 2][u];
        }
        float s[2 * SMALL_ROWS];
        int o = 0;
        for (; o + 4 <= 2 * R; o += 4) hsum4(t[o], t[o + 1], t[o + 2], t[o + 3], s + o);
        for (; o < 2 * R; o++) s[o] = hsum(t[o]);
        for (o = 0; o < 2 * R; o++) {
            float *out = y + (o / 2) * ldy + j + o % 2;
            *out = accumulate ? *out + s[o] : s[o];
        }
    }
    if (n2 < n) gemm_small(x, ldx, wi + n2 * k, y + n2, ldy, 1, k, accumulate, R, KK);
}

/* gemm_pairs on 16-float registers (AVX-512; built unless MF_NARROW_PAIRS): a pair's two 8-float chunks lie
 * side by side in wi, so one 16-float load takes both and one FMA against x's chunk, broadcast to both
 * halves, does gemm_pairs' two. Each lane sees the same products and sums in the same order, so the results
 * are gemm_pairs' bit for bit, with half the FMA and weight-load instructions: at 3-8 rows of x the pass is
 * bound by its FMAs (a core that runs 512-bit FMAs at full width does twice the lanes a cycle). Where the
 * weights are `resident` (in L2: gemm_blocked's chunks after the first) a pass takes two pairs, which
 * shares each load of x between 4 outputs (1.1-1.3x there; from memory the two streams ran slower). */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(MF_NARROW_PAIRS)
#define WIDE_PAIRS 1
/* P (1 or 2) pairs of weight rows at once, from wp (pair p at wp + 2 p k), for R rows of x. */
static inline __attribute__((always_inline)) void pairs16_pass(const float *x, int64_t ldx, const float *wp, float *y,
                                                               int64_t ldy, int64_t k, int accumulate, const int R,
                                                               const int KK, const int P) {
    const int64_t kb = k - k % (8 * KK);
    __m512 a[2][SMALL_ROWS][8];
    for (int q = 0; q < P; q++)
        for (int r = 0; r < R; r++)
            for (int u = 0; u < KK; u++) a[q][r][u] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kb; c += 8 * KK) {
        if (R > 2)
            for (int q = 0; q < P; q++)
                for (int p = 0; p < 2 * KK * 32; p += 64)
                    __builtin_prefetch((const char *)(wp + 2 * q * k + 2 * c) + p + PREFETCH_AHEAD, 0, 0);
        for (int u = 0; u < KK; u++) {
            __m512 w01[2];
            for (int q = 0; q < P; q++) w01[q] = _mm512_loadu_ps(wp + 2 * q * k + 2 * (c + 8 * u));
            for (int r = 0; r < R; r++) {
                const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + c + 8 * u));
                for (int q = 0; q < P; q++) a[q][r][u] = _mm512_fmadd_ps(w01[q], xv, a[q][r][u]);
            }
        }
    }
    for (int64_t c = kb; c < k; c += 8)
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * ldx + c));
            for (int q = 0; q < P; q++)
                a[q][r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(wp + 2 * q * k + 2 * c), xv, a[q][r][0]);
        }
    for (int q = 0; q < P; q++) {
        v8 t[2 * SMALL_ROWS];
        for (int r = 0; r < R; r++) {
            __m512 s = a[q][r][0];
            for (int u = 1; u < KK; u++) s = _mm512_add_ps(s, a[q][r][u]);
            t[2 * r] = (v8)_mm512_castps512_ps256(s);
            t[2 * r + 1] = (v8)_mm512_extractf32x8_ps(s, 1);
        }
        float s[2 * SMALL_ROWS];
        int o = 0;
        for (; o + 4 <= 2 * R; o += 4) hsum4(t[o], t[o + 1], t[o + 2], t[o + 3], s + o);
        for (; o < 2 * R; o++) s[o] = hsum(t[o]);
        for (o = 0; o < 2 * R; o++) {
            float *out = y + (o / 2) * ldy + 2 * q + o % 2;
            *out = accumulate ? *out + s[o] : s[o];
        }
    }
}

static inline __attribute__((always_inline)) void gemm_pairs16(const float *x, int64_t ldx, const float *wi, float *y,
                                                               int64_t ldy, int64_t n, int64_t k, int accumulate,
                                                               const int R, const int KK, const int resident) {
    const int64_t n2 = n & ~(int64_t)1, n4 = resident ? n & ~(int64_t)3 : 0;
    int64_t j = 0;
    for (; j < n4; j += 4) pairs16_pass(x, ldx, wi + j * k, y + j, ldy, k, accumulate, R, KK, 2);
    for (; j < n2; j += 2) pairs16_pass(x, ldx, wi + j * k, y + j, ldy, k, accumulate, R, KK, 1);
    if (n2 < n) gemm_small(x, ldx, wi + n2 * k, y + n2, ldy, 1, k, accumulate, R, KK);
}
#define PAIRS(x, ldx, wi, y, ldy, n, k, acc, R, KK, res) gemm_pairs16(x, ldx, wi, y, ldy, n, k, acc, R, KK, res)
#else
#define WIDE_PAIRS 0
#define PAIRS(x, ldx, wi, y, ldy, n, k, acc, R, KK, res) gemm_pairs(x, ldx, wi, y, ldy, n, k, acc, R, KK)
#endif

int mf_wide_pairs(void) { return WIDE_PAIRS; }

/* The core's float32 FMA peak as this build can reach it (bench.decode_kernel's compute bound): `iters`
 * rounds of 12 independent FMA chains on the widest registers the GEMMs use, enough to cover the FMA
 * latency on every x86 core with two FMA pipes. Returns the FLOPs done; `out` keeps them from being
 * optimised away. */
double mf_fma_peak(int64_t iters, float *out) {
#if WIDE_PAIRS
    typedef __m512 vec;
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
    typedef __m256 vec;
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
    typedef v8 vec;
#define FMA(a, b, c) ((a) * (b) + (c))
#endif
    enum { CHAINS = 12, LANES = sizeof(vec) / sizeof(float) };
    vec acc[CHAINS], m, c;
    memset(&m, 0, sizeof m);
    memset(&c, 0, sizeof c);
    for (int i = 0; i < LANES; i++) ((float *)&m)[i] = 0.999999f, ((float *)&c)[i] = 1e-7f;
    for (int j = 0; j < CHAINS; j++) acc[j] = c;
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < CHAINS; j++) acc[j] = FMA(acc[j], m, c);
#undef FMA
    for (int j = 1; j < CHAINS; j++) acc[0] += acc[j];
    memcpy(out, &acc[0], sizeof(float));
    return 2.0 * CHAINS * LANES * (double)iters;
}

/* Up to SMALL_ROWS rows: gemm_pairs on w's pairs when given (wi), else gemm_small on the plain w; `resident`:
 * the weights are in cache (gemm_pairs16's two-pair passes). */
static void gemm_few_rows(const float *x, int64_t ldx, const float *w, const float *wi, float *y, int64_t ldy,
                          int64_t rows, int64_t n, int64_t k, int accumulate, int resident) {
#define FEW(R, KK) (wi ? (resident ? PAIRS(x, ldx, wi, y, ldy, n, k, accumulate, R, KK, 1)                 \
                               : PAIRS(x, ldx, wi, y, ldy, n, k, accumulate, R, KK, 0))                \
                       : gemm_small(x, ldx, w, y, ldy, n, k, accumulate, R, KK))
    switch (rows) {  /* constant R and KK: the compiler keeps the accumulators in registers */
        case 1: FEW(1, 8); break;
        case 2: FEW(2, 4); break;
        case 3: FEW(3, 3); break;
        case 4: FEW(4, 2); break;
        case 5: FEW(5, 2); break;
        case 6: FEW(6, 1); break;
        case 7: FEW(7, 1); break;
        default: FEW(8, 1); break;
    }
#undef FEW
}

/* Past SMALL_ROWS, up to BLOCKED_ROWS rows on w's pairs: gemm_few_rows over blocks of BLOCK_COLS weight rows,
 * each block taken by every chunk of SMALL_ROWS rows of x in turn. A block (64 x k floats: 144-384 KiB
 * here) stays in L2 while the chunks pass over it, so the weights still stream from memory once. Each
 * output is its chunk's gemm_few_rows sum: for a chunk of R rows, the order gemm_few_rows gives R rows
 * (resident or not: the same bits). */
#define BLOCKED_ROWS 64
#define BLOCK_COLS 64  /* even: a block starts on a pair */
static void gemm_blocked(const float *x, int64_t ldx, const float *wi, float *y, int64_t ldy, int64_t rows,
                         int64_t n, int64_t k, int accumulate) {
    for (int64_t j0 = 0; j0 < n; j0 += BLOCK_COLS) {
        const int64_t nb = n - j0 < BLOCK_COLS ? n - j0 : BLOCK_COLS;
        for (int64_t r0 = 0; r0 < rows; r0 += SMALL_ROWS) {
            const int64_t rr = rows - r0 < SMALL_ROWS ? rows - r0 : SMALL_ROWS;
            gemm_few_rows(x + r0 * ldx, ldx, NULL, wi + j0 * k, y + r0 * ldy + j0, ldy, rr, nb, k, accumulate, r0 > 0);
        }
    }
}

/* y[rows, n] (row stride ldy) = x[rows, k] (row stride ldx) w[n, k]^T (+ y when accumulate): gemm_few_rows up to
 * `small` (<= SMALL_ROWS) rows, else the transposed column-major GEMM, or MKL's compute on `packed` (w packed by mf_pack
 * for these rows) when given. */
static void linear(const float *x, int64_t ldx, const float *w, const float *wi, const float *packed, float *y,
                   int64_t rows, int64_t n, int64_t k, int64_t ldy, int accumulate, int64_t small) {
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (rows <= small && rows <= SMALL_ROWS) {
        gemm_few_rows(x, ldx, w, wi, y, ldy, rows, n, k, accumulate, 0);
        return;
    }
    if (rows <= small && wi) {
        gemm_blocked(x, ldx, wi, y, ldy, rows, n, k, accumulate);
        return;
    }
    if (packed) {
        cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, (int)rows, (int)n, (int)k, x, (int)ldx, packed, (int)k,
                            beta, y, (int)ldy);
        return;
    }
    const int m_ = (int)n, n_ = (int)rows, k_ = (int)k, lda = (int)k, ldb = (int)ldx, ldc = (int)ldy;
    sgemm_("T", "N", &m_, &n_, &k_, &one, w, &lda, x, &ldb, &beta, y, &ldc);
}

int64_t mf_small_rows(void) { return SMALL_ROWS; }
int64_t mf_blocked_rows(void) { return BLOCKED_ROWS; }

int mf_pack_available(void) { return cblas_sgemm_pack_get_size && cblas_sgemm_pack && cblas_sgemm_compute; }

/* Bytes of w [n, k] packed as the right-hand matrix of a product with `rows` rows. */
int64_t mf_pack_size(int64_t rows, int64_t n, int64_t k) {
    return (int64_t)cblas_sgemm_pack_get_size(B_MATRIX, (int)rows, (int)n, (int)k);
}

void mf_pack(int64_t rows, int64_t n, int64_t k, const float *w, float *dest) {
    cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, (int)rows, (int)n, (int)k, 1.0f, w, (int)k, dest);
}

static void rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        double ss = 0.0;
        for (int64_t j = 0; j < n; j++) ss += (double)xr[j] * xr[j];
        const float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (int64_t j = 0; j < n; j++) y[r * n + j] = w[j] * (xr[j] * inv);
    }
}

/* x*cos + roll(x, D/2)*signed_sin on each of `heads` heads of one row, as ops.apply_rope. */
static void rope(float *x, const float *cos, const float *sin, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
    float tmp[MAX_HEAD_DIM];
    for (int64_t hh = 0; hh < heads; hh++) {
        float *xh = x + hh * d;
        memcpy(tmp, xh, (size_t)d * sizeof(float));
        for (int64_t i = 0; i < half; i++) xh[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
        for (int64_t i = half; i < d; i++) xh[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
    }
}

/* Softmax attention of one key/value head's query group (q: groups x d, contiguous) over the n cache
 * rows kc, vc ([n, d]) that `valid` allows: per query head, its scores key by key, masked to -inf,
 * e^(s - max) (exactly 0 where masked), then the weighted sum of values key by key. With d a multiple
 * of 32 each 32-float chunk of a head is four named vectors: four independent add chains that stay
 * in registers (an array of accumulators would go through memory on every key). */
static void attend_group(const float *q, const float *kc, const float *vc, const uint8_t *valid, int64_t n,
                         int64_t groups, int64_t d, float *p, float *out) {
    const float scale = 1.0f / sqrtf((float)d);
    const int chunked = d % 32 == 0;
    for (int64_t g = 0; g < groups; g++) {
        const float *qg = q + g * d;
        float mx = -INFINITY;
        for (int64_t s = 0; s < n; s++) {
            const float *ks = kc + s * d;
            float dot = 0.0f;
            if (chunked) {
                dot = hsum(dot_lanes(qg, ks, d));
            } else {
                for (int64_t i = 0; i < d; i++) dot += qg[i] * ks[i];
            }
            p[s] = valid[s] ? dot * scale : -INFINITY;
            mx = p[s] > mx ? p[s] : mx;
        }
        int64_t s = 0;
        float den = 0.0f;
        for (; s + 8 <= n; s += 8) {
            const v8 e = exp8(load8(p + s) - splat(mx));
            store8(p + s, e);
            den += hsum(e);
        }
        for (; s < n; s++) {
            p[s] = valid[s] ? expf(p[s] - mx) : 0.0f;
            den += p[s];
        }
        const float inv = 1.0f / den;
        float *og = out + g * d;
        if (chunked) {
            for (int64_t c = 0; c < d; c += 32) {
                v8 a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
                for (s = 0; s < n; s++) {
                    const float *vs = vc + s * d + c;
                    const v8 e = splat(p[s]);
                    a0 += e * load8(vs);
                    a1 += e * load8(vs + 8);
                    a2 += e * load8(vs + 16);
                    a3 += e * load8(vs + 24);
                }
                store8(og + c, a0 * splat(inv));
                store8(og + c + 8, a1 * splat(inv));
                store8(og + c + 16, a2 * splat(inv));
                store8(og + c + 24, a3 * splat(inv));
            }
        } else {
            for (int64_t i = 0; i < d; i++) {
                float a = 0.0f;
                for (s = 0; s < n; s++) a += p[s] * vc[s * d + i];
                og[i] = a * inv;
            }
        }
    }
}

/* Each computed row's T queries (token j at cache column col + j) over the columns 0..col + j that key_valid
 * allows: causal within the block when the caller has marked the block's columns valid. Computed row i is
 * the plan's row rows[i] (rows NULL: row i), whose cache and mask it reads. */
static void attend(const Model *m, int64_t layer, int64_t col, const int64_t *rows, int64_t n_rows) {
    const int64_t d = m->head_dim, hkv = m->kv_heads, groups = m->heads / hkv, s_len = m->max_len, T = m->block;
    const int64_t ld = (m->heads + 2 * hkv) * d;
    for (int64_t ri = 0; ri < n_rows; ri++) {
        const int64_t r = rows ? rows[ri] : ri;
        for (int64_t j = 0; j < T; j++) {
            const int64_t i = ri * T + j;
            for (int64_t kh = 0; kh < hkv; kh++)
                attend_group(m->qkv + i * ld + kh * groups * d, m->k_cache[layer] + (r * hkv + kh) * s_len * d,
                             m->v_cache[layer] + (r * hkv + kh) * s_len * d, m->key_valid + r * s_len,
                             col + j + 1, groups, d, m->scores, m->att + (i * m->heads + kh * groups) * d);
        }
    }
}

/* gate <- silu(gate) * up, in place over each row's [gate | up] halves. */
static void swiglu(float *gu, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        float *g = gu + r * 2 * inter, *u = g + inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            const v8 x = load8(g + i);
            store8(g + i, x / (splat(1.0f) + exp8(-x)) * load8(u + i));
        }
        for (; i < inter; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

int64_t mf_max_head_dim(void) { return MAX_HEAD_DIM; }

/* One forward of T = m->block tokens for each of n_rows rows, tokens [n_rows, T]: computed row i is the
 * plan's row p = rows[i] (rows NULL: i), so rows that have finished cost nothing. Its token j sits at cache
 * column col + j of row p and takes rope table entry t0[i] + j of row p (t0 NULL: t for every row). Writes
 * the tokens' keys/values into the caches and their logits [n_rows*T, V]. The weights packed for B*T rows
 * serve only a product of B*T rows; fewer rows take the few-row GEMM or the plain BLAS call. Returns 0; 1
 * when a column, table entry or row lies outside the plan; 2 for a token outside the vocabulary. */
static int forward(const Model *m, const int64_t *tokens, const int64_t *t0, int64_t t, int64_t col, float *logits,
                   const int64_t *rows, int64_t n_rows, int last_only) {
    const int64_t T = m->block, M = n_rows * T, H = m->hidden, D = m->head_dim, nq = m->heads * D;
    const int64_t nkv = m->kv_heads * D, I = m->inter, S = m->max_len, ld = nq + 2 * nkv;
    const int full = n_rows == m->rows;  /* the packed copies' row count */
    if (D > MAX_HEAD_DIM || col < 0 || col + T > S || n_rows < 0 || n_rows > m->rows) return 1;
    for (int64_t i = 0; i < n_rows; i++) {
        const int64_t tr = t0 ? t0[i] : t;
        if (tr < 0 || tr + T > m->n_new || (rows && (rows[i] < 0 || rows[i] >= m->rows))) return 1;
    }
    for (int64_t i = 0; i < M; i++)
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return 2;
    for (int64_t i = 0; i < M; i++) memcpy(m->x + i * H, m->embed + tokens[i] * H, (size_t)H * sizeof(float));
    for (int64_t l = 0; l < m->layers; l++) {
        rms_norm(m->x, m->attn_norm[l], m->h, M, H, m->eps);
        linear(m->h, H, m->wqkv[l], m->wqkv_i ? m->wqkv_i[l] : NULL, full && m->wqkv_p ? m->wqkv_p[l] : NULL, m->qkv,
               M, ld, H, ld, 0, m->small_rows);
        for (int64_t i = 0; i < M; i++) {
            const int64_t ri = i / T, j = i % T, r = rows ? rows[ri] : ri;
            const int64_t e = r * m->n_new + (t0 ? t0[ri] : t) + j;
            float *row = m->qkv + i * ld;
            if (m->bqkv[l])
                for (int64_t c = 0; c < ld; c++) row[c] += m->bqkv[l][c];
            rope(row, m->cos + e * D, m->sin + e * D, m->heads + m->kv_heads, D);  /* q heads, then k heads */
            for (int64_t kh = 0; kh < m->kv_heads; kh++) {
                const int64_t off = ((r * m->kv_heads + kh) * S + col + j) * D;
                memcpy(m->k_cache[l] + off, row + nq + kh * D, (size_t)D * sizeof(float));
                memcpy(m->v_cache[l] + off, row + nq + nkv + kh * D, (size_t)D * sizeof(float));
            }
        }
        attend(m, l, col, rows, n_rows);
        /* x += attention output */
        linear(m->att, nq, m->wo[l], m->wo_i ? m->wo_i[l] : NULL, full && m->wo_p ? m->wo_p[l] : NULL, m->x, M, H,
               nq, H, 1, m->small_rows);
        rms_norm(m->x, m->mlp_norm[l], m->h, M, H, m->eps);
        linear(m->h, H, m->wgu[l], m->wgu_i ? m->wgu_i[l] : NULL, full && m->wgu_p ? m->wgu_p[l] : NULL, m->gu, M,
               2 * I, H, 2 * I, 0, m->small_rows);
        swiglu(m->gu, M, I);
        /* x += MLP output: the gate halves of gu are the [M, I] input at row stride 2I */
        linear(m->gu, 2 * I, m->w_down[l], m->w_down_i ? m->w_down_i[l] : NULL,
               full && m->w_down_p ? m->w_down_p[l] : NULL, m->x, M, H, I, H, 1, m->small_rows);
    }
    if (!logits) return 0;  /* the caches only (a draft's plain step: its proposal is unused) */
    if (last_only) {  /* a prefill samples from each row's last token alone: the head over n_rows rows, not M */
        for (int64_t i = 0; i < n_rows; i++)
            rms_norm(m->x + (i * T + T - 1) * H, m->final_norm, m->h + i * H, 1, H, m->eps);
        linear(m->h, H, m->lm_head, m->lm_head_i, NULL, logits, n_rows, m->vocab, H, m->vocab, 0, m->small_rows);
        return 0;
    }
    rms_norm(m->x, m->final_norm, m->h, M, H, m->eps);
    linear(m->h, H, m->lm_head, m->lm_head_i, full ? m->lm_head_p : NULL, logits, M, m->vocab, H, m->vocab, 0,
           m->small_rows);
    return 0;
}

/* Decode step t (cache column col) for tokens [B] of a one-token plan (block 1). */
int mf_decode_step(const Model *m, const int64_t *tokens, int64_t t, int64_t col, float *logits) {
    if (m->block != 1) return 1;
    return forward(m, tokens, NULL, t, col, logits, NULL, m->rows, 0);
}

/* A block step (tokens [n_rows, block] of the plan's rows `rows`, NULL: all B; computed row i's first token at
 * rope entry t0[i]), e.g. a speculative verify forward over the rows still decoding. Logits [n_rows*block, V],
 * [n_rows, V] of each row's last token with last_only (a prefill), or none (logits NULL): the tokens' keys and
 * values only. */
int mf_block_step(const Model *m, const int64_t *tokens, const int64_t *t0, int64_t col, float *logits,
                  const int64_t *rows, int64_t n_rows, int last_only) {
    if (rows && n_rows <= 0) return 0; /* no row left: nothing to compute (gemm_few_rows takes 1 row or more) */
    return forward(m, tokens, t0, 0, col, logits, rows, rows ? n_rows : m->rows, last_only);
}

/* One token per row of logits [B, V] at temperature T, as miles_fn.sampling.sample_with_uniform without
 * top-k/top-p: logp = (x/T - max) - log(sum e^(x/T - max)); greedy (u == NULL) takes the first argmax,
 * otherwise the first token whose float64 cumulative probability, divided by the total, exceeds u[r].
 * Writes the token to tok[r * stride] and its logp to lp[r * stride]; work holds 2V floats. */
static void sample(int64_t rows, int64_t V, const float *logits, const double *u, float temperature, int64_t *tok,
                   float *lp, int64_t stride, float *work) {
    float *scaled = work, *prob = work + V;
    for (int64_t r = 0; r < rows; r++) {
        const float *lr = logits + r * V;
        float mx = -INFINITY;
        int64_t arg = 0;
        for (int64_t j = 0; j < V; j++) {
            scaled[j] = lr[j] / temperature;
            if (scaled[j] > mx) { mx = scaled[j]; arg = j; }
        }
        float sum = 0.0f;
        int64_t j = 0;
        for (; j + 8 <= V; j += 8) sum += hsum(exp8(load8(scaled + j) - splat(mx)));
        for (; j < V; j++) sum += expf(scaled[j] - mx);
        const float lse = logf(sum);
        if (u) {
            j = 0;
            for (; j + 8 <= V; j += 8) store8(prob + j, exp8(load8(scaled + j) - splat(mx) - splat(lse)));
            for (; j < V; j++) prob[j] = expf(scaled[j] - mx - lse);
            double total = 0.0;
            for (j = 0; j < V; j++) total += (double)prob[j];
            double cdf = 0.0;
            arg = V - 1;
            for (j = 0; j < V; j++) {
                cdf += (double)prob[j];
                if (cdf / total > u[r]) { arg = j; break; }
            }
        }
        tok[r * stride] = arg;
        lp[r * stride] = (scaled[arg] - mx) - lse;
    }
}

/* The same sampler over `rows` rows of logits [rows, V] (u [rows] or NULL), tok/lp [rows]. */
void mf_sample_rows(int64_t rows, int64_t V, const float *logits, const double *u, float temperature, int64_t *tok,
                    float *lp, float *work) {
    sample(rows, V, logits, u, temperature, tok, lp, 1, work);
}

/* generate's decode loop for plain temperature (or greedy, u == NULL) sampling: step t samples column t
 * of tok/lp [B, n_new] from logits (the prefill's on entry; the plan's buffer after), then, unless it is
 * the last, runs the decode step of those tokens at cache column first_col + t. With stop tokens a row
 * that has sampled one emits 0 (log-prob 0) from then on and leaves the batch: the steps after compute
 * only the rows still decoding (the tail of a batch costs what its live rows cost), and the loop ends
 * when none is left; n_out counts each row's tokens, its stop token included. `work` holds 2V floats,
 * `live` B bytes, `step_tok` 2B int64 (the step's tokens, then the live rows). Returns 0, or forward's
 * error code. */
int mf_generate(const Model *m, float *logits, const double *u, float temperature, const int64_t *stop,
                int64_t n_stop, int64_t first_col, int64_t *tok, float *lp, int64_t *n_out, float *work,
                uint8_t *live, int64_t *step_tok) {
    const int64_t B = m->rows, n = m->n_new, V = m->vocab;
    int64_t *act = step_tok + B, n_act = B;  /* logits row i belongs to plan row act[i] */
    for (int64_t r = 0; r < B; r++) { live[r] = 1; n_out[r] = 0; act[r] = r; }
    for (int64_t t = 0; t < n; t++) {
        for (int64_t r = 0; r < B; r++) { tok[r * n + t] = 0; lp[r * n + t] = 0.0f; }
        int64_t kept = 0;
        for (int64_t i = 0; i < n_act; i++) {
            const int64_t r = act[i];
            sample(1, V, logits + i * V, u ? u + t * B + r : NULL, temperature, tok + r * n + t, lp + r * n + t, 1,
                   work);
            n_out[r]++;
            for (int64_t j = 0; j < n_stop; j++)
                if (tok[r * n + t] == stop[j]) live[r] = 0;
            if (live[r]) { act[kept] = r; step_tok[kept] = tok[r * n + t]; kept++; }
        }
        n_act = kept;
        if (t == n - 1 || n_act == 0) break;
        const int rc = forward(m, step_tok, NULL, t, first_col + t, logits, n_act == B ? NULL : act, n_act, 0);
        if (rc) return rc;
    }
    return 0;
}
