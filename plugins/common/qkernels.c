/* Native kernels for GGUF checkpoints on CPUs (see qkernels.py): matmuls over weight blocks
 * with int8 or float32 activations, paged attention, and a whole Llama-family decoder stack.
 *
 * Matmul: y[r, j] = sum_k x[r, k] * w[j, k] + bias[j], the weight rows stored as GGUF stores them,
 * blocks of 32 weights with a float16 scale d (and minimum m), regrouped at load time so that 16
 * output columns sit side by side (ifb_interleave, below):
 *   Q4_0 (18 bytes: d, 16 code bytes)    w = d * (q - 8), q in 0..15
 *   Q4_1 (20 bytes: d, m, 16 code bytes) w = d * q + m
 *   Q8_0 (34 bytes: d, 32 int8 codes)    w = d * q
 * (a 4-bit block's byte i holds weight i in its low nibble and weight i + 16 in its high one).
 * With int8 activations (the default; see "int8 activations" below) x is quantized per block
 * of 32 and each block's product is an exact integer sum (VNNI where the CPU has it). With float32
 * activations each block's weights are rebuilt in float32 exactly as gguf's float32 dequantization
 * computes them (no fused rounding: build with -ffp-contract=off), then multiplied with x: the
 * result differs from a float32 matmul on the dequantized matrix by summation order only.
 *
 * Batch invariance: every output element is computed by the same sequence of operations
 * whatever the number of rows in the call, the tiling, or the threads (work is split by groups
 * of output columns, by attention (token, head) pairs, or by rows and blocks for the elementwise
 * steps, never inside a sum), so a sequence's result never depends on its batch mates.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define IFB_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define IFB_ISA 256
#else
#define IFB_ISA 0
#endif

#define QK 32 /* weights per block */
#define INLINE static inline __attribute__((always_inline))

#if defined(__F16C__)
#include <immintrin.h> /* _cvtsh_ss */
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };                     /* block kinds */
static const long BLOCK_BYTES[3] = {18, 20, 34};

/* An IEEE float16 (stored little-endian at p) as a float: exact. */
INLINE float half_at(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);            /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);   /* normal */
    } else if (man == 0) {
        bits = sign;                                        /* zero */
    } else {                                                /* subnormal: normalize */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* f as the nearest IEEE float16 (ties to even), as bits: what torch's conversion gives. */
INLINE uint16_t half_of(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 h = (_Float16)f;
    uint16_t bits;
    __builtin_memcpy(&bits, &h, sizeof bits);
    return bits;
#endif
}

/* Ask for the cache lines of bytes [p, p + bytes): data the hardware prefetchers do not see coming
 * (the next weight blocks a few steps ahead, KV pages scattered by the block tables). */
INLINE void prefetch_span(const uint8_t *p, long bytes) {
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

int ifb_qk_isa(void) { return IFB_ISA; }

/* ---- matmuls ----
 * The weights are first interleaved (ifb_interleave): output columns go in groups of 16, and for
 * each group and each 32-weight block the group's 16 scales (and minima) come first, then the code
 * bytes in 64-byte chunks, chunk t holding bytes 4t..4t+3 of each of the 16 columns side by side
 * (what one VNNI instruction multiplies with 4 activation bytes). A group's block is the 16
 * columns' GGUF blocks with their bytes moved: the same size.
 *   Q4_0: 16 d, then 4 chunks    (code byte i of a column: weights i and i + 16, as in GGUF)
 *   Q4_1: 16 d, 16 m, then 4 chunks
 *   Q8_0: 16 d, then 8 chunks    (codes stored + 128, as unsigned bytes)
 * Float32 activations: a tile is R rows by C groups; each output element has one accumulator that takes the products in
 * one fixed order (block by block; within a block weights 0, 16, 1, 17, ..., 15, 31), whatever
 * R and C are: a row's result never depends on its batch mates. */

#define GROUP 16
#define CHUNK 64 /* code bytes 4i..4i+3 of the 16 columns: 4 bytes per column */

typedef struct {
    int kind;              /* Q4_0, Q4_1 or Q8_0 */
    int passes;            /* integer activations in 1 or 2 int8 passes (the fields below); 0: float32 x */
    const float *x;        /* [m, k] */
    long m, k, n;
    const uint8_t *blocks; /* interleaved, [ceil(n / 16) groups][k / 32 blocks] */
    const float *bias;     /* [n] or NULL */
    float *y;              /* [m, n] */
    const int8_t *xq;      /* [passes][mq, k] int8 parts of x's codes, per 32-block */
    int use_amx;           /* AMX tiles for whole tiles of rows (the same results) */
    const float *xs;       /* [mq, k / 32] block scales */
    const int32_t *qsum;   /* [mq, k / 32] sums of a block's codes */
    const float *xsum;     /* [mq, k / 32] scale * code sum */
    long mq;               /* rows of codes: m, or m padded with zero rows to whole AMX tiles */
} matmul_t;

/* Bytes of one group's block. */
INLINE long group_bytes(int kind) { return GROUP * BLOCK_BYTES[kind]; }

/* GGUF rows [n, k / 32 blocks] -> interleaved groups; columns past n (the last group's padding)
 * get zero scales, so their weights are zero. */
void ifb_interleave(const uint8_t *src, long n, long k, int kind, uint8_t *dst) {
    long nb = k / QK, bb = BLOCK_BYTES[kind], groups = (n + GROUP - 1) / GROUP;
    long head = kind == Q4_1 ? 4 : 2, codes = bb - head; /* bytes of scales, of codes, per block */
    for (long g = 0; g < groups; g++)
        for (long b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * GROUP * bb;
            for (long c = 0; c < GROUP; c++) {
                long j = g * GROUP + c;
                const uint8_t *blk = j < n ? src + (j * nb + b) * bb : NULL;
                for (long h = 0; h < head; h += 2) { /* d (then m): 16 halves each */
                    out[(h / 2) * 2 * GROUP + 2 * c] = blk ? blk[h] : 0;
                    out[(h / 2) * 2 * GROUP + 2 * c + 1] = blk ? blk[h + 1] : 0;
                }
                for (long i = 0; i < codes; i++) /* Q8_0: code + 128, an unsigned byte */
                    out[head * GROUP + (i / 4) * CHUNK + c * 4 + i % 4] =
                        (uint8_t)((blk ? blk[head + i] : 0) ^ (kind == Q8_0 ? 0x80 : 0));
            }
        }
}

#if IFB_ISA == 512

#define MAX_R 8 /* 8 x 2 accumulators + 2 x 2 weight registers (+ scales), of 32 */
#define MAX_C 2
typedef __m512 vec;
#define VZERO _mm512_setzero_ps
#define VFMA(w, xp, acc) _mm512_fmadd_ps(w, _mm512_set1_ps(*(xp)), acc)

INLINE vec halves16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Code byte i (0..255) of each of the 16 columns. */
INLINE __m512i code_bytes(const uint8_t *q, int i) {
    __m512i v = _mm512_loadu_si512((const void *)(q + (i / 4) * CHUNK));
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i % 4)), _mm512_set1_epi32(0xFF));
}

/* Weights i and i + 16 of 16 columns from their code bytes i. */
INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    __m512i c = code_bytes(q, i);
    __m512i l = _mm512_and_si512(c, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(c, 4);
    if (centered) {
        __m512i eight = _mm512_set1_epi32(8);
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l, eight)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h, eight)), d);
    } else {
        *lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(l), d), m);
        *hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h), d), m);
    }
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(code_bytes(q, i), _mm512_set1_epi32(128))), d);
}

INLINE void store_group(float *y, vec v, long valid) {
    if (valid >= GROUP)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1u), v);
}

INLINE vec load_bias(const float *bias, long valid) {
    if (bias == NULL) return _mm512_setzero_ps();
    return valid >= GROUP ? _mm512_loadu_ps(bias) : _mm512_maskz_loadu_ps((__mmask16)((1u << valid) - 1u), bias);
}

INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }

INLINE void cpu_relax(void) { _mm_pause(); }

/* int8 activations: a chunk holds 4 code bytes per column; dot4 adds, per column, the products of
 * its 4 bytes with 4 signed activation bytes. */
#define MAX_RQ 4
typedef __m512i wvec; /* a chunk of code bytes */
typedef __m512i ivec; /* 16 int32 sums */
INLINE ivec izero(void) { return _mm512_setzero_si512(); }
INLINE wvec load_chunk(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE wvec low_nibbles(wvec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
INLINE wvec high_nibbles(wvec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
INLINE __m512i x4_at(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
}
#if defined(__AVX512VNNI__)
/* 4-bit codes (0..15) */
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) { return _mm512_dpbusd_epi32(s, w, x4_at(x)); }
/* Q8_0 codes stored + 128: sums that hold 128 * (the activations' sum) too (Q8_OFFSET) */
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) { return _mm512_dpbusd_epi32(s, w, x4_at(x)); }
#define Q8_OFFSET 1
#else
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    __m512i p = _mm512_maddubs_epi16(w, x4_at(x)); /* |pair| <= 2 * 15 * 127: no saturation */
    return _mm512_add_epi32(s, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    __m512i ws = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), xb = x4_at(x); /* signed codes */
    xb = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), xb);
    __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xb); /* |pair| <= 2 * 128 * 127 */
    return _mm512_add_epi32(s, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
#define Q8_OFFSET 0
#endif
INLINE ivec isub(ivec s, int32_t v) { return _mm512_sub_epi32(s, _mm512_set1_epi32(v)); }
INLINE ivec itimes256(ivec s) { return _mm512_slli_epi32(s, 8); }
INLINE ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
INLINE vec icvt_scaled(ivec s, float scale) { return _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale)); }
INLINE vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vec vset1(float v) { return _mm512_set1_ps(v); }

#elif IFB_ISA == 256

/* AVX2 has 8 lanes: a "vector" of 16 columns is two registers. */
#define MAX_R 4 /* 4 x 2 accumulators + 4 weight registers + a broadcast, of 16 */
#define MAX_C 1
typedef struct { __m256 a, b; } vec;
INLINE vec VZERO(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
INLINE vec vfma(vec w, const float *xp, vec acc) {
    __m256 x = _mm256_broadcast_ss(xp);
    vec r = {_mm256_fmadd_ps(w.a, x, acc.a), _mm256_fmadd_ps(w.b, x, acc.b)};
    return r;
}
#define VFMA(w, xp, acc) vfma(w, xp, acc)

INLINE vec halves16(const uint8_t *p) {
    vec v = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
    return v;
}

/* Code byte i (0..255) of columns 0-7 (*a) and 8-15 (*b). */
INLINE void code_bytes(const uint8_t *q, int i, __m256i *a, __m256i *b) {
    const uint8_t *p = q + (i / 4) * CHUNK;
    __m256i mask = _mm256_set1_epi32(0xFF);
    *a = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)p), 8 * (i % 4)), mask);
    *b = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)), 8 * (i % 4)), mask);
}

INLINE __m256 q4_half(__m256i c, __m256 d, __m256 m, int centered, int high) {
    c = high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    if (centered) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8))), d);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), d), m);
}

INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    __m256i b0, b1;
    code_bytes(q, i, &b0, &b1);
    lo->a = q4_half(b0, d.a, m.a, centered, 0);
    lo->b = q4_half(b1, d.b, m.b, centered, 0);
    hi->a = q4_half(b0, d.a, m.a, centered, 1);
    hi->b = q4_half(b1, d.b, m.b, centered, 1);
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    __m256i a, b, off = _mm256_set1_epi32(128);
    code_bytes(q, i, &a, &b);
    vec v = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a, off)), d.a),
             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(b, off)), d.b)};
    return v;
}

INLINE void store_group(float *y, vec v, long valid) {
    if (valid >= GROUP) {
        _mm256_storeu_ps(y, v.a);
        _mm256_storeu_ps(y + 8, v.b);
        return;
    }
    float tmp[GROUP];
    _mm256_storeu_ps(tmp, v.a);
    _mm256_storeu_ps(tmp + 8, v.b);
    for (long c = 0; c < valid; c++) y[c] = tmp[c];
}

INLINE vec load_bias(const float *bias, long valid) {
    float tmp[GROUP] = {0};
    if (bias != NULL)
        for (long c = 0; c < valid && c < GROUP; c++) tmp[c] = bias[c];
    vec v = {_mm256_loadu_ps(tmp), _mm256_loadu_ps(tmp + 8)};
    return v;
}

INLINE vec vadd(vec a, vec b) {
    vec r = {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)};
    return r;
}
INLINE vec vmul(vec a, vec b) {
    vec r = {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)};
    return r;
}
INLINE vec vload(const float *p) {
    vec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return v;
}
INLINE void vstore(float *p, vec v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}

INLINE void cpu_relax(void) { _mm_pause(); }

/* int8 activations (see the AVX-512 code): maddubs / madd in place of VNNI. */
#define MAX_RQ 2
typedef struct { __m256i a, b; } wvec;
typedef wvec ivec;
INLINE ivec izero(void) { ivec v = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return v; }
INLINE wvec load_chunk(const uint8_t *p) {
    wvec v = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return v;
}
INLINE wvec low_nibbles(wvec v) {
    __m256i m = _mm256_set1_epi8(0x0F);
    wvec r = {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
    return r;
}
INLINE wvec high_nibbles(wvec v) {
    __m256i m = _mm256_set1_epi8(0x0F);
    wvec r = {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
    return r;
}
INLINE __m256i x4_at(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}
INLINE __m256i madd_pairs(__m256i u, __m256i sx) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), _mm256_set1_epi16(1)); }
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    __m256i xb = x4_at(x);
    ivec r = {_mm256_add_epi32(s.a, madd_pairs(w.a, xb)), _mm256_add_epi32(s.b, madd_pairs(w.b, xb))};
    return r;
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    __m256i xb = x4_at(x), flip = _mm256_set1_epi8((char)0x80);
    __m256i wa = _mm256_xor_si256(w.a, flip), wb = _mm256_xor_si256(w.b, flip); /* signed codes */
    ivec r = {_mm256_add_epi32(s.a, madd_pairs(_mm256_abs_epi8(wa), _mm256_sign_epi8(xb, wa))),
              _mm256_add_epi32(s.b, madd_pairs(_mm256_abs_epi8(wb), _mm256_sign_epi8(xb, wb)))};
    return r;
}
#define Q8_OFFSET 0
INLINE ivec isub(ivec s, int32_t v) {
    __m256i b = _mm256_set1_epi32(v);
    ivec r = {_mm256_sub_epi32(s.a, b), _mm256_sub_epi32(s.b, b)};
    return r;
}
INLINE ivec iadd(ivec a, ivec b) {
    ivec r = {_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)};
    return r;
}
INLINE ivec itimes256(ivec s) {
    ivec r = {_mm256_slli_epi32(s.a, 8), _mm256_slli_epi32(s.b, 8)};
    return r;
}
INLINE vec icvt_scaled(ivec s, float scale) {
    __m256 f = _mm256_set1_ps(scale);
    vec r = {_mm256_mul_ps(_mm256_cvtepi32_ps(s.a), f), _mm256_mul_ps(_mm256_cvtepi32_ps(s.b), f)};
    return r;
}
INLINE vec vfmadd(vec a, vec b, vec c) {
    vec r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
    return r;
}
INLINE vec vset1(float v) {
    vec r = {_mm256_set1_ps(v), _mm256_set1_ps(v)};
    return r;
}

#else

#define MAX_R 4
#define MAX_C 1
typedef struct { float v[GROUP]; } vec;
INLINE vec VZERO(void) { vec r = {{0}}; return r; }
INLINE vec vfma_s(vec w, const float *xp, vec acc) {
    for (int c = 0; c < GROUP; c++) acc.v[c] = acc.v[c] + w.v[c] * *xp;
    return acc;
}
#define VFMA(w, xp, acc) vfma_s(w, xp, acc)

INLINE vec halves16(const uint8_t *p) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = half_at(p + 2 * c);
    return r;
}

INLINE int code_byte(const uint8_t *q, int i, int c) { return q[(i / 4) * CHUNK + c * 4 + i % 4]; }

INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    for (int c = 0; c < GROUP; c++) {
        int l = code_byte(q, i, c) & 0x0F, h = code_byte(q, i, c) >> 4;
        lo->v[c] = centered ? (float)(l - 8) * d.v[c] : (float)l * d.v[c] + m.v[c];
        hi->v[c] = centered ? (float)(h - 8) * d.v[c] : (float)h * d.v[c] + m.v[c];
    }
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (float)(code_byte(q, i, c) - 128) * d.v[c];
    return r;
}

INLINE void store_group(float *y, vec v, long valid) {
    for (long c = 0; c < valid && c < GROUP; c++) y[c] = v.v[c];
}

INLINE vec load_bias(const float *bias, long valid) {
    vec r = {{0}};
    if (bias != NULL)
        for (long c = 0; c < valid && c < GROUP; c++) r.v[c] = bias[c];
    return r;
}

INLINE vec vadd(vec a, vec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] += b.v[c];
    return a;
}
INLINE vec vmul(vec a, vec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] *= b.v[c];
    return a;
}
INLINE vec vload(const float *p) {
    vec v;
    for (int c = 0; c < GROUP; c++) v.v[c] = p[c];
    return v;
}
INLINE void vstore(float *p, vec v) {
    for (int c = 0; c < GROUP; c++) p[c] = v.v[c];
}

INLINE void cpu_relax(void) {}

#define MAX_RQ 4
typedef struct { uint8_t b[CHUNK]; } wvec;
typedef struct { int32_t v[GROUP]; } ivec;
INLINE ivec izero(void) { ivec r = {{0}}; return r; }
INLINE wvec load_chunk(const uint8_t *p) {
    wvec v;
    for (int i = 0; i < CHUNK; i++) v.b[i] = p[i];
    return v;
}
INLINE wvec low_nibbles(wvec v) {
    for (int i = 0; i < CHUNK; i++) v.b[i] &= 0x0F;
    return v;
}
INLINE wvec high_nibbles(wvec v) {
    for (int i = 0; i < CHUNK; i++) v.b[i] >>= 4;
    return v;
}
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    for (int c = 0; c < GROUP; c++)
        for (int j = 0; j < 4; j++) s.v[c] += (int32_t)w.b[4 * c + j] * x[j];
    return s;
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    for (int c = 0; c < GROUP; c++)
        for (int j = 0; j < 4; j++) s.v[c] += ((int32_t)w.b[4 * c + j] - 128) * x[j];
    return s;
}
#define Q8_OFFSET 0
INLINE ivec isub(ivec s, int32_t v) {
    for (int c = 0; c < GROUP; c++) s.v[c] -= v;
    return s;
}
INLINE ivec itimes256(ivec s) {
    for (int c = 0; c < GROUP; c++) s.v[c] *= 256;
    return s;
}
INLINE ivec iadd(ivec a, ivec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] += b.v[c];
    return a;
}
INLINE vec icvt_scaled(ivec s, float scale) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (float)s.v[c] * scale;
    return r;
}
INLINE vec vfmadd(vec a, vec b, vec c) {
    for (int i = 0; i < GROUP; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
INLINE vec vset1(float v) {
    vec r;
    for (int i = 0; i < GROUP; i++) r.v[i] = v;
    return r;
}

#endif

/* Block b of group g: its start, and its codes after the 16 scales (and minima). */
INLINE const uint8_t *group_start(const matmul_t *job, long g, long b, int kind) {
    return job->blocks + (g * (job->k / QK) + b) * group_bytes(kind);
}
INLINE const uint8_t *group_codes(const matmul_t *job, long g, long b, int kind) {
    return group_start(job, g, b, kind) + (kind == Q4_1 ? 4 : 2) * GROUP;
}

/* Block b of group g: its 16 scales d and minima m (Q4_0, Q8_0: m is d, unused); returns its codes. */
INLINE const uint8_t *group_block(const matmul_t *job, long g, long b, int kind, vec *d, vec *m) {
    const uint8_t *blk = group_start(job, g, b, kind);
    *d = halves16(blk);
    *m = kind == Q4_1 ? halves16(blk + 2 * GROUP) : *d;
    return group_codes(job, g, b, kind);
}

/* *buf with room for `need` bytes, grown with realloc; NULL (and *buf as it was) without memory. */
static void *reserve(void **buf, size_t *cap, size_t need) {
    if (need > *cap) {
        void *grown = realloc(*buf, need);
        if (grown == NULL) return NULL;
        *buf = grown;
        *cap = need;
    }
    return *buf;
}

/* Row r of y at group g: acc plus the bias, the padding columns dropped. */
INLINE void store_output(const matmul_t *job, long r, long g, vec acc) {
    long j = g * GROUP, valid = job->n - j;
    store_group(job->y + r * job->n + j, vadd(acc, load_bias(job->bias ? job->bias + j : NULL, valid)), valid);
}

/* The calling thread's panel: C groups' weights unpacked, [C][k][16] floats (see unpack_panel). */
static __thread float *panel_buf;
static __thread size_t panel_cap; /* bytes */

/* Rows [r0, r0 + R) by groups [g0, g0 + C), the weights unpacked from the blocks or (`from_panel`)
 * read from the thread's panel: `R`, `C`, `kind` and `from_panel` are constants at each call site,
 * so the loops unroll and the accumulators stay in registers. */
INLINE void tile_from(const matmul_t *job, long r0, int R, long g0, int C, int kind, int from_panel) {
    long k = job->k, nb = k / QK;
    const float *x = job->x + r0 * k;
    vec acc[MAX_R][MAX_C];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = VZERO();
    for (long b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        const float *wb = panel_buf + b * QK * GROUP; /* from_panel: block b of each group's panel */
        vec d[MAX_C], m[MAX_C];
        const uint8_t *q[MAX_C];
#pragma GCC unroll 4
        for (int c = 0; c < C && !from_panel; c++) q[c] = group_block(job, g0 + c, b, kind, &d[c], &m[c]);
        if (kind == Q8_0) {
            for (int i = 0; i < QK; i++) {
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    vec w = from_panel ? vload(wb + (long)c * k * GROUP + i * GROUP)
                                       : q8_one(q[c], i, d[c]);
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) acc[r][c] = VFMA(w, xb + r * k + i, acc[r][c]);
                }
            }
        } else {
            for (int i = 0; i < QK / 2; i++) {
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) {
                    vec lo, hi;
                    if (from_panel) {
                        lo = vload(wb + (long)c * k * GROUP + i * GROUP);
                        hi = vload(wb + (long)c * k * GROUP + (i + QK / 2) * GROUP);
                    } else {
                        q4_pair(q[c], i, d[c], m[c], kind == Q4_0, &lo, &hi);
                    }
#pragma GCC unroll 16
                    for (int r = 0; r < R; r++) {
                        acc[r][c] = VFMA(lo, xb + r * k + i, acc[r][c]);
                        acc[r][c] = VFMA(hi, xb + r * k + i + QK / 2, acc[r][c]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) store_output(job, r0 + r, g0 + c, acc[r][c]);
}

/* ---- many rows: unpack C groups once into a panel, then run every row tile over it ----
 * The panel holds the very weights tile() unpacks, taken in the same order, so a row's result is
 * bit-identical whichever path computes it. */

/* Rows from which unpacking once per panel beats unpacking in every tile (measured). */
#define PANEL_MIN_ROWS 32


INLINE void unpack_panel(const matmul_t *job, long g0, int C, int kind) {
    long k = job->k, nb = k / QK;
    for (int c = 0; c < C; c++) {
        float *out = panel_buf + (long)c * k * GROUP;
        for (long b = 0; b < nb; b++) {
            vec d, m;
            const uint8_t *q = group_block(job, g0 + c, b, kind, &d, &m);
            float *ob = out + b * QK * GROUP;
            if (kind == Q8_0) {
                for (int i = 0; i < QK; i++) vstore(ob + i * GROUP, q8_one(q, i, d));
            } else {
                for (int i = 0; i < QK / 2; i++) {
                    vec lo, hi;
                    q4_pair(q, i, d, m, kind == Q4_0, &lo, &hi);
                    vstore(ob + i * GROUP, lo);
                    vstore(ob + (i + QK / 2) * GROUP, hi);
                }
            }
        }
    }
}

/* Every row tile of rows [h0, h1) over groups [g, g + C). */
#define tile(job, r0, R, g0, C, kind) tile_from(job, r0, R, g0, C, kind, 0)
#define panel_tile(job, r0, R, g0, C, kind) tile_from(job, r0, R, g0, C, kind, 1)

#define ROW_TILES(FN)                                                                       \
    for (long r0 = h0; r0 < h1; r0 += MAX_R) {                                              \
        int rows = h1 - r0 < MAX_R ? (int)(h1 - r0) : MAX_R;                                \
        switch (rows) {                                                                     \
        case 1: FN(job, r0, 1, g, C, kind); break;                                          \
        case 2: FN(job, r0, 2, g, C, kind); break;                                          \
        case 3: FN(job, r0, 3, g, C, kind); break;                                          \
        EXTRA_CASES(FN)                                                                     \
        default: FN(job, r0, MAX_R, g, C, kind); break;                                     \
        }                                                                                   \
    }
#if MAX_R == 8
#define EXTRA_CASES(FN)                                                                     \
    case 4: FN(job, r0, 4, g, C, kind); break;                                              \
    case 5: FN(job, r0, 5, g, C, kind); break;                                              \
    case 6: FN(job, r0, 6, g, C, kind); break;                                              \
    case 7: FN(job, r0, 7, g, C, kind); break;
#elif MAX_R == 4
#define EXTRA_CASES(FN)
#else
#error "MAX_R is 4 or 8"
#endif

INLINE void groups_by(const matmul_t *job, long g, int C, long h0, long h1, int kind, int has_panel) {
    if (h1 - h0 >= PANEL_MIN_ROWS && has_panel) {
        unpack_panel(job, g, C, kind);
        ROW_TILES(panel_tile)
    } else {
        ROW_TILES(tile)
    }
}

/* Rows per block: a block of x stays in L2 while every group of the range passes over it. */
#define X_BLOCK_FLOATS 65536L

INLINE void groups(const matmul_t *job, long g0, long g1, int kind) {
    long height = X_BLOCK_FLOATS / job->k / MAX_R * MAX_R;
    if (height < PANEL_MIN_ROWS) height = PANEL_MIN_ROWS;
    /* without a panel, tile() unpacks in place: the same results */
    int has_panel = job->m >= PANEL_MIN_ROWS &&
                    reserve((void **)&panel_buf, &panel_cap, sizeof(float) * (size_t)(MAX_C * job->k * GROUP));
    for (long h0 = 0; h0 < job->m; h0 += height) {
        long h1 = h0 + height < job->m ? h0 + height : job->m;
        long g = g0;
#if MAX_C > 1
        for (; g + MAX_C <= g1; g += MAX_C) groups_by(job, g, MAX_C, h0, h1, kind, has_panel);
#endif
        for (; g < g1; g++) groups_by(job, g, 1, h0, h1, kind, has_panel);
    }
}

/* ---- integer activations ----
 * x is quantized per row and 32-block: scale s = max|x| / L, codes round(x * L / max|x|) (ties
 * to even), with L = 127 (8-bit codes, llama.cpp's Q8_0 activations: one int8 pass) or L = 32512
 * (about 15 bits, two int8 passes: a code q is q = 256 * q1 + q2 with q1 = round(q / 256) and
 * q2 in -127..127, and the block sum is 256 * sum(code_w * q1) + sum(code_w * q2), one shift and
 * one add to join the passes. The 1 in 256 codes whose q2 would be +-128 (which the AVX2 sign
 * trick cannot negate) move one step towards q1's multiple of 256 first). A block's
 * integer sum S = sum(code_w * code_x) is exact; then, block by block in one fixed order,
 *   Q4_0: acc = fma((S - 8 * sum(code_x)) * s, d, acc)
 *   Q4_1: acc = fma(S * s, d, acc); acc = fma(m, s * sum(code_x), acc)
 *   Q8_0: acc = fma(S * s, d, acc)
 * so a row's result is the same whatever the batch, the tiling, the threads or the ISA. */

#define LEVELS_1 127.0f   /* one pass */
#define LEVELS_2 32512.0f /* two passes: 256 * 127 */

/* Split among the pool's threads when `work` (about the number of float32 values the step
 * touches, in the units of MIN_WORK_PER_SHARE) is worth it, else run on the calling thread. */
static void run_elementwise(void (*fn)(const void *arg, long i0, long i1), const void *arg, long count,
                            long work);

typedef struct {
    const float *x;
    long k, mq;
    int passes;
    int8_t *xq;
    float *xs, *xsum;
    int32_t *qsum;
} quantize_t;

/* Blocks [i0, i1) of x (block i: row i / (k / 32), its 32 values from column 32 * (i % (k / 32))). */
static void quantize_blocks(const void *arg, long i0, long i1) {
    const quantize_t *a = (const quantize_t *)arg;
    const float *x = a->x;
    long k = a->k, mq = a->mq;
    int passes = a->passes;
    int8_t *xq = a->xq;
    float *xs = a->xs, *xsum = a->xsum;
    int32_t *qsum = a->qsum;
    float levels = passes == 2 ? LEVELS_2 : LEVELS_1;
    for (long i = i0; i < i1; i++) {
        const float *p = x + i * QK;
        int8_t *q = xq + i * QK, *q2 = q + mq * k; /* the second part (two passes) */
        int32_t sum = 0;
#if IFB_ISA == 512
        __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float inv = top > 0.0f ? levels / top : 0.0f;
        __m512i lim = _mm512_set1_epi32((int)levels), nlim = _mm512_set1_epi32(-(int)levels);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        qa = _mm512_max_epi32(_mm512_min_epi32(qa, lim), nlim);
        qb = _mm512_max_epi32(_mm512_min_epi32(qb, lim), nlim);
        if (passes == 2) { /* q / 256 is exact in float32: its rounding ties to even */
            __m512 part = _mm512_set1_ps(1.0f / 256.0f);
            __m512i ha = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(qa), part));
            __m512i hb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(qb), part));
            __m512i l7 = _mm512_set1_epi32(127), nl7 = _mm512_set1_epi32(-127);
            __m512i la = _mm512_max_epi32(_mm512_min_epi32(_mm512_sub_epi32(qa, itimes256(ha)), l7), nl7);
            __m512i lb = _mm512_max_epi32(_mm512_min_epi32(_mm512_sub_epi32(qb, itimes256(hb)), l7), nl7);
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(itimes256(ha), la),
                                                           _mm512_add_epi32(itimes256(hb), lb)));
            _mm_storeu_si128((__m128i *)q2, _mm512_cvtepi32_epi8(la));
            _mm_storeu_si128((__m128i *)(q2 + 16), _mm512_cvtepi32_epi8(lb));
            qa = ha;
            qb = hb;
        } else {
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        }
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
#else
        float top = 0.0f;
        for (int j = 0; j < QK; j++) top = fabsf(p[j]) > top ? fabsf(p[j]) : top;
        float inv = top > 0.0f ? levels / top : 0.0f;
        for (int j = 0; j < QK; j++) {
            float v = nearbyintf(p[j] * inv); /* ties to even, as the vector conversion */
            int c = v > levels ? (int)levels : v < -levels ? -(int)levels : (int)v;
            if (passes == 2) {
                int h = (int)nearbyintf((float)c * (1.0f / 256.0f)), l = c - 256 * h;
                l = l > 127 ? 127 : l < -127 ? -127 : l;
                sum += 256 * h + l;
                q2[j] = (int8_t)l;
                c = h;
            } else {
                sum += c;
            }
            q[j] = (int8_t)c;
        }
#endif
        xs[i] = top / levels;
        qsum[i] = sum;
        xsum[i] = xs[i] * (float)sum;
    }
}

/* Per-block codes (as `passes` int8 parts), scales and sums of x [m, k]. */
static void quantize_rows(const float *x, long m, long k, int passes, long mq, int8_t *xq, float *xs,
                          int32_t *qsum, float *xsum) {
    quantize_t a = {x, k, mq, passes, xq, xs, xsum, qsum};
    run_elementwise(quantize_blocks, &a, m * (k / QK), m * k);
}

/* acc after block b of row r: the block's integer sum s (Q8_0: with Q8_OFFSET's offset) through
 * the float32 steps above, for weight scales d and minima m. */
INLINE vec block_step(const matmul_t *job, long r, long b, int kind, ivec s, vec d, vec m, vec acc) {
    long rb = r * (job->k / QK) + b;
    int32_t fix = kind == Q4_0 ? 8 * job->qsum[rb] : kind == Q8_0 && Q8_OFFSET ? 128 * job->qsum[rb] : 0;
    acc = vfmadd(icvt_scaled(kind == Q4_1 ? s : isub(s, fix), job->xs[rb]), d, acc);
    return kind == Q4_1 ? vfmadd(m, vset1(job->xsum[rb]), acc) : acc;
}

#define Q8_AHEAD 4 /* blocks between a block's prefetch and its products */

INLINE void tile_q8(const matmul_t *job, long r0, int R, long g0, int C, int kind, int P) {
    long k = job->k, nb = k / QK;
    vec acc[MAX_RQ][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) acc[r][c] = VZERO();
    for (long b = 0; b < nb; b++) {
        ivec s[MAX_RQ][4];
        vec d[4], m[4];
        const uint8_t *q[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            q[c] = group_block(job, g0 + c, b, kind, &d[c], &m[c]);
            if (b + Q8_AHEAD < nb) /* the group's blocks are contiguous: ask for one further on */
                prefetch_span(group_start(job, g0 + c, b + Q8_AHEAD, kind), group_bytes(kind));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) s[r][c] = izero();
        }
        /* Two passes: small tiles unpack each chunk once and sum its products with the codes'
         * high parts (s) and low parts (s2), then s = 256 * s + s2; larger ones (which would run
         * out of registers so) go over the block twice, s = 256 * s between the passes. */
        const int fused = P == 2 && R * C <= 4;
        ivec s2[MAX_RQ][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) s2[r][c] = izero();
        for (int pass = 0; pass < (fused ? 1 : P); pass++) {
            const int8_t *xb = job->xq + pass * job->mq * k + r0 * k + b * QK, *xb2 = xb + job->mq * k;
            if (pass > 0)
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) s[r][c] = itimes256(s[r][c]);
            if (kind == Q8_0) {
#pragma GCC unroll 8
                for (int t = 0; t < QK / 4; t++)
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        wvec w = load_chunk(q[c] + t * CHUNK);
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            s[r][c] = dot4_q8(s[r][c], w, xb + r * k + 4 * t);
                            if (fused) s2[r][c] = dot4_q8(s2[r][c], w, xb2 + r * k + 4 * t);
                        }
                    }
            } else {
#pragma GCC unroll 4
                for (int t = 0; t < QK / 8; t++)
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        wvec v = load_chunk(q[c] + t * CHUNK), lo = low_nibbles(v), hi = high_nibbles(v);
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            s[r][c] = dot4_u4(s[r][c], lo, xb + r * k + 4 * t);
                            s[r][c] = dot4_u4(s[r][c], hi, xb + r * k + QK / 2 + 4 * t);
                            if (fused) {
                                s2[r][c] = dot4_u4(s2[r][c], lo, xb2 + r * k + 4 * t);
                                s2[r][c] = dot4_u4(s2[r][c], hi, xb2 + r * k + QK / 2 + 4 * t);
                            }
                        }
                    }
            }
        }
        if (fused)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int c = 0; c < C; c++) s[r][c] = iadd(itimes256(s[r][c]), s2[r][c]);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) acc[r][c] = block_step(job, r0 + r, b, kind, s[r][c], d[c], m[c], acc[r][c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store_output(job, r0 + r, g0 + c, acc[r][c]);
}

/* Every row tile of rows [h0, h1) over groups [g, g + C). */
INLINE void rows_q8(const matmul_t *job, long h0, long h1, long g, int C, int kind, int P) {
    for (long r0 = h0; r0 < h1; r0 += MAX_RQ) {
        long rows = h1 - r0;
        if (rows >= MAX_RQ) tile_q8(job, r0, MAX_RQ, g, C, kind, P);
#if MAX_RQ > 3
        else if (rows == 3) tile_q8(job, r0, 3, g, C, kind, P);
#endif
#if MAX_RQ > 2
        else if (rows == 2) tile_q8(job, r0, 2, g, C, kind, P);
#endif
        else tile_q8(job, r0, 1, g, C, kind, P);
    }
}


#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && IFB_ISA == 512
/* ---- AMX tiles for the integer sums ----
 * Whole tiles of 16 rows, and a part tile of AMX_PAD_MIN rows or more padded with zero rows (fewer
 * rows left over go to the vector code): a block's sums for 16 rows
 * by 16 columns come from one tile product per pass: A = 16 rows of the block's 32 activation
 * codes, B = the group block's 8 chunks as its 8 rows (4 codes of each column side by side: the
 * chunk layout is AMX's), C = int32 [16][16].
 * The sums are the same integers as dot4's, then the same float32 operations: bit-identical.
 * The tile products cost little; what is left is each block's float32 steps per row and the
 * trip of C through memory, which tile_amx overlaps with the products of the blocks after. */
#include <sys/syscall.h>
#include <unistd.h>
#define HAS_AMX 1
#define AMX_AHEAD 8 /* steps between a block's prefetch and its products */
#define AMX_ROWS 16
/* Rows left over from whole tiles from which a tile padded with zero rows beats the vector tiles
 * (measured, Q4_1 at 15-bit activations, a 30-layer step: 9 rows 6.9 ms on the vector tiles and
 * 6.4 ms padded, 10 rows 7.3 and 6.9, 15 rows 10.8 and 7.9; at 8 rows the vector tiles win, 5.5
 * against 5.9 ms). The rows' results are the same. */
#define AMX_PAD_MIN 9

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static _Atomic int amx_state; /* 0: not asked yet, 1: usable, -1: refused by the kernel */

/* Whether this process may use AMX tiles (Linux grants the state on request). */
static int amx_usable(void) {
    if (atomic_load(&amx_state) == 0) {
        const char *off = getenv("IFB_KERNEL_AMX"); /* "0": the vector code only */
        int ok = !(off && off[0] == '0') &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        atomic_store(&amx_state, ok ? 1 : -1);
    }
    return atomic_load(&amx_state) > 0;
}

static __thread int amx_configured;

static void amx_configure(void) {
    tilecfg_t cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = QK; } /* A, per pass */
    cfg.rows[2] = QK / 4; cfg.colsb[2] = CHUNK;                            /* B */
    cfg.rows[5] = QK / 4; cfg.colsb[5] = CHUNK;                            /* B, second set */
    for (int t = 3; t < 5; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = 4 * GROUP; } /* C, per pass */
    for (int t = 6; t < 8; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = 4 * GROUP; } /* second set */
    /* GCC does not see ldtilecfg read cfg: without a barrier it drops the stores above */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
    amx_configured = 1;
}

/* 4-bit codes: the group block's 4 chunks as B's 8 rows in bt (weights 4t..4t+3 are row t,
 * weights 16 + 4t.. row 4 + t); Q8_0 codes are B as stored. */
INLINE void amx_unpack(const matmul_t *job, long g, long b, int kind, uint8_t *bt) {
    if (kind == Q8_0) return;
    const uint8_t *q = group_codes(job, g, b, kind);
    for (int t = 0; t < 4; t++) {
        wvec v = load_chunk(q + t * CHUNK);
        _mm512_store_si512((void *)(bt + t * CHUNK), low_nibbles(v));
        _mm512_store_si512((void *)(bt + (t + 4) * CHUNK), high_nibbles(v));
    }
}

/* Block b's tile products for group g into tiles C1T (and C2T: the second pass), B in tile BT. */
#define AMX_ISSUE(BT, C1T, C2T, bt, g, b)                                                   \
    do {                                                                                    \
        if (kind == Q8_0)                                                                   \
            _tile_loadd(BT, group_codes(job, g, b, kind), CHUNK);                           \
        else                                                                                \
            _tile_loadd(BT, (bt), CHUNK);                                                   \
        const int8_t *xb_ = job->xq + r0 * k + (b) * QK;                                    \
        _tile_loadd(0, xb_, k);                                                             \
        _tile_zero(C1T);                                                                    \
        _tile_dpbsud(C1T, 0, BT);                                                           \
        if (P == 2) {                                                                       \
            _tile_loadd(1, xb_ + job->mq * k, k);                                           \
            _tile_zero(C2T);                                                                \
            _tile_dpbsud(C2T, 1, BT);                                                       \
        }                                                                                   \
    } while (0)

#define AMX_STORE(C1T, C2T, cs)                                                             \
    do {                                                                                    \
        _tile_stored(C1T, (cs)[0], 4 * GROUP);                                              \
        if (P == 2) _tile_stored(C2T, (cs)[1], 4 * GROUP);                                  \
    } while (0)

/* Rows [r0, r0 + 16) by groups [g0, g1), their (group, block) steps i = (g - g0) * nb + b in one
 * software pipeline, so that no step waits on the one before: at step i, step i + 1's products
 * are issued (tiles 2-4 or 5-7 in turn), step i + 2's codes unpacked, step i's products stored
 * (issued a step earlier) and step i - 1's sums (stored a step earlier) taken through the float32
 * steps of its group. */
INLINE void tile_amx(const matmul_t *job, long r0, long g0, long g1, int kind, int P) {
    if (!amx_configured) amx_configure();
    long k = job->k, nb = k / QK, steps = (g1 - g0) * nb;
    __m512 acc[AMX_ROWS];
    _Alignas(64) uint8_t bts[2][QK / 4 * CHUNK];
    _Alignas(64) int32_t cs[2][2][AMX_ROWS][GROUP]; /* [step & 1][pass] */
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    /* (group, block) of the steps issued next, unpacked next and summed next */
    long gi = g0, bi = 0, gu = g0, bu = 0, ge = g0, be = 0;
#define NEXT(g, b) (++(b) == nb ? ((b) = 0, ++(g)) : 0)
    for (int u = 0; u < 2 && u < steps; u++, NEXT(gu, bu)) amx_unpack(job, gu, bu, kind, bts[u]);
    AMX_ISSUE(2, 3, 4, bts[0], gi, bi);
    NEXT(gi, bi);
    for (long i = 0; i <= steps; i++) {
        if (i + 1 < steps) {
            if ((i + 1) & 1)
                AMX_ISSUE(5, 6, 7, bts[1], gi, bi);
            else
                AMX_ISSUE(2, 3, 4, bts[0], gi, bi);
            NEXT(gi, bi);
        }
        if (i + 2 < steps) {
            amx_unpack(job, gu, bu, kind, bts[i & 1]);
            NEXT(gu, bu);
        }
        if (i + AMX_AHEAD < steps) /* a chunk's steps are contiguous blocks: ask for one further on */
            prefetch_span(group_start(job, g0, 0, kind) + (i + AMX_AHEAD) * group_bytes(kind), group_bytes(kind));
        if (i < steps) {
            if (i & 1)
                AMX_STORE(6, 7, cs[1]);
            else
                AMX_STORE(3, 4, cs[0]);
        }
        if (i == 0) continue;
        vec d, m; /* step i - 1, whose sums were stored a step ago */
        group_block(job, ge, be, kind, &d, &m);
        int32_t(*c1)[GROUP] = cs[(i - 1) & 1][0], (*c2)[GROUP] = cs[(i - 1) & 1][1];
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) { /* B holds Q8_0 codes + 128, as VNNI's dot4_q8 reads them */
            ivec s = _mm512_load_si512((const void *)c1[r]);
            if (P == 2) s = iadd(itimes256(s), _mm512_load_si512((const void *)c2[r]));
            acc[r] = block_step(job, r0 + r, be, kind, s, d, m, acc[r]);
        }
        if (be == nb - 1) /* the group's last block; padding rows are not stored */
#pragma GCC unroll 16
            for (int r = 0; r < AMX_ROWS; r++) {
                if (r0 + r < job->m) store_output(job, r0 + r, ge, acc[r]);
                acc[r] = _mm512_setzero_ps();
            }
        NEXT(ge, be);
    }
#undef NEXT
}

#if Q8_OFFSET != 1
#error "the AMX tiles give Q8_0 sums with the offset, as VNNI's"
#endif
#else
#define HAS_AMX 0
#endif

/* Rows per block of x: its codes stay in L2 while every group of the range passes over them. */
#define XQ_BLOCK_BYTES 262144L

INLINE void groups_q8(const matmul_t *job, long g0, long g1, int kind, int P) {
    long start = 0; /* rows from here on: vector tiles */
#if HAS_AMX
    if (job->use_amx) { /* whole tiles of 16 rows (padded ones included); the rest below */
        start = job->mq / AMX_ROWS * AMX_ROWS;
        for (long r0 = 0; r0 < start; r0 += AMX_ROWS) tile_amx(job, r0, g0, g1, kind, P);
    }
#endif
    long height = XQ_BLOCK_BYTES / job->k;
    if (height < MAX_RQ) height = MAX_RQ;
    for (long h0 = start; h0 < job->m; h0 += height) {
        long h1 = h0 + height < job->m ? h0 + height : job->m, g = g0;
        if (h1 - h0 == 1) /* one row: more columns at once keep more sums in flight */
            for (; g + 4 <= g1; g += 4) rows_q8(job, h0, h1, g, 4, kind, P);
        for (; g + 2 <= g1; g += 2) rows_q8(job, h0, h1, g, 2, kind, P);
        for (; g < g1; g++) rows_q8(job, h0, h1, g, 1, kind, P);
    }
}

/* Groups [g0, g1) of `kind` (a constant at each call site), by the job's activations. */
INLINE void columns_of(const matmul_t *job, long g0, long g1, int kind) {
    if (job->passes == 2)
        groups_q8(job, g0, g1, kind, 2);
    else if (job->passes == 1)
        groups_q8(job, g0, g1, kind, 1);
    else
        groups(job, g0, g1, kind);
}

static void run_columns(const matmul_t *job, long g0, long g1) {
    if (job->kind == Q4_0)
        columns_of(job, g0, g1, Q4_0);
    else if (job->kind == Q4_1)
        columns_of(job, g0, g1, Q4_1);
    else
        columns_of(job, g0, g1, Q8_0);
}

typedef struct {
    const float *q;                 /* [t, hq, d]: row stride q_stride, heads contiguous */
    long q_stride, t, hq, hkv, d;
    const uint8_t *k_cache, *v_cache; /* [blocks, block_size, hkv, d] of float32, or float16 (kv_half) */
    int kv_half;
    long block_size;
    const int64_t *block_tables;    /* [seqs, width] */
    long width;
    const int64_t *query_start_loc; /* [seqs + 1] */
    const int64_t *seq_lens;        /* [seqs]: context length after this step */
    const long *token_seq;          /* [t]: the sequence of each query token */
    long max_ctx;
    float scale;
    float *out;                     /* [t, hq, d] */
} attention_t;

typedef struct {
    const float *x; /* [rows, n] */
    long n;
    int64_t *out;   /* [rows] */
} argmax_t;

/* Independent items of an elementwise step (rows, or blocks of a row): fn(arg, i0, i1) runs [i0, i1). */
typedef struct {
    void (*fn)(const void *arg, long i0, long i1);
    const void *arg;
} items_t;

/* A unit of work for the pool: `count` independent items, split in contiguous ranges. */
typedef struct {
    int kind; /* 0: matmul (items are groups of 16 output columns), 1: attention (items are (token, kv head)
               * pairs), 2: argmax (items are rows), 3: an elementwise step (its own items) */
    long count;
    matmul_t mm;
    attention_t at;
    argmax_t am;
    items_t it;
} job_t;


/* ---- paged attention ----
 * Query token t of sequence b sits at position p = seq_lens[b] - (query_start_loc[b + 1] - t) and
 * attends to positions 0..p of its sequence, read through its block table. Each (token, head) is
 * computed on its own, in one fixed order, so a token's result is the same whether it is decoded
 * alone, in a batch, or as part of a prefill chunk of any length. */

INLINE float dot(const float *a, const float *b, long d) {
#if IFB_ISA == 512
    if (d % 16 == 0) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (long i = 16; i < d; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s);
        return _mm512_reduce_add_ps(s);
    }
#elif IFB_ISA == 256
    if (d % 8 == 0) {
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
        for (long i = 8; i < d; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    float s = 0.0f;
    for (long i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* y += a * x */
INLINE void axpy(float *y, float a, const float *x, long d) {
    long i = 0;
#if IFB_ISA == 512
    __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif IFB_ISA == 256
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < d; i++) y[i] += a * x[i];
}

#if IFB_ISA == 512
/* e^x for x <= 88, to about 2 ulp: e^x = 2^n e^f with |f| <= ln2 / 2, e^f from its degree-6
 * Taylor polynomial. */
INLINE __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* below, e^x is under float's normal range */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln 2 in two parts (Cody-Waite) */
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 e = _mm512_set1_ps(1.0f / 720.0f);
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 120.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 24.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 6.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}
#endif

/* act[r, i] = silu(gate) * up over `rows` rows of [gate | up] (2 * inter floats each). */
static void silu_rows(const float *gu, long rows, long inter, float *act) {
    for (long r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * inter, *up = gate + inter;
        float *out = act + r * inter;
        long i = 0;
#if IFB_ISA == 512
        for (; i + 16 <= inter; i += 16) {
            __m512 g = _mm512_loadu_ps(gate + i);
            __m512 e = exp_nonpositive(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.0f)));
            __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < inter; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* The largest of p[0..n) (-inf for n = 0). */
static float max_of(const float *p, long n) {
    long j = 0;
    float top = -INFINITY;
#if IFB_ISA == 512
    if (n >= 16) {
        __m512 m = _mm512_loadu_ps(p);
        for (j = 16; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + j));
        top = _mm512_reduce_max_ps(m);
    }
#endif
    for (; j < n; j++)
        if (p[j] > top) top = p[j];
    return top;
}

/* p[j] = p[j] / sum for j < n (correctly rounded, as a scalar division). */
static void divide_by(float *p, long n, float sum) {
    long j = 0;
#if IFB_ISA == 512
    __m512 v = _mm512_set1_ps(sum);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, _mm512_div_ps(_mm512_loadu_ps(p + j), v));
#elif IFB_ISA == 256
    __m256 v = _mm256_set1_ps(sum);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, _mm256_div_ps(_mm256_loadu_ps(p + j), v));
#endif
    for (; j < n; j++) p[j] = p[j] / sum;
}

/* p[j] = e^(p[j] - top) for j < n; returns their sum (in a fixed order). */
static float exp_shifted(float *p, long n, float top) {
    long j = 0;
    float sum = 0.0f;
#if IFB_ISA == 512
    __m512 acc = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), shift));
        _mm512_storeu_ps(p + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p + j), shift));
        _mm512_mask_storeu_ps(p + j, tail, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        p[j] = expf(p[j] - top);
        sum += p[j];
    }
    return sum;
}

/* Cached K/V values are float32, or float16 (`half`, a constant at each call site) read as float32
 * (exact): a float16 cache halves the bytes a decode step streams for its context.
 * Row p of d cached values as float32: p itself, or (float16) converted into tmp. */
INLINE const float *kv_row(const void *row, long d, int half, float *tmp) {
    const uint8_t *p = (const uint8_t *)row;
    if (!half) return (const float *)p;
    long i = 0;
#if IFB_ISA == 512
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(tmp + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i))));
#elif IFB_ISA == 256
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    for (; i < d; i++) tmp[i] = half_at(p + 2 * i);
    return tmp;
}

#if IFB_ISA == 512
INLINE __m512 kv_load(const uint8_t *p, long i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* o_h = sum_j p_h[j] v_j over positions j < ctx for H heads at once (H and nv = d / 16 constants
 * at each call site), v_j read through the block table once for all of them; each head's sums
 * take the same operations in the same order as axpy's. */
INLINE void weighted_rows(float *o, const float *p, long p_stride, long ctx, const int64_t *table,
                          const uint8_t *v0, long bs, long row_bytes, int H, int nv, int half) {
    __m512 acc[16];
    for (int i = 0; i < H * nv; i++) acc[i] = _mm512_setzero_ps();
    for (long j0 = 0; j0 < ctx; j0 += bs) {
        const uint8_t *v = v0 + table[j0 / bs] * bs * row_bytes;
        if (j0 + bs < ctx) { /* the next block's values */
            const uint8_t *next = v0 + table[j0 / bs + 1] * bs * row_bytes;
            for (long j = 0; j < bs && j0 + bs + j < ctx; j++)
                prefetch_span(next + j * row_bytes, 16 * nv * (half ? 2 : 4));
        }
        for (long j = j0; j < ctx && j < j0 + bs; j++, v += row_bytes)
            for (int c = 0; c < nv; c++) {
                __m512 x = kv_load(v, 16 * c, half);
                for (int h = 0; h < H; h++)
                    acc[h * nv + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * p_stride + j]), x, acc[h * nv + c]);
            }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + h * 16 * nv + 16 * c, acc[h * nv + c]);
}

/* weighted_rows for `heads` heads of d = 16 * nv, in runs of as many as keep 16 sums in registers. */
INLINE void weighted_heads(float *o, const float *p, long p_stride, long heads, long ctx, const int64_t *table,
                           const uint8_t *v0, long bs, long row_bytes, int nv, int half) {
    long most = 16 / nv;
    for (long h = 0; h < heads;) {
        long n = heads - h < most ? heads - h : most;
        float *oh = o + h * 16 * nv;
        const float *ph = p + h * p_stride;
        if (n >= 4)
            weighted_rows(oh, ph, p_stride, ctx, table, v0, bs, row_bytes, 4, nv, half);
        else if (n == 3)
            weighted_rows(oh, ph, p_stride, ctx, table, v0, bs, row_bytes, 3, nv, half);
        else if (n == 2)
            weighted_rows(oh, ph, p_stride, ctx, table, v0, bs, row_bytes, 2, nv, half);
        else
            weighted_rows(oh, ph, p_stride, ctx, table, v0, bs, row_bytes, 1, nv, half);
        h += n >= 4 ? 4 : n;
    }
}
#endif

/* Scores of a run of SCORE_LANES keys at once: each key's products are summed lane-wise as dot()
 * does, then the run's partial vectors are reduced together by a transposing tree (pairs of lanes
 * i, i + 8, then i, i + 4, ...). Each key's score depends on its own vector only: a key scores the
 * same bits in a full run and in a run cut short by the end of the context (NULL keys). */
#if IFB_ISA == 512
#define SCORE_LANES 16
/* The tree leaves key KEY_OF_SLOT[s]'s sum in lane KEY_OF_SLOT[s] when it starts in vector s. */
static const int KEY_OF_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

INLINE int scores_fit(long d) { return d % 16 == 0; }

INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    __m512 v[16];
    for (int s = 0; s < 16; s++) {
        const float *k = keys[KEY_OF_SLOT[s]];
        if (k == NULL) {
            v[s] = _mm512_setzero_ps();
            continue;
        }
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
        for (long i = 16; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), acc);
        v[s] = acc;
    }
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    _mm512_storeu_ps(out, _mm512_mul_ps(z, _mm512_set1_ps(scale)));
}

#elif IFB_ISA == 256
#define SCORE_LANES 8
static const int KEY_OF_SLOT[8] = {0, 4, 1, 5, 2, 6, 3, 7};

INLINE int scores_fit(long d) { return d % 8 == 0; }

INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    __m256 v[8];
    for (int s = 0; s < 8; s++) {
        const float *k = keys[KEY_OF_SLOT[s]];
        if (k == NULL) {
            v[s] = _mm256_setzero_ps();
            continue;
        }
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (long i = 8; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
        v[s] = acc;
    }
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m256 z = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    _mm256_storeu_ps(out, _mm256_mul_ps(z, _mm256_set1_ps(scale)));
}

#else
#define SCORE_LANES 1
INLINE int scores_fit(long d) { (void)d; return 0; }
INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    (void)q; (void)keys; (void)d; (void)scale; (void)out;
}
#endif

/* Ask for up to SCORE_LANES rows of `bytes`. */
INLINE void prefetch_rows(const uint8_t *const *rows, long n, long bytes) {
    for (long s = 0; s < n && s < SCORE_LANES; s++) prefetch_span(rows[s], bytes);
}

/* Items [i0, i1): (token, kv head) pairs. The kv head's keys are scored for all the group's query
 * heads run by run (a run's keys are read once, then from L1), and its values summed for them in
 * one pass; each head's arithmetic is what it would be alone. */
INLINE void attention_items_of(const attention_t *a, long i0, long i1, int half, long D) {
    long group = a->hq / a->hkv, d = D ? D : a->d, bs = a->block_size, es = half ? 2 : 4, row_bytes = a->hkv * d * es;
    long stride = a->max_ctx + SCORE_LANES; /* room for a whole last run of scores, and of key addresses */
    float *p = (float *)malloc(sizeof(float) * (size_t)(stride * group + SCORE_LANES * d));
    const uint8_t **keys = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)stride);
    if (p == NULL || keys == NULL) {
        free(p);
        free(keys);
        return;
    }
    float *tmp = p + stride * group;
    for (long i = i0; i < i1; i++) {
        long t = i / a->hkv, g = i % a->hkv, b = a->token_seq[t];
        long ctx = a->seq_lens[b] - (a->query_start_loc[b + 1] - t) + 1;
        const int64_t *table = a->block_tables + b * a->width;
        long j = 0; /* position j is slot j % bs of block table[j / bs] */
        for (long j0 = 0; j0 < ctx; j0 += bs) {
            const uint8_t *k = a->k_cache + table[j0 / bs] * bs * row_bytes + g * d * es;
            for (; j < ctx && j < j0 + bs; j++, k += row_bytes) keys[j] = k;
        }
        for (; j < ctx + SCORE_LANES; j++) keys[j] = NULL;
        const float *q0 = a->q + t * a->q_stride + g * group * d;
        if (scores_fit(d))
            for (long j0 = 0; j0 < ctx; j0 += SCORE_LANES) {
                const float *run[SCORE_LANES]; /* float16: converted once for the group's heads */
                prefetch_rows(keys + j0 + 2 * SCORE_LANES, ctx - j0 - 2 * SCORE_LANES, d * es);
                for (int s = 0; s < SCORE_LANES; s++)
                    run[s] = keys[j0 + s] ? kv_row(keys[j0 + s], d, half, tmp + s * d) : NULL;
                for (long h = 0; h < group; h++) score_run(q0 + h * d, run, d, a->scale, p + h * stride + j0);
            }
        else
            for (long h = 0; h < group; h++)
                for (j = 0; j < ctx; j++)
                    p[h * stride + j] = dot(q0 + h * d, kv_row(keys[j], d, half, tmp), d) * a->scale;
        for (long h = 0; h < group; h++) { /* the softmax weights */
            float *ph = p + h * stride;
            divide_by(ph, ctx, exp_shifted(ph, ctx, max_of(ph, ctx)));
        }
        float *o = a->out + (t * a->hq + g * group) * d;
        const uint8_t *v0 = a->v_cache + g * d * es;
#if IFB_ISA == 512
        if (d == 64 || d == 128) { /* the usual head sizes: the sums stay in registers */
            if (d == 64)
                weighted_heads(o, p, stride, group, ctx, table, v0, bs, row_bytes, 4, half);
            else
                weighted_heads(o, p, stride, group, ctx, table, v0, bs, row_bytes, 8, half);
            continue;
        }
#endif
        for (long h = 0; h < group; h++) {
            float *oh = o + h * d;
            for (long c = 0; c < d; c++) oh[c] = 0.0f;
            for (long j0 = 0; j0 < ctx; j0 += bs) {
                const uint8_t *v = v0 + table[j0 / bs] * bs * row_bytes;
                for (j = j0; j < ctx && j < j0 + bs; j++, v += row_bytes)
                    axpy(oh, p[h * stride + j], kv_row(v, d, half, tmp), d);
            }
        }
    }
    free(p);
    free(keys);
}

/* Specialised for float16 or float32 caches and for the usual head sizes, whose loops over d the
 * compiler can then unroll (the same operations in the same order as for any d). */
INLINE void attention_items_by_d(const attention_t *a, long i0, long i1, int half) {
    if (a->d == 64)
        attention_items_of(a, i0, i1, half, 64);
    else if (a->d == 128)
        attention_items_of(a, i0, i1, half, 128);
    else
        attention_items_of(a, i0, i1, half, 0);
}

static void attention_items(const attention_t *a, long i0, long i1) {
    if (a->kv_half)
        attention_items_by_d(a, i0, i1, 1);
    else
        attention_items_by_d(a, i0, i1, 0);
}

/* The index of the first maximum of x[0..n) (n >= 1), or of the first NaN, as torch's max picks. */
static long argmax_row(const float *x, long n) {
    long i = 1, best_i = 0;
    float best = x[0];
    int has_nan = x[0] != x[0];
#if IFB_ISA == 512
    if (n >= 32) { /* per lane the first of its maxima, then the lowest index among the lanes' */
        __m512 bv = _mm512_loadu_ps(x);
        __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bi;
        __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
            __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_mov_ps(bv, gt, v);
            bi = _mm512_mask_mov_epi32(bi, gt, idx);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        has_nan = nan != 0;
        best = _mm512_reduce_max_ps(bv);
        __mmask16 top = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(top, bi);
    }
#endif
    for (; i < n; i++) {
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
        has_nan |= x[i] != x[i];
    }
    if (has_nan)
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return best_i;
}

static void run_items(const job_t *job, long i0, long i1) {
    if (job->kind == 0)
        run_columns(&job->mm, i0, i1);
    else if (job->kind == 1)
        attention_items(&job->at, i0, i1);
    else if (job->kind == 2)
        for (long r = i0; r < i1; r++) job->am.out[r] = argmax_row(job->am.x + r * job->am.n, job->am.n);
    else
        job->it.fn(job->it.arg, i0, i1);
}

/* ---- a small pool ----
 * A job's items are cut into chunks that the caller and the helpers claim one at a time, so a
 * helper that the OS has not scheduled (a busy machine) leaves its share to the others instead
 * of stalling the caller. After a job a helper busy-waits for the next one for a while (a decode
 * step calls again within microseconds), yielding its core to other runnable threads, then sleeps
 * on a condition variable. One caller at a time uses the pool; a concurrent caller computes alone.
 * Chunks never change an item's arithmetic. */

#define MAX_HELPERS 63
#define SPIN_NS 50000L            /* pure spinning after a job */
#define YIELD_NS 2000000L         /* then spinning with sched_yield, then sleeping */
#define MIN_WORK_PER_SHARE 1024L  /* in 32-multiply-add units: smaller shares are not worth a hand-off */
#define CHUNKS_PER_SHARE 8

static pthread_mutex_t pool_use = PTHREAD_MUTEX_INITIALIZER;   /* held by the caller using the pool */
static pthread_mutex_t pool_sleep = PTHREAD_MUTEX_INITIALIZER; /* guards the sleeping helpers' wake-up */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t pool_ticket;   /* (job number << 32) | next chunk to claim */
static _Atomic long pool_done;         /* chunks of the current job finished */
static _Atomic int pool_sleepers;
static int pool_started;               /* helpers running (guarded by pool_use) */
static _Atomic int pool_wanted = 1;    /* threads per call, the caller included */
static job_t pool_job;                 /* the current job: written before its ticket is published */
static long pool_chunks;

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Claim the next chunk of job `seq`; 0 when that job is over or another one has replaced it. */
static int claim(uint32_t seq, long *chunk) {
    uint64_t t = atomic_load_explicit(&pool_ticket, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(t >> 32) != seq || (long)(t & 0xFFFFFFFFu) >= pool_chunks) return 0;
        if (atomic_compare_exchange_weak_explicit(&pool_ticket, &t, t + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *chunk = (long)(t & 0xFFFFFFFFu);
            return 1;
        }
    }
}

/* Claim and run chunks of job `seq` until none is left. */
static void work_on(uint32_t seq) {
    long chunk;
    while (claim(seq, &chunk)) {
        long count = pool_job.count;
        run_items(&pool_job, count * chunk / pool_chunks, count * (chunk + 1) / pool_chunks);
        atomic_fetch_add_explicit(&pool_done, 1, memory_order_release);
    }
}

static uint32_t current_job(void) { return (uint32_t)(atomic_load(&pool_ticket) >> 32); }

static void wait_for_job(uint32_t seen) {
    long start = now_ns();
    unsigned spins = 0;
    while (current_job() == seen) {
        cpu_relax();
        if (++spins % 256) continue;
        long waited = now_ns() - start;
        if (waited < SPIN_NS) continue;
        if (waited < YIELD_NS) {
            sched_yield();
            continue;
        }
        pthread_mutex_lock(&pool_sleep);
        atomic_fetch_add(&pool_sleepers, 1);
        while (current_job() == seen) pthread_cond_wait(&pool_wake, &pool_sleep);
        atomic_fetch_sub(&pool_sleepers, 1);
        pthread_mutex_unlock(&pool_sleep);
    }
}

static void *helper_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg; /* the job number when this helper was created */
    for (;;) {
        wait_for_job(seen);
        seen = current_job();
        work_on(seen);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* helpers do not survive fork(): the child starts without any */
    pool_started = 0;
    pthread_mutex_init(&pool_use, NULL);
    pthread_mutex_init(&pool_sleep, NULL);
    pthread_cond_init(&pool_wake, NULL);
    atomic_store(&pool_sleepers, 0);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, child_after_fork); }

/* Threads per call, the caller included (1: no helpers). Helpers start on first use. */
void ifb_qk_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_HELPERS + 1) n = MAX_HELPERS + 1;
    atomic_store(&pool_wanted, n);
}

int ifb_qk_get_threads(void) { return atomic_load(&pool_wanted); }

/* Run `job`'s items, over the pool when `work` (in 32-multiply-add units) is large enough. */
static void run_job(const job_t *job, long work) {
    long shares = atomic_load(&pool_wanted);
    if (shares > work / MIN_WORK_PER_SHARE) shares = work / MIN_WORK_PER_SHARE;
    if (shares > job->count) shares = job->count;
    if (shares <= 1 || pthread_mutex_trylock(&pool_use) != 0) {
        run_items(job, 0, job->count);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    uint32_t seq = current_job() + 1;
    while (pool_started < shares - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, helper_main, (void *)(uintptr_t)(seq - 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool_started++;
    }
    /* an elementwise step is over in microseconds: two chunks a thread keep its claims few */
    long chunks = (pool_started + 1) * (job->kind == 3 ? 2 : CHUNKS_PER_SHARE);
    pool_job = *job;
    pool_chunks = chunks < job->count ? chunks : job->count;
    atomic_store_explicit(&pool_done, 0, memory_order_relaxed);
    pthread_mutex_lock(&pool_sleep);
    atomic_store_explicit(&pool_ticket, (uint64_t)seq << 32, memory_order_release);
    if (atomic_load(&pool_sleepers) > 0) pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_sleep);
    work_on(seq);
    /* a helper may still be inside the last chunks it claimed */
    while (atomic_load_explicit(&pool_done, memory_order_acquire) < pool_chunks) cpu_relax();
    /* Close the job before the next one rewrites pool_job and pool_chunks: a helper still
     * looping on this job's ticket must not take a chunk number below the next job's count
     * for one of this job's (it would run a half-written job). */
    atomic_store_explicit(&pool_ticket, ((uint64_t)seq << 32) | 0xFFFFFFFFu, memory_order_release);
    pthread_mutex_unlock(&pool_use);
}

static void run_elementwise(void (*fn)(const void *arg, long i0, long i1), const void *arg, long count,
                            long work) {
    job_t job = {.kind = 3, .count = count, .it = {fn, arg}};
    run_job(&job, work);
}

/* y [m, n] = x [m, k] (float32, row-major, k a multiple of 32) times the weight rows in `blocks`
 * (interleaved by ifb_interleave from GGUF blocks of `kind`), plus bias [n] (or NULL). `passes`:
 * x quantized to 15-bit (2) or 8-bit (1) integer codes per block, or used as float32 (0).
 * 0; -1 without memory for the codes (y untouched); -2 for an unknown kind. */
int ifb_block_matmul(const float *x, long m, long k, const uint8_t *blocks, int kind, int passes,
                     const float *bias, float *y, long n) {
    if (kind < Q4_0 || kind > Q8_0) return -2;
    job_t job = {.kind = 0, .count = (n + GROUP - 1) / GROUP, .mm = {kind, 0, x, m, k, n, blocks, bias, y}};
    if (passes == 1 || passes == 2) { /* the caller's buffers: helpers read them only while it waits */
        static __thread void *codes_buf;
        static __thread size_t codes_cap;
        long mq = m;
#if HAS_AMX
        job.mm.use_amx = m >= AMX_PAD_MIN && amx_usable();
        if (job.mm.use_amx && m % AMX_ROWS >= AMX_PAD_MIN) mq = (m / AMX_ROWS + 1) * AMX_ROWS;
#endif
        size_t nbk = (size_t)(mq * (k / QK)), real = (size_t)(m * (k / QK));
        void *buf = reserve(&codes_buf, &codes_cap, (size_t)(passes * mq * k) + 12 * nbk);
        if (buf == NULL) return -1;
        float *xs = (float *)buf, *xsum = xs + nbk; /* the 4-byte arrays first: aligned */
        int32_t *qsum = (int32_t *)(xsum + nbk);
        int8_t *xq = (int8_t *)(qsum + nbk);
        quantize_rows(x, m, k, passes, mq, xq, xs, qsum, xsum);
        if (mq > m) { /* zero rows: zero codes and scales, results computed and dropped */
            for (int pass = 0; pass < passes; pass++)
                memset(xq + pass * mq * k + m * k, 0, (size_t)((mq - m) * k));
            memset(xs + real, 0, sizeof(float) * (nbk - real));
            memset(xsum + real, 0, sizeof(float) * (nbk - real));
            memset(qsum + real, 0, sizeof(int32_t) * (nbk - real));
        }
        job.mm.passes = passes;
        job.mm.mq = mq;
        job.mm.xq = xq;
        job.mm.xs = xs;
        job.mm.qsum = qsum;
        job.mm.xsum = xsum;
    }
    run_job(&job, m * n * (k / QK));
    return 0;
}

/* out[r] = the index of the first maximum of row r of x [m, n] (n >= 1), or of its first NaN: the
 * greedy pick, as torch's max(dim=-1) makes it. */
void ifb_argmax_rows(const float *x, long m, long n, int64_t *out) {
    job_t job = {.kind = 2, .count = m, .am = {x, n, out}};
    run_job(&job, m * n / QK);
}

/* Which sequence each query token belongs to; returns the longest context and sets *work (in
 * 32-multiply-add units for `hq` heads of `d`). */
static long plan_attention(const int64_t *query_start_loc, const int64_t *seq_lens, long num_seqs, long hq,
                           long d, long *token_seq, long *work) {
    long max_ctx = 0, pairs = 0;
    for (long b = 0; b < num_seqs; b++) {
        for (long i = query_start_loc[b]; i < query_start_loc[b + 1]; i++) token_seq[i] = b;
        if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
        pairs += (query_start_loc[b + 1] - query_start_loc[b]) * seq_lens[b];
    }
    *work = pairs * hq * d * 2 / QK;
    return max_ctx;
}

/* out [t, hq, d] = causal attention of q (row stride q_stride) over the paged K/V cache, the step's
 * own K/V already written; scale multiplies q . k. Query heads h use K/V head h / (hq / hkv). */
void ifb_paged_attention(const float *q, long q_stride, long t, long hq, long hkv, long d,
                         const void *k_cache, const void *v_cache, int kv_half, long block_size,
                         const int64_t *block_tables, long width, const int64_t *query_start_loc,
                         const int64_t *seq_lens, long num_seqs, float scale, float *out) {
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (token_seq == NULL) return;
    long work;
    long max_ctx = plan_attention(query_start_loc, seq_lens, num_seqs, hq, d, token_seq, &work);
    job_t job = {.kind = 1, .count = t * hkv};
    job.at = (attention_t){q, q_stride, t, hq, hkv, d, k_cache, v_cache, kv_half, block_size, block_tables, width,
                           query_start_loc, seq_lens, token_seq, max_ctx, scale, out};
    run_job(&job, work);
    free(token_seq);
}

/* ---- a whole decoder stack in one call ----
 * The Llama-family layer of model.py (pre-norm attention with rotate-half RoPE and GQA, then a
 * SwiGLU MLP), every projection on GGUF blocks and float32 or float16 KV caches, for all the step's tokens.
 * It runs the same per-row operations as the kernels above; what it saves is the Python
 * dispatch of a few dozen small tensor operations per layer. */

typedef struct {
    long kind;                     /* Q4_0, Q4_1 or Q8_0 */
    long passes;                   /* integer activations (see ifb_block_matmul) */
    const uint8_t *blocks;         /* interleaved, as ifb_block_matmul reads them */
    const float *bias;             /* or NULL */
    long n, k;                     /* output and input features */
} weight_t;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const float *q_norm, *k_norm;      /* [head_dim] each (Qwen3), or NULL */
    weight_t qkv, o, gate_up, down;    /* q | k | v rows, and gate | up rows */
} layer_t;

typedef struct {
    long num_layers, hidden, intermediate, hq, hkv, d;
    float eps;
    const layer_t *layers;
} decoder_t;

typedef struct {
    long t;                            /* tokens in the step */
    const float *rope;                 /* [t, 2, d]: cos, then signed sin (-sin | sin), per token */
    const int64_t *slot_mapping;       /* [t] */
    const int64_t *block_tables;       /* [seqs, width] */
    long width;
    const int64_t *query_start_loc;    /* [seqs + 1] */
    const int64_t *seq_lens;           /* [seqs] */
    long num_seqs, block_size;
    void *const *k_caches, *const *v_caches; /* [num_layers] of [blocks, block_size, hkv, d] */
    long kv_half;                      /* the caches hold float16 (else float32) */
} step_t;

static int matmul_rows(const weight_t *w, const float *x, long m, float *y) {
    return ifb_block_matmul(x, m, w->k, w->blocks, (int)w->kind, (int)w->passes, w->bias, y, w->n);
}

/* out = w * (x / sqrt(mean(x^2) + eps)) over each of `rows` rows of `dim` (out may be x). */
static void rms_norm_rows(const float *x, long rows, long dim, const float *w, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        for (long c = 0; c < dim; c++) o[c] = w[c] * (xr[c] * inv);
    }
}

/* x = x * cos + swap_halves(x) * signed_sin, as model.py's _apply_rope_signed computes it. */
static void rope_in_place(float *x, long d, const float *cos, const float *sin, float *tmp) {
    long half = d / 2, i = 0;
    if (half % GROUP == 0) /* a vector's partners are a vector too */
        for (; i < d; i += GROUP) {
            const float *partner = x + (i < half ? i + half : i - half);
            vstore(tmp + i, vadd(vmul(vload(x + i), vload(cos + i)), vmul(vload(partner), vload(sin + i))));
        }
    for (; i < d; i++) tmp[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    for (i = 0; i < d; i++) x[i] = tmp[i];
}

/* cache[at + i] = x[i] for i < n, in float32 or (half) as float16 rounded to nearest even, as
 * torch's conversion rounds. */
static void store_kv(void *cache, long at, const float *x, long n, int half) {
    if (!half) {
        for (long i = 0; i < n; i++) ((float *)cache)[at + i] = x[i];
        return;
    }
    uint16_t *out = (uint16_t *)cache + at;
    long i = 0;
#if IFB_ISA == 512
    for (; i + 16 <= n; i += 16) /* the same rounding as half_of's */
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#elif IFB_ISA == 256
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = half_of(x[i]);
}

/* The decoder's elementwise steps, each over independent rows (run_elementwise splits them). */
typedef struct {
    const decoder_t *m;
    const step_t *s;
    const layer_t *L;
    long l;
    float *x, *h, *qkv, *gu, *act;
    const float *delta, *norm;
} rows_t;

/* Rows [r0, r1): x += delta (when given), then h = rms_norm(x) with the weights `norm`. */
static void add_norm_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    long hidden = a->m->hidden;
    float *x = a->x + r0 * hidden;
    if (a->delta != NULL) {
        const float *delta = a->delta + r0 * hidden;
        for (long i = 0; i < (r1 - r0) * hidden; i++) x[i] = x[i] + delta[i];
    }
    rms_norm_rows(x, r1 - r0, hidden, a->norm, a->m->eps, a->h + r0 * hidden);
}

/* Rows [r0, r1) of qkv: the q/k norms (Qwen3), RoPE on q and k, then k and v into the caches. */
static void rope_store_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    const decoder_t *m = a->m;
    const step_t *s = a->s;
    const layer_t *L = a->L;
    long hq = m->hq, hkv = m->hkv, d = m->d, row = (hq + 2 * hkv) * d;
    float tmp[d];
    for (long r = r0; r < r1; r++) {
        float *q = a->qkv + r * row, *k = q + hq * d, *v = k + hkv * d;
        if (L->q_norm != NULL) {
            rms_norm_rows(q, hq, d, L->q_norm, m->eps, q);
            rms_norm_rows(k, hkv, d, L->k_norm, m->eps, k);
        }
        const float *cos = s->rope + r * 2 * d, *sin = cos + d;
        for (long head = 0; head < hq + hkv; head++) rope_in_place(q + head * d, d, cos, sin, tmp);
        long slot = (long)s->slot_mapping[r];
        store_kv(s->k_caches[a->l], slot * hkv * d, k, hkv * d, (int)s->kv_half);
        store_kv(s->v_caches[a->l], slot * hkv * d, v, hkv * d, (int)s->kv_half);
    }
}

static void silu_of_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    long inter = a->m->intermediate;
    silu_rows(a->gu + r0 * 2 * inter, r1 - r0, inter, a->act + r0 * inter);
}

/* Run every layer over the step's tokens; x [t, hidden] is updated in place. 0, or what failed:
 * -1 without memory. */
int ifb_decoder_forward(const decoder_t *m, const step_t *s, float *x) {
    long t = s->t, hidden = m->hidden, inter = m->intermediate, hq = m->hq, hkv = m->hkv, d = m->d;
    long row = (hq + 2 * hkv) * d;
    size_t floats = (size_t)t * (size_t)(2 * hidden + row + hq * d + 3 * inter);
    float *buf = (float *)malloc(sizeof(float) * floats);
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (buf == NULL || token_seq == NULL) {
        free(buf);
        free(token_seq);
        return -1;
    }
    float *h = buf, *qkv = h + t * hidden, *att = qkv + t * row, *gu = att + t * hq * d;
    float *act = gu + t * 2 * inter, *delta = act + t * inter;
    long work;
    long max_ctx = plan_attention(s->query_start_loc, s->seq_lens, s->num_seqs, hq, d, token_seq, &work);
    int status = 0;
    for (long l = 0; l < m->num_layers; l++) {
        const layer_t *L = &m->layers[l];
        /* the previous layer's MLP output (in delta) joins the residual stream here */
        rows_t rows = {m, s, L, l, x, h, qkv, gu, act, l > 0 ? delta : NULL, L->attn_norm};
        run_elementwise(add_norm_rows, &rows, t, t * hidden);
        if ((status = matmul_rows(&L->qkv, h, t, qkv)) != 0) break;
        run_elementwise(rope_store_rows, &rows, t, t * row);
        job_t job = {.kind = 1, .count = t * hkv};
        job.at = (attention_t){qkv, row, t, hq, hkv, d, s->k_caches[l], s->v_caches[l], (int)s->kv_half, s->block_size,
                               s->block_tables, s->width, s->query_start_loc, s->seq_lens, token_seq, max_ctx,
                               1.0f / sqrtf((float)d), att};
        run_job(&job, work);
        if ((status = matmul_rows(&L->o, att, t, delta)) != 0) break;
        rows.delta = delta;
        rows.norm = L->mlp_norm;
        run_elementwise(add_norm_rows, &rows, t, t * hidden);
        if ((status = matmul_rows(&L->gate_up, h, t, gu)) != 0) break;
        run_elementwise(silu_of_rows, &rows, t, t * 2 * inter);
        if ((status = matmul_rows(&L->down, act, t, delta)) != 0) break;
        if (l == m->num_layers - 1)
            for (long i = 0; i < t * hidden; i++) x[i] = x[i] + delta[i];
    }
    free(buf);
    free(token_seq);
    return status;
}
