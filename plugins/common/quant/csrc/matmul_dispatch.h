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

static void run_columns(const matmul_t *job, long g0, long g1) {
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
