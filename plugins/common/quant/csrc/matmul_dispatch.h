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

/* Rows [h0, h1) over groups [g, g + C) when rows take their own passes (job->row_passes): each run
 * of rows with equal passes through that pass count's tiles. A row's sums are those of a call
 * whose every row had its passes: the tiles' results never depend on the rows beside them. */
INLINE void rows_by_passes(const matmul_t *job, long h0, long h1, long g, int C, int kind) {
    for (long a = h0; a < h1;) {
        long b = a + 1;
        while (b < h1 && job->row_passes[b] == job->row_passes[a]) b++;
        if (job->row_passes[a] == 1)
            rows_q8(job, a, b, g, C, kind, 1);
        else
            rows_q8(job, a, b, g, C, kind, 2);
        a = b;
    }
}

/* groups_q8 for rows of mixed passes (no AMX): the same row blocks, each group's weights read
 * once per row block whatever the runs in it. */
INLINE void groups_by_passes(const matmul_t *job, long g0, long g1, int kind) {
    long height = XQ_BLOCK_BYTES / job->k;
    if (height < MAX_RQ) height = MAX_RQ;
    for (long h0 = 0; h0 < job->m; h0 += height) {
        long h1 = h0 + height < job->m ? h0 + height : job->m, g = g0;
        for (; g + 2 <= g1; g += 2) rows_by_passes(job, h0, h1, g, 2, kind);
        for (; g < g1; g++) rows_by_passes(job, h0, h1, g, 1, kind);
    }
}

/* One function for each kind and pass count: inlined into one large function, the tiles' sums were
 * spilled to the stack around every dot (a 4-row K4 tile ran 1.6 times slower so). */
#define GROUPS_OF(KIND, P)                                                                          \
    static __attribute__((noinline)) void groups_##KIND##_##P(const matmul_t *job, long g0, long g1) { \
        groups_q8(job, g0, g1, KIND, P);                                                            \
    }
GROUPS_OF(Q4_0, 1)
GROUPS_OF(Q4_0, 2)
GROUPS_OF(Q4_1, 1)
GROUPS_OF(Q4_1, 2)
GROUPS_OF(Q8_0, 1)
GROUPS_OF(Q8_0, 2)
GROUPS_OF(K4, 1)
GROUPS_OF(K4, 2)
GROUPS_OF(K6, 1)
GROUPS_OF(K6, 2)
GROUPS_OF(K5, 1)
GROUPS_OF(K5, 2)
#undef GROUPS_OF
#define GROUPS_BY_PASSES_OF(KIND)                                                                   \
    static __attribute__((noinline)) void groups_##KIND##_rows(const matmul_t *job, long g0, long g1) { \
        groups_by_passes(job, g0, g1, KIND);                                                        \
    }
GROUPS_BY_PASSES_OF(Q4_0)
GROUPS_BY_PASSES_OF(Q4_1)
GROUPS_BY_PASSES_OF(Q8_0)
GROUPS_BY_PASSES_OF(K4)
GROUPS_BY_PASSES_OF(K6)
GROUPS_BY_PASSES_OF(K5)
#undef GROUPS_BY_PASSES_OF

static void run_columns(const matmul_t *job, long g0, long g1) {
    static void (*const by_row[6])(const matmul_t *, long, long) = {
        groups_Q4_0_rows, groups_Q4_1_rows, groups_Q8_0_rows, groups_K4_rows, groups_K6_rows, groups_K5_rows};
    if (job->row_passes != NULL) {
        by_row[job->kind](job, g0, g1);
        return;
    }
    static void (*const integer[6][2])(const matmul_t *, long, long) = {
        {groups_Q4_0_1, groups_Q4_0_2}, {groups_Q4_1_1, groups_Q4_1_2}, {groups_Q8_0_1, groups_Q8_0_2},
        {groups_K4_1, groups_K4_2},     {groups_K6_1, groups_K6_2},     {groups_K5_1, groups_K5_2}};
    if (job->passes == 1 || job->passes == 2) /* the K kinds always (ifb_block_matmul refuses float32 x) */
        integer[job->kind][job->passes - 1](job, g0, g1);
    else if (job->kind == Q4_0)
        groups(job, g0, g1, Q4_0);
    else if (job->kind == Q4_1)
        groups(job, g0, g1, Q4_1);
    else
        groups(job, g0, g1, Q8_0);
}
