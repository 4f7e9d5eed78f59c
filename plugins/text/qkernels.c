/* Native kernels for GGUF checkpoints on CPUs (see qkernels.py): matmuls over weight blocks
 * with float32 activations, paged attention, and a whole Llama-family decoder stack.
 *
 * Matmul: y[r, j] = sum_k x[r, k] * w[j, k] + bias[j], each weight row stored as GGUF stores it,
 * blocks of 32 weights with a float16 scale d (and minimum m):
 *   Q4_0 (18 bytes: d, 16 code bytes)    w = d * (q - 8), q in 0..15
 *   Q4_1 (20 bytes: d, m, 16 code bytes) w = d * q + m
 *   Q8_0 (34 bytes: d, 32 int8 codes)    w = d * q
 * (a 4-bit block's byte i holds weight i in its low nibble and weight i + 16 in its high one).
 * Each block's weights are rebuilt in float32 exactly as gguf's float32 dequantization computes
 * them (no fused rounding: build with -ffp-contract=off), then multiplied with x: the result
 * differs from a float32 matmul on the dequantized matrix by summation order only.
 *
 * Batch invariance: every output element is computed by the same sequence of operations
 * whatever the number of rows in the call, the tiling, or the threads (work is split by
 * output columns, or by attention (token, head) pairs, never inside a sum), so a sequence's
 * result never depends on its batch mates.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <time.h>

/* A tile is one output column for TILE_ROWS rows of x (more columns per tile, reading several
 * weight rows at once, measured slower on a decode step); its accumulators, the column's
 * unpacked block and one row's x must fit the vector registers. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define IFB_ISA 512
#define TILE_ROWS 4
#define PANEL_ROWS 6 /* 6 x 4 accumulators + 2 weight registers, of 32 */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define IFB_ISA 256
#define TILE_ROWS 2 /* 2 x 4 accumulators + 4 weight + 4 x registers, of 16 */
#define PANEL_ROWS 3 /* 3 x 4 accumulators + 4 weight registers; x is read by the multiply-adds */
#else
#define IFB_ISA 0
#define TILE_ROWS 4
#define PANEL_ROWS 4
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

int ifb_qk_isa(void) { return IFB_ISA; }

/* ---- one block's weights (wblk), a row's accumulators (vacc) ---- */

#if IFB_ISA == 512

typedef struct { __m512 lo, hi; } wblk;        /* weights 0-15 and 16-31 */
typedef struct { __m512 lo[2], hi[2]; } vacc;  /* even and odd blocks: four FMA chains per row */

/* Q4_1 (minimum m) or Q4_0 (`centered`: w = d * (q - 8)). */
INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m, int centered) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iota8 = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    /* the 16 values a code can stand for, then a lookup: vpermps reads an index's low 4 bits */
    __m512 table = centered ? _mm512_mul_ps(_mm512_set1_ps(d), iota8)
                            : _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
    __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    w->lo = _mm512_permutexvar_ps(codes, table);
    w->hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

INLINE void load_q8(wblk *w, const int8_t *q, float d) {
    __m512 scale = _mm512_set1_ps(d);
    w->lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), scale);
    w->hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), scale);
}

typedef struct { __m512 lo, hi; } xblk;

INLINE void load_x(xblk *v, const float *x) {
    v->lo = _mm512_loadu_ps(x);
    v->hi = _mm512_loadu_ps(x + 16);
}

INLINE void acc_zero(vacc *a) { a->lo[0] = a->hi[0] = a->lo[1] = a->hi[1] = _mm512_setzero_ps(); }

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x, int odd) {
    a->lo[odd] = _mm512_fmadd_ps(w->lo, x->lo, a->lo[odd]);
    a->hi[odd] = _mm512_fmadd_ps(w->hi, x->hi, a->hi[odd]);
}

INLINE void store_w(float *dst, const wblk *w) {
    _mm512_storeu_ps(dst, w->lo);
    _mm512_storeu_ps(dst + 16, w->hi);
}

INLINE void load_w(wblk *w, const float *src) {
    w->lo = _mm512_loadu_ps(src);
    w->hi = _mm512_loadu_ps(src + 16);
}

INLINE float acc_sum(const vacc *a) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a->lo[0], a->hi[0]), _mm512_add_ps(a->lo[1], a->hi[1])));
}

INLINE void cpu_relax(void) { _mm_pause(); }

#elif IFB_ISA == 256

typedef struct { __m256 v[4]; } wblk;  /* weights 0-7, 8-15, 16-23, 24-31 */
typedef struct { __m256 v[4]; } vacc;

INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m, int centered) {
    const __m256i low = _mm256_set1_epi32(0x0F), eight = _mm256_set1_epi32(8);
    __m256 scale = _mm256_set1_ps(d), minimum = _mm256_set1_ps(m);
    __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i codes[4] = {_mm256_and_si256(c0, low), _mm256_and_si256(c1, low),
                        _mm256_srli_epi32(c0, 4), _mm256_srli_epi32(c1, 4)};
    for (int i = 0; i < 4; i++) {
        if (centered)
            w->v[i] = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(codes[i], eight)));
        else
            w->v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(codes[i]), scale), minimum);
    }
}

INLINE void load_q8(wblk *w, const int8_t *q, float d) {
    __m256 scale = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++)
        w->v[i] = _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)))), scale);
}

INLINE void acc_zero(vacc *a) {
    for (int i = 0; i < 4; i++) a->v[i] = _mm256_setzero_ps();
}

typedef struct { __m256 v[4]; } xblk;

INLINE void load_x(xblk *x, const float *p) {
    for (int i = 0; i < 4; i++) x->v[i] = _mm256_loadu_ps(p + 8 * i);
}

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x, int odd) {
    (void)odd;
    for (int i = 0; i < 4; i++) a->v[i] = _mm256_fmadd_ps(w->v[i], x->v[i], a->v[i]);
}

INLINE void store_w(float *dst, const wblk *w) {
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 8 * i, w->v[i]);
}

INLINE void load_w(wblk *w, const float *src) {
    for (int i = 0; i < 4; i++) w->v[i] = _mm256_loadu_ps(src + 8 * i);
}

INLINE float acc_sum(const vacc *a) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(a->v[0], a->v[1]), _mm256_add_ps(a->v[2], a->v[3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

INLINE void cpu_relax(void) { _mm_pause(); }

#else

typedef struct { float v[QK]; } wblk;
typedef struct { float s; } vacc;

INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m, int centered) {
    for (int i = 0; i < 16; i++) {
        if (centered) {
            w->v[i] = d * (float)((q[i] & 0x0F) - 8);
            w->v[i + 16] = d * (float)((q[i] >> 4) - 8);
        } else {
            w->v[i] = (float)(q[i] & 0x0F) * d + m;
            w->v[i + 16] = (float)(q[i] >> 4) * d + m;
        }
    }
}

INLINE void load_q8(wblk *w, const int8_t *q, float d) {
    for (int i = 0; i < QK; i++) w->v[i] = (float)q[i] * d;
}

INLINE void acc_zero(vacc *a) { a->s = 0.0f; }

typedef struct { const float *p; } xblk;

INLINE void load_x(xblk *x, const float *p) { x->p = p; }

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x, int odd) {
    (void)odd;
    for (int i = 0; i < QK; i++) a->s += w->v[i] * x->p[i];
}

INLINE void store_w(float *dst, const wblk *w) {
    for (int i = 0; i < QK; i++) dst[i] = w->v[i];
}

INLINE void load_w(wblk *w, const float *src) {
    for (int i = 0; i < QK; i++) w->v[i] = src[i];
}

INLINE float acc_sum(const vacc *a) { return a->s; }

INLINE void cpu_relax(void) {}

#endif

/* ---- matmuls ---- */

typedef struct {
    int kind;              /* Q4_0, Q4_1 or Q8_0 */
    const float *x;        /* [m, k] */
    long m, k, n;
    const uint8_t *blocks; /* [n, k / 32 blocks] */
    const float *bias;     /* [n] or NULL */
    float *y;              /* [m, n] */
} matmul_t;

typedef struct {
    const float *q;                 /* [t, hq, d]: row stride q_stride, heads contiguous */
    long q_stride, t, hq, hkv, d;
    const float *k_cache, *v_cache; /* [blocks, block_size, hkv, d] */
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

/* A unit of work for the pool: `count` independent items, split in contiguous ranges. */
typedef struct {
    int kind; /* 0: matmul (items are output columns), 1: attention (items are (token, kv head) pairs) */
    long count;
    matmul_t mm;
    attention_t at;
} job_t;

/* Weights of block b of column j (`kind` is a constant at each call site). */
INLINE void load_block(wblk *w, const matmul_t *job, long j, long b, int kind) {
    const uint8_t *block = job->blocks + (j * (job->k / QK) + b) * BLOCK_BYTES[kind];
    float d = half_at(block);
    if (kind == Q4_0)
        load_q4(w, block + 2, d, 0.0f, 1);
    else if (kind == Q4_1)
        load_q4(w, block + 4, d, half_at(block + 2), 0);
    else
        load_q8(w, (const int8_t *)(block + 2), d);
}

/* Column j for `rows` rows starting at x: `rows` is a constant at each call site, so the loops
 * unroll and the accumulators stay in registers. Every row runs the same operations in the same
 * order whatever the tile's size. */
INLINE void tile(const matmul_t *job, const float *x, int rows, long j, float *out, int kind) {
    long k = job->k, n = job->n, nb = k / QK;
    vacc acc[TILE_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc_zero(&acc[r]);
    for (long b = 0; b < nb; b += 2) {
        wblk w;
        load_block(&w, job, j, b, kind);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xblk xv;
            load_x(&xv, x + r * k + b * QK);
            acc_block(&acc[r], &w, &xv, 0);
        }
        if (b + 1 == nb) break;
        load_block(&w, job, j, b + 1, kind);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xblk xv;
            load_x(&xv, x + r * k + (b + 1) * QK);
            acc_block(&acc[r], &w, &xv, 1);
        }
    }
    float bias = job->bias ? job->bias[j] : 0.0f;
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) out[r * n] = acc_sum(&acc[r]) + bias;
}

/* Columns per chunk: a chunk's weights stay in L1 while every row tile of x passes over them. */
#define CHUNK 16

#define TILE_CALL(R) tile(job, x, R, j, job->y + r0 * n + j, kind)

/* Output columns [j0, j1) of a job, unpacking each block once per row tile (few rows: decode). */
INLINE void columns(const matmul_t *job, long j0, long j1, int kind) {
    long m = job->m, n = job->n, k = job->k;
    for (long c0 = j0; c0 < j1; c0 += CHUNK) {
        long c1 = c0 + CHUNK < j1 ? c0 + CHUNK : j1;
        for (long r0 = 0; r0 < m; r0 += TILE_ROWS) {
            int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
            const float *x = job->x + r0 * k;
            for (long j = c0; j < c1; j++) {
                switch (rows) {
                case 1: TILE_CALL(1); break;
#if TILE_ROWS >= 4
                case 2: TILE_CALL(2); break;
                case 3: TILE_CALL(3); break;
#endif
                default: TILE_CALL(TILE_ROWS); break;
                }
            }
        }
    }
}

/* ---- many rows (prefill): unpack a panel of columns once, then run every row tile over it ----
 * The unpacked weights are the very values load_block produces and each row accumulates them in
 * the same order with the same accumulators as tile(), so a row's result is bit-identical
 * whichever path computes it. */

/* Rows from which the panel path pays for its unpacking pass. */
#define PANEL_MIN_ROWS (2 * PANEL_ROWS)
/* Unpacked floats per panel, and x floats per row block: both stay in L2 while the row tiles
 * pass over the panel. */
#define PANEL_FLOATS 16384L
#define X_BLOCK_FLOATS 65536L

static __thread float *panel_buf;
static __thread long panel_cap;

/* Column j for `rows` rows starting at x, its unpacked weights at w ([k] floats). */
INLINE void panel_tile(const matmul_t *job, const float *x, int rows, const float *w, long j, float *out) {
    long k = job->k, n = job->n, nb = k / QK;
    vacc acc[PANEL_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc_zero(&acc[r]);
    for (long b = 0; b < nb; b += 2) {
        wblk wb;
        load_w(&wb, w + b * QK);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xblk xv;
            load_x(&xv, x + r * k + b * QK);
            acc_block(&acc[r], &wb, &xv, 0);
        }
        if (b + 1 == nb) break;
        load_w(&wb, w + (b + 1) * QK);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xblk xv;
            load_x(&xv, x + r * k + (b + 1) * QK);
            acc_block(&acc[r], &wb, &xv, 1);
        }
    }
    float bias = job->bias ? job->bias[j] : 0.0f;
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) out[r * n] = acc_sum(&acc[r]) + bias;
}

#define PANEL_CALL(R) panel_tile(job, x, R, panel_buf + (j - c0) * k, j, job->y + r0 * n + j)

/* Output columns [j0, j1) through the panel buffer; 0 when the buffer cannot be had. Rows go in
 * blocks whose x stays in L2 while every panel of the columns passes over it. */
INLINE int panel_columns(const matmul_t *job, long j0, long j1, int kind) {
    long m = job->m, n = job->n, k = job->k, nb = k / QK;
    long width = PANEL_FLOATS / k > 0 ? PANEL_FLOATS / k : 1; /* columns per panel */
    long height = X_BLOCK_FLOATS / k / PANEL_ROWS * PANEL_ROWS; /* rows per block */
    if (height < PANEL_ROWS) height = PANEL_ROWS;
    if (panel_cap < width * k) {
        float *buf = (float *)realloc(panel_buf, sizeof(float) * (size_t)(width * k));
        if (buf == NULL) return 0;
        panel_buf = buf;
        panel_cap = width * k;
    }
    for (long h0 = 0; h0 < m; h0 += height) {
        long h1 = h0 + height < m ? h0 + height : m;
        for (long c0 = j0; c0 < j1; c0 += width) {
            long c1 = c0 + width < j1 ? c0 + width : j1;
            for (long j = c0; j < c1; j++)
                for (long b = 0; b < nb; b++) {
                    wblk w;
                    load_block(&w, job, j, b, kind);
                    store_w(panel_buf + (j - c0) * k + b * QK, &w);
                }
            for (long r0 = h0; r0 < h1; r0 += PANEL_ROWS) {
                int rows = h1 - r0 < PANEL_ROWS ? (int)(h1 - r0) : PANEL_ROWS;
                const float *x = job->x + r0 * k;
                for (long j = c0; j < c1; j++) {
                    switch (rows) {
                    case 1: PANEL_CALL(1); break;
                    case 2: PANEL_CALL(2); break;
#if PANEL_ROWS > 3
                    case 3: PANEL_CALL(3); break;
#endif
#if PANEL_ROWS > 4
                    case 4: PANEL_CALL(4); break;
#endif
#if PANEL_ROWS > 5
                    case 5: PANEL_CALL(5); break;
#endif
                    default: PANEL_CALL(PANEL_ROWS); break;
                    }
                }
            }
        }
    }
    return 1;
}

static void run_columns(const matmul_t *job, long j0, long j1) {
    if (job->m >= PANEL_MIN_ROWS) {
        int done = job->kind == Q4_0   ? panel_columns(job, j0, j1, Q4_0)
                   : job->kind == Q4_1 ? panel_columns(job, j0, j1, Q4_1)
                                       : panel_columns(job, j0, j1, Q8_0);
        if (done) return;
    }
    if (job->kind == Q4_0)
        columns(job, j0, j1, Q4_0);
    else if (job->kind == Q4_1)
        columns(job, j0, j1, Q4_1);
    else
        columns(job, j0, j1, Q8_0);
}

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
/* e^x for x <= 0 (softmax scores minus their maximum), to about 2 ulp: e^x = 2^n e^f with
 * |f| <= ln2 / 2, e^f from its degree-6 Taylor polynomial. */
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

#if IFB_ISA == 512
/* o = sum_j (p[j] / sum) v_j over positions j < ctx, v_j read through the block table; `nv`
 * (d / 16) is a constant at each call site. The same arithmetic, in the same order, as axpy. */
INLINE void weighted_rows(float *o, const float *p, float sum, long ctx, const int64_t *table, const float *v0,
                          long bs, long row, int nv) {
    __m512 acc[8];
    for (int c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
    for (long j0 = 0; j0 < ctx; j0 += bs) {
        const float *v = v0 + table[j0 / bs] * bs * row;
        for (long j = j0; j < ctx && j < j0 + bs; j++, v += row) {
            __m512 w = _mm512_set1_ps(p[j] / sum);
            for (int c = 0; c < nv; c++) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16 * c), acc[c]);
        }
    }
    for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + 16 * c, acc[c]);
}
#endif

static void attention_items(const attention_t *a, long i0, long i1) {
    long group = a->hq / a->hkv, d = a->d, bs = a->block_size, row = a->hkv * d;
    float *p = (float *)malloc(sizeof(float) * (size_t)(a->max_ctx > 0 ? a->max_ctx : 1));
    if (p == NULL) return;
    for (long i = i0; i < i1; i++) {
        long t = i / a->hkv, g = i % a->hkv, b = a->token_seq[t];
        long ctx = a->seq_lens[b] - (a->query_start_loc[b + 1] - t) + 1;
        const int64_t *table = a->block_tables + b * a->width;
        for (long h = g * group; h < (g + 1) * group; h++) {
            const float *qh = a->q + t * a->q_stride + h * d;
            float top = -INFINITY, sum = 0.0f;
            /* walk the context block by block: position j is slot j % bs of block table[j / bs] */
            for (long j0 = 0; j0 < ctx; j0 += bs) {
                const float *k = a->k_cache + table[j0 / bs] * bs * row + g * d;
                for (long j = j0; j < ctx && j < j0 + bs; j++, k += row) {
                    p[j] = dot(qh, k, d) * a->scale;
                    if (p[j] > top) top = p[j];
                }
            }
            sum = exp_shifted(p, ctx, top);
            float *o = a->out + (t * a->hq + h) * d;
#if IFB_ISA == 512
            if (d == 64 || d == 128) { /* the usual head sizes: the sums stay in registers */
                if (d == 64)
                    weighted_rows(o, p, sum, ctx, table, a->v_cache + g * d, bs, row, 4);
                else
                    weighted_rows(o, p, sum, ctx, table, a->v_cache + g * d, bs, row, 8);
                continue;
            }
#endif
            for (long c = 0; c < d; c++) o[c] = 0.0f;
            for (long j0 = 0; j0 < ctx; j0 += bs) {
                const float *v = a->v_cache + table[j0 / bs] * bs * row + g * d;
                for (long j = j0; j < ctx && j < j0 + bs; j++, v += row) axpy(o, p[j] / sum, v, d);
            }
        }
    }
    free(p);
}

static void run_items(const job_t *job, long i0, long i1) {
    if (job->kind == 0)
        run_columns(&job->mm, i0, i1);
    else
        attention_items(&job->at, i0, i1);
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
    long chunks = (pool_started + 1) * CHUNKS_PER_SHARE;
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
    pthread_mutex_unlock(&pool_use);
}

/* y [m, n] = x [m, k] (float32, row-major, k a multiple of 32) times the weight rows in
 * `blocks` [n, k / 32 blocks of `kind`], plus bias [n] (or NULL). */
void ifb_block_matmul(const float *x, long m, long k, const uint8_t *blocks, int kind, const float *bias,
                      float *y, long n) {
    if (kind < Q4_0 || kind > Q8_0) return;
    job_t job = {.kind = 0, .count = n, .mm = {kind, x, m, k, n, blocks, bias, y}};
    run_job(&job, m * n * (k / QK));
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
                         const float *k_cache, const float *v_cache, long block_size,
                         const int64_t *block_tables, long width, const int64_t *query_start_loc,
                         const int64_t *seq_lens, long num_seqs, float scale, float *out) {
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (token_seq == NULL) return;
    long work;
    long max_ctx = plan_attention(query_start_loc, seq_lens, num_seqs, hq, d, token_seq, &work);
    job_t job = {.kind = 1, .count = t * hkv};
    job.at = (attention_t){q, q_stride, t, hq, hkv, d, k_cache, v_cache, block_size, block_tables, width,
                           query_start_loc, seq_lens, token_seq, max_ctx, scale, out};
    run_job(&job, work);
    free(token_seq);
}

/* ---- a whole decoder stack in one call ----
 * The Llama-family layer of model.py (pre-norm attention with rotate-half RoPE and GQA, then a
 * SwiGLU MLP), every projection on GGUF blocks and float32 KV caches, for all the step's tokens.
 * It runs the same per-row operations as the kernels above; what it saves is the Python
 * dispatch of a few dozen small tensor operations per layer. */

typedef struct {
    long kind;                     /* Q4_0, Q4_1 or Q8_0 */
    const uint8_t *blocks;         /* as for ifb_block_matmul */
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
    float *const *k_caches, *const *v_caches; /* [num_layers] of [blocks, block_size, hkv, d] */
} step_t;

static void matmul_rows(const weight_t *w, const float *x, long m, float *y) {
    ifb_block_matmul(x, m, w->k, w->blocks, (int)w->kind, w->bias, y, w->n);
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
    long half = d / 2;
    for (long i = 0; i < d; i++) tmp[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    for (long i = 0; i < d; i++) x[i] = tmp[i];
}

/* Run every layer over the step's tokens; x [t, hidden] is updated in place. 0, or -1 without memory. */
int ifb_decoder_forward(const decoder_t *m, const step_t *s, float *x) {
    long t = s->t, hidden = m->hidden, inter = m->intermediate, hq = m->hq, hkv = m->hkv, d = m->d;
    long row = (hq + 2 * hkv) * d;
    size_t floats = (size_t)t * (size_t)(2 * hidden + row + hq * d + 3 * inter) + (size_t)d;
    float *buf = (float *)malloc(sizeof(float) * floats);
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (buf == NULL || token_seq == NULL) {
        free(buf);
        free(token_seq);
        return -1;
    }
    float *h = buf, *qkv = h + t * hidden, *att = qkv + t * row, *gu = att + t * hq * d;
    float *act = gu + t * 2 * inter, *delta = act + t * inter, *tmp = delta + t * hidden;
    long work;
    long max_ctx = plan_attention(s->query_start_loc, s->seq_lens, s->num_seqs, hq, d, token_seq, &work);
    for (long l = 0; l < m->num_layers; l++) {
        const layer_t *L = &m->layers[l];
        rms_norm_rows(x, t, hidden, L->attn_norm, m->eps, h);
        matmul_rows(&L->qkv, h, t, qkv);
        for (long r = 0; r < t; r++) {
            float *q = qkv + r * row, *k = q + hq * d, *v = k + hkv * d;
            if (L->q_norm != NULL) {
                rms_norm_rows(q, hq, d, L->q_norm, m->eps, q);
                rms_norm_rows(k, hkv, d, L->k_norm, m->eps, k);
            }
            const float *cos = s->rope + r * 2 * d, *sin = cos + d;
            for (long head = 0; head < hq + hkv; head++) rope_in_place(q + head * d, d, cos, sin, tmp);
            long slot = (long)s->slot_mapping[r];
            for (long c = 0; c < hkv * d; c++) {
                s->k_caches[l][slot * hkv * d + c] = k[c];
                s->v_caches[l][slot * hkv * d + c] = v[c];
            }
        }
        job_t job = {.kind = 1, .count = t * hkv};
        job.at = (attention_t){qkv, row, t, hq, hkv, d, s->k_caches[l], s->v_caches[l], s->block_size,
                               s->block_tables, s->width, s->query_start_loc, s->seq_lens, token_seq, max_ctx,
                               1.0f / sqrtf((float)d), att};
        run_job(&job, work);
        matmul_rows(&L->o, att, t, delta);
        for (long i = 0; i < t * hidden; i++) x[i] = x[i] + delta[i];
        rms_norm_rows(x, t, hidden, L->mlp_norm, m->eps, h);
        matmul_rows(&L->gate_up, h, t, gu);
        for (long r = 0; r < t; r++) {
            const float *gate = gu + r * 2 * inter, *up = gate + inter;
            for (long i = 0; i < inter; i++) act[r * inter + i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
        matmul_rows(&L->down, act, t, delta);
        for (long i = 0; i < t * hidden; i++) x[i] = x[i] + delta[i];
    }
    free(buf);
    free(token_seq);
    return 0;
}
