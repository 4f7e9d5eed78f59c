/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the AMX tiles for the integer sums (where the compiler and CPU have AMX). */

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

static __thread int amx_configured; /* 1: the tiles of tile_amx, 2: those of tile_amx_k6 */

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

/* K6's tiles: a block's two halves of 16 weights, each its own product (A: 16 rows of 16 codes,
 * B: 4 chunks) into its own sums, per pass: A in 0 / 1, B in 2 / 5, C in 3 / 4 (pass 1), 6 / 7 (pass 2). */
static void amx_configure_k6(void) {
    tilecfg_t cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 2; t++) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = QK / 2; }
    cfg.rows[2] = cfg.rows[5] = QK / 8;
    cfg.colsb[2] = cfg.colsb[5] = CHUNK;
    for (int t = 3; t < 8; t++)
        if (t != 5) { cfg.rows[t] = AMX_ROWS; cfg.colsb[t] = 4 * GROUP; }
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
    amx_configured = 2;
}

/* Rows [r0, r0 + 16) by K6 groups [g0, g1): per block, its 6-bit codes rebuilt as bytes by
 * k6_chunk, the halves' tile products (sums of the unsigned codes, as the vector tiles' dot4_u4
 * gives them), then block_step_k6: the vector tiles' bits. Not pipelined as tile_amx is: the
 * products of the next block overlap the float steps. */
INLINE void tile_amx_k6(const matmul_t *job, long r0, long g0, long g1, int P) {
    if (amx_configured != 2) amx_configure_k6();
    long k = job->k, nb = k / QK;
    _Alignas(64) int32_t cs[2][2][AMX_ROWS][GROUP]; /* [half][pass] */
    _Alignas(64) uint8_t bt[QK / 4 * CHUNK];         /* the block's code bytes, rebuilt by k6_chunk */
    for (long g = g0; g < g1; g++) {
        __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (long b = 0; b < nb; b++) {
            const uint8_t *q = group_codes(job, g, b, K6);
            const int8_t *xb = job->xq + r0 * k + b * QK;
            if (b + 2 < nb) prefetch_span(group_start(job, g, b + 2, K6), group_bytes(K6));
#pragma GCC unroll 8
            for (int t = 0; t < QK / 4; t++) _mm512_store_si512((void *)(bt + t * CHUNK), k6_chunk(q, t));
            _tile_loadd(2, bt, CHUNK);
            _tile_loadd(5, bt + (QK / 8) * CHUNK, CHUNK);
            _tile_loadd(0, xb, k);
            _tile_loadd(1, xb + QK / 2, k);
            _tile_zero(3);
            _tile_zero(4);
            _tile_dpbsud(3, 0, 2);
            _tile_dpbsud(4, 1, 5);
            if (P == 2) {
                _tile_loadd(0, xb + job->mq * k, k);
                _tile_loadd(1, xb + job->mq * k + QK / 2, k);
                _tile_zero(6);
                _tile_zero(7);
                _tile_dpbsud(6, 0, 2);
                _tile_dpbsud(7, 1, 5);
                _tile_stored(6, cs[0][1], 4 * GROUP);
                _tile_stored(7, cs[1][1], 4 * GROUP);
            }
            _tile_stored(3, cs[0][0], 4 * GROUP);
            _tile_stored(4, cs[1][0], 4 * GROUP);
            vec da, db;
            group_block(job, g, b, K6, &da, &db);
#pragma GCC unroll 16
            for (int r = 0; r < AMX_ROWS; r++) {
                ivec sa = _mm512_load_si512((const void *)cs[0][0][r]), sb = _mm512_load_si512((const void *)cs[1][0][r]);
                if (P == 2) {
                    sa = iadd(itimes256(sa), _mm512_load_si512((const void *)cs[0][1][r]));
                    sb = iadd(itimes256(sb), _mm512_load_si512((const void *)cs[1][1][r]));
                }
                acc[r] = block_step_k6(job, r0 + r, b, sa, sb, da, db, acc[r]);
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++)
            if (r0 + r < job->m) store_output(job, r0 + r, g, acc[r]);
    }
}

/* 4-bit codes: the group block's 4 chunks as B's 8 rows in bt (weights 4t..4t+3 are row t,
 * weights 16 + 4t.. row 4 + t); Q8_0 and K5 codes are B as stored. */
INLINE void amx_unpack(const matmul_t *job, long g, long b, int kind, uint8_t *bt) {
    if (kind == Q8_0 || kind == K5) return;
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
        if (kind == Q8_0 || kind == K5)                                                     \
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
    if (kind == K6) {
        tile_amx_k6(job, r0, g0, g1, P);
        return;
    }
    if (amx_configured != 1) amx_configure();
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
        if (i + AMX_AHEAD < steps) /* ask for a block further on */
            prefetch_span(group_start(job, g0 + (i + AMX_AHEAD) / nb, (i + AMX_AHEAD) % nb, kind), group_bytes(kind));
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
        for (int r = 0; r < AMX_ROWS; r++) { /* B holds Q8_0 codes + 128, as VNNI's dot4_q8 reads them; K5 codes as they are */
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
