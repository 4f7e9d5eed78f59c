/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * integer-activation matmuls over GGUF rows kept exactly as stored, for the block types that are
 * not interleaved (qkernels.py's stored_matmul; quant_blocks.py is the reference in torch):
 *   Q5_0 (22 bytes / 32: d, 32 high bits, 16 nibble bytes)        w = d * (q - 16)
 *   Q5_1 (24 bytes / 32: d, m, 32 high bits, 16 nibble bytes)     w = d * q + m
 *   Q4_K (144 bytes / 256: d, dmin, 12 bytes of 6-bit scales and minima, 128 nibble bytes)
 *   Q5_K (176 bytes / 256: as Q4_K, with 32 bytes of fifth bits)  w = d * sc_j * q - dmin * m_j
 *   Q6_K (210 bytes / 256: 128 nibble bytes, 64 bytes of two high bits, 16 int8 scales, d)
 *                                                                 w = d * sc_j * (q - 32), j per 16
 * Each weight row is decoded once per call into int8 codes with float32 sub-block scales (exact: a
 * float16 times a small integer) and, for the affine types, minima per 32; the activations are the
 * codes of quantize_rows (matmul_int.h). Per sub-block of G weights (32, Q6_K 16) the integer sum S
 * (two int8 passes: 256 * S_high + S_low) is exact; then in one fixed order, one rounding each,
 *   acc = fma((float)S * xs, scale, acc)   and, after each 32 of an affine type,
 *   acc = fma(min, xsum, acc)
 * Work is split by output columns, never inside a sum, and no step depends on the instruction set,
 * so a row's result never depends on its batch mates, the threads or the ISA. */

enum { T_Q5_0 = 6, T_Q5_1 = 7, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 }; /* ggml's type numbers */

typedef struct {
    int type, passes;
    long m, k, n, row_bytes;
    const uint8_t *rows;  /* [n, row_bytes] as stored */
    const float *bias;    /* [n] or NULL */
    float *y;             /* [m, n] */
    const int16_t *xc;    /* [m, k] activation codes: the int8 parts joined, 256 * high + low */
    const float *xs, *xsum; /* [m, k / 32] */
} stored_t;

/* Bytes of a row of k weights, or -1 for a type this file does not read (or a k it cannot). */
static long stored_row_bytes(int type, long k) {
    long small = k % 32 == 0 ? k / 32 : -1, large = k % 256 == 0 ? k / 256 : -1;
    switch (type) {
    case T_Q5_0: return small < 0 ? -1 : small * 22;
    case T_Q5_1: return small < 0 ? -1 : small * 24;
    case T_Q4_K: return large < 0 ? -1 : large * 144;
    case T_Q5_K: return large < 0 ? -1 : large * 176;
    case T_Q6_K: return large < 0 ? -1 : large * 210;
    default: return -1;
    }
}

INLINE int stored_group(int type) { return type == T_Q6_K ? 16 : 32; }

/* Q4_K / Q5_K: the j-th 6-bit scale and minimum of a super-block's 12 bytes p. */
INLINE void k_scale_min(const uint8_t *p, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = p[j] & 63;
        *mn = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 15) | ((p[j - 4] >> 6) << 4);
        *mn = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

/* One row as codes [k], scales [k / G] and (affine types) minima [k / 32]. */
static void decode_row(int type, const uint8_t *p, long k, int8_t *codes, float *scales, float *mins) {
    if (type == T_Q5_0 || type == T_Q5_1) {
        int head = type == T_Q5_1 ? 4 : 2, off = type == T_Q5_0 ? 16 : 0, bb = head + 20;
        for (long b = 0; b < k / 32; b++, p += bb) {
            scales[b] = half_at(p);
            if (type == T_Q5_1) mins[b] = half_at(p + 2);
            uint32_t qh = (uint32_t)p[head] | (uint32_t)p[head + 1] << 8 | (uint32_t)p[head + 2] << 16 |
                          (uint32_t)p[head + 3] << 24;
            const uint8_t *qs = p + head + 4;
            int8_t *c = codes + 32 * b;
#if IFB_ISA == 512 || IFB_ISA == 256
            /* bit i of the word -> 16 in byte i: each byte of a half picks its word byte, tests its bit */
            const __m128i pick = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
            const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
            const __m128i nib = _mm_set1_epi8(15), sixteen = _mm_set1_epi8(16), offset = _mm_set1_epi8((char)off);
            __m128i q = _mm_loadu_si128((const __m128i *)qs);
            __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
            __m128i b0 = _mm_shuffle_epi8(_mm_set1_epi16((short)(qh & 0xFFFFu)), pick);
            __m128i b1 = _mm_shuffle_epi8(_mm_set1_epi16((short)(qh >> 16)), pick);
            b0 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b0, bit), bit), sixteen);
            b1 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b1, bit), bit), sixteen);
            _mm_storeu_si128((__m128i *)c, _mm_sub_epi8(_mm_or_si128(lo, b0), offset));
            _mm_storeu_si128((__m128i *)(c + 16), _mm_sub_epi8(_mm_or_si128(hi, b1), offset));
#else
            for (int i = 0; i < 16; i++) {
                c[i] = (int8_t)(((qs[i] & 15) | ((qh >> i) & 1) << 4) - off);
                c[i + 16] = (int8_t)(((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) - off);
            }
#endif
        }
    } else if (type == T_Q4_K || type == T_Q5_K) {
        long bb = type == T_Q4_K ? 144 : 176;
        for (long s = 0; s < k / 256; s++, p += bb) {
            float d = half_at(p), dmin = half_at(p + 2);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                k_scale_min(p + 4, j, &sc, &mn);
                scales[8 * s + j] = d * (float)sc;
                mins[8 * s + j] = -(dmin * (float)mn);
            }
            const uint8_t *qh = p + 16, *qs = p + (type == T_Q4_K ? 16 : 48);
            int8_t *c = codes + 256 * s;
            for (int r = 0; r < 4; r++) /* run r of 32 bytes: sub-blocks 2r (low nibbles) and 2r + 1 */
                for (int i = 0; i < 32; i++) {
                    int lo = qs[32 * r + i] & 15, hi = qs[32 * r + i] >> 4;
                    if (type == T_Q5_K) {
                        lo |= ((qh[i] >> (2 * r)) & 1) << 4;
                        hi |= ((qh[i] >> (2 * r + 1)) & 1) << 4;
                    }
                    c[64 * r + i] = (int8_t)lo;
                    c[64 * r + 32 + i] = (int8_t)hi;
                }
        }
    } else { /* Q6_K */
        for (long s = 0; s < k / 256; s++, p += 210) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            float d = half_at(p + 208);
            for (int j = 0; j < 16; j++) scales[16 * s + j] = d * (float)sc[j];
            for (int h = 0; h < 2; h++) { /* halves of 128: 64 nibble bytes, 32 bytes of 2-bit pairs */
                const uint8_t *q = ql + 64 * h, *hb = qh + 32 * h;
                int8_t *c = codes + 256 * s + 128 * h;
                for (int i = 0; i < 32; i++) { /* weights i, 32 + i, 64 + i, 96 + i */
                    c[i] = (int8_t)(((q[i] & 15) | (hb[i] & 3) << 4) - 32);
                    c[32 + i] = (int8_t)(((q[32 + i] & 15) | ((hb[i] >> 2) & 3) << 4) - 32);
                    c[64 + i] = (int8_t)(((q[i] >> 4) | ((hb[i] >> 4) & 3) << 4) - 32);
                    c[96 + i] = (int8_t)(((q[32 + i] >> 4) | ((hb[i] >> 6) & 3) << 4) - 32);
                }
            }
        }
    }
}

#if IFB_ISA == 512 || IFB_ISA == 256
/* The 8 int32 lanes' sum. */
INLINE int32_t hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

/* sum(a[i] * b[i]) over G weight codes and activation codes: an exact int32 (products of at most
 * 64 * 32512 in pairs), whatever the instruction set. */
INLINE int32_t dot_codes(const int8_t *a, const int16_t *b, int g) {
#if IFB_ISA == 512
    if (g == 32) {
        __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)a));
        return _mm512_reduce_add_epi32(_mm512_madd_epi16(w, _mm512_loadu_si512((const void *)b)));
    }
#endif
#if IFB_ISA == 512 || IFB_ISA == 256
    __m256i acc = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a)),
                                    _mm256_loadu_si256((const __m256i *)b));
    if (g == 32)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(a + 16))),
                                                      _mm256_loadu_si256((const __m256i *)(b + 16))));
    return hsum8(acc);
#else
    int32_t s = 0;
    for (int i = 0; i < g; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
#endif
}

#if IFB_ISA == 512
#define STORED_COLUMNS 16 /* AVX-512: output columns decoded together, one lane each */

/* The 16 int32 products (in pairs) of G codes and activation codes (Q6_K's 16: 8, the rest zero). */
INLINE __m512i madd_codes(const int8_t *a, const int16_t *b, int g) {
    if (g == 32)
        return _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)a)),
                                 _mm512_loadu_si512((const void *)b));
    return _mm512_zextsi256_si512(_mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)a)),
                                                    _mm256_loadu_si256((const __m256i *)b)));
}
INLINE __m512i pair_sums(__m512i a, __m512i b) { /* per 128 bits: a, b, a, b partial sums */
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
INLINE __m512i quad_sums(__m512i a, __m512i b) { /* per 128 bits: the 4 columns' partial sums */
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
INLINE __m512i lane_sums(__m512i a, __m512i b) { /* 128-bit lanes 0 + 1 and 2 + 3 of a, then of b */
    return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}
/* Lane c: the sum of v[c]'s lanes (exact integers: any order gives them). */
INLINE __m512i transpose_sums(const __m512i v[16]) {
    __m512i t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = pair_sums(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; i++) u[i] = quad_sums(t[2 * i], t[2 * i + 1]);
    return lane_sums(lane_sums(u[0], u[1]), lane_sums(u[2], u[3]));
}

/* Groups [g0, g1) of 16 output columns for every row: the group's rows decoded once (columns past
 * n: zero codes, scales and minima), then per sub-block the 16 integer sums side by side and the
 * float steps on 16 lanes, each lane the very sequence stored_columns runs for its column. */
static void stored_groups(const void *arg, long g0, long g1) {
    const stored_t *a = (const stored_t *)arg;
    enum { C = STORED_COLUMNS };
    long k = a->k, nb = k / QK;
    int g = stored_group(a->type), affine = a->type != T_Q5_0 && a->type != T_Q6_K;
    long nsub = k / g;
    /* on the stack: 16 decoded rows, 1.25 bytes per weight (380 KB for rows of 18944) */
    int8_t codes[C * k];
    float scales[nsub * C], mins[nb * C], row_scales[nsub], row_mins[nb]; /* [sub-block][column] */
    for (long grp = g0; grp < g1; grp++) {
        long j0 = grp * C, cols = a->n - j0 < C ? a->n - j0 : C;
        for (int c = 0; c < C; c++) {
            if (c < cols) {
                decode_row(a->type, a->rows + (j0 + c) * a->row_bytes, k, codes + c * k, row_scales, row_mins);
            } else {
                memset(codes + c * k, 0, (size_t)k);
                for (long s = 0; s < nsub; s++) row_scales[s] = 0.0f;
                for (long b = 0; b < nb; b++) row_mins[b] = 0.0f;
            }
            for (long s = 0; s < nsub; s++) scales[s * C + c] = row_scales[s];
            if (affine)
                for (long b = 0; b < nb; b++) mins[b * C + c] = row_mins[b];
        }
        for (long r = 0; r < a->m; r++) {
            const int16_t *xc = a->xc + r * k;
            const float *xs = a->xs + r * nb, *xsum = a->xsum + r * nb;
            __m512 acc = _mm512_setzero_ps();
            for (long s = 0; s < nsub; s++) {
                __m512i v[C];
                for (int c = 0; c < C; c++) v[c] = madd_codes(codes + c * k + s * g, xc + s * g, g);
                __m512 sum = _mm512_cvtepi32_ps(transpose_sums(v));
                acc = _mm512_fmadd_ps(_mm512_mul_ps(sum, _mm512_set1_ps(xs[s * g / QK])),
                                      _mm512_loadu_ps(scales + s * C), acc);
                if (affine) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mins + s * C), _mm512_set1_ps(xsum[s]), acc);
            }
            float out[C];
            _mm512_storeu_ps(out, acc);
            float *y = a->y + r * a->n + j0;
            for (int c = 0; c < cols; c++) y[c] = a->bias ? out[c] + a->bias[j0 + c] : out[c];
        }
    }
}
#else
/* Output columns [j0, j1) for every row. */
static void stored_columns(const void *arg, long j0, long j1) {
    const stored_t *a = (const stored_t *)arg;
    long k = a->k, nb = k / QK;
    int g = stored_group(a->type), affine = a->type != T_Q5_0 && a->type != T_Q6_K;
    long nsub = k / g;
    /* one decoded row on the stack: 1.25 bytes per weight (24 KB for rows of 18944) */
    int8_t codes[k];
    float scales[nsub], mins[nb];
    for (long j = j0; j < j1; j++) {
        decode_row(a->type, a->rows + j * a->row_bytes, k, codes, scales, mins);
        for (long r = 0; r < a->m; r++) {
            const int16_t *xc = a->xc + r * k;
            const float *xs = a->xs + r * nb, *xsum = a->xsum + r * nb;
            float acc = 0.0f;
            for (long s = 0; s < nsub; s++) {
                int32_t sum = dot_codes(codes + s * g, xc + s * g, g);
                acc = fmaf((float)sum * xs[s * g / QK], scales[s], acc);
                if (affine) acc = fmaf(mins[s], xsum[s], acc);
            }
            a->y[r * a->n + j] = a->bias ? acc + a->bias[j] : acc;
        }
    }
}
#endif

/* y [m, n] = x [m, k] (float32) times n GGUF rows of `type` as stored (row_bytes each), plus bias
 * [n] (or NULL), x quantized to 15-bit (passes 2) or 8-bit (1) codes per block of 32.
 * 0; -1 without memory; -2 for a type (or k) this file does not read; -3 for other passes. */
int ifb_stored_matmul(const float *x, long m, long k, const uint8_t *rows, int type, int passes,
                      const float *bias, float *y, long n) {
    long row_bytes = stored_row_bytes(type, k);
    if (row_bytes < 0) return -2;
    if (passes != 1 && passes != 2) return -3;
    static __thread void *act_buf;
    static __thread size_t act_cap;
    size_t nbk = (size_t)(m * (k / QK));
    void *buf = reserve(&act_buf, &act_cap, (size_t)(passes * m * k) + 12 * nbk + 2 * (size_t)(m * k));
    if (buf == NULL) return -1;
    float *xs = (float *)buf, *xsum = xs + nbk;
    int32_t *qsum = (int32_t *)(xsum + nbk);
    int8_t *xq = (int8_t *)(qsum + nbk);
    quantize_rows(x, m, k, passes, m, xq, xs, qsum, xsum, NULL);
    int16_t *xc = (int16_t *)(xq + passes * m * k); /* aligned: k is a multiple of 32 */
    for (long i = 0; i < m * k; i++) xc[i] = (int16_t)(passes == 2 ? 256 * xq[i] + xq[m * k + i] : xq[i]);
    stored_t job = {type, passes, m, k, n, row_bytes, rows, bias, y, xc, xs, xsum};
#if IFB_ISA == 512
    run_elementwise(stored_groups, &job, (n + STORED_COLUMNS - 1) / STORED_COLUMNS, m * n * (k / QK));
#else
    run_elementwise(stored_columns, &job, n, m * n * (k / QK));
#endif
    return 0;
}

/* ---- K-quant rows for the interleaved kernels ----
 * Q4_K, Q6_K, and Q5_K / Q5_1 rows [n, row_bytes] as stored -> the K4, K6 and K5 groups of
 * matmul_layout.h, through
 * decode_row: the same codes and the same float32 scales (and minima) stored_groups multiplies, so
 * the interleaved kernels give stored_matmul's bits. Columns past n get zero scales and codes.
 * 0; -2 for another type (or a k it cannot read). */
int ifb_interleave_kquant(const uint8_t *src, long n, long k, int type, uint8_t *dst) {
    long row_bytes = stored_row_bytes(type, k);
    if (row_bytes < 0 || (type != T_Q4_K && type != T_Q6_K && type != T_Q5_K && type != T_Q5_1)) return -2;
    int kind = type == T_Q4_K ? K4 : type == T_Q6_K ? K6 : K5;
    long nb = k / QK, groups = (n + GROUP - 1) / GROUP, head = head_bytes(kind), grow = group_row_bytes(kind, k);
    int8_t *codes = (int8_t *)malloc((size_t)k);
    float *scales = (float *)malloc(sizeof(float) * (size_t)(k / 16)), *mins = (float *)malloc(sizeof(float) * (size_t)nb);
    if (codes == NULL || scales == NULL || mins == NULL) {
        free(codes);
        free(scales);
        free(mins);
        return -1;
    }
    memset(dst, 0, (size_t)(groups * grow));
    for (long j = 0; j < n; j++) {
        const uint8_t *row = src + j * row_bytes;
        decode_row(type, row, k, codes, scales, mins);
        long g = j / GROUP, c = j % GROUP;
        for (long b = 0; b < nb; b++) {
            uint8_t *out = (uint8_t *)block_at(dst + g * grow, b, kind);
            float *f = (float *)out; /* K5: [16 scales][16 minima] */
            if (kind != K5 && b % SUPER == 0) { /* the super-block's head: d (and K4's dmin) as stored */
                const uint8_t *sup = row + (b / SUPER) * (kind == K4 ? 144 : 210) + (kind == K4 ? 0 : 208);
                uint8_t *h = out - super_head_bytes(kind);
                h[2 * c] = sup[0];
                h[2 * c + 1] = sup[1];
                if (kind == K4) {
                    h[2 * GROUP + 2 * c] = sup[2];
                    h[2 * GROUP + 2 * c + 1] = sup[3];
                }
            }
            const int8_t *q = codes + b * QK;
            if (kind == K5) {
                f[c] = scales[b];
                f[GROUP + c] = mins[b];
                for (int i = 0; i < QK; i++) /* codes 0..31 as bytes, laid out as Q8_0's */
                    out[head + (i / 4) * CHUNK + c * 4 + i % 4] = (uint8_t)q[i];
            } else if (kind == K4) { /* the block's 6-bit scale and minimum */
                int sc, mn;
                k_scale_min(row + (b / SUPER) * 144 + 4, (int)(b % SUPER), &sc, &mn);
                out[c] = (uint8_t)sc;
                out[GROUP + c] = (uint8_t)mn;
                for (int i = 0; i < QK / 2; i++) /* byte i: weights i and i + 16, as Q4_1's */
                    out[head + (i / 4) * CHUNK + c * 4 + i % 4] = (uint8_t)(q[i] | q[i + QK / 2] << 4);
            } else { /* the int8 scales of the block's halves, then the 6-bit codes q + 32 */
                const uint8_t *sc = row + (b / SUPER) * 210 + 192 + 2 * (b % SUPER);
                out[c] = sc[0];
                out[GROUP + c] = sc[1];
                for (int i = 0; i < QK / 2; i++) /* low 4 bits: byte i holds weights i and i + 16 */
                    out[head + (i / 4) * CHUNK + c * 4 + i % 4] = (uint8_t)(((q[i] + 32) & 15) | ((q[i + QK / 2] + 32) & 15) << 4);
                for (int i = 0; i < QK; i++) /* top 2 bits: weight i = 16h + 4u + j at bits 2u of plane h's byte j */
                    out[head + (4 + i / 16) * CHUNK + c * 4 + i % 4] |= (uint8_t)(((q[i] + 32) >> 4) << (2 * (i % 16 / 4)));
            }
        }
    }
    free(codes);
    free(scales);
    free(mins);
    return 0;
}
