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
 *
 * The code lives in rooms, the headers beside this file, one concern each, included here in order
 * as one translation unit: the compiler sees one unit, so every static helper inlines as before.
 */

#include "base.h"

int ifb_qk_isa(void) { return IFB_ISA; }

#include "matmul_layout.h"

#if IFB_ISA == 512
#include "isa_avx512.h"
#elif IFB_ISA == 256
#include "isa_avx2.h"
#else
#include "isa_scalar.h"
#endif

#include "matmul_float.h"
#include "matmul_int.h"
#include "matmul_tiles.h"
#include "amx.h"
#include "matmul_dispatch.h"
#include "jobs.h"
#include "attention.h"
#include "argmax.h"
#include "pool.h"
#include "matmul_stored.h"

/* ---- the entry points (qkernels.py) ---- */

/* y [m, n] = x [m, k] (float32, row-major, k a multiple of 32) times the weight rows in `blocks`
 * (interleaved by ifb_interleave from GGUF blocks of `kind`, or by ifb_interleave_kquant for K4, K6
 * and K5), plus bias [n] (or NULL); y's rows are ldy floats apart (n: a plain [m, n] matrix).
 * `passes`: x quantized to 15-bit (2) or 8-bit (1) integer codes per block of 32, or used as float32 (0:
 * not for the K kinds). 0; -1 without memory for the codes (y untouched); -2 for an unknown kind. */
int ifb_block_matmul_rows(const float *x, long m, long k, const uint8_t *blocks, int kind, int passes,
                          const uint8_t *row_passes, const float *bias, float *y, long n, long ldy);

int ifb_block_matmul_ld(const float *x, long m, long k, const uint8_t *blocks, int kind, int passes,
                        const float *bias, float *y, long n, long ldy) {
    return ifb_block_matmul_rows(x, m, k, blocks, kind, passes, NULL, bias, y, n, ldy);
}

/* ifb_block_matmul_ld with each row's own passes: row r's codes are row_passes[r]'s (1 or 2) when
 * row_passes is not NULL (then `passes` must be 1 or 2 too); row r's result is then the one a call
 * at row_passes[r] for every row gives it. -2 also for a row_passes entry other than 1 or 2. */
int ifb_block_matmul_rows(const float *x, long m, long k, const uint8_t *blocks, int kind, int passes,
                          const uint8_t *row_passes, const float *bias, float *y, long n, long ldy) {
    if (kind < Q4_0 || kind > K5 || (kind >= K4 && passes != 1 && passes != 2) || ldy < n) return -2;
    if (row_passes != NULL) {
        if (passes != 1 && passes != 2) return -2;
        int uniform = 1;
        for (long r = 0; r < m; r++) {
            if (row_passes[r] != 1 && row_passes[r] != 2) return -2;
            uniform &= row_passes[r] == row_passes[0];
        }
        if (uniform) { /* one pass count: the plain path (AMX where it runs) */
            if (m > 0) passes = row_passes[0];
            row_passes = NULL;
        }
    }
    job_t job = {.kind = 0, .count = (n + GROUP - 1) / GROUP, .mm = {kind, 0, x, m, k, n, blocks, bias, y}};
    job.mm.ldy = ldy;
    job.mm.row_passes = row_passes;
    if (passes == 1 || passes == 2) { /* the caller's buffers: helpers read them only while it waits */
        static __thread void *codes_buf;
        static __thread size_t codes_cap;
        long mq = m;
        int parts = row_passes != NULL ? 2 : passes;
#if HAS_AMX
        job.mm.use_amx = row_passes == NULL && m >= AMX_PAD_MIN && amx_usable();
        if (job.mm.use_amx && m % AMX_ROWS >= AMX_PAD_MIN) mq = (m / AMX_ROWS + 1) * AMX_ROWS;
#endif
        size_t nbk = (size_t)(mq * (k / QK)), real = (size_t)(m * (k / QK));
        void *buf = reserve(&codes_buf, &codes_cap, (size_t)(parts * mq * k) + 20 * nbk);
        if (buf == NULL) return -1;
        float *xs = (float *)buf, *xsum = xs + nbk; /* the 4-byte arrays first: aligned */
        int32_t *qsum = (int32_t *)(xsum + nbk), *qsum16 = qsum + nbk;
        int8_t *xq = (int8_t *)(qsum16 + 2 * nbk);
        quantize_rows_of(x, m, k, passes, row_passes, mq, xq, xs, qsum, xsum, kind == K6 ? qsum16 : NULL);
        if (mq > m) { /* zero rows: zero codes and scales, results computed and dropped */
            for (int pass = 0; pass < passes; pass++)
                memset(xq + pass * mq * k + m * k, 0, (size_t)((mq - m) * k));
            memset(xs + real, 0, sizeof(float) * (nbk - real));
            memset(xsum + real, 0, sizeof(float) * (nbk - real));
            memset(qsum + real, 0, sizeof(int32_t) * (nbk - real));
            memset(qsum16 + 2 * real, 0, sizeof(int32_t) * 2 * (nbk - real));
        }
        job.mm.passes = passes;
        job.mm.mq = mq;
        job.mm.xq = xq;
        job.mm.xs = xs;
        job.mm.qsum = qsum;
        job.mm.qsum16 = qsum16;
        job.mm.xsum = xsum;
    }
    run_job(&job, m * n * (k / QK));
    return 0;
}

int ifb_block_matmul(const float *x, long m, long k, const uint8_t *blocks, int kind, int passes,
                     const float *bias, float *y, long n) {
    return ifb_block_matmul_ld(x, m, k, blocks, kind, passes, bias, y, n, n);
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

/* ifb_paged_attention within a sliding `window` (> 0: a query at position p sees p - window + 1 .. p; the
 * blocks of earlier positions are never read, so their block-table entries may be stale) and with
 * learned `sinks` ([hq]: one more logit per head in the softmax, its probability dropped; or NULL). */
void ifb_windowed_attention(const float *q, long q_stride, long t, long hq, long hkv, long d,
                            const void *k_cache, const void *v_cache, int kv_half, long block_size,
                            const int64_t *block_tables, long width, const int64_t *query_start_loc,
                            const int64_t *seq_lens, long num_seqs, float scale, long window, const float *sinks,
                            float *out) {
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (token_seq == NULL) return;
    long work;
    long max_ctx = plan_attention(query_start_loc, seq_lens, num_seqs, hq, d, token_seq, &work);
    if (window > 0 && max_ctx > window) { /* the work is what the window leaves */
        long most = 0;
        for (long b = 0; b < num_seqs; b++) most += query_start_loc[b + 1] - query_start_loc[b];
        long bound = most * window * hq * d * 2 / QK;
        work = work < bound ? work : bound;
    }
    job_t job = {.kind = 1, .count = t * hkv};
    job.at = (attention_t){q, q_stride, t, hq, hkv, d, k_cache, v_cache, kv_half, block_size, block_tables, width,
                           query_start_loc, seq_lens, token_seq, max_ctx, scale, out, window, sinks};
    run_job(&job, work);
    free(token_seq);
}

/* out [t, hq, d] = causal attention of q (row stride q_stride) over the paged K/V cache, the step's
 * own K/V already written; scale multiplies q . k. Query heads h use K/V head h / (hq / hkv). */
void ifb_paged_attention(const float *q, long q_stride, long t, long hq, long hkv, long d,
                         const void *k_cache, const void *v_cache, int kv_half, long block_size,
                         const int64_t *block_tables, long width, const int64_t *query_start_loc,
                         const int64_t *seq_lens, long num_seqs, float scale, float *out) {
    ifb_windowed_attention(q, q_stride, t, hq, hkv, d, k_cache, v_cache, kv_half, block_size, block_tables, width,
                           query_start_loc, seq_lens, num_seqs, scale, 0, NULL, out);
}

#include "decoder.h"
