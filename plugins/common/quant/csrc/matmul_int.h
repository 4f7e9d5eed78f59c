/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * integer activations: quantizing x to codes, and the integer-sum tiles. */

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
 *   K4:   as Q4_1 (its float32 scale and minimum in place of d and m)
 *   K5:   as K4 (codes 0..31)
 *   K6:   acc = fma(S_a * s, d_a, acc); acc = fma(S_b * s, d_b, acc) (S_a, S_b: the sums of the
 *         block's weights 0..15 and 16..31, each with its own scale)
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
    int32_t *qsum, *qsum16;
    const uint8_t *row_passes; /* [m] or NULL (see matmul_t) */
} quantize_t;

/* Blocks [i0, i1) of x (block i: row i / (k / 32), its 32 values from column 32 * (i % (k / 32))). */
static void quantize_blocks(const void *arg, long i0, long i1) {
    const quantize_t *a = (const quantize_t *)arg;
    const float *x = a->x;
    long k = a->k, mq = a->mq;
    const uint8_t *row_passes = a->row_passes;
    int8_t *xq = a->xq;
    float *xs = a->xs, *xsum = a->xsum;
    int32_t *qsum = a->qsum, *qsum16 = a->qsum16;
    for (long i = i0; i < i1; i++) {
        int passes = row_passes != NULL ? row_passes[i / (k / QK)] : a->passes;
        float levels = passes == 2 ? LEVELS_2 : LEVELS_1;
        const float *p = x + i * QK;
        int8_t *q = xq + i * QK, *q2 = q + mq * k; /* the second part (two passes) */
        int32_t sum = 0, first = 0; /* first: the sum of codes 0..15 */
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
            first = _mm512_reduce_add_epi32(_mm512_add_epi32(itimes256(ha), la));
            sum = first + _mm512_reduce_add_epi32(_mm512_add_epi32(itimes256(hb), lb));
            _mm_storeu_si128((__m128i *)q2, _mm512_cvtepi32_epi8(la));
            _mm_storeu_si128((__m128i *)(q2 + 16), _mm512_cvtepi32_epi8(lb));
            qa = ha;
            qb = hb;
        } else {
            first = _mm512_reduce_add_epi32(qa);
            sum = first + _mm512_reduce_add_epi32(qb);
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
                if (j < QK / 2) first += 256 * h + l;
                q2[j] = (int8_t)l;
                c = h;
            } else {
                sum += c;
                if (j < QK / 2) first += c;
            }
            q[j] = (int8_t)c;
        }
#endif
        xs[i] = top / levels;
        qsum[i] = sum;
        if (qsum16 != NULL) {
            qsum16[2 * i] = first;
            qsum16[2 * i + 1] = sum - first;
        }
        xsum[i] = xs[i] * (float)sum;
    }
}

/* Per-block codes (as `passes` int8 parts, or row r's row_passes[r] when row_passes is not NULL),
 * scales and sums of x [m, k]; qsum16 (or NULL): the sums of each half block's codes. */
static void quantize_rows_of(const float *x, long m, long k, int passes, const uint8_t *row_passes, long mq,
                             int8_t *xq, float *xs, int32_t *qsum, float *xsum, int32_t *qsum16) {
    quantize_t a = {x, k, mq, passes, xq, xs, xsum, qsum, qsum16, row_passes};
    run_elementwise(quantize_blocks, &a, m * (k / QK), m * k);
}

static void quantize_rows(const float *x, long m, long k, int passes, long mq, int8_t *xq, float *xs,
                          int32_t *qsum, float *xsum, int32_t *qsum16) {
    quantize_rows_of(x, m, k, passes, NULL, mq, xq, xs, qsum, xsum, qsum16);
}

/* acc after block b of row r: the block's integer sum s (Q8_0: with Q8_OFFSET's offset) through
 * the float32 steps above, for weight scales d and minima m. */
INLINE vec block_step(const matmul_t *job, long r, long b, int kind, ivec s, vec d, vec m, vec acc) {
    long rb = r * (job->k / QK) + b;
    int32_t fix = kind == Q4_0 ? 8 * job->qsum[rb] : kind == Q8_0 && Q8_OFFSET ? 128 * job->qsum[rb] : 0;
    int affine = kind == Q4_1 || kind == K4 || kind == K5;
    acc = vfmadd(icvt_scaled(affine ? s : isub(s, fix), job->xs[rb]), d, acc);
    return affine ? vfmadd(m, vset1(job->xsum[rb]), acc) : acc;
}

/* K6's step: the two halves' sums sa and sb of the 6-bit codes q (weights q - 32: each half's sum
 * less 32 times its activation codes' sum), scales da and db. */
INLINE vec block_step_k6(const matmul_t *job, long r, long b, ivec sa, ivec sb, vec da, vec db, vec acc) {
    long rb = r * (job->k / QK) + b;
    int32_t fa = 32 * job->qsum16[2 * rb], fb = 32 * job->qsum16[2 * rb + 1];
    acc = vfmadd(icvt_scaled(isub(sa, fa), job->xs[rb]), da, acc);
    return vfmadd(icvt_scaled(isub(sb, fb), job->xs[rb]), db, acc);
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
        ivec s[MAX_RQ][4], sb[MAX_RQ][4]; /* sb: K6's second half */
        vec d[4], m[4];
        const uint8_t *q[4];
#pragma GCC unroll 4
        for (int c = 0; c < C; c++) {
            q[c] = group_block(job, g0 + c, b, kind, &d[c], &m[c]);
            if (b + Q8_AHEAD < nb) /* the group's blocks are contiguous: ask for one further on */
                prefetch_span(group_start(job, g0 + c, b + Q8_AHEAD, kind), group_bytes(kind));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) s[r][c] = sb[r][c] = izero();
        }
        /* Two passes: small tiles unpack each chunk once and sum its products with the codes'
         * high parts (s) and low parts (s2), then s = 256 * s + s2; larger ones (which would run
         * out of registers so) go over the block twice, s = 256 * s between the passes. */
        const int fused = P == 2 && R * C <= (kind == K6 ? 2 : 4);
        ivec s2[MAX_RQ][4], s2b[MAX_RQ][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++) s2[r][c] = s2b[r][c] = izero();
        for (int pass = 0; pass < (fused ? 1 : P); pass++) {
            const int8_t *xb = job->xq + pass * job->mq * k + r0 * k + b * QK, *xb2 = xb + job->mq * k;
            if (pass > 0)
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        s[r][c] = itimes256(s[r][c]);
                        if (kind == K6) sb[r][c] = itimes256(sb[r][c]);
                    }
            if (kind == Q8_0 || kind == K6 || kind == K5) { /* byte codes; K5's 0..31 and K6's 0..63 unsigned, as nibbles */
#pragma GCC unroll 8
                for (int t = 0; t < QK / 4; t++)
#pragma GCC unroll 4
                    for (int c = 0; c < C; c++) {
                        wvec w = kind == K6 ? k6_chunk(q[c], t) : load_chunk(q[c] + t * CHUNK);
#pragma GCC unroll 8
                        for (int r = 0; r < R; r++) {
                            if (kind == K6 && t >= QK / 8) { /* weights 16..31 */
                                sb[r][c] = dot4_u4(sb[r][c], w, xb + r * k + 4 * t);
                                if (fused) s2b[r][c] = dot4_u4(s2b[r][c], w, xb2 + r * k + 4 * t);
                                continue;
                            }
                            s[r][c] = kind == Q8_0 ? dot4_q8(s[r][c], w, xb + r * k + 4 * t)
                                                   : dot4_u4(s[r][c], w, xb + r * k + 4 * t);
                            if (fused)
                                s2[r][c] = kind == Q8_0 ? dot4_q8(s2[r][c], w, xb2 + r * k + 4 * t)
                                                        : dot4_u4(s2[r][c], w, xb2 + r * k + 4 * t);
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
                for (int c = 0; c < C; c++) {
                    s[r][c] = iadd(itimes256(s[r][c]), s2[r][c]);
                    if (kind == K6) sb[r][c] = iadd(itimes256(sb[r][c]), s2b[r][c]);
                }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < C; c++)
                acc[r][c] = kind == K6 ? block_step_k6(job, r0 + r, b, s[r][c], sb[r][c], d[c], m[c], acc[r][c])
                                       : block_step(job, r0 + r, b, kind, s[r][c], d[c], m[c], acc[r][c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; c++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) store_output(job, r0 + r, g0 + c, acc[r][c]);
}
