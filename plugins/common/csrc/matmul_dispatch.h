/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * which tiles run a matmul job's columns. */

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
    if (job->kind == K4) /* K kinds: integer activations only (ifb_block_matmul refuses float32 ones) */
        job->passes == 2 ? groups_q8(job, g0, g1, K4, 2) : groups_q8(job, g0, g1, K4, 1);
    else if (job->kind == K6)
        job->passes == 2 ? groups_q8(job, g0, g1, K6, 2) : groups_q8(job, g0, g1, K6, 1);
    else if (job->kind == K5)
        job->passes == 2 ? groups_q8(job, g0, g1, K5, 2) : groups_q8(job, g0, g1, K5, 1);
    else if (job->kind == Q4_0)
        columns_of(job, g0, g1, Q4_0);
    else if (job->kind == Q4_1)
        columns_of(job, g0, g1, Q4_1);
    else
        columns_of(job, g0, g1, Q8_0);
}
