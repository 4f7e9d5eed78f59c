/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the integer-sum tiles of 4 rows by 2 groups written out for AVX-512 (each sum its own variable:
 * held in arrays, GCC spilled them to the stack around every dot), and which tile runs a block of
 * rows. The same integers and float32 steps as tile_q8's, so the same bits. */

#if IFB_ISA == 512
/* The 4 x 2 tiles' results: accumulator a<r><c> is row r0 + r's group g0 + c. */
INLINE void store_4x2(const matmul_t *job, long r0, long g0, vec a00, vec a01, vec a10, vec a11, vec a20, vec a21,
                      vec a30, vec a31) {
    const vec a[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < 2; c++) store_output(job, r0 + r, g0 + c, a[r][c]);
}

/* tile_q8 for the nibble kinds (Q4_0, Q4_1, K4), 4 rows by 2 groups, each sum its own variable
 * (GCC keeps arrays of them on the stack). */
INLINE void tile_q4_4x2(const matmul_t *job, long r0, long g0, int kind, int P) {
    long k = job->k, nb = k / QK;
    __m512 a00 = VZERO(), a01 = VZERO(), a10 = VZERO(), a11 = VZERO(), a20 = VZERO(), a21 = VZERO(),
           a30 = VZERO(), a31 = VZERO();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (long b = 0; b < nb; b++) {
        /* the scales are made after the sums: fewer registers held across the dots */
        const uint8_t *q0 = group_codes(job, g0, b, kind), *q1 = group_codes(job, g0 + 1, b, kind);
        if (b + Q8_AHEAD < nb) {
            prefetch_span(group_start(job, g0, b + Q8_AHEAD, kind), group_bytes(kind));
            prefetch_span(group_start(job, g0 + 1, b + Q8_AHEAD, kind), group_bytes(kind));
        }
        __m512i s00 = izero(), s01 = izero(), s10 = izero(), s11 = izero(), s20 = izero(), s21 = izero(),
                s30 = izero(), s31 = izero();
#pragma GCC unroll 2
        for (int pass = 0; pass < P; pass++) {
            const int8_t *x = job->xq + pass * job->mq * k + r0 * k + b * QK;
            if (pass > 0) {
                s00 = itimes256(s00); s01 = itimes256(s01); s10 = itimes256(s10); s11 = itimes256(s11);
                s20 = itimes256(s20); s21 = itimes256(s21); s30 = itimes256(s30); s31 = itimes256(s31);
            }
#pragma GCC unroll 4
            for (int t = 0; t < QK / 8; t++) {
                __m512i v0 = _mm512_loadu_si512((const void *)(q0 + t * CHUNK)),
                        v1 = _mm512_loadu_si512((const void *)(q1 + t * CHUNK));
                __m512i l0 = _mm512_and_si512(v0, nib), h0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nib);
                __m512i l1 = _mm512_and_si512(v1, nib), h1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nib);
#define Q4_ROW(sa, sb, xr)                                                                  \
    do {                                                                                    \
        sa = dot4_u4(dot4_u4(sa, l0, (xr) + 4 * t), h0, (xr) + QK / 2 + 4 * t);             \
        sb = dot4_u4(dot4_u4(sb, l1, (xr) + 4 * t), h1, (xr) + QK / 2 + 4 * t);             \
    } while (0)
                Q4_ROW(s00, s01, x);
                Q4_ROW(s10, s11, x + k);
                Q4_ROW(s20, s21, x + 2 * k);
                Q4_ROW(s30, s31, x + 3 * k);
#undef Q4_ROW
            }
        }
        vec d0, m0, d1, m1;
        group_block(job, g0, b, kind, &d0, &m0);
        group_block(job, g0 + 1, b, kind, &d1, &m1);
        a00 = block_step(job, r0, b, kind, s00, d0, m0, a00);
        a01 = block_step(job, r0, b, kind, s01, d1, m1, a01);
        a10 = block_step(job, r0 + 1, b, kind, s10, d0, m0, a10);
        a11 = block_step(job, r0 + 1, b, kind, s11, d1, m1, a11);
        a20 = block_step(job, r0 + 2, b, kind, s20, d0, m0, a20);
        a21 = block_step(job, r0 + 2, b, kind, s21, d1, m1, a21);
        a30 = block_step(job, r0 + 3, b, kind, s30, d0, m0, a30);
        a31 = block_step(job, r0 + 3, b, kind, s31, d1, m1, a31);
    }
    store_4x2(job, r0, g0, a00, a01, a10, a11, a20, a21, a30, a31);
}


/* The byte kinds' (Q8_0, K6, K5) 4 x 2 tile, each sum its own variable; K6's block in its two
 * halves one after the other (the sums of one half, both passes, then its step: block_step_k6's
 * order), so it needs no more registers than the others. */
INLINE vec step_k6_half(const matmul_t *job, long r, long b, int half, ivec s, vec d, vec acc) {
    long rb = r * (job->k / QK) + b;
    int32_t fix = 32 * job->qsum16[2 * rb + half]; /* as block_step_k6 */
    return vfmadd(icvt_scaled(isub(s, fix), job->xs[rb]), d, acc);
}

INLINE void tile_q8_4x2(const matmul_t *job, long r0, long g0, int kind, int P) {
    long k = job->k, nb = k / QK;
    __m512 a00 = VZERO(), a01 = VZERO(), a10 = VZERO(), a11 = VZERO(), a20 = VZERO(), a21 = VZERO(),
           a30 = VZERO(), a31 = VZERO();
    const int halves = kind == K6 ? 2 : 1, chunks = QK / 4 / halves;
    for (long b = 0; b < nb; b++) {
        /* the scales are made after the sums: fewer registers held across the dots */
        const uint8_t *q0 = group_codes(job, g0, b, kind), *q1 = group_codes(job, g0 + 1, b, kind);
        if (b + Q8_AHEAD < nb) {
            prefetch_span(group_start(job, g0, b + Q8_AHEAD, kind), group_bytes(kind));
            prefetch_span(group_start(job, g0 + 1, b + Q8_AHEAD, kind), group_bytes(kind));
        }
#pragma GCC unroll 2
        for (int h = 0; h < halves; h++) {
            __m512i s00 = izero(), s01 = izero(), s10 = izero(), s11 = izero(), s20 = izero(), s21 = izero(),
                    s30 = izero(), s31 = izero();
#pragma GCC unroll 2
            for (int pass = 0; pass < P; pass++) {
                const int8_t *x = job->xq + pass * job->mq * k + r0 * k + b * QK;
                if (pass > 0) {
                    s00 = itimes256(s00); s01 = itimes256(s01); s10 = itimes256(s10); s11 = itimes256(s11);
                    s20 = itimes256(s20); s21 = itimes256(s21); s30 = itimes256(s30); s31 = itimes256(s31);
                }
#pragma GCC unroll 8
                for (int t = h * chunks; t < (h + 1) * chunks; t++) {
                    __m512i w0 = kind == K6 ? k6_chunk(q0, t) : load_chunk(q0 + t * CHUNK),
                            w1 = kind == K6 ? k6_chunk(q1, t) : load_chunk(q1 + t * CHUNK);
#define Q8_ROW(sa, sb, xr)                                                                          \
    do {                                                                                            \
        sa = kind == Q8_0 ? dot4_q8(sa, w0, (xr) + 4 * t) : dot4_u4(sa, w0, (xr) + 4 * t);          \
        sb = kind == Q8_0 ? dot4_q8(sb, w1, (xr) + 4 * t) : dot4_u4(sb, w1, (xr) + 4 * t);          \
    } while (0)
                    Q8_ROW(s00, s01, x);
                    Q8_ROW(s10, s11, x + k);
                    Q8_ROW(s20, s21, x + 2 * k);
                    Q8_ROW(s30, s31, x + 3 * k);
#undef Q8_ROW
                }
            }
            vec d0, m0, d1, m1;
            group_block(job, g0, b, kind, &d0, &m0);
            group_block(job, g0 + 1, b, kind, &d1, &m1);
            if (kind == K6) { /* half h: scales d (first half) and m (second) */
                a00 = step_k6_half(job, r0, b, h, s00, h ? m0 : d0, a00);
                a01 = step_k6_half(job, r0, b, h, s01, h ? m1 : d1, a01);
                a10 = step_k6_half(job, r0 + 1, b, h, s10, h ? m0 : d0, a10);
                a11 = step_k6_half(job, r0 + 1, b, h, s11, h ? m1 : d1, a11);
                a20 = step_k6_half(job, r0 + 2, b, h, s20, h ? m0 : d0, a20);
                a21 = step_k6_half(job, r0 + 2, b, h, s21, h ? m1 : d1, a21);
                a30 = step_k6_half(job, r0 + 3, b, h, s30, h ? m0 : d0, a30);
                a31 = step_k6_half(job, r0 + 3, b, h, s31, h ? m1 : d1, a31);
            } else {
                a00 = block_step(job, r0, b, kind, s00, d0, m0, a00);
                a01 = block_step(job, r0, b, kind, s01, d1, m1, a01);
                a10 = block_step(job, r0 + 1, b, kind, s10, d0, m0, a10);
                a11 = block_step(job, r0 + 1, b, kind, s11, d1, m1, a11);
                a20 = block_step(job, r0 + 2, b, kind, s20, d0, m0, a20);
                a21 = block_step(job, r0 + 2, b, kind, s21, d1, m1, a21);
                a30 = block_step(job, r0 + 3, b, kind, s30, d0, m0, a30);
                a31 = block_step(job, r0 + 3, b, kind, s31, d1, m1, a31);
            }
        }
    }
    store_4x2(job, r0, g0, a00, a01, a10, a11, a20, a21, a30, a31);
}
#endif

/* A tile of R rows by C groups: the 4 x 2 tiles above where they fit, else tile_q8. */
INLINE void tile_int(const matmul_t *job, long r0, int R, long g0, int C, int kind, int P) {
#if IFB_ISA == 512
    if (R == 4 && C == 2) {
        if (kind == Q4_0 || kind == Q4_1 || kind == K4)
            tile_q4_4x2(job, r0, g0, kind, P);
        else
            tile_q8_4x2(job, r0, g0, kind, P);
        return;
    }
#endif
    tile_q8(job, r0, R, g0, C, kind, P);
}

/* Every row tile of rows [h0, h1) over groups [g, g + C). */
INLINE void rows_q8(const matmul_t *job, long h0, long h1, long g, int C, int kind, int P) {
    for (long r0 = h0; r0 < h1; r0 += MAX_RQ) {
        long rows = h1 - r0;
        if (rows >= MAX_RQ) tile_int(job, r0, MAX_RQ, g, C, kind, P);
#if MAX_RQ > 3
        else if (rows == 3) tile_int(job, r0, 3, g, C, kind, P);
#endif
#if MAX_RQ > 2
        else if (rows == 2) tile_int(job, r0, 2, g, C, kind, P);
#endif
        else tile_int(job, r0, 1, g, C, kind, P);
    }
}
