/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the matmul tiles and panels with float32 activations. */


/* Block b of group g: its start, and its codes after the 16 scales (and minima). */
INLINE const uint8_t *group_start(const matmul_t *job, long g, long b, int kind) {
    return block_at(job->blocks + g * group_row_bytes(kind, job->k), b, kind);
}
/* The head of the super-block that holds block b of group g (K4, K6). */
INLINE const uint8_t *super_head(const matmul_t *job, long g, long b, int kind) {
    return group_start(job, g, b - b % SUPER, kind) - super_head_bytes(kind);
}
INLINE const uint8_t *group_codes(const matmul_t *job, long g, long b, int kind) {
    return group_start(job, g, b, kind) + head_bytes(kind);
}

/* Block b of group g: its 16 scales d and minima m (Q4_0, Q8_0: m is d, unused; K6: d and m are
 * the scales of the two halves); returns its codes. */
INLINE const uint8_t *group_block(const matmul_t *job, long g, long b, int kind, vec *d, vec *m) {
    const uint8_t *blk = group_start(job, g, b, kind);
    if (kind == K4) { /* d * sc and -(dmin * m): exact float32 products */
        const uint8_t *sup = super_head(job, g, b, K4);
        *d = vmul(halves16(sup), icvt(iload_u8(blk)));
        *m = vmul(vmul(halves16(sup + 2 * GROUP), icvt(iload_u8(blk + GROUP))), vset1(-1.0f));
        return group_codes(job, g, b, kind);
    }
    if (kind == K6) { /* d * sc of each half */
        vec dd = halves16(super_head(job, g, b, K6));
        *d = vmul(dd, icvt(iload_i8(blk)));
        *m = vmul(dd, icvt(iload_i8(blk + GROUP)));
        return group_codes(job, g, b, kind);
    }
    if (kind >= K4) {
        *d = vload((const float *)blk);
        *m = vload((const float *)blk + GROUP);
        return group_codes(job, g, b, kind);
    }
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
    store_group(job->y + r * job->ldy + j, vadd(acc, load_bias(job->bias ? job->bias + j : NULL, valid)), valid);
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
