/* dyngen's native CPU kernels: block-quantized matmuls and the small per-layer ops.
 *
 * Built at first use by kernels/native/native_library.py with -O3 -march=native -fopenmp and
 * called through ctypes with raw pointers; every array is contiguous and float32 unless
 * named otherwise. OpenMP here is the same runtime as torch's (the soname is already
 * loaded by torch when this library loads), so the two share one thread pool.
 *
 * Matmuls work on blocks of 32 values along the input dimension:
 *   weights   block_q4: w = d * q + m, q in 0..15 (GGUF Q4_1; Q4_0 is m = -8 d)
 *             block_q8: w = d * q, q in -127..127 (GGUF Q8_0)
 *   inputs    quantized per call, per row and block: x ~= s * q, q in -127..127, with
 *             s * sum(q) kept for the q4 offset term.
 * So a block's dot product is integer (u8 x s8 or s8 x s8 products summed in 32 bits)
 * scaled once by d * s: the arithmetic of llama.cpp's Q4_1 x Q8_1 path, which reads a
 * quarter of float32's weight bytes and runs 32 multiply-adds per instruction.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define DG_AVX2 1
#endif
/* 512-bit integer dot products (vpdpbusd on zmm): the 8-row block layouts are read two groups
 * (16 output rows) per register. */
#if defined(DG_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DG_AVX512 1
#endif

/* A float16 value (its bits) as float32. */
static inline float dg_half(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal */
    } else if (exp == 31) {
        f = man ? NAN : INFINITY;
    } else {
        f = ldexpf((float)(man | 0x400), (int)exp - 25);
    }
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits |= sign;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* float32 to float16 bits, rounding to nearest even (as F16C's vcvtps2ph and torch's .half()). */
static inline uint16_t dg_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? 0x200 : 0)); /* inf, nan */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds past 65504: inf */
    if (ax < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (ax < 0x33000000u) return sign; /* under half the smallest subnormal */
        /* value = m * 2^(e - 150) = (m >> (126 - e)) units of 2^-24, the subnormal's unit */
        const uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u, drop = 126 - e;
        const uint32_t q = m >> drop, rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
        return (uint16_t)(sign | (q + (rest > half || (rest == half && (q & 1u)))));
    }
    const uint32_t q = ((ax >> 13) - (112u << 10)), rest = ax & 0x1FFFu; /* rebias 127 -> 15 */
    return (uint16_t)(sign | (q + (rest > 0x1000u || (rest == 0x1000u && (q & 1u)))));
#endif
}

/* A bfloat16 value (its bits) as float32: the top half of its bits. */
static inline float dg_bf16(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 to bfloat16 bits, rounding to nearest even (as torch's .bfloat16()); a NaN stays a NaN. */
static inline uint16_t dg_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* x [n] float32 -> bfloat16 bits, as the decoder layer writes a bfloat16 cache: dg_to_bf16 without
 * a branch, so the loop vectorizes. */
void dg_to_bf16_array(const float *x, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, 4);
        const uint32_t nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
        out[i] = (uint16_t)(nan ? (b >> 16) | 0x40u : (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
}

/* The K/V cache's element types (kv_kind below). */
#define DG_KV_F32 0
#define DG_KV_F16 1
#define DG_KV_BF16 2
#define DG_KV_I8 3 /* int8 with a float16 scale per (page, head, slot) */

/* x [n] float32 -> float16 bits, as the decoder layer writes a float16 cache: 8 at a time where F16C
 * converts vectors (the same rounding as its one-value form, dg_to_half). */
void dg_to_half_array(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = dg_to_half(x[i]);
}

#define QK 32

typedef struct {
    float d;
    float m;
    uint8_t qs[16]; /* byte j: value j in the low nibble, value j + 16 in the high nibble */
} block_q4;

typedef struct {
    float d;
    int8_t qs[QK];
} block_q8;

/* A thread's scratch buffer, kept between calls: grown to `bytes` when that is more than it has
 * (the old contents are not kept), never shrunk. NULL if out of memory (the old buffer stays). */
typedef struct {
    void *buf;
    size_t cap;
} dg_tls_buf;

static void dg_release(dg_tls_buf *t) {
    free(t->buf);
    t->buf = NULL, t->cap = 0;
}

static void *dg_grow(dg_tls_buf *t, size_t bytes) {
    if (bytes > t->cap) {
        void *buf = malloc(bytes);
        if (!buf) return NULL;
        free(t->buf);
        t->buf = buf, t->cap = bytes;
    }
    return t->buf;
}

int dg_block_q4_size(void) { return (int)sizeof(block_q4); }
int dg_block_q8_size(void) { return (int)sizeof(block_q8); }

/* Software prefetch of the weights a thread reads next. The hardware prefetchers did not run far
 * enough ahead of a matmul's tasks: each task's first pass over its weights waited on memory, and
 * the step lost most on a host with little bandwidth to spare. Block b's share of a region laid
 * out as blocks of `bytes` each (NULL: nothing), into L2 (into L1 measured the same). */
static inline void dg_prefetch_block(const char *pf, int64_t bytes, int64_t b) {
    if (!pf) return;
    const char *p = pf + b * bytes;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

/* A task's weights two groups ahead of group g (what this thread reads next under a static
 * schedule), for dg_prefetch_block; NULL past the end. */
#define DG_AHEAD(g, groups, w, nb) ((g) + 2 < (groups) ? (const char *)((w) + ((g) + 2) * (nb)) : NULL)

int dg_simd(void) {
#if defined(DG_AVX512)
    return 4; /* 512-bit VNNI block matmuls, AVX2 code for the rest */
#elif defined(DG_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return 3; /* AVX2 code with 256-bit VNNI dot products */
#elif defined(DG_AVX2) && defined(__AVXVNNI__)
    return 2;
#elif defined(DG_AVX2)
    return 1;
#else
    return 0; /* portable scalar code */
#endif
}

/* ---- peak arithmetic rates, for the benchmarks' "% of peak" ---------------------------------------
 * Twelve independent accumulators in registers, on every thread at once: the rate of the
 * instruction this build's kernels use, with nothing else in the way. kind 0: int8 products
 * (vpdpbusd, or vpmaddubsw where the build has no VNNI), counted as 2 ops per product; 1: float32
 * FMA; 2: bfloat16 pair dot products (vdpbf16ps), 2 flops per product. Returns ops per second
 * summed over the threads, or 0 where the build has no such instruction. */
#define DG_R12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

static double dg_now(void) {
#if defined(_OPENMP)
    return omp_get_wtime();
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

double dg_peak(int kind, int64_t iters) {
    double ops_per_iter = 0.0;
#if defined(DG_AVX512)
    ops_per_iter = kind == 0 ? 12.0 * 128 : kind == 1 ? 12.0 * 32 : 0.0;
#if defined(__AVX512BF16__)
    if (kind == 2) ops_per_iter = 12.0 * 64;
#endif
#elif defined(DG_AVX2)
    ops_per_iter = kind == 0 ? 12.0 * 64 : kind == 1 ? 12.0 * 16 : 0.0;
#endif
    if (ops_per_iter == 0.0) return 0.0;
    int threads = 1;
    const double t0 = dg_now();
#pragma omp parallel
    {
#if defined(_OPENMP)
#pragma omp single
        threads = omp_get_num_threads();
#endif
        int32_t sink = 0;
#if defined(DG_AVX512)
        if (kind == 0) {
            __m512i u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);
#define DG_PI(i) __m512i a##i = _mm512_set1_epi32(i);
#define DG_PO(i) a##i = _mm512_dpbusd_epi32(a##i, u, v);
#define DG_PS(i) sink += _mm512_reduce_add_epi32(a##i);
            DG_R12(DG_PI)
            for (int64_t n = 0; n < iters; n++) {
                DG_R12(DG_PO)
                __asm__ volatile("" : "+v"(u));
            }
            DG_R12(DG_PS)
#undef DG_PI
#undef DG_PO
#undef DG_PS
        } else {
            __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
#define DG_PI(i) __m512 f##i = _mm512_set1_ps((float)i);
#define DG_PS(i) sink += (int32_t)_mm512_reduce_add_ps(f##i);
            DG_R12(DG_PI)
            if (kind == 1) {
#define DG_PO(i) f##i = _mm512_fmadd_ps(f##i, x, y);
                for (int64_t n = 0; n < iters; n++) {
                    DG_R12(DG_PO)
                    __asm__ volatile("" : "+v"(x));
                }
#undef DG_PO
            }
#if defined(__AVX512BF16__)
            else {
                __m512bh p = (__m512bh)_mm512_set1_epi16(0x3f80);
#define DG_PO(i) f##i = _mm512_dpbf16_ps(f##i, p, p);
                for (int64_t n = 0; n < iters; n++) {
                    DG_R12(DG_PO)
                    __asm__ volatile("" : "+v"(p));
                }
#undef DG_PO
            }
#endif
            DG_R12(DG_PS)
#undef DG_PI
#undef DG_PS
        }
#elif defined(DG_AVX2)
        if (kind == 0) {
            __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
#define DG_PI(i) __m256i a##i = _mm256_set1_epi16(i);
#define DG_PO(i) a##i = _mm256_add_epi16(a##i, _mm256_maddubs_epi16(u, v));
#define DG_PS(i) sink += _mm256_extract_epi16(a##i, 0);
            DG_R12(DG_PI)
            for (int64_t n = 0; n < iters; n++) {
                DG_R12(DG_PO)
                __asm__ volatile("" : "+x"(u));
            }
            DG_R12(DG_PS)
#undef DG_PI
#undef DG_PO
#undef DG_PS
        } else {
            __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
#define DG_PI(i) __m256 f##i = _mm256_set1_ps((float)i);
#define DG_PO(i) f##i = _mm256_fmadd_ps(f##i, x, y);
#define DG_PS(i) sink += (int32_t)_mm256_cvtss_f32(f##i);
            DG_R12(DG_PI)
            for (int64_t n = 0; n < iters; n++) {
                DG_R12(DG_PO)
                __asm__ volatile("" : "+x"(x));
            }
            DG_R12(DG_PS)
#undef DG_PI
#undef DG_PO
#undef DG_PS
        }
#endif
        __asm__ volatile("" : : "r"(sink));
    }
    return ops_per_iter * (double)iters * threads / (dg_now() - t0);
}

/* ---- activation quantization ---------------------------------------------------- */

/* x [rows, k] -> q [rows, k] int8, s and ssum [rows, k / 32]. Rounds half to even. */
/* One row of k values (k a multiple of 32) into q, and its blocks' scales and scaled sums. */
static inline void dg_quantize_row(const float *x, int64_t k, int8_t *q, float *s, float *ssum) {
    const int64_t nb = k / QK;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = q + b * QK;
#if defined(DG_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, id), rnd));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, id), rnd));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, id), rnd));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, id), rnd));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        /* packs work within 128-bit lanes; the permute restores element order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)qb, p);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
        const int isum = _mm_cvtsi128_si32(s4);
#else
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float d = amax / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        int isum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)nearbyintf(xb[i] * id);
            qb[i] = (int8_t)v;
            isum += v;
        }
#endif
        s[b] = d;
        ssum[b] = d * (float)isum;
    }
}

void dg_quantize_q8(const float *x, int64_t rows, int64_t k, int8_t *q, float *s, float *ssum) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static) if (rows * k >= 32768)
    for (int64_t r = 0; r < rows; r++) dg_quantize_row(x + r * k, k, q + r * k, s + r * nb, ssum + r * nb);
}

/* ---- block dot products ----------------------------------------------------------- */

#if defined(DG_AVX2)
static inline __m256i dg_dot_u8s8(__m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#else
    /* u8 x s8 pairs summed in 16 bits: at most 2 * 15 * 127 (q4) or 2 * 127 * 127 (q8), no saturation */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

static inline __m256i dg_unpack_q4(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m128i low = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
}

static inline float dg_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* A tile is R rows of x against one weight row; R is a compile-time constant in each
 * instance, so the accumulators stay in registers. One row (a decode step) splits its
 * blocks over two accumulator chains to hide the multiply-add latency. */
#define RT 4

#if defined(DG_AVX2)
#define DG_Q4_TILE(R)                                                                                  \
    static inline void dg_q4_tile_##R(const block_q4 *wr, int64_t nb, int64_t k, const int8_t *qx,      \
                                      const float *sx, const float *ssum, float *y, int64_t n) {       \
        __m256 acc[R], acc2[R];                                                                        \
        float off[R], off2[R];                                                                         \
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_ps(), off[r] = off2[r] = 0.0f; \
        int64_t b = 0;                                                                                 \
        if (R == 1) {                                                                                  \
            for (; b + 1 < nb; b += 2) {                                                               \
                const __m256i w0 = dg_unpack_q4(wr[b].qs), w1 = dg_unpack_q4(wr[b + 1].qs);            \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + b * QK));                 \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + b * QK + QK));            \
                acc[0] = _mm256_fmadd_ps(_mm256_set1_ps(wr[b].d * sx[b]),                              \
                                         _mm256_cvtepi32_ps(dg_dot_u8s8(w0, x0)), acc[0]);             \
                acc2[0] = _mm256_fmadd_ps(_mm256_set1_ps(wr[b + 1].d * sx[b + 1]),                     \
                                          _mm256_cvtepi32_ps(dg_dot_u8s8(w1, x1)), acc2[0]);           \
                off[0] += wr[b].m * ssum[b];                                                           \
                off2[0] += wr[b + 1].m * ssum[b + 1];                                                  \
            }                                                                                          \
        }                                                                                              \
        for (; b < nb; b++) {                                                                          \
            const __m256i wq = dg_unpack_q4(wr[b].qs);                                                 \
            const float d = wr[b].d, mo = wr[b].m;                                                     \
            for (int r = 0; r < R; r++) {                                                              \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + r * k + b * QK));         \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * sx[r * nb + b]),                           \
                                         _mm256_cvtepi32_ps(dg_dot_u8s8(wq, xq)), acc[r]);             \
                off[r] += mo * ssum[r * nb + b];                                                       \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) y[r * n] = dg_hsum(_mm256_add_ps(acc[r], acc2[r])) + off[r] + off2[r]; \
    }

#define DG_Q8_TILE(R)                                                                                  \
    static inline void dg_q8_tile_##R(const block_q8 *wr, int64_t nb, int64_t k, const int8_t *qx,      \
                                      const float *sx, float *y, int64_t n) {                          \
        __m256 acc[R], acc2[R];                                                                        \
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = _mm256_setzero_ps();                           \
        int64_t b = 0;                                                                                 \
        if (R == 1) {                                                                                  \
            for (; b + 1 < nb; b += 2) {                                                               \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)wr[b].qs);                      \
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)wr[b + 1].qs);                  \
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + b * QK));                 \
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(qx + b * QK + QK));            \
                acc[0] = _mm256_fmadd_ps(                                                              \
                    _mm256_set1_ps(wr[b].d * sx[b]),                                                   \
                    _mm256_cvtepi32_ps(dg_dot_u8s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0))), \
                    acc[0]);                                                                           \
                acc2[0] = _mm256_fmadd_ps(                                                             \
                    _mm256_set1_ps(wr[b + 1].d * sx[b + 1]),                                           \
                    _mm256_cvtepi32_ps(dg_dot_u8s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1))), \
                    acc2[0]);                                                                          \
            }                                                                                          \
        }                                                                                              \
        for (; b < nb; b++) {                                                                          \
            const __m256i wq = _mm256_loadu_si256((const __m256i *)wr[b].qs);                          \
            const __m256i wa = _mm256_sign_epi8(wq, wq); /* |w|; x takes w's sign instead */           \
            const float d = wr[b].d;                                                                   \
            for (int r = 0; r < R; r++) {                                                              \
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + r * k + b * QK));         \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * sx[r * nb + b]),                           \
                                         _mm256_cvtepi32_ps(dg_dot_u8s8(wa, _mm256_sign_epi8(xq, wq))), \
                                         acc[r]);                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) y[r * n] = dg_hsum(_mm256_add_ps(acc[r], acc2[r]));               \
    }
#else
#define DG_Q4_TILE(R)                                                                                  \
    static inline void dg_q4_tile_##R(const block_q4 *wr, int64_t nb, int64_t k, const int8_t *qx,      \
                                      const float *sx, const float *ssum, float *y, int64_t n) {       \
        for (int r = 0; r < R; r++) {                                                                  \
            float acc = 0.0f;                                                                          \
            for (int64_t b = 0; b < nb; b++) {                                                         \
                const int8_t *xb = qx + r * k + b * QK;                                                \
                int isum = 0;                                                                          \
                for (int i = 0; i < 16; i++)                                                           \
                    isum += (wr[b].qs[i] & 0x0F) * xb[i] + (wr[b].qs[i] >> 4) * xb[i + 16];            \
                acc += wr[b].d * sx[r * nb + b] * (float)isum + wr[b].m * ssum[r * nb + b];            \
            }                                                                                          \
            y[r * n] = acc;                                                                            \
        }                                                                                              \
    }

#define DG_Q8_TILE(R)                                                                                  \
    static inline void dg_q8_tile_##R(const block_q8 *wr, int64_t nb, int64_t k, const int8_t *qx,      \
                                      const float *sx, float *y, int64_t n) {                          \
        for (int r = 0; r < R; r++) {                                                                  \
            float acc = 0.0f;                                                                          \
            for (int64_t b = 0; b < nb; b++) {                                                         \
                const int8_t *xb = qx + r * k + b * QK;                                                \
                int isum = 0;                                                                          \
                for (int i = 0; i < QK; i++) isum += wr[b].qs[i] * xb[i];                              \
                acc += wr[b].d * sx[r * nb + b] * (float)isum;                                         \
            }                                                                                          \
            y[r * n] = acc;                                                                            \
        }                                                                                              \
    }
#endif

DG_Q4_TILE(1)
DG_Q4_TILE(2)
DG_Q4_TILE(3)
DG_Q4_TILE(4)
DG_Q8_TILE(1)
DG_Q8_TILE(2)
DG_Q8_TILE(3)
DG_Q8_TILE(4)

/* y [m, n] = x [m, k] . w [n, k]^T with w in q4 blocks [n, k / 32] and x quantized by dg_quantize_q8. */
void dg_matmul_q4(const block_q4 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx,
                  const float *ssum, int64_t m, float *y) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const block_q4 *wr = w + j * nb;
        int64_t r = 0;
        for (; r + RT <= m; r += RT) dg_q4_tile_4(wr, nb, k, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + j, n);
        switch (m - r) {
            case 3: dg_q4_tile_3(wr, nb, k, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + j, n); break;
            case 2: dg_q4_tile_2(wr, nb, k, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + j, n); break;
            case 1: dg_q4_tile_1(wr, nb, k, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + j, n); break;
            default: break;
        }
    }
}

/* y [m, n] = x [m, k] . w [n, k]^T with w in q8 blocks [n, k / 32]. */
void dg_matmul_q8(const block_q8 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx, int64_t m,
                  float *y) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const block_q8 *wr = w + j * nb;
        int64_t r = 0;
        for (; r + RT <= m; r += RT) dg_q8_tile_4(wr, nb, k, qx + r * k, sx + r * nb, y + r * n + j, n);
        switch (m - r) {
            case 3: dg_q8_tile_3(wr, nb, k, qx + r * k, sx + r * nb, y + r * n + j, n); break;
            case 2: dg_q8_tile_2(wr, nb, k, qx + r * k, sx + r * nb, y + r * n + j, n); break;
            case 1: dg_q8_tile_1(wr, nb, k, qx + r * k, sx + r * nb, y + r * n + j, n); break;
            default: break;
        }
    }
}

/* ---- AMX tiles: the process's grant and the switches ---------------------------------------------- */
#if defined(DG_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__linux__)
#define DG_AMX 1
#include <sys/syscall.h>
long syscall(long number, ...); /* unistd.h declares it only past strict C11 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} dg_tile_config;

static int dg_amx_granted = -1; /* -1 not asked yet, 0 refused, 1 granted */
static int dg_amx_off = 0;      /* DG_TILES_* bits switched off for this process */

/* The kernel must grant the process the tile registers' state (Linux: ARCH_REQ_XCOMP_PERM for
 * XTILEDATA) before any thread uses them; asked once. */
static int dg_amx_usable(void) {
    int s = __atomic_load_n(&dg_amx_granted, __ATOMIC_ACQUIRE);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        __atomic_store_n(&dg_amx_granted, s, __ATOMIC_RELEASE);
    }
    return s;
}
#endif

#define DG_TILES_ATTENTION 1
#define DG_TILES_LINEARS 2

/* Whether the tile paths in `which` (DG_TILES_* bits) run; on < 0 only asks, 0 switches them off
 * for this process, 1 back on where the build, CPU and OS allow (tests and benchmarks compare the
 * tiles with the vectors, which give the same bits for the linears). */
int dg_set_amx(int which, int on) {
#if defined(DG_AMX)
    if (on == 0) __atomic_fetch_or(&dg_amx_off, which, __ATOMIC_ACQ_REL);
    if (on > 0) __atomic_fetch_and(&dg_amx_off, ~which, __ATOMIC_ACQ_REL);
    return !(__atomic_load_n(&dg_amx_off, __ATOMIC_ACQUIRE) & which) && dg_amx_usable();
#else
    (void)which, (void)on;
    return 0;
#endif
}

/* ---- 8-row interleaved q4 blocks: one vector lane per output row ----------------------------
 *
 * block_q4x8 holds one block of 32 inputs for 8 consecutive output rows: their d and m (float16,
 * as GGUF stores them: a decode step streams every weight byte, and these are a sixth), then
 * 4 chunks of 32 bytes. Chunk c holds, for row i, bytes 4i..4i+3 = inputs 4c..4c+3 in the low
 * nibbles and inputs 4c+16..4c+19 in the high nibbles. One load and two masks give 8 rows x 4
 * inputs twice; a broadcast of 4 activation bytes multiplies all 8 rows at once, so the sums
 * land one row per lane and a tile's 8 results are stored as they are: no horizontal sums,
 * and each weight chunk serves every input row of the tile (R) from registers.
 * u8 x s8 pairs are at most 2 * 15 * 127 = 3810, so a block's 8 pair sums fit in 16 bits. */
typedef struct {
    uint16_t d[8];
    uint16_t m[8];
    uint8_t qs[128];
} block_q4x8;

int dg_block_q4x8_size(void) { return (int)sizeof(block_q4x8); }

/* block_q8x8: one block of 32 inputs for 8 consecutive output rows: their d, then 8 chunks of
 * 32 bytes; chunk c holds, for row i, bytes 4i..4i+3 = inputs 4c..4c+3 (kernels further down). */
typedef struct {
    uint16_t d[8]; /* float16 */
    int8_t qs[256];
} block_q8x8;

int dg_block_q8x8_size(void) { return (int)sizeof(block_q8x8); }

#if defined(DG_AVX2)
static inline __m256i dg_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

#define DG_Q4X8_TILE(R)                                                                                \
    static inline void dg_q4x8_tile_##R(const block_q4x8 *wg, int64_t nb, int64_t k, const char *pf,    \
                                        const int8_t *qx, const float *sx, const float *ssum, float *y, \
                                        int64_t n) {                                                   \
        const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                       \
        __m256 acc[R];                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                      \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            const block_q4x8 *blk = wg + b;                                                            \
            dg_prefetch_block(pf, (int64_t)sizeof(block_q4x8), b);                                     \
            __m256i s16[R];                                                                            \
            for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();                               \
            for (int c = 0; c < 4; c++) {                                                              \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));           \
                const __m256i lo = _mm256_and_si256(raw, low);                                         \
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);                   \
                for (int r = 0; r < R; r++) {                                                          \
                    const int8_t *xb = qx + r * k + b * QK + 4 * c;                                    \
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, dg_bcast4(xb)));        \
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, dg_bcast4(xb + 16)));   \
                }                                                                                      \
            }                                                                                          \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));               \
            const __m256 mo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->m));              \
            for (int r = 0; r < R; r++) {                                                              \
                const __m256 sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));                \
                acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(sx[r * nb + b])), acc[r]); \
                acc[r] = _mm256_fmadd_ps(mo, _mm256_set1_ps(ssum[r * nb + b]), acc[r]);                \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * n, acc[r]);                               \
    }
#else
#define DG_Q4X8_TILE(R)                                                                                \
    static inline void dg_q4x8_tile_##R(const block_q4x8 *wg, int64_t nb, int64_t k, const char *pf,    \
                                        const int8_t *qx, const float *sx, const float *ssum, float *y, \
                                        int64_t n) {                                                   \
        (void)pf;                                                                                      \
        for (int r = 0; r < R; r++) {                                                                  \
            for (int i = 0; i < 8; i++) {                                                              \
                float acc = 0.0f;                                                                      \
                for (int64_t b = 0; b < nb; b++) {                                                     \
                    const block_q4x8 *blk = wg + b;                                                    \
                    const int8_t *xb = qx + r * k + b * QK;                                            \
                    int isum = 0;                                                                      \
                    for (int c = 0; c < 4; c++)                                                        \
                        for (int t = 0; t < 4; t++) {                                                  \
                            const uint8_t v = blk->qs[32 * c + 4 * i + t];                             \
                            isum += (v & 0x0F) * xb[4 * c + t] + (v >> 4) * xb[4 * c + t + 16];        \
                        }                                                                              \
                    acc += dg_half(blk->d[i]) * sx[r * nb + b] * (float)isum                            \
                           + dg_half(blk->m[i]) * ssum[r * nb + b];                                     \
                }                                                                                      \
                y[r * n + i] = acc;                                                                    \
            }                                                                                          \
        }                                                                                              \
    }
#endif

DG_Q4X8_TILE(1)
DG_Q4X8_TILE(2)
DG_Q4X8_TILE(3)
DG_Q4X8_TILE(4)

#if defined(DG_AVX512)
/* ---- 512-bit VNNI over the 8-row layouts: two groups per register --------------------------------
 * A chunk of group g fills the low 256 bits and the same chunk of group g + 1 the high, so each
 * lane is one of 16 consecutive output rows and a tile's results are stored as they are. Tiles
 * of up to 8 activation rows use each weight register 8 times; products sum exactly in 32-bit
 * lanes (vpdpbusd), then the same float steps as the 256-bit tiles, so both give equal results.
 * Most of the work goes to 32-row tiles over two such pairs (dg_q4x32_tile, dg_q8x32_tile), the
 * rest to 16-row tiles. Work is split over (band of 64 activation rows, unit of groups): a long
 * prefill keeps one band's activations in cache while the weights stream. An odd last group reads
 * itself twice and stores its own 8 lanes only. Calls of one or two rows stay on the 256-bit tiles: they are
 * bound by streaming the weights, and one stream per task (one group) reads faster there than
 * two (measured on Zen 5: 30 layers at one row 1.85 ms against 2.14 ms). */
#define DG_BAND 64
#define DG_SPLIT 4 /* tiles of up to this many rows sum each block in two chains */
/* Calls of at least this many rows take the 32-row tiles. Fewer rows are bound by streaming the
 * weights, where a 16-row tile of 8 rows reads each weight from memory once for all of them: the
 * 32-row tiles (4 rows a pass) made a whole 8-row step 8-15% slower and a 16-row one ~5%, and
 * gained from ~32 rows (33-row steps -3%, W1's 64-row steps -6 to -11%; engine steps, Zen 5). */
#define DG_QUAD_ROWS 32

static inline __m512i dg_pair256(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static inline __m512 dg_pair_half(const uint16_t *a, const uint16_t *b) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)a), hi = _mm_loadu_si128((const __m128i *)b);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

static inline __m512i dg_bcast4_512(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

#define DG_Q4X16_TILE(R)                                                                               \
    static inline void dg_q4x16_tile_##R(const block_q4x8 *wa, const block_q4x8 *wb, int64_t nb,       \
                                         int64_t k, const char *pf, int64_t pfb, const int8_t *qx,     \
                                         const float *sx, const float *ssum, float *y, int64_t n,      \
                                         __mmask16 keep) {                                             \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                    \
        __m512 acc[R];                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                      \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            const block_q4x8 *ba = wa + b, *bb = wb + b;                                               \
            dg_prefetch_block(pf, pfb, b);                                                             \
            __m512i s32[R], s32b[R]; /* few rows: two chains hide vpdpbusd's latency */               \
            for (int r = 0; r < R; r++) s32[r] = s32b[r] = _mm512_setzero_si512();                    \
            for (int c = 0; c < 4; c++) {                                                              \
                const __m512i raw = dg_pair256(ba->qs + 32 * c, bb->qs + 32 * c);                      \
                const __m512i lo = _mm512_and_si512(raw, low);                                         \
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);                   \
                for (int r = 0; r < R; r++) {                                                          \
                    const int8_t *xb = qx + r * k + b * QK + 4 * c;                                    \
                    s32[r] = _mm512_dpbusd_epi32(s32[r], lo, dg_bcast4_512(xb));                       \
                    if (R <= DG_SPLIT)                                                                 \
                        s32b[r] = _mm512_dpbusd_epi32(s32b[r], hi, dg_bcast4_512(xb + 16));            \
                    else                                                                               \
                        s32[r] = _mm512_dpbusd_epi32(s32[r], hi, dg_bcast4_512(xb + 16));              \
                }                                                                                      \
            }                                                                                          \
            if (R <= DG_SPLIT)                                                                         \
                for (int r = 0; r < R; r++) s32[r] = _mm512_add_epi32(s32[r], s32b[r]);                \
            const __m512 d = dg_pair_half(ba->d, bb->d), mo = dg_pair_half(ba->m, bb->m);              \
            for (int r = 0; r < R; r++) {                                                              \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32[r]),                                   \
                                         _mm512_mul_ps(d, _mm512_set1_ps(sx[r * nb + b])), acc[r]);    \
                acc[r] = _mm512_fmadd_ps(mo, _mm512_set1_ps(ssum[r * nb + b]), acc[r]);                \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * n, keep, acc[r]);                    \
    }

/* s8 weights: vpdpbusd multiplies u8 by s8, so the activations come as q + 128 (u8) and
 * 128 * sum(w) per lane and block, summed by the same instruction against ones, is taken off. */
#define DG_Q8X16_TILE(R)                                                                               \
    static inline void dg_q8x16_tile_##R(const block_q8x8 *wa, const block_q8x8 *wb, int64_t nb,       \
                                         int64_t k, const char *pf, int64_t pfb, const uint8_t *ux,    \
                                         const float *sx, float *y, int64_t n, __mmask16 keep) {       \
        const __m512i ones = _mm512_set1_epi8(1);                                                      \
        __m512 acc[R];                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                      \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            const block_q8x8 *ba = wa + b, *bb = wb + b;                                               \
            dg_prefetch_block(pf, pfb, b);                                                             \
            __m512i s32[R], s32b[R], wsum = _mm512_setzero_si512();                                    \
            for (int r = 0; r < R; r++) s32[r] = s32b[r] = _mm512_setzero_si512();                    \
            for (int c = 0; c < 8; c++) {                                                              \
                const __m512i wq = dg_pair256(ba->qs + 32 * c, bb->qs + 32 * c);                       \
                wsum = _mm512_dpbusd_epi32(wsum, ones, wq);                                            \
                for (int r = 0; r < R; r++) {                                                          \
                    const __m512i xs = dg_bcast4_512(ux + r * k + b * QK + 4 * c);                     \
                    if (R <= DG_SPLIT && (c & 1))                                                      \
                        s32b[r] = _mm512_dpbusd_epi32(s32b[r], xs, wq);                                \
                    else                                                                               \
                        s32[r] = _mm512_dpbusd_epi32(s32[r], xs, wq);                                  \
                }                                                                                      \
            }                                                                                          \
            if (R <= DG_SPLIT)                                                                         \
                for (int r = 0; r < R; r++) s32[r] = _mm512_add_epi32(s32[r], s32b[r]);                \
            const __m512i corr = _mm512_slli_epi32(wsum, 7);                                           \
            const __m512 d = dg_pair_half(ba->d, bb->d);                                               \
            for (int r = 0; r < R; r++)                                                                \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s32[r], corr)),           \
                                         _mm512_mul_ps(d, _mm512_set1_ps(sx[r * nb + b])), acc[r]);    \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * n, keep, acc[r]);                    \
    }

DG_Q4X16_TILE(1)
DG_Q4X16_TILE(2)
DG_Q4X16_TILE(3)
DG_Q4X16_TILE(4)
DG_Q4X16_TILE(5)
DG_Q4X16_TILE(6)
DG_Q4X16_TILE(7)
DG_Q4X16_TILE(8)
/* A 32-row tile's R rows of sums (acc0: its first pair's 16 lanes, acc1: the second's) into y. */
static inline __attribute__((always_inline)) void dg_store_x32(const int R, const __m512 *acc0, const __m512 *acc1,
                                                               float *y, int64_t n) {
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(y + r * n, acc0[r]);
        _mm512_storeu_ps(y + r * n + 16, acc1[r]);
    }
}

/* Four groups (32 output rows, two group pairs) x R (<= 4) activation rows: each activation
 * broadcast feeds two dpbusd, one per pair, where the 16-row tiles spend a load per dpbusd (W1's
 * gate/up and down at 64 rows, two threads: 570 -> 643 and 534 -> 585 GMAC/s). The same integer
 * sums (exact in any order) and float steps per lane as the 16-row tiles, so either gives a row's
 * outputs bit for bit. */
#define DG_Q4X32_TILE(R)                                                                               \
    static inline void dg_q4x32_tile_##R(const block_q4x8 *w4, int64_t nb, int64_t k, const char *pf,  \
                                         int64_t pfb, const int8_t *qx, const float *sx,                \
                                         const float *ssum, float *y, int64_t n) {                     \
        const block_q4x8 *wa = w4, *wb = w4 + nb, *wc = w4 + 2 * nb, *wd = w4 + 3 * nb;                \
        const __m512i low = _mm512_set1_epi8(0x0F);                                                    \
        __m512 acc0[R], acc1[R];                                                                       \
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            dg_prefetch_block(pf, pfb, b);                                                             \
            __m512i s0[R], s1[R];                                                                      \
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_si512();                        \
            for (int c = 0; c < 4; c++) {                                                              \
                const __m512i r0 = dg_pair256(wa[b].qs + 32 * c, wb[b].qs + 32 * c);                   \
                const __m512i r1 = dg_pair256(wc[b].qs + 32 * c, wd[b].qs + 32 * c);                   \
                const __m512i lo0 = _mm512_and_si512(r0, low);                                         \
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), low);                   \
                const __m512i lo1 = _mm512_and_si512(r1, low);                                         \
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), low);                   \
                for (int r = 0; r < R; r++) {                                                          \
                    const int8_t *xb = qx + r * k + b * QK + 4 * c;                                    \
                    const __m512i xl = dg_bcast4_512(xb), xh = dg_bcast4_512(xb + 16);                 \
                    s0[r] = _mm512_dpbusd_epi32(s0[r], lo0, xl);                                       \
                    s1[r] = _mm512_dpbusd_epi32(s1[r], lo1, xl);                                       \
                    s0[r] = _mm512_dpbusd_epi32(s0[r], hi0, xh);                                       \
                    s1[r] = _mm512_dpbusd_epi32(s1[r], hi1, xh);                                       \
                }                                                                                      \
            }                                                                                          \
            const __m512 d0 = dg_pair_half(wa[b].d, wb[b].d), m0 = dg_pair_half(wa[b].m, wb[b].m);     \
            const __m512 d1 = dg_pair_half(wc[b].d, wd[b].d), m1 = dg_pair_half(wc[b].m, wd[b].m);     \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512 xs = _mm512_set1_ps(sx[r * nb + b]), xo = _mm512_set1_ps(ssum[r * nb + b]); \
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(d0, xs), acc0[r]);  \
                acc0[r] = _mm512_fmadd_ps(m0, xo, acc0[r]);                                            \
                acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(d1, xs), acc1[r]);  \
                acc1[r] = _mm512_fmadd_ps(m1, xo, acc1[r]);                                            \
            }                                                                                          \
        }                                                                                              \
        dg_store_x32(R, acc0, acc1, y, n);                                                             \
    }

DG_Q4X32_TILE(1)
DG_Q4X32_TILE(2)
DG_Q4X32_TILE(3)
DG_Q4X32_TILE(4)

/* dg_q4x32 for s8 weights (dg_q8x16_tile's steps): each u8 activation broadcast feeds both pairs. */
#define DG_Q8X32_TILE(R)                                                                               \
    static inline void dg_q8x32_tile_##R(const block_q8x8 *w4, int64_t nb, int64_t k, const char *pf,  \
                                         int64_t pfb, const uint8_t *ux, const float *sx, float *y,    \
                                         int64_t n) {                                                  \
        const block_q8x8 *wa = w4, *wb = w4 + nb, *wc = w4 + 2 * nb, *wd = w4 + 3 * nb;                \
        const __m512i ones = _mm512_set1_epi8(1);                                                      \
        __m512 acc0[R], acc1[R];                                                                       \
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            dg_prefetch_block(pf, pfb, b);                                                             \
            __m512i s0[R], s1[R], ws0 = _mm512_setzero_si512(), ws1 = _mm512_setzero_si512();          \
            for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_si512();                        \
            for (int c = 0; c < 8; c++) {                                                              \
                const __m512i q0 = dg_pair256(wa[b].qs + 32 * c, wb[b].qs + 32 * c);                   \
                const __m512i q1 = dg_pair256(wc[b].qs + 32 * c, wd[b].qs + 32 * c);                   \
                ws0 = _mm512_dpbusd_epi32(ws0, ones, q0);                                              \
                ws1 = _mm512_dpbusd_epi32(ws1, ones, q1);                                              \
                for (int r = 0; r < R; r++) {                                                          \
                    const __m512i xs = dg_bcast4_512(ux + r * k + b * QK + 4 * c);                     \
                    s0[r] = _mm512_dpbusd_epi32(s0[r], xs, q0);                                        \
                    s1[r] = _mm512_dpbusd_epi32(s1[r], xs, q1);                                        \
                }                                                                                      \
            }                                                                                          \
            const __m512i c0 = _mm512_slli_epi32(ws0, 7), c1 = _mm512_slli_epi32(ws1, 7);             \
            const __m512 d0 = dg_pair_half(wa[b].d, wb[b].d), d1 = dg_pair_half(wc[b].d, wd[b].d);     \
            for (int r = 0; r < R; r++) {                                                              \
                const __m512 xs = _mm512_set1_ps(sx[r * nb + b]);                                      \
                acc0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s0[r], c0)),             \
                                          _mm512_mul_ps(d0, xs), acc0[r]);                             \
                acc1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s1[r], c1)),             \
                                          _mm512_mul_ps(d1, xs), acc1[r]);                             \
            }                                                                                          \
        }                                                                                              \
        dg_store_x32(R, acc0, acc1, y, n);                                                             \
    }

DG_Q8X32_TILE(1)
DG_Q8X32_TILE(2)
DG_Q8X32_TILE(3)
DG_Q8X32_TILE(4)

DG_Q8X16_TILE(1)
DG_Q8X16_TILE(2)
DG_Q8X16_TILE(3)
DG_Q8X16_TILE(4)
DG_Q8X16_TILE(5)
DG_Q8X16_TILE(6)
DG_Q8X16_TILE(7)
DG_Q8X16_TILE(8)

/* Rows per band: at most DG_BAND, all bands the same size (a multiple of 8, the last one the rest). */
static inline int64_t dg_band_rows(int64_t m) {
    const int64_t bands = (m + DG_BAND - 1) / DG_BAND;
    return ((m + bands - 1) / bands + 7) / 8 * 8;
}

/* Rows r0..end of one band against one group pair, in tiles of 8 and one of the rest. */
#define DG_X16_BAND(tile, X, ...)                                                                      \
    do {                                                                                               \
        int64_t r = r0;                                                                                \
        for (; r + 8 <= end; r += 8) tile##_8(wa, wb, nb, k, r == r0 ? pf : NULL, pfb, X(r), __VA_ARGS__); \
        const char *pfr = r == r0 ? pf : NULL;                                                         \
        switch (end - r) {                                                                             \
            case 7: tile##_7(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 6: tile##_6(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 5: tile##_5(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 4: tile##_4(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 3: tile##_3(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 2: tile##_2(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            case 1: tile##_1(wa, wb, nb, k, pfr, pfb, X(r), __VA_ARGS__); break;                       \
            default: break;                                                                            \
        }                                                                                              \
    } while (0)

/* Rows r0..end of one band against one quad of groups (w4), in tiles of 4 rows and one of the rest.
 * (Tiles of 4, 5 and 6 rows ran the body's int4 shapes within 2% of each other at 8-64 rows; the
 * int8 head at 64 rows ran 564 GMAC/s in tiles of 4 against 385 in tiles of 6, whose sums did not
 * fit in registers. Zen 5, two threads.) */
#define DG_X32_BAND(tile, X)                                                                           \
    do {                                                                                               \
        int64_t r = r0;                                                                                \
        for (; r + 4 <= end; r += 4) tile##_4(w4, nb, k, r == r0 ? pf : NULL, pfb, X(r), n);           \
        const char *pfr = r == r0 ? pf : NULL;                                                         \
        switch (end - r) {                                                                             \
            case 3: tile##_3(w4, nb, k, pfr, pfb, X(r), n); break;                                     \
            case 2: tile##_2(w4, nb, k, pfr, pfb, X(r), n); break;                                     \
            case 1: tile##_1(w4, nb, k, pfr, pfb, X(r), n); break;                                     \
            default: break;                                                                            \
        }                                                                                              \
    } while (0)

/* The task's (unit, band), rows r0..end. A unit is four groups (a quad, w4, for the 32-row tiles)
 * up to the last whole quad, then a pair (wa/wb, keep its lanes) or the odd last group for the
 * 16-row tiles. Bands are of equal size (dg_band_rows), so no thread's share ends on a short last
 * band. Up to two bands the tasks are unit-major: a thread's static share is whole units with all
 * their bands, so it streams half the weights once, each unit staying in L1 across its bands
 * (band-major, 72 rows gave one thread the 64-row band and the other 8 rows, both streaming every
 * weight: W1 at 72 rows ran 46% slower). More bands (prefill chunks) stay band-major: there the
 * activations outweigh the weights, and a band's activations stay in L2 while the thread runs the
 * units. The next unit's weights (this thread's next under the static schedule) are fetched while
 * the first tile of the unit's first band runs: without it every unit waited on memory for its
 * first pass (the 49152-row head at 64 rows: 5.5 ms before, 3.9 ms with it, 3.7 ms from cache). */
#define DG_X32_TASK(type, w)                                                                           \
    const int unit_major = bands <= 2;                                                                 \
    const int64_t band = unit_major ? task % bands : task / units;                                     \
    const int64_t u = unit_major ? task / bands : task % units;                                        \
    const int64_t g = u < quads ? 4 * u : 4 * quads + 2 * (u - quads); /* the unit's first group */    \
    const int64_t r0 = band * rows_per_band, end = r0 + rows_per_band < m ? r0 + rows_per_band : m;    \
    const int64_t ng = u + 1 < quads ? g + 4 : u + 1 < units ? 4 * quads + 2 * (u + 1 - quads) : groups; \
    const int64_t pfb = (u + 1 < quads ? 4 : 2) * (int64_t)sizeof(type);                               \
    const char *pf = (!unit_major || band == 0) && ng < groups ? (const char *)((w) + ng * nb) : NULL; \
    float *yg = y + 8 * g;                                                                             \
    const type *w4 = (w) + g * nb, *wa = w4, *wb = g + 1 < groups ? wa + nb : wa;                      \
    const __mmask16 keep = g + 1 < groups ? 0xFFFF : 0x00FF

static void dg_matmul_q4x16(const block_q4x8 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx,
                            const float *ssum, int64_t m, float *y) {
    const int64_t nb = k / QK, groups = n / 8, quads = m >= DG_QUAD_ROWS ? groups / 4 : 0;
    const int64_t units = quads + (groups - 4 * quads + 1) / 2;
    const int64_t rows_per_band = dg_band_rows(m), bands = (m + rows_per_band - 1) / rows_per_band;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < bands * units; task++) {
        DG_X32_TASK(block_q4x8, w);
#define DG_Q4_X(r) qx + (r) * k, sx + (r) * nb, ssum + (r) * nb, yg + (r) * n
        if (u < quads)
            DG_X32_BAND(dg_q4x32_tile, DG_Q4_X);
        else
            DG_X16_BAND(dg_q4x16_tile, DG_Q4_X, n, keep);
#undef DG_Q4_X
    }
}

static _Thread_local dg_tls_buf dg_u8_tls;

/* Returns 0 if the activations' u8 copy could not be allocated (the caller takes the 256-bit path). */
static int dg_matmul_q8x16(const block_q8x8 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx,
                           int64_t m, float *y) {
    const size_t need = (size_t)m * (size_t)k;
    uint8_t *ux = (uint8_t *)dg_grow(&dg_u8_tls, need);
    if (!ux) return 0;
    for (size_t i = 0; i < need; i++) ux[i] = (uint8_t)qx[i] ^ 0x80; /* q + 128 */
    const int64_t nb = k / QK, groups = n / 8, quads = m >= DG_QUAD_ROWS ? groups / 4 : 0;
    const int64_t units = quads + (groups - 4 * quads + 1) / 2;
    const int64_t rows_per_band = dg_band_rows(m), bands = (m + rows_per_band - 1) / rows_per_band;
#pragma omp parallel for schedule(static)
    for (int64_t task = 0; task < bands * units; task++) {
        DG_X32_TASK(block_q8x8, w);
#define DG_Q8_X(r) ux + (r) * k, sx + (r) * nb, yg + (r) * n
        if (u < quads)
            DG_X32_BAND(dg_q8x32_tile, DG_Q8_X);
        else
            DG_X16_BAND(dg_q8x16_tile, DG_Q8_X, n, keep);
#undef DG_Q8_X
    }
    return 1;
}
#endif

#if defined(DG_AMX)
/* ---- the 8-row layouts on AMX tiles, for calls of DG_AMX_ROWS rows or more -----------------------
 * One block (32 inputs) of 16 activation rows against one group pair (16 output rows) is one tile
 * product: A = the rows' 32 bytes, B = the pair's weights as 8 rows of input quads by 16 columns
 * (q8x8's chunks of both groups side by side; q4x8's nibbles widened to bytes, the low ones of
 * chunk c in row c and the high ones in row c + 4), C = 16 x 16 sums in 32 bits: tdpbssd for s8
 * weights, tdpbsud for the u4 ones. The sums are exact, and every block's float steps are the
 * vector tiles' (the same operations in the same order), so a row's outputs have the same bits
 * here as in any other tile: how many rows share a call does not change a job's tokens.
 *
 * Each block needs its own float scaling, so every product's sums go through memory (dg_amx_run
 * has the order of the work). A tile's 16 activation rows are packed contiguously first.
 * Against the vector tiles, on the 2-core Intel AMX part (30 layers of the shipped model's int4
 * body and its int8 head, ms): 16 rows 7.0 -> 5.6, 32 rows 12.3 -> 9.4, 64 rows 23.4 -> 16.3,
 * 256 rows 102 -> 74; at 12 rows about even, at 8 rows 3.6 -> 5.2 (a 16-row tile's work for 8):
 * so from 13 rows. */
#define DG_AMX_ROWS 13
/* Inputs of at least 4 blocks: a pair's first blocks are made three blocks ahead, in the last pair's last unit. */
#define DG_AMX_K (4 * QK)

static _Thread_local dg_tls_buf dg_amx_lin_tls;

/* One block's products of the A rows at a (stride as) and the B tile at bt, into tile TC, on tiles
 * TA, TB (literals: the instructions name their tiles); stored later (DG_AMX_STORE), once made. */
#define DG_AMX_PRODUCT(TA, TB, TC, Q4, a, as, bt)                                                      \
    do {                                                                                               \
        _tile_zero(TC);                                                                                \
        _tile_loadd(TA, (a), (as));                                                                    \
        _tile_loadd(TB, (bt), 64);                                                                     \
        if (Q4)                                                                                        \
            _tile_dpbsud(TC, TA, TB);                                                                  \
        else                                                                                           \
            _tile_dpbssd(TC, TA, TB);                                                                  \
    } while (0)
#define DG_AMX_STORE(TC, cb) _tile_stored(TC, (cb), 64)

/* Block b's sums of 16 rows (cb) into their accumulators, as the vector tiles scale them; sx and
 * ssum: the 16 rows' scales of the block. */
static inline __attribute__((always_inline)) void dg_amx_scale(const int q4, const int32_t *cb, const char *wa,
                                                               const char *wb, const float *sx, const float *ssum,
                                                               int64_t b, __m512 *acc) {
    __m512 d, mo = _mm512_setzero_ps();
    if (q4) {
        const block_q4x8 *ba = (const block_q4x8 *)wa + b, *bb = (const block_q4x8 *)wb + b;
        d = dg_pair_half(ba->d, bb->d), mo = dg_pair_half(ba->m, bb->m);
    } else {
        d = dg_pair_half(((const block_q8x8 *)wa + b)->d, ((const block_q8x8 *)wb + b)->d);
    }
#pragma GCC unroll 16 /* the accumulators stay in registers */
    for (int r = 0; r < 16; r++) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb + 16 * r)));
        acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(sx[r])), acc[r]);
        if (q4) acc[r] = _mm512_fmadd_ps(mo, _mm512_set1_ps(ssum[r]), acc[r]);
    }
}

/* Block b of the pair (wa, wb)'s B tiles into bt (its [nb][8][64] bytes). */
static inline __attribute__((always_inline)) void dg_amx_b(const int q4, const char *wa, const char *wb, int64_t b,
                                                           int8_t *bt) {
    bt += 512 * b;
    if (q4) {
        const __m512i low = _mm512_set1_epi8(0x0F);
        const block_q4x8 *ba = (const block_q4x8 *)wa + b, *bb = (const block_q4x8 *)wb + b;
        for (int c = 0; c < 4; c++) {
            const __m512i raw = dg_pair256(ba->qs + 32 * c, bb->qs + 32 * c);
            _mm512_store_si512((void *)(bt + 64 * c), _mm512_and_si512(raw, low));
            _mm512_store_si512((void *)(bt + 64 * (c + 4)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low));
        }
    } else {
        const block_q8x8 *ba = (const block_q8x8 *)wa + b, *bb = (const block_q8x8 *)wb + b;
        for (int c = 0; c < 8; c++)
            _mm512_store_si512((void *)(bt + 64 * c), dg_pair256(ba->qs + 32 * c, bb->qs + 32 * c));
    }
}

/* A thread's pairs p0..p1 of y [m, n] = x [m, k] . w^T: pa, psx, pss the activations and their scales
 * as dg_matmul_amx packs them; bts two pairs' B tiles, ring 4 blocks' sums (this thread's scratch).
 *
 * The units (pair, row tile) run as one stream of blocks, G = unit * nb + block. Block G is made in C
 * tile {2, 3, 6, 7}[G % 4] from A and B in tiles 0 and 1 (G even) or 4 and 5, three blocks ahead of
 * its scaling, and stored just before it: tiles are not renamed, and a product stored right behind
 * its tdp held up all work after it. So a unit's first blocks are made while the last unit's are
 * scaled, and the next pair's B tiles are made block by block during its last unit; the pair after
 * next's weights are fetched meanwhile. The 16 accumulators stay in registers: every index into
 * them is a constant. */
static inline __attribute__((always_inline)) void dg_amx_run(const int q4, const void *w, int64_t n, int64_t k,
                                                             const int8_t *pa, const float *psx, const float *pss,
                                                             int64_t m, float *y, int64_t p0, int64_t p1,
                                                             int8_t *bts, int32_t *ring) {
    const int64_t nb = k / QK, groups = n / 8, nrt = (m + 15) / 16, total = (p1 - p0) * nrt * nb;
    const size_t wbytes = q4 ? sizeof(block_q4x8) : sizeof(block_q8x8);
    const char *wend = (const char *)w + (size_t)groups * nb * wbytes;
#define DG_AMX_WA(p) ((const char *)w + (size_t)(2 * (p)) * nb * wbytes)
#define DG_AMX_WB(p) (2 * (p) + 1 < groups ? DG_AMX_WA(p) + nb * wbytes : DG_AMX_WA(p))
#define DG_AMX_BT(p) (bts + (((p) - p0) & 1) * nb * 512)
    for (int64_t b = 0; b < nb; b++) dg_amx_b(q4, DG_AMX_WA(p0), DG_AMX_WB(p0), b, DG_AMX_BT(p0));
    /* The maker: the next block to make (its unit's row tile, pair and block). */
    int64_t mrt = 0, mp = p0, mi = 0;
#define DG_AMX_MAKE(TA, TB, TC)                                                                        \
    do {                                                                                               \
        const int8_t *a_ = pa + (mrt * nb + mi) * 512, *b_ = DG_AMX_BT(mp) + 512 * mi;                 \
        if (q4)                                                                                        \
            DG_AMX_PRODUCT(TA, TB, TC, 1, a_, 32, b_);                                                 \
        else                                                                                           \
            DG_AMX_PRODUCT(TA, TB, TC, 0, a_, 32, b_);                                                 \
        if (++mi == nb) {                                                                              \
            mi = 0;                                                                                    \
            if (++mrt == nrt) mrt = 0, mp++;                                                           \
        }                                                                                              \
    } while (0)
    DG_AMX_MAKE(0, 1, 2);
    if (total > 1) DG_AMX_MAKE(4, 5, 3);
    if (total > 2) DG_AMX_MAKE(0, 1, 6);
    /* The scaler: unit (p, rt), block i. */
    int64_t p = p0, rt = 0, i = 0;
    const char *wa = DG_AMX_WA(p), *wb = DG_AMX_WB(p);
/* The pair after next's weights [f, fend), fetched over pair p's blocks (empty past the last pair). */
#define DG_AMX_AHEAD(p)                                                                                \
    do {                                                                                               \
        f = fend = wend;                                                                               \
        if (2 * ((p) + 2) < groups) {                                                                  \
            f = DG_AMX_WA((p) + 2);                                                                    \
            fend = f + 2 * nb * wbytes < wend ? f + 2 * nb * wbytes : wend;                            \
        }                                                                                              \
    } while (0)
    const char *f, *fend;
    DG_AMX_AHEAD(p);
    const int64_t per_step = ((fend - f) / 64 + nb * nrt) / (nb * nrt);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
#define DG_AMX_STEP(TC, TA3, TB3, TC3, j)                                                              \
    if (G + (j) < total) {                                                                             \
        for (int64_t t_ = 0; t_ < per_step && f < fend; t_++, f += 64) _mm_prefetch(f, _MM_HINT_T0);   \
        DG_AMX_STORE(TC, ring + 256 * (j));                                                            \
        /* The next pair's block i, before block i + 3 - nb of it is made (nb >= 4). */               \
        if (rt == nrt - 1 && p + 1 < p1) dg_amx_b(q4, DG_AMX_WA(p + 1), DG_AMX_WB(p + 1), i, DG_AMX_BT(p + 1)); \
        if (G + (j) + 3 < total) DG_AMX_MAKE(TA3, TB3, TC3);                                           \
        dg_amx_scale(q4, ring + 256 * (j), wa, wb, psx + (rt * nb + i) * 16,                           \
                     q4 ? pss + (rt * nb + i) * 16 : NULL, i, acc);                                    \
        if (++i == nb) { /* the unit's outputs, and on to the next unit */                             \
            const int64_t rows = m - rt * 16 < 16 ? m - rt * 16 : 16;                                  \
            const __mmask16 keep = 2 * p + 1 < groups ? 0xFFFF : 0x00FF;                               \
            float *yr = y + rt * 16 * n + 16 * p;                                                      \
            _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {                                    \
                if (r < rows) _mm512_mask_storeu_ps(yr + r * n, keep, acc[r]);                         \
                acc[r] = _mm512_setzero_ps();                                                          \
            }                                                                                          \
            i = 0;                                                                                     \
            if (++rt == nrt) {                                                                         \
                rt = 0, p++;                                                                           \
                wa = DG_AMX_WA(p), wb = DG_AMX_WB(p);                                                  \
                DG_AMX_AHEAD(p);                                                                       \
            }                                                                                          \
        }                                                                                              \
    }
    for (int64_t G = 0; G < total; G += 4) {
        DG_AMX_STEP(2, 4, 5, 7, 0)
        DG_AMX_STEP(3, 0, 1, 2, 1)
        DG_AMX_STEP(6, 4, 5, 3, 2)
        DG_AMX_STEP(7, 0, 1, 6, 3)
    }
#undef DG_AMX_STEP
#undef DG_AMX_MAKE
#undef DG_AMX_AHEAD
#undef DG_AMX_WA
#undef DG_AMX_WB
#undef DG_AMX_BT
}

static __attribute__((noinline)) void dg_amx_run_q4(const void *w, int64_t n, int64_t k, const int8_t *pa,
                                                    const float *psx, const float *pss, int64_t m, float *y,
                                                    int64_t p0, int64_t p1, int8_t *bts, int32_t *ring) {
    dg_amx_run(1, w, n, k, pa, psx, pss, m, y, p0, p1, bts, ring);
}

static __attribute__((noinline)) void dg_amx_run_q8(const void *w, int64_t n, int64_t k, const int8_t *pa,
                                                    const float *psx, int64_t m, float *y, int64_t p0, int64_t p1,
                                                    int8_t *bts, int32_t *ring) {
    dg_amx_run(0, w, n, k, pa, psx, NULL, m, y, p0, p1, bts, ring);
}

static _Thread_local dg_tls_buf dg_amx_pack_tls;
static int64_t dg_amx_linear_calls = 0; /* calls the tiles ran (tests check the dispatch reaches them) */

/* y [m, n] = x [m, k] . w^T on tiles: w q4x8 (q4) or q8x8 blocks, qx [m, k] s8 with scales sx (and
 * ssum for q4) [m, k / 32]. The activations are first packed tile by tile, [row tile][block][16][32]
 * (a tile's A is 512 contiguous bytes: read with the rows' stride, 16 lines a block held up each
 * load) with their scales [row tile][block][16], rows past m zero. Each thread then takes a run of
 * pairs. Returns 0 without touching y if a buffer could not be had. */
static int dg_matmul_amx(const void *w, int q4, int64_t n, int64_t k, const int8_t *qx, const float *sx,
                         const float *ssum, int64_t m, float *y) {
    const int64_t nb = k / QK, pairs = (n / 8 + 1) / 2, nrt = (m + 15) / 16;
    const size_t packed = (size_t)(nrt * nb) * (512 + 2 * 16 * sizeof(float));
    char *pk = (char *)dg_grow(&dg_amx_pack_tls, packed + 64);
    if (!pk) return 0;
    int8_t *pa = (int8_t *)(((uintptr_t)pk + 63) & ~(uintptr_t)63);
    float *psx = (float *)(pa + nrt * nb * 512), *pss = psx + nrt * nb * 16;
    /* two pairs' B tiles [nb][8][64] and a ring of 4 blocks' sums [16][16] */
    const size_t bytes = (size_t)nb * 1024 + 4 * 1024 + 64;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nrt * nb; t++) {
            const int64_t rt = t / nb, b = t % nb;
            for (int64_t r = 0; r < 16; r++) {
                const int64_t row = rt * 16 + r;
                int8_t *dst = pa + t * 512 + 32 * r;
                if (row < m) {
                    memcpy(dst, qx + row * k + QK * b, 32);
                    psx[t * 16 + r] = sx[row * nb + b];
                    pss[t * 16 + r] = q4 ? ssum[row * nb + b] : 0.0f;
                } else {
                    memset(dst, 0, 32);
                    psx[t * 16 + r] = pss[t * 16 + r] = 0.0f;
                }
            }
        }
        char *raw = (char *)dg_grow(&dg_amx_lin_tls, bytes);
        if (!raw) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            dg_tile_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            cfg.rows[0] = cfg.rows[4] = 16, cfg.colsb[0] = cfg.colsb[4] = 32; /* A: 16 rows x 32 inputs */
            cfg.rows[1] = cfg.rows[5] = 8, cfg.colsb[1] = cfg.colsb[5] = 64;  /* B: 8 quads x 16 outputs */
            for (int t = 2; t < 8; t += t == 3 ? 3 : 1) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* C (2, 3, 6, 7): 16 x 16 sums */
            _tile_loadconfig(&cfg);
            int8_t *bt = (int8_t *)(((uintptr_t)raw + 63) & ~(uintptr_t)63);
            int32_t *ring = (int32_t *)(bt + nb * 1024);
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = pairs * t / nt, p1 = pairs * (t + 1) / nt;
            if (p1 > p0 && q4) dg_amx_run_q4(w, n, k, pa, psx, pss, m, y, p0, p1, bt, ring);
            if (p1 > p0 && !q4) dg_amx_run_q8(w, n, k, pa, psx, m, y, p0, p1, bt, ring);
            _tile_release();
        }
    }
    if (!failed) __atomic_fetch_add(&dg_amx_linear_calls, 1, __ATOMIC_RELAXED);
    return !failed;
}
#endif

/* How many block linears the AMX tiles have run in this process (0 where the build has none). */
int64_t dg_tile_linear_calls(void) {
#if defined(DG_AMX)
    return __atomic_load_n(&dg_amx_linear_calls, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

#if defined(DG_AMX)
/* Whether a call of m rows and k inputs goes to the tiles (both 8-row layouts ask it). */
static inline int dg_amx_takes(int64_t m, int64_t k) {
    return m >= DG_AMX_ROWS && k >= DG_AMX_K && dg_set_amx(DG_TILES_LINEARS, -1);
}
#endif

/* y [m, n] = x [m, k] . w^T with w in q4x8 blocks [n / 8, k / 32] (n a multiple of 8). */
void dg_matmul_q4x8(const block_q4x8 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx,
                    const float *ssum, int64_t m, float *y) {
#if defined(DG_AMX)
    if (dg_amx_takes(m, k) && dg_matmul_amx(w, 1, n, k, qx, sx, ssum, m, y)) return;
#endif
#if defined(DG_AVX512)
    if (m > 2) {
        dg_matmul_q4x16(w, n, k, qx, sx, ssum, m, y);
        return;
    }
#endif
    const int64_t nb = k / QK, groups = n / 8;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const block_q4x8 *wg = w + g * nb;
        const char *pf = DG_AHEAD(g, groups, w, nb), *pfr = pf;
        int64_t r = 0;
        for (; r + RT <= m; r += RT, pfr = NULL)
            dg_q4x8_tile_4(wg, nb, k, pfr, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + 8 * g, n);
        switch (m - r) {
            case 3: dg_q4x8_tile_3(wg, nb, k, pfr, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + 8 * g, n); break;
            case 2: dg_q4x8_tile_2(wg, nb, k, pfr, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + 8 * g, n); break;
            case 1: dg_q4x8_tile_1(wg, nb, k, pfr, qx + r * k, sx + r * nb, ssum + r * nb, y + r * n + 8 * g, n); break;
            default: break;
        }
    }
}

/* q8x8 tiles (block_q8x8 above). As in q4x8, one lane per output row. s8 x s8 goes through u8 x s8 with w's sign moved onto x (|w| x sign(w) x);
 * a pair is at most 2 * 127 * 127, so each chunk's pairs are widened to 32 bits at once. */

#if defined(DG_AVX2)
#define DG_Q8X8_TILE(R)                                                                                \
    static inline void dg_q8x8_tile_##R(const block_q8x8 *wg, int64_t nb, int64_t k, const char *pf,    \
                                        const int8_t *qx, const float *sx, float *y, int64_t n) {      \
        const __m256i ones = _mm256_set1_epi16(1);                                                     \
        __m256 acc[R];                                                                                 \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                      \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            const block_q8x8 *blk = wg + b;                                                            \
            dg_prefetch_block(pf, (int64_t)sizeof(block_q8x8), b);                                     \
            __m256i s32[R];                                                                            \
            for (int r = 0; r < R; r++) s32[r] = _mm256_setzero_si256();                               \
            for (int c = 0; c < 8; c++) {                                                              \
                const __m256i wq = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * c));            \
                const __m256i wa = _mm256_sign_epi8(wq, wq);                                           \
                for (int r = 0; r < R; r++) {                                                          \
                    const __m256i xs = _mm256_sign_epi8(dg_bcast4(qx + r * k + b * QK + 4 * c), wq);   \
                    s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones)); \
                }                                                                                      \
            }                                                                                          \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d));               \
            for (int r = 0; r < R; r++)                                                                \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]),                                   \
                                         _mm256_mul_ps(d, _mm256_set1_ps(sx[r * nb + b])), acc[r]);    \
        }                                                                                              \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * n, acc[r]);                               \
    }
#else
#define DG_Q8X8_TILE(R)                                                                                \
    static inline void dg_q8x8_tile_##R(const block_q8x8 *wg, int64_t nb, int64_t k, const char *pf,    \
                                        const int8_t *qx, const float *sx, float *y, int64_t n) {      \
        (void)pf;                                                                                      \
        for (int r = 0; r < R; r++) {                                                                  \
            for (int i = 0; i < 8; i++) {                                                              \
                float acc = 0.0f;                                                                      \
                for (int64_t b = 0; b < nb; b++) {                                                     \
                    const block_q8x8 *blk = wg + b;                                                    \
                    const int8_t *xb = qx + r * k + b * QK;                                            \
                    int isum = 0;                                                                      \
                    for (int c = 0; c < 8; c++)                                                        \
                        for (int t = 0; t < 4; t++) isum += blk->qs[32 * c + 4 * i + t] * xb[4 * c + t]; \
                    acc += dg_half(blk->d[i]) * sx[r * nb + b] * (float)isum;                           \
                }                                                                                      \
                y[r * n + i] = acc;                                                                    \
            }                                                                                          \
        }                                                                                              \
    }
#endif

DG_Q8X8_TILE(1)
DG_Q8X8_TILE(2)
DG_Q8X8_TILE(3)
DG_Q8X8_TILE(4)

/* y [m, n] = x [m, k] . w^T with w in q8x8 blocks [n / 8, k / 32] (n a multiple of 8). */
void dg_matmul_q8x8(const block_q8x8 *w, int64_t n, int64_t k, const int8_t *qx, const float *sx, int64_t m,
                    float *y) {
#if defined(DG_AMX)
    if (dg_amx_takes(m, k) && dg_matmul_amx(w, 0, n, k, qx, sx, NULL, m, y)) return;
#endif
#if defined(DG_AVX512)
    if (m > 2 && dg_matmul_q8x16(w, n, k, qx, sx, m, y)) return;
#endif
    const int64_t nb = k / QK, groups = n / 8;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const block_q8x8 *wg = w + g * nb;
        const char *pf = DG_AHEAD(g, groups, w, nb), *pfr = pf;
        int64_t r = 0;
        for (; r + RT <= m; r += RT, pfr = NULL)
            dg_q8x8_tile_4(wg, nb, k, pfr, qx + r * k, sx + r * nb, y + r * n + 8 * g, n);
        switch (m - r) {
            case 3: dg_q8x8_tile_3(wg, nb, k, pfr, qx + r * k, sx + r * nb, y + r * n + 8 * g, n); break;
            case 2: dg_q8x8_tile_2(wg, nb, k, pfr, qx + r * k, sx + r * nb, y + r * n + 8 * g, n); break;
            case 1: dg_q8x8_tile_1(wg, nb, k, pfr, qx + r * k, sx + r * nb, y + r * n + 8 * g, n); break;
            default: break;
        }
    }
}

/* ---- whole linears: quantize the float rows into per-thread scratch, then multiply --------------
 * One call per linear from Python: the activation blocks never become tensors. */
typedef struct {
    int8_t *q;
    float *s, *ssum;
    size_t cap; /* values of q */
} dg_scratch;

static _Thread_local dg_scratch dg_tls;

/* Room for rows x k activations in this thread's scratch; 0 if out of memory. */
static int dg_reserve(int64_t rows, int64_t k) {
    const size_t need = (size_t)rows * (size_t)k;
    if (need <= dg_tls.cap) return 1;
    int8_t *q = (int8_t *)malloc(need);
    float *s = (float *)malloc(need / QK * sizeof(float));
    float *ssum = (float *)malloc(need / QK * sizeof(float));
    if (!q || !s || !ssum) {
        free(q), free(s), free(ssum);
        return 0;
    }
    free(dg_tls.q), free(dg_tls.s), free(dg_tls.ssum);
    dg_tls.q = q, dg_tls.s = s, dg_tls.ssum = ssum, dg_tls.cap = need;
    return 1;
}

/* y [m, n] = x [m, k] . w^T for the four block layouts (0: q4, 1: q8, 2: q4x8, 3: q8x8).
 * Returns 0, or -1 if the scratch could not be allocated (y untouched). */
int dg_linear(int layout, const void *w, int64_t n, int64_t k, const float *x, int64_t m, float *y) {
    if (!dg_reserve(m, k)) return -1;
    dg_quantize_q8(x, m, k, dg_tls.q, dg_tls.s, dg_tls.ssum);
    switch (layout) {
        case 0: dg_matmul_q4((const block_q4 *)w, n, k, dg_tls.q, dg_tls.s, dg_tls.ssum, m, y); break;
        case 1: dg_matmul_q8((const block_q8 *)w, n, k, dg_tls.q, dg_tls.s, m, y); break;
        case 2: dg_matmul_q4x8((const block_q4x8 *)w, n, k, dg_tls.q, dg_tls.s, dg_tls.ssum, m, y); break;
        default: dg_matmul_q8x8((const block_q8x8 *)w, n, k, dg_tls.q, dg_tls.s, m, y); break;
    }
    return 0;
}

/* ---- the small per-layer ops (float32), for steps of few tokens ------------------------- */

#if defined(DG_AVX2)
/* exp's constants, shared by dg_exp8 and dg_exp16 so both give the same bits: the clamp, log2(e),
 * ln 2 in two parts, the polynomial. */
#define DG_EXP_HI 88.3762626647949f
#define DG_EXP_LO -87.3365478515625f
#define DG_EXP_LOG2E 1.44269504088896341f
#define DG_EXP_LN2_HI 0.693359375f
#define DG_EXP_LN2_LO -2.12194440e-4f
#define DG_EXP_P0 1.9875691500e-4f
#define DG_EXP_P1 1.3981999507e-3f
#define DG_EXP_P2 8.3334519073e-3f
#define DG_EXP_P3 4.1665795894e-2f
#define DG_EXP_P4 1.6666665459e-1f
#define DG_EXP_P5 5.0000001201e-1f

/* What dg_exp8 and dg_exp16 share, in P's vectors of type T (P: _mm256 or _mm512): r = x - n ln2
 * (ln 2 in two parts), then p = exp(r) by the polynomial. One text, so both widths give the same bits. */
#define DG_EXP_POLY(P, T, n, x, p)                                                         \
    do {                                                                                   \
        T r_ = P##_fnmadd_ps(n, P##_set1_ps(DG_EXP_LN2_HI), x);                            \
        r_ = P##_fnmadd_ps(n, P##_set1_ps(DG_EXP_LN2_LO), r_);                             \
        p = P##_set1_ps(DG_EXP_P0);                                                        \
        p = P##_fmadd_ps(p, r_, P##_set1_ps(DG_EXP_P1));                                   \
        p = P##_fmadd_ps(p, r_, P##_set1_ps(DG_EXP_P2));                                   \
        p = P##_fmadd_ps(p, r_, P##_set1_ps(DG_EXP_P3));                                   \
        p = P##_fmadd_ps(p, r_, P##_set1_ps(DG_EXP_P4));                                   \
        p = P##_fmadd_ps(p, r_, P##_set1_ps(DG_EXP_P5));                                   \
        p = P##_fmadd_ps(p, P##_mul_ps(r_, r_), P##_add_ps(r_, P##_set1_ps(1.0f)));        \
    } while (0)

/* exp(x) for 8 floats: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial
 * (relative error ~2e-7 over the float range; inputs below -87.3 give 0, as expf nearly does). */
static inline __m256 dg_exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(DG_EXP_HI), lo = _mm256_set1_ps(DG_EXP_LO);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(DG_EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p;
    DG_EXP_POLY(_mm256, __m256, n, x, p);
    /* 2^n through the exponent bits; n in [-126, 127] after the clamp, so this never wraps */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if defined(DG_AVX512)
/* dg_exp8 on 16 floats: the same steps and constants, so each lane gives dg_exp8's bits. */
static inline __m512 dg_exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(DG_EXP_HI), lo = _mm512_set1_ps(DG_EXP_LO);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(DG_EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 p;
    DG_EXP_POLY(_mm512, __m512, n, x, p);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}
#endif

/* x += delta (when delta is not NULL), then out = w * (x / rms(x)), per row of `dim`. */
void dg_add_rms_norm(float *x, const float *delta, const float *w, float *out, int64_t rows, int64_t dim,
                     float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        float *o = out + r * dim;
        int64_t i = 0;
        float ss = 0.0f;
#if defined(DG_AVX2)
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (delta) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(delta + r * dim + i));
                _mm256_storeu_ps(xr + i, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        ss = dg_hsum(acc);
#endif
        for (; i < dim; i++) {
            if (delta) xr[i] += delta[r * dim + i];
            ss += xr[i] * xr[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        i = 0;
#if defined(DG_AVX2)
        const __m256 vinv = _mm256_set1_ps(inv);
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), vinv)));
#endif
        for (; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* Rotate `heads` heads of each row of x in place (row r starts at x + r * row_stride), halves
 * layout: pair i is (i, i + D/2). cos and sin_signed are [positions, D] tables (sin with its first
 * half negated), looked up at positions[r]. */
void dg_rotary(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
               const float *cos_table, const float *sin_signed, const int64_t *positions) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_signed + positions[r] * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * row_stride + h * head_dim;
            int64_t i = 0;
#if defined(DG_AVX2)
            for (; i + 8 <= half; i += 8) {
                const __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
                _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                      _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(v + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                             _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
            }
#endif
            for (; i < half; i++) {
                const float a = v[i], b = v[half + i];
                v[i] = a * c[i] + b * s[i];
                v[half + i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* out [rows, inter] = silu(gu[:, :inter]) * gu[:, inter:] */
/* silu(g) * u over one row of `inter` values. */
static inline void dg_silu_row(const float *g, const float *u, int64_t inter, float *o) {
    int64_t i = 0;
#if defined(DG_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= inter; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = dg_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void dg_silu_mul(const float *gu, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) dg_silu_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, inter, out + r * inter);
}

/* dg_linear of silu(gate) * up, for gu [m, 2k] (gate then up per row): each row's activations
 * are made in a per-thread buffer and quantized from there, so the [m, k] float activations
 * of a prefill (12 MB a layer at 2k tokens, memory-bound) are never written out and read back.
 * The same row functions as dg_silu_mul and dg_quantize_q8, so y equals dg_linear(silu_mul(gu))
 * bit for bit. */
static _Thread_local dg_tls_buf dg_silu_tls;

int dg_linear_silu(int layout, const void *w, int64_t n, int64_t k, const float *gu, int64_t m, float *y) {
    if (!dg_reserve(m, k)) return -1;
    int8_t *q = dg_tls.q;
    float *s = dg_tls.s, *ssum = dg_tls.ssum;
    const int64_t nb = k / QK;
    int failed = 0;
#pragma omp parallel if (m * k >= 32768)
    {
        /* Each thread's row buffer is kept between calls (the decode layer calls this per layer). */
        float *act = (float *)dg_grow(&dg_silu_tls, (size_t)k * sizeof(float));
        if (!act) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) {
            if (!act) continue;
            dg_silu_row(gu + r * 2 * k, gu + r * 2 * k + k, k, act);
            dg_quantize_row(act, k, q + r * k, s + r * nb, ssum + r * nb);
        }
    }
    if (failed) return -1;
    switch (layout) {
        case 0: dg_matmul_q4((const block_q4 *)w, n, k, q, s, ssum, m, y); break;
        case 1: dg_matmul_q8((const block_q8 *)w, n, k, q, s, m, y); break;
        case 2: dg_matmul_q4x8((const block_q4x8 *)w, n, k, q, s, ssum, m, y); break;
        default: dg_matmul_q8x8((const block_q8x8 *)w, n, k, q, s, m, y); break;
    }
    return 0;
}

/* ---- greedy choice -------------------------------------------------------------------------- */

/* out[r] = the index of row r's largest value, the lowest index among equals, the first NaN's
 * if the row has one: what torch.argmax answers, at a vector max's speed (torch's argmax over
 * 64 x 49152 logits took 0.8 ms here, its amax 0.08 ms). One pass for the maximum, one to find
 * its first position. */
void dg_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float mx = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#if defined(DG_AVX512)
        __m512 vm = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vm = _mm512_max_ps(vm, v);
        }
        nan = unordered != 0;
        mx = _mm512_reduce_max_ps(vm);
#elif defined(DG_AVX2)
        __m256 vm = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            vm = _mm256_max_ps(vm, v);
        }
        nan = _mm256_movemask_ps(unordered) != 0;
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
#endif
        for (; i < n; i++) {
            if (row[i] != row[i]) nan = 1;
            else if (row[i] > mx) mx = row[i];
        }
        int64_t at = 0;
        if (nan) {
            while (row[at] == row[at]) at++;
        } else {
            while (at < n - 1 && row[at] != mx) at++;
        }
        out[r] = at;
    }
}

/* ---- sampling's passes over whole rows -------------------------------------------------------- */

/* out[r] = the first column whose running float64 sum of p[r] exceeds u[r] times the row's total,
 * w - 1 if none does: searchsorted(cumsum(p, float64), u * total, right=True) clamped, as the
 * sampler's torch path draws. torch's float64 cumsum adds a row's values in order, as this does,
 * so both give the same sums and the same column, without a [rows, w] float64 copy (a 64 x 49152
 * draw: 11 ms in torch on one thread). The running sum is kept at every DG_CDF_STEP columns, so
 * the search resumes from the last kept sum at or below the target instead of adding again. */
#define DG_CDF_STEP 128
#define DG_CDF_KEPT 1024
void dg_inverse_cdf(const float *p, int64_t rows, int64_t w, const float *u, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * w >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = p + r * w;
        double kept[DG_CDF_KEPT]; /* kept[j]: the running sum before column j * step */
        int64_t step = DG_CDF_STEP;
        while ((w + step - 1) / step > DG_CDF_KEPT) step *= 2;
        double total = 0.0;
        int64_t nkept = 0;
        for (int64_t i = 0; i < w; i++) {
            if (i % step == 0) kept[nkept++] = total;
            total += (double)row[i];
        }
        const double target = (double)u[r] * total;
        int64_t j = nkept - 1; /* the last kept sum at or below the target: the column is past it */
        while (j > 0 && kept[j] > target) j--;
        double acc = kept[j];
        int64_t at = w - 1;
        for (int64_t i = j * step; i < w; i++) {
            acc += (double)row[i];
            if (acc > target) {
                at = i;
                break;
            }
        }
        out[r] = at;
    }
}

/* The float bits of p >= 0 rise with its value, so their high bits bucket a row by value: the
 * exponent first, then 8 more bits inside the one bucket where the mass reaches top_p. */
#define DG_TOP_BUCKETS 256

/* Per row: the bit pattern `edge` such that the probabilities whose bits are >= edge are the
 * fewest whole buckets, from the top, whose mass (float64) reaches top_p[r]; -1 if they are more
 * than cap tokens (or the row's mass never reaches top_p). */
static int64_t dg_top_edge(const uint32_t *bits, int64_t n, double top_p, int64_t cap) {
    int64_t count[DG_TOP_BUCKETS];
    double mass[DG_TOP_BUCKETS];
    uint32_t shift = 23, prefix = 0, mask = 0; /* level 1: bits >> 23 (the sign bit is 0) */
    int64_t above = 0;
    double cum = 0.0;
    for (int level = 0; level < 2; level++) {
        memset(count, 0, sizeof(count));
        memset(mass, 0, sizeof(mass));
        for (int64_t i = 0; i < n; i++) {
            const uint32_t b = bits[i];
            if ((b & mask) != prefix) continue;
            const uint32_t k = (b >> shift) & (DG_TOP_BUCKETS - 1);
            count[k]++;
            float f;
            memcpy(&f, &b, 4);
            mass[k] += (double)f;
        }
        int k = DG_TOP_BUCKETS - 1;
        for (; k >= 0; k--) {
            if (cum + mass[k] >= top_p) break;
            cum += mass[k];
            above += count[k];
        }
        if (k < 0) return -1;
        const uint32_t edge = prefix | ((uint32_t)k << shift);
        if (above + count[k] <= cap) return (int64_t)edge;
        /* Too many at the edge: split its bucket by the next 8 bits. */
        prefix = edge;
        mask |= (uint32_t)(DG_TOP_BUCKETS - 1) << shift;
        shift -= 8;
    }
    return -1;
}

/* For each row of probabilities p [rows, n] (>= 0) with its top_p: ids[r, :count[r]], in increasing
 * id order, of every token whose probability is at least an edge chosen so that they are the
 * fewest whole value buckets from the top whose mass reaches top_p: a set of the row's largest
 * values (ties at the edge all in) holding the top_p nucleus. The rest of the row, up to cap,
 * is filled with the lowest ids outside the set (distinct padding, for the caller to mask).
 * count[r] = -1 where the set would pass cap ids: that row needs the whole vocabulary. */
void dg_top_mass(const float *p, int64_t rows, int64_t n, const double *top_p, int64_t cap, int64_t *ids,
                 int64_t *count) {
#pragma omp parallel for schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *bits = (const uint32_t *)(const void *)(p + r * n);
        const int64_t edge = dg_top_edge(bits, n, top_p[r], cap);
        int64_t *out = ids + r * cap;
        if (edge < 0) {
            count[r] = -1;
            for (int64_t j = 0; j < cap; j++) out[j] = j < n ? j : 0;
            continue;
        }
        int64_t c = 0, pad = 0;
        for (int64_t i = 0; i < n; i++)
            if (bits[i] >= (uint32_t)edge) out[c++] = i;
        count[r] = c;
        /* Padding: the lowest ids outside the set, distinct from every id in it. */
        for (int64_t i = 0, j = 0; c + pad < cap && i < n; i++) {
            while (j < c && out[j] < i) j++;
            if (j < c && out[j] == i) continue;
            out[c + pad++] = i;
        }
    }
}

static _Thread_local dg_tls_buf dg_rank_tls;

/* top_p over whole rows, as the sampler's torch path applies it: rank each row by s descending,
 * ties by lower id first (a stable sort), sum p (float64, in that order) over the ranks, and set
 * s to -inf from the first rank whose mass above it reaches top_p[r] (+inf: the row is left as it
 * is). The ranking is a stable radix sort of s's bits, 8 bits a pass, skipping bytes that every
 * value shares: ~0.2 ms for 49152 values, where torch's stable sort took 1.5 ms a row. Returns 0
 * if its scratch could not be allocated (nothing changed). */
int dg_top_p_rows(float *s, const float *p, int64_t rows, int64_t n, const double *top_p) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) if (rows * n >= 65536) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        if (!(top_p[r] <= 1.0)) continue;
        uint32_t *key = (uint32_t *)dg_grow(&dg_rank_tls, 4 * (size_t)n * sizeof(uint32_t));
        if (!key) {
            failed = 1;
            continue;
        }
        uint32_t *id = key + n, *key2 = id + n, *id2 = key2 + n;
        float *row = s + r * n;
        const float *prow = p + r * n;
        int64_t count[4][256];
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, row + i, 4);
            b = (b & 0x80000000u) ? ~b : (b | 0x80000000u); /* ascending with the value */
            b = ~b;                                         /* descending */
            key[i] = b, id[i] = (uint32_t)i;
            for (int d = 0; d < 4; d++) count[d][(b >> (8 * d)) & 0xFF]++;
        }
        for (int d = 0; d < 4; d++) {
            if (count[d][(key[0] >> (8 * d)) & 0xFF] == n) continue; /* one byte value: order kept */
            int64_t at[256], sum = 0;
            for (int v = 0; v < 256; v++) at[v] = sum, sum += count[d][v];
            for (int64_t i = 0; i < n; i++) {
                const int64_t j = at[(key[i] >> (8 * d)) & 0xFF]++;
                key2[j] = key[i], id2[j] = id[i];
            }
            uint32_t *t = key;
            key = key2, key2 = t;
            t = id, id = id2, id2 = t;
        }
        double above = 0.0;
        int64_t k = 0;
        for (; k < n && above < top_p[r]; k++) above += (double)prow[id[k]];
        for (; k < n; k++) row[id[k]] = -INFINITY;
    }
    return !failed;
}

/* ---- decode attention over the paged cache --------------------------------------------- */

static inline float dg_scale_at(const void *scales, int64_t i, int half) {
    return half ? dg_half(((const uint16_t *)scales)[i]) : ((const float *)scales)[i];
}

/* Float vectors of the widest kind the build has, for the attention's dot products and sums. */
#if defined(DG_AVX512)
#define DG_VW 16
typedef __m512 dg_vf;
#define dg_vload _mm512_loadu_ps
#define dg_vstore _mm512_storeu_ps
#define dg_vset1 _mm512_set1_ps
#define dg_vzero _mm512_setzero_ps
#define dg_vfma _mm512_fmadd_ps
#define dg_vadd _mm512_add_ps
#define DG_VMAX _mm512_max_ps
#define dg_vsum _mm512_reduce_add_ps
#define dg_vload_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define dg_vload_h(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define dg_vload_b(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(DG_AVX2)
#define DG_VW 8
typedef __m256 dg_vf;
#define dg_vload _mm256_loadu_ps
#define dg_vstore _mm256_storeu_ps
#define dg_vset1 _mm256_set1_ps
#define dg_vzero _mm256_setzero_ps
#define dg_vfma _mm256_fmadd_ps
#define dg_vadd _mm256_add_ps
#define DG_VMAX _mm256_max_ps
#define dg_vsum dg_hsum
#define dg_vload_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define dg_vload_h(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define dg_vload_b(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#endif

static _Thread_local dg_tls_buf dg_attn_tls;

#if defined(DG_AVX512)
/* The fixed lane-sum tree of the 16-key score blocks (dg_scores16_heads, dg_scores16_bf16_heads).
 * Its first two levels: a quarter's 4 keys (16 lane sums each) into one vector, pairs merged within
 * 128-bit lanes. */
static inline __m512 dg_tree_quarter(const __m512 acc[4]) {
    const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
    const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(a0, a1, 0x44), _mm512_shuffle_ps(a0, a1, 0xEE));
}

/* Its last two levels: the four quarters joined across 128-bit lanes into 16 scores, times
 * `scale`; the first `count` are stored. */
static inline void dg_tree_store(const __m512 b[4], int64_t count, float scale, float *out) {
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    const __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << count) - 1u), _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
}

/* Scores of HG (1-3) query heads (qh + g * D) against `count` (<= 16) consecutive K rows of a page,
 * float32, float16 or bfloat16 (kind: DG_KV_*), times `scale`, into out + g * stride [0..count). D is
 * a multiple of 16.
 * Each K vector is loaded (and converted) once for all HG heads. A score is 16 lane sums over D,
 * then a fixed tree over the lanes: pairs merged within 128-bit lanes (unpack, shuffle), then
 * across them (shuffle_f32x4), 16 keys' trees in one pass. Keys go four at a time (HG x 4 sums in
 * registers) through the tree's first two levels; the last two join the four quarters. */
static inline __attribute__((always_inline)) void dg_scores16_heads(const int HG, const float *qh, const void *k,
                                                                    int kind, int64_t count, int64_t D,
                                                                    float scale, float *out, int64_t stride) {
    __m512 b[3][4];
    for (int qq = 0; qq < 4; qq++) {
        __m512 acc[3][4];
        for (int g = 0; g < HG; g++)
            for (int t = 0; t < 4; t++) acc[g][t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) {
            __m512 qv[3];
            for (int g = 0; g < HG; g++) qv[g] = _mm512_loadu_ps(qh + g * D + i);
            for (int t = 0; t < 4; t++) {
                if (4 * qq + t >= count) break;
                const int64_t row = 4 * qq + t;
                const __m512 kv = kind == DG_KV_F16    ? dg_vload_h((const uint16_t *)k + row * D + i)
                                  : kind == DG_KV_BF16 ? dg_vload_b((const uint16_t *)k + row * D + i)
                                                       : _mm512_loadu_ps((const float *)k + row * D + i);
                for (int g = 0; g < HG; g++) acc[g][t] = _mm512_fmadd_ps(qv[g], kv, acc[g][t]);
            }
        }
        for (int g = 0; g < HG; g++) b[g][qq] = dg_tree_quarter(acc[g]);
    }
    for (int g = 0; g < HG; g++) dg_tree_store(b[g], count, scale, out + g * stride);
}

/* The scores of a group's per_kv query heads against one block of (<= 16) K rows, HG <= 3 heads
 * per pass; the element kind and the pass's head count become constants in each branch. */
#define DG_SCORES16_KIND(KIND)                                                                         \
    do {                                                                                               \
        if (n == 3) dg_scores16_heads(3, qh, k, KIND, count, D, scale, o, stride);                     \
        else if (n == 2) dg_scores16_heads(2, qh, k, KIND, count, D, scale, o, stride);                \
        else dg_scores16_heads(1, qh, k, KIND, count, D, scale, o, stride);                            \
    } while (0)
static inline void dg_scores16_group(const float *qg, const void *k, int kind, int64_t count, int64_t D,
                                     float scale, float *out, int64_t stride, int64_t per_kv) {
    for (int64_t g = 0; g < per_kv; g += 3) {
        const int64_t n = per_kv - g < 3 ? per_kv - g : 3;
        const float *qh = qg + g * D;
        float *o = out + g * stride;
        if (kind == DG_KV_F16) DG_SCORES16_KIND(DG_KV_F16);
        else if (kind == DG_KV_BF16) DG_SCORES16_KIND(DG_KV_BF16);
        else DG_SCORES16_KIND(DG_KV_F32);
    }
}
#undef DG_SCORES16_KIND

#if defined(__AVX512BF16__)
/* dg_scores16_heads for a bfloat16 cache on CPUs with bfloat16 pair dot products: the HG query heads
 * come as bfloat16 (qb + g * D), each K row's 32-value vectors are multiplied
 * with them by pairs (vdpbf16ps: two exact products added to a float32 lane per instruction, half
 * the instructions of float32 products and no conversion of K), then the same tree over the lanes.
 * D is a multiple of 32. */
static inline __attribute__((always_inline)) void dg_scores16_bf16_heads(const int HG, const uint16_t *qb,
                                                                         const uint16_t *k, int64_t count,
                                                                         int64_t D, float scale, float *out,
                                                                         int64_t stride) {
    __m512 b[3][4];
    for (int qq = 0; qq < 4; qq++) {
        __m512 acc[3][4];
        for (int g = 0; g < HG; g++)
            for (int t = 0; t < 4; t++) acc[g][t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 32) {
            __m512bh qv[3];
            for (int g = 0; g < HG; g++) qv[g] = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + i));
            for (int t = 0; t < 4; t++) {
                if (4 * qq + t >= count) break;
                const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(k + (4 * qq + t) * D + i));
                for (int g = 0; g < HG; g++) acc[g][t] = _mm512_dpbf16_ps(acc[g][t], qv[g], kv);
            }
        }
        for (int g = 0; g < HG; g++) b[g][qq] = dg_tree_quarter(acc[g]);
    }
    for (int g = 0; g < HG; g++) dg_tree_store(b[g], count, scale, out + g * stride);
}

static inline void dg_scores16_bf16_group(const uint16_t *qb, const uint16_t *k, int64_t count, int64_t D,
                                          float scale, float *out, int64_t stride, int64_t per_kv) {
    for (int64_t g = 0; g < per_kv; g += 3) {
        const int64_t n = per_kv - g < 3 ? per_kv - g : 3;
        const uint16_t *qh = qb + g * D;
        float *o = out + g * stride;
        if (n == 3) dg_scores16_bf16_heads(3, qh, k, count, D, scale, o, stride);
        else if (n == 2) dg_scores16_bf16_heads(2, qh, k, count, D, scale, o, stride);
        else dg_scores16_bf16_heads(1, qh, k, count, D, scale, o, stride);
    }
}

#endif
#endif

/* The largest of n scores, NaNs skipped (as fmaxf does; a maximum rounds nothing, so lanes give
 * the same value as a scalar walk). */
static inline float dg_max_scores(const float *x, int64_t n) {
    float mx = -INFINITY;
    int64_t t = 0;
#if defined(DG_VW)
    dg_vf vm = dg_vset1(-INFINITY);
    /* max_ps(x, m) answers m where x is NaN: a NaN score never becomes the maximum */
    for (; t + DG_VW <= n; t += DG_VW) vm = DG_VMAX(dg_vload(x + t), vm);
    float lanes[DG_VW];
    dg_vstore(lanes, vm);
    for (int i = 0; i < DG_VW; i++) mx = lanes[i] > mx ? lanes[i] : mx;
#endif
    for (; t < n; t++) mx = x[t] > mx ? x[t] : mx;
    return mx;
}

/* The K and V rows the next task of a thread will read, pulled towards L2 a little at a time
 * while the current task computes: the rows of a (sequence, K/V head) are a few short runs in
 * scattered pages, which the hardware's stream prefetch reaches too late to hide the memory's
 * latency (cold, the 30 layers' attention took 2.7x its time with the cache warm). */
typedef struct {
    const char *k, *v;     /* the caches */
    const char *ks, *vs;   /* an int8 cache's scales (NULL: none), scale_bytes each */
    const int64_t *table;  /* the next task's page table */
    int64_t kh, KVH, page_size, row_bytes, scale_bytes, len;
    int64_t run;           /* runs done: the pages of K, then those of V (then K's and V's scales) */
    int64_t runs;          /* 2 or 4 runs a page, 0 when there is no next task */
    const char *at;        /* next line of the current run */
    int64_t left;          /* its bytes left */
} dg_prefetch;

#define DG_PF_STRIDE 64

static inline void dg_prefetch_start(dg_prefetch *pf, const void *k, const void *v, const void *ks,
                                     const void *vs, int64_t scale_bytes, const int64_t *table, int64_t kh,
                                     int64_t KVH, int64_t page_size, int64_t row_bytes, int64_t len) {
    const int64_t pages = (len + page_size - 1) / page_size;
    pf->k = (const char *)k, pf->v = (const char *)v, pf->ks = (const char *)ks, pf->vs = (const char *)vs;
    pf->table = table, pf->kh = kh, pf->KVH = KVH, pf->page_size = page_size, pf->row_bytes = row_bytes;
    pf->scale_bytes = ks ? scale_bytes : 0, pf->len = len;
    pf->run = 0, pf->runs = table ? (ks ? 4 : 2) * pages : 0, pf->at = NULL, pf->left = 0;
}

/* The lines a task's prefetch issues in all (for spreading them over the current task). */
static inline int64_t dg_prefetch_lines(const dg_prefetch *pf) {
    return pf->runs ? 2 * pf->len * (pf->row_bytes + pf->scale_bytes) / DG_PF_STRIDE : 0;
}

/* Issue the next n prefetches of the stream. */
static inline void dg_prefetch_step(dg_prefetch *pf, int64_t n) {
    for (; n > 0; n--) {
        if (pf->left <= 0) {
            if (pf->run >= pf->runs) return;
            const int64_t pages = pf->runs / (pf->ks ? 4 : 2), p = pf->run % pages, part = pf->run / pages;
            const int64_t rows = p == pages - 1 ? pf->len - p * pf->page_size : pf->page_size;
            const int64_t slot = (pf->table[p] * pf->KVH + pf->kh) * pf->page_size;
            const int64_t bytes = part < 2 ? pf->row_bytes : pf->scale_bytes;
            pf->at = (part == 0 ? pf->k : part == 1 ? pf->v : part == 2 ? pf->ks : pf->vs) + slot * bytes;
            pf->left = rows * bytes;
            pf->run++;
        }
        __builtin_prefetch(pf->at, 0, 2);
        pf->at += DG_PF_STRIDE, pf->left -= DG_PF_STRIDE;
    }
}

#if defined(DG_AVX512)
/* o[a] (HG heads of D = 16 * NV values, D apart) = the sum over rows t < len of p[a * len + t] *
 * V[t]: each V row of the page table read once for the HG heads, HG * NV sums side by side (one
 * head's NV sums form a chain as long as the rows, bound by the FMA's latency). Called with
 * constant HG and NV where it matters, so the loops unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void dg_pv_heads(const int HG, const int NV, const float *p, int64_t len,
                                                              const void *v_cache, int kind, const int64_t *table,
                                                              int64_t KVH, int64_t kh, int64_t page_size, int64_t D,
                                                              dg_prefetch *pf, int64_t pf_step, int prefetch,
                                                              float *o) {
    __m512 acc[4][4];
    for (int a = 0; a < HG; a++)
        for (int v = 0; v < NV; v++) acc[a][v] = _mm512_setzero_ps();
    for (int64_t pg = 0, t = 0; t < len; pg++) {
        const int64_t base = (table[pg] * KVH + kh) * page_size;
        const int64_t count = len - t < page_size ? len - t : page_size;
        for (int64_t j = 0; j < count; j++, t++) {
            if (prefetch && t % 16 == 0) dg_prefetch_step(pf, pf_step);
            __m512 vr[4];
            for (int v = 0; v < NV; v++)
                vr[v] = kind == DG_KV_F16    ? dg_vload_h((const uint16_t *)v_cache + (base + j) * D + 16 * v)
                        : kind == DG_KV_BF16 ? dg_vload_b((const uint16_t *)v_cache + (base + j) * D + 16 * v)
                                             : _mm512_loadu_ps((const float *)v_cache + (base + j) * D + 16 * v);
            for (int a = 0; a < HG; a++) {
                const __m512 pv = _mm512_set1_ps(p[a * len + t]);
                for (int v = 0; v < NV; v++) acc[a][v] = _mm512_fmadd_ps(pv, vr[v], acc[a][v]);
            }
        }
    }
    for (int a = 0; a < HG; a++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(o + a * D + 16 * v, acc[a][v]);
}
#endif

#if defined(DG_AVX512) && defined(__AVX512BF16__)
/* o[a] (HG heads of D = 32 * NW values, D apart) = the sum over rows t < len of p * V[t] for a
 * bfloat16 cache, two rows at a time through bfloat16 pair dot products: pb holds each head's
 * weights as bfloat16 pairs (p[t], p[t + 1]) (pb + a * pstride), rows t and t + 1 are interleaved
 * by 16-bit element (a missing row t + 1 is zeros), and each lane sums p[t] V[t][d] + p[t + 1]
 * V[t + 1][d] for one d. The interleave permutes d within each 32 values; the stores undo it. */
static inline __attribute__((always_inline)) void dg_pv_bf16_heads(const int HG, const int NW, const uint32_t *pb,
                                                                   int64_t pstride, int64_t len,
                                                                   const uint16_t *v_cache, const int64_t *table,
                                                                   int64_t KVH, int64_t kh, int64_t page_size,
                                                                   int64_t D, dg_prefetch *pf, int64_t pf_step,
                                                                   int prefetch, float *o) {
    __m512 lo[4][2], hi[4][2];
    for (int a = 0; a < HG; a++)
        for (int w = 0; w < NW; w++) lo[a][w] = hi[a][w] = _mm512_setzero_ps();
    int64_t pg = 0, off = 0; /* the next row's page-table entry and slot in its page */
    for (int64_t t = 0; t < len; t += 2) {
        if (prefetch && t % 16 == 0) dg_prefetch_step(pf, pf_step);
        const uint16_t *r0 = v_cache + ((table[pg] * KVH + kh) * page_size + off) * D, *r1 = NULL;
        if (++off == page_size) pg++, off = 0;
        if (t + 1 < len) {
            r1 = v_cache + ((table[pg] * KVH + kh) * page_size + off) * D;
            if (++off == page_size) pg++, off = 0;
        }
        __m512bh vl[2], vh[2];
        for (int w = 0; w < NW; w++) {
            const __m512i x0 = _mm512_loadu_si512((const void *)(r0 + 32 * w));
            const __m512i x1 = r1 ? _mm512_loadu_si512((const void *)(r1 + 32 * w)) : _mm512_setzero_si512();
            vl[w] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            vh[w] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        }
        for (int a = 0; a < HG; a++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[a * pstride + t / 2]);
            for (int w = 0; w < NW; w++) {
                lo[a][w] = _mm512_dpbf16_ps(lo[a][w], pp, vl[w]);
                hi[a][w] = _mm512_dpbf16_ps(hi[a][w], pp, vh[w]);
            }
        }
    }
    /* lo's lane 4L + j holds d = 8L + j, hi's d = 8L + 4 + j (the interleave works in 128-bit lanes) */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int a = 0; a < HG; a++)
        for (int w = 0; w < NW; w++) {
            _mm512_storeu_ps(o + a * D + 32 * w, _mm512_permutex2var_ps(lo[a][w], first, hi[a][w]));
            _mm512_storeu_ps(o + a * D + 32 * w + 16, _mm512_permutex2var_ps(lo[a][w], second, hi[a][w]));
        }
}
#endif

#define DG_MAX_SHARES 64 /* threads the attention's tasks are shared out to, at most */

/* The next task of a thread's share (share[at], ending at share[DG_MAX_SHARES + at]), or of the next
 * share with any left once its own is done; -1 when all are. */
static inline int64_t dg_claim(int64_t *share, int threads, int *at) {
    for (int tries = 0; tries < threads; tries++) {
        const int64_t c = __atomic_fetch_add(&share[*at], 1, __ATOMIC_RELAXED);
        if (c < share[DG_MAX_SHARES + *at]) return c;
        *at = (*at + 1) % threads;
    }
    return -1;
}

/* Threads for ntask attention tasks (cost[i]: keys task i reads, summing to total), and each one's
 * contiguous share of the task order: thread t's starts at the first task whose costs before it
 * reach t / threads of the total (share[t]; its end at share[DG_MAX_SHARES + t]). */
static int dg_share_tasks(const int64_t *cost, int64_t ntask, int64_t total, int64_t *share) {
    int threads = omp_get_max_threads();
    if (threads > DG_MAX_SHARES) threads = DG_MAX_SHARES;
    if (threads > ntask) threads = ntask > 1 ? (int)ntask : 1;
    for (int64_t t = 0, i = 0, before = 0; t < threads; t++) {
        for (; i < ntask && before < total * t / threads; i++) before += cost[i];
        share[t] = i;
    }
    for (int t = 0; t < threads; t++) share[DG_MAX_SHARES + t] = t + 1 < threads ? share[t + 1] : ntask;
    return threads;
}

#if defined(DG_AMX)
/* ---- attention on AMX tiles (a bfloat16 or int8 cache, head_dim 32 or 64) -----------------------
 * A task is up to 16 query vectors of one K/V head: the group's query heads of up to 16 / per_kv
 * consecutive rows of one sequence (a verify step's or a prefill chunk's tokens), so one pass over
 * the keys serves all of them; or of up to 16 / per_kv decode rows of as many sequences whose page
 * tables begin with the same pages (a prompt the prefix cache shares), so one pass over those pages
 * serves them all, and each row then adds its own keys to its sums (its rows of the sum tiles are
 * stored and loaded back: float32, exact).
 * - Scores: a 16-key block of K rows is a tile as the cache holds it (16 rows of 32 bfloat16), the
 *   queries (bfloat16, as the vector path rounds them) are the other operand, paired by dimension;
 *   C[key][query] = one tdpbf16ps per 32 dimensions. A score's arithmetic depends only on its query
 *   and key, so a row gets the same scores in any group, alone included.
 * - Softmax: per query vector over its own row's keys, exactly as alone (the same code and length).
 * - Sums over V: the weights (bfloat16) are a tile of 16 query vectors by 32 keys; V's rows t, t+1
 *   interleaved by 16-bit element (as dg_pv_bf16_heads does) are the other, and each 32-key block
 *   adds one tdpbf16ps per 16 output values. A row shorter than its group's longest adds products
 *   of zero weights past its own keys (V rows past the longest are zeroed, whatever a page holds).
 * Per layer on the 2-core Intel AMX part, against the 512-bit path: 16 verify rows at 800 keys
 * 234 -> 91 us, a 64-row prefill chunk at 600 keys 673 -> 235 us, one row 30 -> 26 us, 64 decode
 * rows at 800 keys 1232 -> 1142 us (those read the memory's rate of K/V). vdpbf16ps runs at a
 * quarter of an FMA's rate there, so its 512-bit pair products gained nothing on float32's. */
static _Thread_local dg_tls_buf dg_amx_tls;

#define DG_AMX_Q 16

/* The cache a tile task reads: bfloat16 K/V, or int8 with a scale per (page, head, slot) (float32,
 * or float16 where `half`), whose rows become bfloat16 exactly (|q| <= 127 needs 7 bits). */
typedef struct {
    const void *k, *v, *ks, *vs; /* ks, vs: NULL for bfloat16 */
    int half;
    int64_t KVH, page_size, D;
} dg_amx_cache;

/* Slot t of (sequence table, head kh): its index in the cache's [pages, KVH, page_size] order. */
static inline int64_t dg_amx_slot(const dg_amx_cache *kv, const int64_t *table, int64_t kh, int64_t t) {
    return (table[t / kv->page_size] * kv->KVH + kh) * kv->page_size + t % kv->page_size;
}

/* 32 int8 values as 32 bfloat16, exactly. */
static inline __m512i dg_i8x32_bf16(const int8_t *p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* n (<= 16) scales from slot `at` on, as floats (zeros past n). */
static inline __m512 dg_amx_scales(const dg_amx_cache *kv, const void *scales, int64_t at, int64_t n) {
    const __mmask16 m = (__mmask16)(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1u);
    if (kv->half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)scales + at));
    return _mm512_maskz_loadu_ps(m, (const float *)scales + at);
}

/* A bfloat16 cache's scores of the group's Q query vectors for keys t0.. (16 at a time) of a task
 * whose longest row sees L keys, times `scale`, into sc + c * ls (c < Q): tile 0 the sums, 1-2 K,
 * 3-4 the queries. */
static inline void dg_amx_scores(const dg_amx_cache *kv, const int64_t *table, int64_t kh, int64_t t_begin,
                                 int64_t L, int64_t c0, int64_t c1, float scale, float *sc, int64_t ls, float *ctmp,
                                 dg_prefetch *pf, int64_t pf_step) {
    const int64_t D = kv->D;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(DG_AMX_Q));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = t_begin; t0 < L; t0 += 16) {
        const int64_t slot = dg_amx_slot(kv, table, kh, t0), count = L - t0 < 16 ? L - t0 : 16;
        const uint16_t *rows = (const uint16_t *)kv->k + slot * D;
        _tile_zero(0);
        _tile_loadd(1, rows, D * 2);
        _tile_dpbf16ps(0, 1, 3);
        if (D == 64) {
            _tile_loadd(2, rows + 32, D * 2);
            _tile_dpbf16ps(0, 2, 4);
        }
        _tile_stored(0, ctmp, DG_AMX_Q * 4);
        dg_prefetch_step(pf, pf_step);
        const __mmask16 keep = (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1u);
        for (int64_t c = c0; c < c1; c++)
            _mm512_mask_storeu_ps(sc + c * ls + t0, keep, _mm512_mul_ps(_mm512_i32gather_ps(idx, ctmp + c, 4), vscale));
    }
}

/* An int8 cache's scores: the block's K rows go to the tile as the cache holds them (tile 6, D bytes
 * a row) against the group's queries quantized to int8 (tile 3, [D / 4][16][4]), one tdpbssd a block
 * of 16 keys. The int32 sums are exact, so a query's scores have the same bits in any task; each
 * becomes float times its key's scale, then times its query's scale and `scale` (qf[c]). */
static inline void dg_amx_scores_i8(const dg_amx_cache *kv, const int64_t *table, int64_t kh, int64_t t_begin,
                                    int64_t L, int64_t c0, int64_t c1, const float *qf, float *sc, int64_t ls,
                                    int32_t *ctmp, dg_prefetch *pf, int64_t pf_step) {
    const int64_t D = kv->D;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(DG_AMX_Q));
    for (int64_t t0 = t_begin; t0 < L; t0 += 16) {
        const int64_t slot = dg_amx_slot(kv, table, kh, t0), count = L - t0 < 16 ? L - t0 : 16;
        _tile_zero(0);
        _tile_loadd(6, (const int8_t *)kv->k + slot * D, D);
        _tile_dpbssd(0, 6, 3);
        _tile_stored(0, ctmp, DG_AMX_Q * 4);
        dg_prefetch_step(pf, pf_step);
        const __mmask16 keep = (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1u);
        const __m512 ks = dg_amx_scales(kv, kv->ks, slot, count);
        for (int64_t c = c0; c < c1; c++) {
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_i32gather_epi32(idx, ctmp + c, 4)), ks);
            _mm512_mask_storeu_ps(sc + c * ls + t0, keep, _mm512_mul_ps(s, _mm512_set1_ps(qf[c])));
        }
    }
}

/* Query vector qv (D values) as int8 at `scale_out`'s scale (absmax / 127, rounded to nearest even),
 * its 4-value groups into q8 + 4c, 64 bytes apart (tile 3's layout). */
static inline void dg_amx_query_i8(const float *qv, int64_t D, int64_t c, int8_t *q8, float *scale_out) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(qv + i)));
    const float absmax = _mm512_reduce_max_ps(mx);
    const __m512 inv = _mm512_set1_ps(absmax > 0.0f ? 127.0f / absmax : 0.0f);
    for (int64_t i = 0; i < D; i += 16) {
        int32_t quads[4];
        _mm_storeu_si128((__m128i *)quads,
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qv + i), inv))));
        for (int j = 0; j < 4; j++) memcpy(q8 + (i / 4 + j) * 64 + 4 * c, quads + j, 4);
    }
    *scale_out = absmax / 127.0f;
}

/* Softmax of one query vector's `len` scores (sg), as bfloat16 weights into pw [0, lp): zeros past len.
 * An int8 cache's V scales go into the weights (each weight times its row's scale, then rounded). */
static inline void dg_amx_softmax(const dg_amx_cache *kv, const int64_t *table, int64_t kh, float *sg, int64_t len,
                                  int64_t lp, uint16_t *pw) {
    const float mx = dg_max_scores(sg, len);
    __m512 vs = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 m = (__mmask16)(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1u);
        const __m512 e = _mm512_maskz_mov_ps(m, dg_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t),
                                                                          _mm512_set1_ps(mx))));
        _mm512_mask_storeu_ps(sg + t, m, e);
        vs = _mm512_add_ps(vs, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vs));
    for (int64_t t = 0; t < lp; t += 32) {
        const int64_t n = len - t < 0 ? 0 : len - t;
        const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u);
        const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xFFFF : n <= 16 ? 0 : (1u << (n - 16)) - 1u);
        __m512 lo = _mm512_mul_ps(_mm512_maskz_loadu_ps(m0, sg + t), inv);
        __m512 hi = _mm512_mul_ps(_mm512_maskz_loadu_ps(m1, sg + t + 16), inv);
        if (kv->ks && n > 0) { /* 32-key blocks never cross a page (pages of 32s) */
            const int64_t slot = dg_amx_slot(kv, table, kh, t);
            lo = _mm512_mul_ps(lo, dg_amx_scales(kv, kv->vs, slot, n));
            hi = _mm512_mul_ps(hi, dg_amx_scales(kv, kv->vs, slot + 16, n - 16));
        }
        _mm512_storeu_si512((void *)(pw + t), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* One V row's 32 values from `i` as bfloat16 (zeros for a row past the task's keys). */
static inline __m512i dg_amx_vrow(const dg_amx_cache *kv, int64_t slot, int64_t i, int live) {
    if (!live) return _mm512_setzero_si512();
    if (kv->ks) return dg_i8x32_bf16((const int8_t *)kv->v + slot * kv->D + i);
    return _mm512_loadu_si512((const void *)((const uint16_t *)kv->v + slot * kv->D + i));
}

/* O[c] += sum over keys t in the 32-key blocks [t_begin, t_end) (live below L) of w[c][t] V[t]: tiles 4-7
 * the sums (zeroed first where `fresh`), 1 the weights (rows of pw, ls apart), 2 the interleaved V rows. */
static inline void dg_amx_pv(const dg_amx_cache *kv, const int64_t *table, int64_t kh, int64_t L, int64_t t_begin,
                             int64_t t_end, int fresh, const uint16_t *pw, int64_t ls, uint32_t *vb, dg_prefetch *pf,
                             int64_t pf_step) {
    const int64_t halves = kv->D / 32;
    if (fresh) {
        _tile_zero(4);
        _tile_zero(5);
        if (halves == 2) {
            _tile_zero(6);
            _tile_zero(7);
        }
    }
    for (int64_t t0 = t_begin; t0 < t_end; t0 += 32) {
        const int64_t slot = dg_amx_slot(kv, table, kh, t0); /* a 32-key block stays in its page */
        for (int64_t i = 0; i < 16; i++) {
            const int64_t t = t0 + 2 * i;
            for (int64_t h = 0; h < halves; h++) {
                const __m512i x0 = dg_amx_vrow(kv, slot + 2 * i, 32 * h, t < L);
                const __m512i x1 = dg_amx_vrow(kv, slot + 2 * i + 1, 32 * h, t + 1 < L);
                _mm512_storeu_si512((void *)(vb + (2 * h) * 256 + 16 * i), _mm512_unpacklo_epi16(x0, x1));
                _mm512_storeu_si512((void *)(vb + (2 * h + 1) * 256 + 16 * i), _mm512_unpackhi_epi16(x0, x1));
            }
        }
        dg_prefetch_step(pf, pf_step);
        _tile_loadd(1, pw + t0, ls * 2);
        _tile_loadd(2, vb, 64);
        _tile_dpbf16ps(4, 1, 2);
        _tile_loadd(2, vb + 256, 64);
        _tile_dpbf16ps(5, 1, 2);
        if (halves == 2) {
            _tile_loadd(2, vb + 512, 64);
            _tile_dpbf16ps(6, 1, 2);
            _tile_loadd(2, vb + 768, 64);
            _tile_dpbf16ps(7, 1, 2);
        }
    }
}

/* Decode rows whose page tables begin with the same pages (a shared prompt) attend as one task once
 * they share at least this many keys. */
#define DG_AMX_SHARE_MIN 64

static int64_t dg_amx_shared_tasks = 0; /* such tasks run in this process (tests check they happen) */

typedef struct {
    int64_t page, row;
} dg_amx_lead;

static int dg_amx_lead_cmp(const void *a, const void *b) {
    const dg_amx_lead *x = (const dg_amx_lead *)a, *y = (const dg_amx_lead *)b;
    if (x->page != y->page) return x->page < y->page ? -1 : 1;
    return x->row < y->row ? -1 : x->row > y->row;
}

static void dg_attention_amx(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                             const void *k_scale, const void *v_scale, int scale_half, const int64_t *page_tables, int64_t max_pages, const int64_t *row_seq,
                             const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                             int64_t page_size, float scale, float *out) {
    const int64_t per_kv = H / KVH, group = DG_AMX_Q / per_kv;
    const dg_amx_cache kv = {k_cache, v_cache, k_scale, v_scale, scale_half, KVH, page_size, D};
    const int i8 = k_scale != NULL;
    const int64_t row_bytes = D * (i8 ? 1 : 2);
    /* Tasks (first, rows, K/V head, shared keys), each group head by head; at most B * KVH of them:
     * - shared < 0: rows first.. of one sequence (a verify step's or a prefill chunk's tokens), which
     *   read its keys up to the longest row's;
     * - shared >= 0: rows gm[first..], each the only row of its sequence in the step, whose first
     *   `shared` keys lie on the same pages: those keys' scores and V sums are made once for all the
     *   rows, then each row's own keys are added to its sums alone. */
    const size_t most = (size_t)(B * KVH);
    int64_t *tasks = (int64_t *)malloc((5 * most + 2 * DG_MAX_SHARES + 7 * (size_t)B) * sizeof(int64_t));
    if (!tasks) abort();
    int64_t *cost = tasks + 4 * most, *share = cost + most, *gm = share + 2 * DG_MAX_SHARES;
    /* by row: its group's first member in gm (-1: none; -2: a member, not the first), their count and
     * the keys they share */
    int64_t *gfirst = gm + B, *gcount = gfirst + B, *gshared = gcount + B;
    dg_amx_lead *lead = (dg_amx_lead *)(gshared + B);
#define DG_AMX_TABLE(r) (page_tables + (row_seq ? row_seq[r] : (r)) * max_pages)
    int64_t total = 0, ntask = 0, nlead = 0, placed = 0;
    for (int64_t r = 0; r < B; r++) {
        const int64_t seq = row_seq ? row_seq[r] : r;
        const int alone = !row_seq || ((r == 0 || row_seq[r - 1] != seq) && (r + 1 == B || row_seq[r + 1] != seq));
        gfirst[r] = -1;
        if (alone && seq_lens[r] >= DG_AMX_SHARE_MIN) lead[nlead].page = page_tables[seq * max_pages], lead[nlead++].row = r;
    }
    if (nlead > 1) qsort(lead, (size_t)nlead, sizeof *lead, dg_amx_lead_cmp);
    for (int64_t i = 0, j; i < nlead; i = j) {
        const int64_t r0 = lead[i].row;
        const int64_t *t0 = DG_AMX_TABLE(r0);
        int64_t keys = seq_lens[r0] / 32 * 32; /* shared so far: whole 32-key blocks every row sees */
        for (j = i + 1; j < nlead && j - i < group && lead[j].page == lead[i].page; j++) {
            const int64_t r = lead[j].row, len = seq_lens[r] / 32 * 32, upto = len < keys ? len : keys;
            const int64_t *t = DG_AMX_TABLE(r);
            int64_t c = 0;
            while (c < upto && t[c / page_size] == t0[c / page_size]) c += page_size;
            if (c > upto) c = upto;
            if (c < DG_AMX_SHARE_MIN) break;
            keys = c;
        }
        if (j - i < 2) continue;
        gfirst[r0] = placed, gcount[r0] = j - i, gshared[r0] = keys;
        for (int64_t k = i; k < j; k++) {
            if (k > i) gfirst[lead[k].row] = -2;
            gm[placed++] = lead[k].row;
        }
    }
    for (int64_t s = 0; s < B;) {
        int64_t e = s + 1;
        while (row_seq && e < B && row_seq[e] == row_seq[s]) e++;
        if (gfirst[s] >= 0) {
            const int64_t f = gfirst[s], n = gcount[s], shared = gshared[s];
            int64_t c = 16 + shared;
            for (int64_t k = 0; k < n; k++) c += 16 + seq_lens[gm[f + k]] - shared;
            for (int64_t kh = 0; kh < KVH; kh++, ntask++) {
                tasks[4 * ntask] = f, tasks[4 * ntask + 1] = n, tasks[4 * ntask + 2] = kh, tasks[4 * ntask + 3] = shared;
                cost[ntask] = c, total += c;
            }
            __atomic_fetch_add(&dg_amx_shared_tasks, KVH, __ATOMIC_RELAXED);
        } else if (gfirst[s] == -1) {
            for (int64_t kh = 0; kh < KVH; kh++)
                for (int64_t r = s; r < e; r += group, ntask++) {
                    const int64_t rows = e - r < group ? e - r : group;
                    tasks[4 * ntask] = r, tasks[4 * ntask + 1] = rows, tasks[4 * ntask + 2] = kh, tasks[4 * ntask + 3] = -1;
                    cost[ntask] = 16 + seq_lens[r + rows - 1], total += cost[ntask];
                }
        }
        s = e;
    }
    const int threads = dg_share_tasks(cost, ntask, total, share);
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const int64_t halves = D / 32;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        dg_tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
        if (i8) /* K rows of D int8 (tile 6, unused by the V sums at D = 32) against D / 4 query groups */
            cfg.colsb[6] = (uint16_t)D, cfg.rows[3] = (uint8_t)(D / 4);
        _tile_loadconfig(&cfg);
        int at = omp_get_thread_num() % threads;
        for (int64_t next = dg_claim(share, threads, &at), after; next >= 0; next = after) {
            after = dg_claim(share, threads, &at);
            const int64_t f = tasks[4 * next], rows = tasks[4 * next + 1], kh = tasks[4 * next + 2];
            const int64_t shared = tasks[4 * next + 3];
            const int64_t Q = rows * per_kv;
#define DG_AMX_ROW(f, shared, i) ((shared) < 0 ? (f) + (i) : gm[(f) + (i)])
            int64_t L = 0;
            for (int64_t i = 0; i < rows; i++) {
                const int64_t len = seq_lens[DG_AMX_ROW(f, shared, i)];
                L = len > L ? len : L;
            }
            const int64_t lp = (L + 31) / 32 * 32; /* keys in whole 32-key blocks */
            const int64_t *table = DG_AMX_TABLE(DG_AMX_ROW(f, shared, 0));
            /* The next task's keys (its first row's), where they are not this task's. */
            int64_t nr = 0, nkh = 0, nlen = 0;
            if (after >= 0) {
                const int64_t af = tasks[4 * after], ashared = tasks[4 * after + 3];
                nr = DG_AMX_ROW(af, ashared, 0), nkh = tasks[4 * after + 2];
                nlen = ashared < 0 ? seq_lens[af + tasks[4 * after + 1] - 1] : seq_lens[nr];
            }
            const int fetch = after >= 0 && (DG_AMX_TABLE(nr) != table || nkh != kh);
            dg_prefetch pf;
            dg_prefetch_start(&pf, k_cache, v_cache, k_scale, v_scale, scale_half ? 2 : 4,
                              fetch ? DG_AMX_TABLE(nr) : NULL, nkh, KVH, page_size, row_bytes, fetch ? nlen : 0);
            const int64_t blocks = (L + 15) / 16 + lp / 32;
            const int64_t pf_step = 1 + dg_prefetch_lines(&pf) / blocks;
            /* scratch: scores [16][lp], weights [32][lp] bfloat16 (a row's own keys read 16 rows from
             * its first), queries 2 x [16][16] pairs (int8: [16][16][4]), V pairs 4 x [16][16], a tile
             * of sums [16][16], outputs 4 x [16][16] (and 16 rows past them), a row's own sums 4 x [16][16] */
            const size_t floats = (size_t)(DG_AMX_Q * lp + DG_AMX_Q * lp + 2 * 256 + 4 * 256 + 256 + 5 * 256 +
                                           4 * 256 + 16);
            float *sc = (float *)dg_grow(&dg_amx_tls, floats * sizeof(float));
            if (!sc) abort();
            uint16_t *pw = (uint16_t *)(sc + DG_AMX_Q * lp);
            uint32_t *qb = (uint32_t *)(sc + DG_AMX_Q * lp + DG_AMX_Q * lp);
            uint32_t *vb = qb + 2 * 256;
            float *ctmp = (float *)(vb + 4 * 256), *otmp = ctmp + 256, *mtmp = otmp + 5 * 256;
            /* queries as bfloat16 pairs by dimension: qb[h][i][c] = (q_c[32h + 2i], q_c[32h + 2i + 1]);
             * for an int8 cache, as int8 4-value groups (dg_amx_query_i8) */
            memset(qb, 0, 2 * 256 * sizeof(uint32_t));
            float qf[DG_AMX_Q]; /* int8: each query's scale times `scale` */
            for (int64_t c = 0; c < Q; c++) {
                const float *qv = q + DG_AMX_ROW(f, shared, c / per_kv) * q_stride + (kh * per_kv + c % per_kv) * D;
                if (i8) {
                    dg_amx_query_i8(qv, D, c, (int8_t *)qb, qf + c);
                    qf[c] *= scale;
                    continue;
                }
                for (int64_t h = 0; h < D / 32; h++) {
                    uint32_t pairs[16];
                    _mm512_storeu_si512((void *)pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qv + 32 * h + 16),
                                                                                    _mm512_loadu_ps(qv + 32 * h)));
                    for (int i = 0; i < 16; i++) qb[h * 256 + i * 16 + c] = pairs[i];
                }
            }
            _tile_loadd(3, qb, 64);
            if (!i8 && D == 64) _tile_loadd(4, qb + 256, 64);
            /* Scores: the keys all rows read (the shared ones, or a sequence's), then a row's own. */
            const int64_t common = shared < 0 ? L : shared;
            if (i8)
                dg_amx_scores_i8(&kv, table, kh, 0, common, 0, Q, qf, sc, lp, (int32_t *)ctmp, &pf, pf_step);
            else
                dg_amx_scores(&kv, table, kh, 0, common, 0, Q, scale, sc, lp, ctmp, &pf, pf_step);
            for (int64_t i = 0; shared >= 0 && i < rows; i++) {
                const int64_t r = gm[f + i], c0 = i * per_kv;
                if (i8)
                    dg_amx_scores_i8(&kv, DG_AMX_TABLE(r), kh, shared, seq_lens[r], c0, c0 + per_kv, qf, sc, lp,
                                     (int32_t *)ctmp, &pf, pf_step);
                else
                    dg_amx_scores(&kv, DG_AMX_TABLE(r), kh, shared, seq_lens[r], c0, c0 + per_kv, scale, sc, lp, ctmp,
                                  &pf, pf_step);
            }
            for (int64_t c = 0; c < Q; c++) {
                const int64_t r = DG_AMX_ROW(f, shared, c / per_kv);
                dg_amx_softmax(&kv, DG_AMX_TABLE(r), kh, sc + c * lp, seq_lens[r], lp, pw + c * lp);
            }
            /* V sums over the shared keys; then each row's own from its queries' sums so far (tiles
             * 4-7 loaded from its rows on: its sums are the tile's first rows, the rest discarded) */
            dg_amx_pv(&kv, table, kh, L, 0, shared < 0 ? lp : shared, 1, pw, lp, vb, &pf, pf_step);
            _tile_stored(4, otmp, 64);
            _tile_stored(5, otmp + 256, 64);
            if (halves == 2) {
                _tile_stored(6, otmp + 512, 64);
                _tile_stored(7, otmp + 768, 64);
            }
            for (int64_t i = 0; shared >= 0 && i < rows; i++) {
                const int64_t r = gm[f + i], own = (seq_lens[r] + 31) / 32 * 32;
                if (own <= shared) continue;
                float *oi = otmp + i * per_kv * 16;
                _tile_loadd(4, oi, 64);
                _tile_loadd(5, oi + 256, 64);
                if (halves == 2) {
                    _tile_loadd(6, oi + 512, 64);
                    _tile_loadd(7, oi + 768, 64);
                }
                dg_amx_pv(&kv, DG_AMX_TABLE(r), kh, seq_lens[r], shared, own, 0, pw + i * per_kv * lp, lp, vb, &pf,
                          pf_step);
                _tile_stored(4, mtmp, 64);
                _tile_stored(5, mtmp + 256, 64);
                if (halves == 2) {
                    _tile_stored(6, mtmp + 512, 64);
                    _tile_stored(7, mtmp + 768, 64);
                }
                for (int64_t h = 0; h < 2 * halves; h++)
                    memcpy(oi + h * 256, mtmp + h * 256, (size_t)per_kv * 16 * sizeof(float));
            }
            for (int64_t c = 0; c < Q; c++) {
                float *o = out + DG_AMX_ROW(f, shared, c / per_kv) * H * D + (kh * per_kv + c % per_kv) * D;
                for (int64_t h = 0; h < D / 32; h++) {
                    const __m512 lo = _mm512_loadu_ps(otmp + (2 * h) * 256 + c * 16);
                    const __m512 hi = _mm512_loadu_ps(otmp + (2 * h + 1) * 256 + c * 16);
                    _mm512_storeu_ps(o + 32 * h, _mm512_permutex2var_ps(lo, first, hi));
                    _mm512_storeu_ps(o + 32 * h + 16, _mm512_permutex2var_ps(lo, second, hi));
                }
            }
#undef DG_AMX_ROW
#undef DG_AMX_TABLE
        }
        _tile_release();
    }
    free(tasks);
}
#endif

/* How many tile attention tasks have served rows of several sequences at once (0 without tiles). */
int64_t dg_shared_attention_tasks(void) {
#if defined(DG_AMX)
    return __atomic_load_n(&dg_amx_shared_tasks, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* Whether a bfloat16 or int8 cache of this geometry is attended on tiles here: heads of 32 or 64
 * values, pages of 32s (a 32-key block stays in its page), at most 16 query heads per K/V head (a
 * tile's columns), and the tiles on. The dispatch below and `--kv-cache auto` both ask it. */
int dg_amx_attends(int64_t H, int64_t KVH, int64_t D, int64_t page_size) {
#if defined(DG_AMX)
    return (D == 64 || D == 32) && page_size % 32 == 0 && KVH > 0 && H % KVH == 0 && H / KVH <= DG_AMX_Q &&
           dg_set_amx(DG_TILES_ATTENTION, -1);
#else
    (void)H, (void)KVH, (void)D, (void)page_size;
    return 0;
#endif
}

/* One query row per task group: q [B, H, D] (row b at q + b * q_stride); the caches are
 * [pages, KVH, page_size, D], float32, float16 or bfloat16 (kv_kind: DG_KV_*) or, with scales, int8
 * with one scale per
 * (page, head, slot), float32 or float16 (scale_half); row b reads page table row_seq[b] of
 * page_tables [*, max_pages] (b itself where row_seq is NULL) and sees its first seq_lens[b] keys;
 * out [B, H * D]. Query heads h share K/V head h / (H / KVH). Work is split over (row, K/V head);
 * each task walks its page table page by page, scores every query head of the group against one
 * K row read, and sums V rows into each head's output held in registers (a head's D values at a
 * time, up to 128).
 *
 * A row's arithmetic depends on nothing but its query, its keys and its length, so a step with
 * query chunks (prefill, mixed steps, speculative verification) runs each chunk token as a row
 * of its own (row_seq naming its sequence) and gets, bit for bit, what decoding that token alone
 * would: a job's tokens do not depend on how its prompt and output were split into steps (a
 * resumed job, a prefix-cache hit, a verified draft). */
void dg_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                         const void *k_scale, const void *v_scale, int scale_half, int kv_kind,
                         const int64_t *page_tables, int64_t max_pages, const int64_t *row_seq,
                         const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t page_size,
                         float scale, float *out) {
#if defined(DG_AMX)
    if ((k_scale != NULL || kv_kind == DG_KV_BF16) && dg_amx_attends(H, KVH, D, page_size)) {
        dg_attention_amx(q, q_stride, k_cache, v_cache, k_scale, v_scale, scale_half, page_tables, max_pages, row_seq,
                         seq_lens, B, H, KVH, D, page_size, scale, out);
        return;
    }
#endif
    const int64_t per_kv = H / KVH;
    const int quant = k_scale != NULL, kind = quant ? DG_KV_F32 : kv_kind;
    const int half = kind == DG_KV_F16, bf16 = kind == DG_KV_BF16;
    const int64_t row_bytes = D * (quant ? 1 : half || bf16 ? 2 : 4);
#if defined(__AVX512BF16__)
    /* A bfloat16 cache on a CPU with bfloat16 pair dot products: scores from bfloat16 queries, and
     * V rows summed two at a time with bfloat16 weights (dg_pv_bf16_heads, head_dim <= 64). */
    const int dot_bf16 = bf16 && D % 32 == 0;
#endif
    /* A task is one (row, K/V head). A chunk's rows (consecutive rows of one sequence) go head by
     * head, and each thread takes a contiguous share of that order, balanced by keys read: a thread
     * reads a (sequence, head)'s keys from memory once and its further rows find them in its own
     * cache. A thread done with its share claims from the front of the next, so a thread held up
     * delays no one. Tasks are claimed one ahead, so each thread knows its next task and
     * prefetches its rows. (Claimed one at a time in (row, head) order, a chunk's rows of one head
     * went to both threads in turn: whole 16-row verify steps at 800 keys took 10.7 ms against
     * 9.9 now, 2-row ones 3.85 against 3.63; 64 decode rows and a 512-token prefill the same.) */
    const int64_t ntask = B * KVH;
    int64_t *order = (int64_t *)malloc((2 * (size_t)ntask + 2 * DG_MAX_SHARES) * sizeof(int64_t));
    if (!order) abort();
    int64_t *cost = order + ntask; /* keys each task reads */
    int64_t *share = cost + ntask; /* each thread's next claim, then (+ DG_MAX_SHARES) its end */
    int64_t total = 0;             /* keys read over all tasks */
    {
        int64_t n = 0;
        for (int64_t s = 0; s < B;) {
            int64_t e = s + 1;
            while (row_seq && e < B && row_seq[e] == row_seq[s]) e++;
            for (int64_t kh = 0; kh < KVH; kh++)
                for (int64_t b = s; b < e; b++, n++)
                    order[n] = b * KVH + kh, cost[n] = 16 + seq_lens[b], total += cost[n];
            s = e;
        }
    }
    const int threads = dg_share_tasks(cost, ntask, total, share);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
    int at = omp_get_thread_num() % threads; /* the share being claimed from */
    for (int64_t next = dg_claim(share, threads, &at), after; next >= 0; next = after) {
        const int64_t task = order[next];
        after = dg_claim(share, threads, &at);
        const int64_t b = task / KVH, kh = task % KVH;
        const int64_t len = seq_lens[b];
        const int64_t seq = row_seq ? row_seq[b] : b;
        const int64_t *table = page_tables + seq * max_pages;
        dg_prefetch pf;
        /* A (sequence, head)'s further rows read the keys its first row read, in this thread's
         * cache by now: only a new (sequence, head) is worth prefetching for. */
        const int64_t nb = after >= 0 ? order[after] / KVH : 0, nkh = after >= 0 ? order[after] % KVH : 0;
        const int64_t nseq = row_seq ? row_seq[nb] : nb;
        if (after >= 0 && (nseq != seq || nkh != kh))
            dg_prefetch_start(&pf, k_cache, v_cache, k_scale, v_scale, scale_half ? 2 : 4,
                              page_tables + nseq * max_pages, nkh, KVH, page_size, row_bytes, seq_lens[nb]);
        else
            dg_prefetch_start(&pf, k_cache, v_cache, NULL, NULL, 0, NULL, 0, KVH, page_size, row_bytes, 0);
        /* Spread over the current task's blocks of 16 K rows and 16 V rows. */
        const int64_t pf_step = 1 + dg_prefetch_lines(&pf) / (2 * ((len + 15) / 16));
        const float *qg = q + b * q_stride + kh * per_kv * D; /* the group's query heads, D apart */
        float *og = out + b * H * D + kh * per_kv * D;
        /* scores, int8 V rows, then (bfloat16 dot products) the queries and the weights as
         * bfloat16, 16 floats of slack each for 64-byte vectors */
        const size_t need = (size_t)(len * per_kv + len * D + per_kv * D / 2 + per_kv * (len / 2 + 1) + 32);
        float *scores = (float *)dg_grow(&dg_attn_tls, need * sizeof(float)); /* [per_kv, len] */
        if (!scores) abort(); /* a few KiB per thread; nothing sensible to return into */
        float *vrows = scores + len * per_kv; /* dequantized V rows of an int8 cache [len, D] */
#if defined(__AVX512BF16__)
        uint16_t *qb = NULL;   /* [per_kv * D]: the group's queries as bfloat16 */
        uint32_t *pb = NULL;   /* [per_kv, len / 2 + 1]: its weights as bfloat16 pairs */
        if (dot_bf16) {
            qb = (uint16_t *)(vrows + len * D);
            pb = (uint32_t *)(vrows + len * D + per_kv * D / 2 + 16);
            for (int64_t i = 0; i < per_kv * D; i += 32)
                _mm512_storeu_si512((void *)(qb + i),
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + i + 16), _mm512_loadu_ps(qg + i)));
        }
#endif
        /* Scores: one K row read serves every query head of the group. */
        for (int64_t p = 0, t = 0; t < len; p++) {
            const int64_t base = (table[p] * KVH + kh) * page_size;
            const int64_t count = len - t < page_size ? len - t : page_size;
#if defined(DG_AVX512)
            if (!quant && D % 16 == 0) { /* 16 rows per head at a time, one transpose-sum */
                for (int64_t j = 0; j < count; j += 16) {
                    const int64_t n16 = count - j < 16 ? count - j : 16;
                    const char *rows = (const char *)k_cache + (base + j) * row_bytes;
#if defined(__AVX512BF16__)
                    if (dot_bf16)
                        dg_scores16_bf16_group(qb, (const uint16_t *)rows, n16, D, scale, scores + t + j, len, per_kv);
                    else
#endif
                        dg_scores16_group(qg, rows, kind, n16, D, scale, scores + t + j, len, per_kv);
                    dg_prefetch_step(&pf, pf_step);
                }
                t += count;
                continue;
            }
#endif
            for (int64_t j = 0; j < count; j++, t++) {
                const int64_t slot = base + j;
                const float ks = quant ? dg_scale_at(k_scale, slot, scale_half) : 1.0f;
                if (t % 16 == 0) dg_prefetch_step(&pf, pf_step);
                for (int64_t g = 0; g < per_kv; g++) {
                    const float *qh = qg + g * D;
                    float dot = 0.0f;
                    int64_t i = 0;
#if defined(DG_VW)
                    dg_vf acc = dg_vzero();
                    if (quant) {
                        const int8_t *kr = (const int8_t *)k_cache + slot * D;
                        for (; i + DG_VW <= D; i += DG_VW) acc = dg_vfma(dg_vload(qh + i), dg_vload_i8(kr + i), acc);
                    } else if (half) {
                        const uint16_t *kr = (const uint16_t *)k_cache + slot * D;
                        for (; i + DG_VW <= D; i += DG_VW) acc = dg_vfma(dg_vload(qh + i), dg_vload_h(kr + i), acc);
                    } else if (bf16) {
                        const uint16_t *kr = (const uint16_t *)k_cache + slot * D;
                        for (; i + DG_VW <= D; i += DG_VW) acc = dg_vfma(dg_vload(qh + i), dg_vload_b(kr + i), acc);
                    } else {
                        const float *kr = (const float *)k_cache + slot * D;
                        for (; i + DG_VW <= D; i += DG_VW) acc = dg_vfma(dg_vload(qh + i), dg_vload(kr + i), acc);
                    }
                    dot = dg_vsum(acc);
#endif
                    if (quant) {
                        const int8_t *kr = (const int8_t *)k_cache + slot * D;
                        for (; i < D; i++) dot += qh[i] * (float)kr[i];
                    } else if (half) {
                        const uint16_t *kr = (const uint16_t *)k_cache + slot * D;
                        for (; i < D; i++) dot += qh[i] * dg_half(kr[i]);
                    } else if (bf16) {
                        const uint16_t *kr = (const uint16_t *)k_cache + slot * D;
                        for (; i < D; i++) dot += qh[i] * dg_bf16(kr[i]);
                    } else {
                        const float *kr = (const float *)k_cache + slot * D;
                        for (; i < D; i++) dot += qh[i] * kr[i];
                    }
                    scores[g * len + t] = dot * ks * scale;
                }
                if (quant) { /* V's row dequantized once for all heads of the group */
                    const int8_t *vq = (const int8_t *)v_cache + slot * D;
                    const float vs = dg_scale_at(v_scale, slot, scale_half);
                    for (int64_t i = 0; i < D; i++) vrows[t * D + i] = (float)vq[i] * vs;
                }
            }
        }
        /* Softmax per head. Up to 4 heads go through the exponentials together: each head's sum is
         * one chain of additions (its order fixes its bits), and side by side the chains overlap. */
        for (int64_t g0 = 0; g0 < per_kv; g0 += 4) {
            const int64_t ng = per_kv - g0 < 4 ? per_kv - g0 : 4;
            float mx[4], sum[4];
            int64_t t0 = 0;
            for (int64_t a = 0; a < ng; a++) mx[a] = dg_max_scores(scores + (g0 + a) * len, len), sum[a] = 0.0f;
#if defined(DG_AVX2)
            __m256 vs[4];
            for (int64_t a = 0; a < ng; a++) vs[a] = _mm256_setzero_ps();
#if defined(DG_AVX512)
            /* 16 exponentials at a time, each dg_exp8's bits, summed 8 lanes at a time in the
             * order of the 8-wide loop below: the same sums, bit for bit */
            for (; t0 + 16 <= len; t0 += 16)
                for (int64_t a = 0; a < ng; a++) {
                    float *sg = scores + (g0 + a) * len;
                    const __m512 e = dg_exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), _mm512_set1_ps(mx[a])));
                    _mm512_storeu_ps(sg + t0, e);
                    vs[a] = _mm256_add_ps(vs[a], _mm512_castps512_ps256(e));
                    vs[a] = _mm256_add_ps(vs[a], _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
                }
#endif
#endif
            for (int64_t a = 0; a < ng; a++) {
                float *sg = scores + (g0 + a) * len;
                int64_t t = t0;
#if defined(DG_AVX2)
                const __m256 vmx = _mm256_set1_ps(mx[a]);
                for (; t + 8 <= len; t += 8) {
                    const __m256 e = dg_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmx));
                    _mm256_storeu_ps(sg + t, e);
                    vs[a] = _mm256_add_ps(vs[a], e);
                }
                sum[a] = dg_hsum(vs[a]);
#endif
                for (; t < len; t++) {
                    sg[t] = expf(sg[t] - mx[a]);
                    sum[a] += sg[t];
                }
                const float inv = 1.0f / sum[a];
                t = 0;
#if defined(DG_AVX512)
                for (const __m512 vi = _mm512_set1_ps(inv); t + 16 <= len; t += 16)
                    _mm512_storeu_ps(sg + t, _mm512_mul_ps(_mm512_loadu_ps(sg + t), vi));
#endif
                for (; t < len; t++) sg[t] *= inv;
            }
        }
#if defined(DG_AVX512)
        /* Heads of up to 64 values in a float or float16 cache: up to 4 heads of the group at once,
         * so each V row is read once for them and 16 sums run side by side (one head's 4 sums
         * form a chain as long as the rows, bound by the FMA's latency). */
        int64_t g_done = 0;
#if defined(__AVX512BF16__)
        if (dot_bf16 && D <= 64) {
            const int64_t pstride = len / 2 + 1;
            for (int64_t g = 0; g < per_kv; g++) { /* the weights as bfloat16 pairs, a zero past the last */
                const float *sg = scores + g * len;
                uint16_t *ph = (uint16_t *)(pb + g * pstride);
                for (int64_t t = 0; t < len; t += 32) {
                    const int64_t n = len - t < 32 ? len - t : 32;
                    const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u);
                    const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xFFFF : n <= 16 ? 0 : (1u << (n - 16)) - 1u);
                    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, sg + t + 16),
                                                           _mm512_maskz_loadu_ps(m0, sg + t));
                    _mm512_mask_storeu_epi16(ph + t, (__mmask32)(n >= 32 ? 0xFFFFFFFFu : (1u << n) - 1u), (__m512i)v);
                }
                ph[len] = 0;
            }
            for (; g_done < per_kv; g_done += 4) {
                const int64_t hg = per_kv - g_done < 4 ? per_kv - g_done : 4;
                const uint32_t *pg = pb + g_done * pstride;
                float *og4 = og + g_done * D;
#define DG_PVB(HG, NW) dg_pv_bf16_heads(HG, NW, pg, pstride, len, (const uint16_t *)v_cache, table, KVH, kh, \
                                        page_size, D, &pf, pf_step, g_done == 0, og4)
                if (D == 64) {
                    switch (hg) {
                    case 1: DG_PVB(1, 2); break;
                    case 2: DG_PVB(2, 2); break;
                    case 3: DG_PVB(3, 2); break;
                    default: DG_PVB(4, 2); break;
                    }
                } else {
                    DG_PVB((int)hg, 1);
                }
#undef DG_PVB
            }
        }
#endif
        if (!quant && D % 16 == 0 && D <= 64) {
            const int64_t nv = D / 16;
            for (; g_done < per_kv; g_done += 4) {
                const int64_t hg = per_kv - g_done < 4 ? per_kv - g_done : 4;
                const float *pg = scores + g_done * len;
                float *og4 = og + g_done * D;
#define DG_PV(HG, NV) dg_pv_heads(HG, NV, pg, len, v_cache, kind, table, KVH, kh, page_size, D, &pf, pf_step, \
                                  g_done == 0, og4)
                if (nv == 4) { /* head_dim 64: constants for the compiler, sums kept in registers */
                    switch (hg) {
                    case 1: DG_PV(1, 4); break;
                    case 2: DG_PV(2, 4); break;
                    case 3: DG_PV(3, 4); break;
                    default: DG_PV(4, 4); break;
                    }
                } else {
                    DG_PV((int)hg, (int)nv);
                }
#undef DG_PV
            }
        }
#else
        const int64_t g_done = 0;
#endif
        /* Outputs: per head, up to 128 of its values summed in registers over every V row. */
        for (int64_t g = g_done; g < per_kv; g++) {
            const float *sg = scores + g * len;
            float *o = og + g * D;
            int64_t i0 = 0;
#if defined(DG_VW)
            enum { NV = 128 / DG_VW };
            for (; i0 + DG_VW <= D; i0 += NV * DG_VW) {
                const int64_t nv = (D - i0) / DG_VW < NV ? (D - i0) / DG_VW : NV;
                dg_vf acc[NV];
                for (int v = 0; v < NV; v++) acc[v] = dg_vzero();
                for (int64_t p = 0, t = 0; t < len; p++) {
                    const int64_t base = (table[p] * KVH + kh) * page_size;
                    const int64_t count = len - t < page_size ? len - t : page_size;
                    for (int64_t j = 0; j < count; j++, t++) {
                        if (t % 16 == 0 && g == 0) dg_prefetch_step(&pf, pf_step);
                        const dg_vf pv = dg_vset1(sg[t]);
                        if (half || bf16) {
                            const uint16_t *vh = (const uint16_t *)v_cache + (base + j) * D;
                            for (int v = 0; v < NV; v++)
                                if (v < nv)
                                    acc[v] = dg_vfma(pv, half ? dg_vload_h(vh + i0 + v * DG_VW) : dg_vload_b(vh + i0 + v * DG_VW),
                                                     acc[v]);
                            continue;
                        }
                        const float *vr = quant ? vrows + t * D : (const float *)v_cache + (base + j) * D;
                        for (int v = 0; v < NV; v++)
                            if (v < nv) acc[v] = dg_vfma(pv, dg_vload(vr + i0 + v * DG_VW), acc[v]);
                    }
                }
                for (int v = 0; v < NV; v++)
                    if (v < nv) dg_vstore(o + i0 + v * DG_VW, acc[v]);
                if (nv < NV) {
                    i0 += nv * DG_VW;
                    break;
                }
            }
#endif
            if (i0 < D) { /* the tail of D no vector covers */
                for (int64_t i = i0; i < D; i++) o[i] = 0.0f;
                for (int64_t p = 0, t = 0; t < len; p++) {
                    const int64_t base = (table[p] * KVH + kh) * page_size;
                    const int64_t count = len - t < page_size ? len - t : page_size;
                    for (int64_t j = 0; j < count; j++, t++) {
                        if (half || bf16) {
                            const uint16_t *vh = (const uint16_t *)v_cache + (base + j) * D;
                            for (int64_t i = i0; i < D; i++) o[i] += sg[t] * (half ? dg_half(vh[i]) : dg_bf16(vh[i]));
                            continue;
                        }
                        const float *vr = quant ? vrows + t * D : (const float *)v_cache + (base + j) * D;
                        for (int64_t i = i0; i < D; i++) o[i] += sg[t] * vr[i];
                    }
                }
            }
        }
    }
    }
    free(order);
}

/* ---- LoRA deltas, one row at a time ------------------------------------------------------------
 *
 * y[i] += (x[i] A^T) B^T for m rows x [m, k] (row i at x + i * x_stride), A [r, k] and BT [r, n]
 * (B transposed), into y [m, n] (row i at y + i * y_stride): a LoRA adapter's delta, the scale
 * already in B. Each row is computed alone in one fixed order (k-long dot products with A's rows,
 * then the r products summed in order per output), so a row's delta is the same however many rows
 * come with it: BLAS takes another kernel for one row than for several, and they round apart. */
void dg_lora_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, const float *a, int64_t r,
                  const float *bt, int64_t n, float *y, int64_t y_stride) {
#pragma omp parallel for schedule(static) if (m * r * (k + n) >= 1 << 18)
    for (int64_t i = 0; i < m; i++) {
        const float *xr = x + i * x_stride;
        float *yr = y + i * y_stride;
        float small[256]; /* the rank is the operator's limit (--max-adapter-rank): a bigger one on the heap */
        float *xa = r <= 256 ? small : (float *)malloc((size_t)r * sizeof(float));
        if (!xa) abort(); /* nothing sensible to return into from a parallel loop */
        for (int64_t j = 0; j < r; j++) {
            const float *aj = a + j * k;
            float dot = 0.0f;
            int64_t t = 0;
#if defined(DG_VW)
            dg_vf acc = dg_vzero();
            for (; t + DG_VW <= k; t += DG_VW) acc = dg_vfma(dg_vload(xr + t), dg_vload(aj + t), acc);
            dot = dg_vsum(acc);
#endif
            for (; t < k; t++) dot += xr[t] * aj[t];
            xa[j] = dot;
        }
        int64_t o = 0;
#if defined(DG_VW)
        for (; o + DG_VW <= n; o += DG_VW) {
            dg_vf acc = dg_vzero();
            for (int64_t j = 0; j < r; j++) acc = dg_vfma(dg_vset1(xa[j]), dg_vload(bt + j * n + o), acc);
            dg_vstore(yr + o, dg_vadd(dg_vload(yr + o), acc));
        }
#endif
        for (; o < n; o++) {
            float sum = 0.0f;
            for (int64_t j = 0; j < r; j++) sum += xa[j] * bt[j * n + o];
            yr[o] += sum;
        }
        if (xa != small) free(xa);
    }
}

/* One K or V head vector x [D] into an int8 cache: scale = max(absmax / 127, float16's smallest
 * normal) rounded to float16, q = floor(x / scale + 0.5) within +-127. The same ops as the per-op
 * path's quantize_kv (kernels/attention/kv_layer.py), so both store the same bytes. */
static void dg_quantize_kv(const float *x, int64_t D, int8_t *q, uint16_t *scale) {
    float mx = 0.0f;
    int64_t i = 0;
#if defined(DG_AVX512)
    __m512 vm = _mm512_setzero_ps();
    for (; i + 16 <= D; i += 16) vm = _mm512_max_ps(vm, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    mx = _mm512_reduce_max_ps(vm);
#endif
    for (; i < D; i++) mx = fabsf(x[i]) > mx ? fabsf(x[i]) : mx;
    float s = mx / 127.0f;
    s = s < 6.103515625e-05f ? 6.103515625e-05f : s;
    *scale = dg_to_half(s);
    const float sf = dg_half(*scale);
    i = 0;
#if defined(DG_AVX512)
    const __m512 vs = _mm512_set1_ps(sf), half = _mm512_set1_ps(0.5f);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (; i + 16 <= D; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), half),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
#endif
    for (; i < D; i++) {
        float v = floorf(x[i] / sf + 0.5f);
        v = v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v;
        q[i] = (int8_t)v;
    }
}

/* ---- one whole decoder layer for a decode step -------------------------------------------------
 *
 * B rows, activations float32, the K/V cache float32, float16, bfloat16 or int8 (kv_kind), and all four
 * projections block linears: then the layer is one call, not a dozen, so the host work per layer
 * (argument checks, allocations, calls) is paid once. Same ops, same order and same kernels as
 * the per-op path: norms, linears, rotary, the K/V write at each row's slot, decode attention,
 * silu * up. A row is one sequence's new token (row_seq NULL: row b is sequence b) or one token
 * of a sequence's chunk (row_seq naming its page table, seq_lens[b] its position + 1): every
 * row's K/V is written before any row attends, so a chunk token sees the ones before it, which
 * is what a speculative verification (the last token and its drafts) needs.
 *
 * x [B, hidden] is the residual stream, updated in place; h [B, hidden] holds this layer's
 * normed input on entry and the next layer's on return (normed with next_norm; with
 * next_norm NULL, x gets the MLP's output added and h is left as is). */
typedef struct {
    int32_t layout; /* as dg_linear */
    const void *blocks;
    int64_t n, k;
} dg_linear_desc;

static _Thread_local dg_tls_buf dg_layer_tls;
#define DG_KEEP_ROWS 256 /* steps of up to this many rows keep the layer's scratch for the next */

static float *dg_layer_scratch(size_t floats) { return (float *)dg_grow(&dg_layer_tls, floats * sizeof(float)); }

int dg_decode_layer(float *x, float *h, const dg_linear_desc *qkv, const dg_linear_desc *o,
                    const dg_linear_desc *gate_up, const dg_linear_desc *down, const float *ffn_norm,
                    const float *next_norm, float eps, const float *cos_table, const float *sin_signed,
                    const int64_t *positions, void *k_cache, void *v_cache, void *k_scale, void *v_scale,
                    int kv_kind, const int64_t *slots, const int64_t *page_tables, int64_t max_pages,
                    const int64_t *row_seq, const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                    int64_t page_size, float attn_scale) {
    const int64_t hidden = o->n, width = qkv->n, inter = down->k;
    float *qkv_out = dg_layer_scratch((size_t)B * (size_t)(width + H * D + hidden + 2 * inter));
    if (!qkv_out) return -1;
    float *attn = qkv_out + B * width, *delta = attn + B * H * D, *gu = delta + B * hidden;
    if (dg_linear(qkv->layout, qkv->blocks, width, qkv->k, h, B, qkv_out)) return -1;
    dg_rotary(qkv_out, B, width, H + KVH, D, cos_table, sin_signed, positions);
    for (int64_t b = 0; b < B; b++) { /* K and V of each row into its slot, per K/V head */
        const int64_t page = slots[b] / page_size, off = slots[b] % page_size;
        for (int64_t kh = 0; kh < KVH; kh++) {
            const int64_t at = ((page * KVH + kh) * page_size + off) * D;
            const float *k = qkv_out + b * width + (H + kh) * D, *v = qkv_out + b * width + (H + KVH + kh) * D;
            if (kv_kind == DG_KV_I8) {
                const int64_t si = (page * KVH + kh) * page_size + off;
                dg_quantize_kv(k, D, (int8_t *)k_cache + at, (uint16_t *)k_scale + si);
                dg_quantize_kv(v, D, (int8_t *)v_cache + at, (uint16_t *)v_scale + si);
            } else if (kv_kind == DG_KV_F16) {
                dg_to_half_array(k, D, (uint16_t *)k_cache + at);
                dg_to_half_array(v, D, (uint16_t *)v_cache + at);
            } else if (kv_kind == DG_KV_BF16) {
                dg_to_bf16_array(k, D, (uint16_t *)k_cache + at);
                dg_to_bf16_array(v, D, (uint16_t *)v_cache + at);
            } else {
                memcpy((float *)k_cache + at, k, (size_t)D * sizeof(float));
                memcpy((float *)v_cache + at, v, (size_t)D * sizeof(float));
            }
        }
    }
    dg_decode_attention(qkv_out, width, k_cache, v_cache, k_scale, v_scale, 1, kv_kind, page_tables, max_pages,
                        row_seq, seq_lens, B, H, KVH, D, page_size, attn_scale, attn);
    if (dg_linear(o->layout, o->blocks, hidden, o->k, attn, B, delta)) return -1;
    dg_add_rms_norm(x, delta, ffn_norm, h, B, hidden, eps);
    if (dg_linear(gate_up->layout, gate_up->blocks, gate_up->n, gate_up->k, h, B, gu)) return -1;
    if (dg_linear_silu(down->layout, down->blocks, hidden, inter, gu, B, delta)) return -1;
    if (next_norm) {
        dg_add_rms_norm(x, delta, next_norm, h, B, hidden, eps);
    } else {
        for (int64_t i = 0; i < B * hidden; i++) x[i] += delta[i];
    }
    return 0;
}

/* One layer's own pointers for dg_decode_layers. */
typedef struct {
    const dg_linear_desc *qkv, *o, *gate_up, *down;
    const float *ffn_norm, *next_norm; /* next_norm NULL: the last layer */
    void *k_cache, *v_cache;
    void *k_scale, *v_scale; /* float16 [pages, KVH, page_size] of an int8 cache, else NULL */
} dg_layer_ref;

/* A decode step's layers, n_layers of them, in one call: each as dg_decode_layer, the step's
 * arguments shared. One foreign call per step instead of one per layer: from Python each call
 * converts its 26 arguments (SmolLM2-135M: 30 layers a step). Returns the first failure's code. */
int dg_decode_layers(float *x, float *h, const dg_layer_ref *layers, int64_t n_layers, float eps,
                     const float *cos_table, const float *sin_signed, const int64_t *positions, int kv_kind,
                     const int64_t *slots, const int64_t *page_tables, int64_t max_pages, const int64_t *row_seq,
                     const int64_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t page_size,
                     float attn_scale) {
    int rc = 0;
    for (int64_t i = 0; i < n_layers && !rc; i++) {
        const dg_layer_ref *l = layers + i;
        rc = dg_decode_layer(x, h, l->qkv, l->o, l->gate_up, l->down, l->ffn_norm, l->next_norm, eps, cos_table,
                             sin_signed, positions, l->k_cache, l->v_cache, l->k_scale, l->v_scale, kv_kind, slots,
                             page_tables, max_pages,
                             row_seq, seq_lens, B, H, KVH, D, page_size, attn_scale);
    }
    /* A long prompt's scratch (~20 KiB a row for SmolLM2-135M) is not kept for the decode steps
     * after it: taking it again costs a 2048-token prefill ~1% of its time. */
    if (B > DG_KEEP_ROWS) dg_release(&dg_layer_tls);
    return rc;
}
