/* Matmuls over GGUF weight blocks with float32 activations (see qkernels.py).
 *
 * y[r, j] = sum_k x[r, k] * w[j, k] + bias[j], with w stored as blocks of 32 weights:
 *   4-bit (Q4_0 / Q4_1): w = d * q + m, q in 0..15; byte i of a block holds weight i in
 *                        its low nibble and weight i + 16 in its high nibble (GGUF's layout)
 *   8-bit (Q8_0):        w = d * q, q in -128..127
 * Each block's weights are rebuilt in float32 exactly as a float32 dequantization
 * computes them (one multiply, one add, no fused rounding: build with
 * -ffp-contract=off), then multiplied with x: the result differs from a float32
 * matmul on the dequantized matrix by summation order only.
 *
 * Every row of x goes through the same sequence of operations whatever the number
 * of rows in the call (rows are tiled so that they share the unpacked weights, but
 * each row keeps its own accumulators), and splitting the output columns over
 * threads changes no element's arithmetic: a row's result never depends on its
 * batch mates or on the thread count.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <time.h>

/* A tile is TILE_ROWS rows of x by TILE_COLS output columns: its accumulators, the columns'
 * unpacked weights and one row's x must fit the vector registers. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define IFB_ISA 512
#define TILE_ROWS 4 /* one column at a time reads the weights as one sequential stream (measured: */
#define TILE_COLS 1 /* a decode step is slower with 2 or 4 columns per tile) */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define IFB_ISA 256
#define TILE_ROWS 2 /* 2 x 4 accumulators + 4 weight + 4 x registers, of 16 */
#define TILE_COLS 1
#else
#define IFB_ISA 0
#define TILE_ROWS 4
#define TILE_COLS 1
#endif

#define QK 32 /* weights per block */
#define INLINE static inline __attribute__((always_inline))

int ifb_qk_isa(void) { return IFB_ISA; }

/* ---- one block's weights (wblk), a row's accumulators (vacc) ---- */

#if IFB_ISA == 512

typedef struct { __m512 lo, hi; } wblk;  /* weights 0-15 and 16-31 */
typedef struct { __m512 lo, hi; } vacc;  /* two independent sums per row */

INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    /* the 16 values a code can stand for, then a lookup: vpermps reads an index's low 4 bits */
    __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
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

INLINE void acc_zero(vacc *a) { a->lo = a->hi = _mm512_setzero_ps(); }

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x) {
    a->lo = _mm512_fmadd_ps(w->lo, x->lo, a->lo);
    a->hi = _mm512_fmadd_ps(w->hi, x->hi, a->hi);
}

INLINE float acc_sum(const vacc *a) { return _mm512_reduce_add_ps(_mm512_add_ps(a->lo, a->hi)); }

INLINE void cpu_relax(void) { _mm_pause(); }

#elif IFB_ISA == 256

typedef struct { __m256 v[4]; } wblk;  /* weights 0-7, 8-15, 16-23, 24-31 */
typedef struct { __m256 v[4]; } vacc;

INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m) {
    const __m256i low = _mm256_set1_epi32(0x0F);
    __m256 scale = _mm256_set1_ps(d), minimum = _mm256_set1_ps(m);
    __m256i c0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i c1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i codes[4] = {_mm256_and_si256(c0, low), _mm256_and_si256(c1, low),
                        _mm256_srli_epi32(c0, 4), _mm256_srli_epi32(c1, 4)};
    for (int i = 0; i < 4; i++)
        w->v[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(codes[i]), scale), minimum);
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

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x) {
    for (int i = 0; i < 4; i++) a->v[i] = _mm256_fmadd_ps(w->v[i], x->v[i], a->v[i]);
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

INLINE void load_q4(wblk *w, const uint8_t *q, float d, float m) {
    for (int i = 0; i < 16; i++) {
        w->v[i] = (float)(q[i] & 0x0F) * d + m;
        w->v[i + 16] = (float)(q[i] >> 4) * d + m;
    }
}

INLINE void load_q8(wblk *w, const int8_t *q, float d) {
    for (int i = 0; i < QK; i++) w->v[i] = (float)q[i] * d;
}

INLINE void acc_zero(vacc *a) { a->s = 0.0f; }

typedef struct { const float *p; } xblk;

INLINE void load_x(xblk *x, const float *p) { x->p = p; }

INLINE void acc_block(vacc *a, const wblk *w, const xblk *x) {
    for (int i = 0; i < QK; i++) a->s += w->v[i] * x->p[i];
}

INLINE float acc_sum(const vacc *a) { return a->s; }

INLINE void cpu_relax(void) {}

#endif

/* ---- matmuls ---- */

typedef struct {
    int bits;            /* 4 or 8 */
    const float *x;      /* [m, k] */
    long m, k, n;
    const void *q;       /* 4-bit: [n, k / 2] bytes; 8-bit: [n, k] int8 */
    const float *d, *mn; /* [n, k / 32]; mn for 4-bit only */
    const float *bias;   /* [n] or NULL */
    float *y;            /* [m, n] */
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

/* Weights of block b of column j. */
INLINE void load_block(wblk *w, const matmul_t *job, long j, long b, int bits) {
    long nb = job->k / QK;
    if (bits == 4)
        load_q4(w, (const uint8_t *)job->q + (j * nb + b) * 16, job->d[j * nb + b], job->mn[j * nb + b]);
    else
        load_q8(w, (const int8_t *)job->q + j * job->k + b * QK, job->d[j * nb + b]);
}

/* Columns [j, j + cols) for `rows` rows starting at x; both are constants at each call site, so the
 * loops unroll and the accumulators stay in registers. Whatever the tile's shape, every (row, column)
 * pair runs the same operations in the same order. */
INLINE void tile(const matmul_t *job, const float *x, int rows, int cols, long j, float *out, int bits) {
    long k = job->k, n = job->n, nb = k / QK;
    vacc acc[TILE_ROWS][TILE_COLS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int c = 0; c < cols; c++) acc_zero(&acc[r][c]);
    for (long b = 0; b < nb; b++) {
        wblk w[TILE_COLS];
#pragma GCC unroll 8
        for (int c = 0; c < cols; c++) load_block(&w[c], job, j + c, b, bits);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            xblk xv;
            load_x(&xv, x + r * k + b * QK);
#pragma GCC unroll 8
            for (int c = 0; c < cols; c++) acc_block(&acc[r][c], &w[c], &xv);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 8
        for (int c = 0; c < cols; c++)
            out[r * n + c] = acc_sum(&acc[r][c]) + (job->bias ? job->bias[j + c] : 0.0f);
}

/* Columns per chunk: a chunk's weights stay in L1 while every row tile of x passes over them. */
#define CHUNK 16

#define TILE_CALL(R, C) tile(job, x, R, C, j, out, bits)
#define ROW_CASES(C)                                                          \
    switch (rows) {                                                           \
    case 1: TILE_CALL(1, C); break;                                           \
    case 2: TILE_CALL(2 < TILE_ROWS ? 2 : TILE_ROWS, C); break;               \
    case 3: TILE_CALL(3 < TILE_ROWS ? 3 : TILE_ROWS, C); break;               \
    default: TILE_CALL(TILE_ROWS, C); break;                                  \
    }

/* Output columns [j0, j1) of a job. */
INLINE void columns(const matmul_t *job, long j0, long j1, int bits) {
    long m = job->m, n = job->n, k = job->k;
    for (long c0 = j0; c0 < j1; c0 += CHUNK) {
        long c1 = c0 + CHUNK < j1 ? c0 + CHUNK : j1;
        for (long r0 = 0; r0 < m; r0 += TILE_ROWS) {
            int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
            const float *x = job->x + r0 * k;
            long j = c0;
            for (; j + TILE_COLS <= c1; j += TILE_COLS) {
                float *out = job->y + r0 * n + j;
                ROW_CASES(TILE_COLS)
            }
            for (; j < c1; j++) {
                float *out = job->y + r0 * n + j;
                ROW_CASES(1)
            }
        }
    }
}

static void run_columns(const matmul_t *job, long j0, long j1) {
    if (job->bits == 4)
        columns(job, j0, j1, 4);
    else
        columns(job, j0, j1, 8);
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

static void attention_items(const attention_t *a, long i0, long i1) {
    long group = a->hq / a->hkv, d = a->d, bs = a->block_size;
    float *p = (float *)malloc(sizeof(float) * (size_t)(a->max_ctx > 0 ? a->max_ctx : 1));
    if (p == NULL) return;
    for (long i = i0; i < i1; i++) {
        long t = i / a->hkv, g = i % a->hkv, b = a->token_seq[t];
        long ctx = a->seq_lens[b] - (a->query_start_loc[b + 1] - t) + 1;
        const int64_t *table = a->block_tables + b * a->width;
        for (long h = g * group; h < (g + 1) * group; h++) {
            const float *qh = a->q + t * a->q_stride + h * d;
            float top = -INFINITY, sum = 0.0f;
            for (long j = 0; j < ctx; j++) {
                const float *k = a->k_cache + ((table[j / bs] * bs + j % bs) * a->hkv + g) * d;
                p[j] = dot(qh, k, d) * a->scale;
                if (p[j] > top) top = p[j];
            }
            for (long j = 0; j < ctx; j++) {
                p[j] = expf(p[j] - top);
                sum += p[j];
            }
            float *o = a->out + (t * a->hq + h) * d;
            for (long c = 0; c < d; c++) o[c] = 0.0f;
            for (long j = 0; j < ctx; j++)
                axpy(o, p[j] / sum, a->v_cache + ((table[j / bs] * bs + j % bs) * a->hkv + g) * d, d);
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

/* y [m, n] = x [m, k] (float32, row-major, k a multiple of 32) times 4-bit blocks q [n, k / 2]
 * with w = d * q + mn (d, mn [n, k / 32]), plus bias [n] (or NULL). */
void ifb_q4_matmul(const float *x, long m, long k, const uint8_t *q, const float *d, const float *mn,
                   const float *bias, float *y, long n) {
    job_t job = {.kind = 0, .count = n, .mm = {4, x, m, k, n, q, d, mn, bias, y}};
    run_job(&job, m * n * (k / QK));
}

/* As ifb_q4_matmul with 8-bit blocks: q [n, k] int8, w = d * q. */
void ifb_q8_matmul(const float *x, long m, long k, const int8_t *q, const float *d,
                   const float *bias, float *y, long n) {
    job_t job = {.kind = 0, .count = n, .mm = {8, x, m, k, n, q, d, NULL, bias, y}};
    run_job(&job, m * n * (k / QK));
}

/* out [t, hq, d] = causal attention of q (row stride q_stride) over the paged K/V cache, the step's
 * own K/V already written; scale multiplies q . k. Query heads h use K/V head h / (hq / hkv). */
void ifb_paged_attention(const float *q, long q_stride, long t, long hq, long hkv, long d,
                         const float *k_cache, const float *v_cache, long block_size,
                         const int64_t *block_tables, long width, const int64_t *query_start_loc,
                         const int64_t *seq_lens, long num_seqs, float scale, float *out) {
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (token_seq == NULL) return;
    long max_ctx = 0, work = 0;
    for (long b = 0; b < num_seqs; b++) {
        for (long i = query_start_loc[b]; i < query_start_loc[b + 1]; i++) token_seq[i] = b;
        if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
        work += (query_start_loc[b + 1] - query_start_loc[b]) * seq_lens[b];
    }
    job_t job = {.kind = 1, .count = t * hkv};
    job.at = (attention_t){q, q_stride, t, hq, hkv, d, k_cache, v_cache, block_size, block_tables, width,
                           query_start_loc, seq_lens, token_seq, max_ctx, scale, out};
    run_job(&job, work * hq * d * 2 / QK);
    free(token_seq);
}
