/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * paged attention, and the vector helpers it shares with the decoder. */

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

#if IFB_ISA == 512
/* e^x for x <= 88, to about 2 ulp: e^x = 2^n e^f with |f| <= ln2 / 2, e^f from its degree-6
 * Taylor polynomial. */
INLINE __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* below, e^x is under float's normal range */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x); /* ln 2 in two parts (Cody-Waite) */
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 e = _mm512_set1_ps(1.0f / 720.0f);
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 120.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 24.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f / 6.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}
#endif

/* act[r, i] = silu(gate) * up over `rows` rows of [gate | up] (2 * inter floats each). */
static void silu_rows(const float *gu, long rows, long inter, float *act) {
    for (long r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * inter, *up = gate + inter;
        float *out = act + r * inter;
        long i = 0;
#if IFB_ISA == 512
        for (; i + 16 <= inter; i += 16) {
            __m512 g = _mm512_loadu_ps(gate + i);
            __m512 e = exp_nonpositive(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(88.0f)));
            /* below -88, e^-g overflows and silu is 0 (as expf gives it): without the mask the clamped
             * e^88 left values under 1e-35, whose products with `up` were subnormal, and every
             * later step on them took the CPU's slow path */
            __mmask16 live = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-88.0f), _CMP_GE_OQ);
            __m512 silu = _mm512_maskz_div_ps(live, g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < inter; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* The largest of p[0..n) (-inf for n = 0). */
static float max_of(const float *p, long n) {
    long j = 0;
    float top = -INFINITY;
#if IFB_ISA == 512
    if (n >= 16) {
        __m512 m = _mm512_loadu_ps(p);
        for (j = 16; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + j));
        top = _mm512_reduce_max_ps(m);
    }
#endif
    for (; j < n; j++)
        if (p[j] > top) top = p[j];
    return top;
}

/* p[j] = p[j] / sum for j < n (correctly rounded, as a scalar division). */
static void divide_by(float *p, long n, float sum) {
    long j = 0;
#if IFB_ISA == 512
    __m512 v = _mm512_set1_ps(sum);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, _mm512_div_ps(_mm512_loadu_ps(p + j), v));
#elif IFB_ISA == 256
    __m256 v = _mm256_set1_ps(sum);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, _mm256_div_ps(_mm256_loadu_ps(p + j), v));
#endif
    for (; j < n; j++) p[j] = p[j] / sum;
}

/* p[j] = e^(p[j] - top) for j < n; returns their sum (in a fixed order). */
static float exp_shifted(float *p, long n, float top) {
    long j = 0;
    float sum = 0.0f;
#if IFB_ISA == 512
    __m512 acc = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), shift));
        _mm512_storeu_ps(p + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, p + j), shift));
        _mm512_mask_storeu_ps(p + j, tail, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        p[j] = expf(p[j] - top);
        sum += p[j];
    }
    return sum;
}

/* Cached K/V values are float32, or float16 (`half`, a constant at each call site) read as float32
 * (exact): a float16 cache halves the bytes a decode step streams for its context.
 * Row p of d cached values as float32: p itself, or (float16) converted into tmp. */
INLINE const float *kv_row(const void *row, long d, int half, float *tmp) {
    const uint8_t *p = (const uint8_t *)row;
    if (!half) return (const float *)p;
    long i = 0;
#if IFB_ISA == 512
    for (; i + 16 <= d; i += 16)
        _mm512_storeu_ps(tmp + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i))));
#elif IFB_ISA == 256
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(tmp + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
    for (; i < d; i++) tmp[i] = half_at(p + 2 * i);
    return tmp;
}

#if IFB_ISA == 512
INLINE __m512 kv_load(const uint8_t *p, long i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* o_h = sum_j p_h[j - lo] v_j over positions lo <= j < ctx for H heads at once (H and nv = d / 16 constants
 * at each call site), v_j read through the block table once for all of them; each head's sums
 * take the same operations in the same order as axpy's. */
INLINE void weighted_rows(float *o, const float *p, long p_stride, long lo, long ctx, const int64_t *table,
                          const uint8_t *v0, long bs, long row_bytes, int H, int nv, int half) {
    __m512 acc[16];
    for (int i = 0; i < H * nv; i++) acc[i] = _mm512_setzero_ps();
    for (long j0 = lo - lo % bs; j0 < ctx; j0 += bs) { /* p[j - lo]: the weight of position j */
        long first = j0 > lo ? j0 : lo;
        const uint8_t *v = v0 + table[j0 / bs] * bs * row_bytes + (first - j0) * row_bytes;
        if (j0 + bs < ctx) { /* the next block's values */
            const uint8_t *next = v0 + table[j0 / bs + 1] * bs * row_bytes;
            for (long j = 0; j < bs && j0 + bs + j < ctx; j++)
                prefetch_span(next + j * row_bytes, 16 * nv * (half ? 2 : 4));
        }
        for (long j = first; j < ctx && j < j0 + bs; j++, v += row_bytes)
            for (int c = 0; c < nv; c++) {
                __m512 x = kv_load(v, 16 * c, half);
                for (int h = 0; h < H; h++)
                    acc[h * nv + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * p_stride + j - lo]), x, acc[h * nv + c]);
            }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + h * 16 * nv + 16 * c, acc[h * nv + c]);
}

/* weighted_rows for `heads` heads of d = 16 * nv, in runs of as many as keep 16 sums in registers. */
INLINE void weighted_heads(float *o, const float *p, long p_stride, long heads, long lo, long ctx,
                           const int64_t *table, const uint8_t *v0, long bs, long row_bytes, int nv, int half) {
    long most = 16 / nv;
    for (long h = 0; h < heads;) {
        long n = heads - h < most ? heads - h : most;
        float *oh = o + h * 16 * nv;
        const float *ph = p + h * p_stride;
        if (n >= 4)
            weighted_rows(oh, ph, p_stride, lo, ctx, table, v0, bs, row_bytes, 4, nv, half);
        else if (n == 3)
            weighted_rows(oh, ph, p_stride, lo, ctx, table, v0, bs, row_bytes, 3, nv, half);
        else if (n == 2)
            weighted_rows(oh, ph, p_stride, lo, ctx, table, v0, bs, row_bytes, 2, nv, half);
        else
            weighted_rows(oh, ph, p_stride, lo, ctx, table, v0, bs, row_bytes, 1, nv, half);
        h += n >= 4 ? 4 : n;
    }
}
#endif

/* Scores of a run of SCORE_LANES keys at once: each key's products are summed lane-wise as dot()
 * does, then the run's partial vectors are reduced together by a transposing tree (pairs of lanes
 * i, i + 8, then i, i + 4, ...). Each key's score depends on its own vector only: a key scores the
 * same bits in a full run and in a run cut short by the end of the context (NULL keys). */
#if IFB_ISA == 512
#define SCORE_LANES 16
/* The tree leaves key KEY_OF_SLOT[s]'s sum in lane KEY_OF_SLOT[s] when it starts in vector s. */
static const int KEY_OF_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

INLINE int scores_fit(long d) { return d % 16 == 0; }

INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    /* The 16 keys' sums advance together, a step of each per 16 columns: summed one key after
     * another, every FMA waited for the one before it (a chain of d / 16), and prefill's scores
     * took 3-4 times the FMAs' throughput. A missing key reads key 0's values (slot 0 is never
     * missing) and is zeroed after. */
    const float *k[16];
    for (int s = 0; s < 16; s++) k[s] = keys[KEY_OF_SLOT[s]] ? keys[KEY_OF_SLOT[s]] : keys[0];
    __m512 v[16], qi = _mm512_loadu_ps(q);
    for (int s = 0; s < 16; s++) v[s] = _mm512_mul_ps(qi, _mm512_loadu_ps(k[s]));
    for (long i = 16; i < d; i += 16) {
        qi = _mm512_loadu_ps(q + i);
        for (int s = 0; s < 16; s++) v[s] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(k[s] + i), v[s]);
    }
    for (int s = 0; s < 16; s++)
        if (keys[KEY_OF_SLOT[s]] == NULL) v[s] = _mm512_setzero_ps();
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
    _mm512_storeu_ps(out, _mm512_mul_ps(z, _mm512_set1_ps(scale)));
}

#elif IFB_ISA == 256
#define SCORE_LANES 8
static const int KEY_OF_SLOT[8] = {0, 4, 1, 5, 2, 6, 3, 7};

INLINE int scores_fit(long d) { return d % 8 == 0; }

INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    const float *k[8];
    for (int s = 0; s < 8; s++) k[s] = keys[KEY_OF_SLOT[s]] ? keys[KEY_OF_SLOT[s]] : keys[0];
    __m256 v[8], qi = _mm256_loadu_ps(q);
    for (int s = 0; s < 8; s++) v[s] = _mm256_mul_ps(qi, _mm256_loadu_ps(k[s]));
    for (long i = 8; i < d; i += 8) {
        qi = _mm256_loadu_ps(q + i);
        for (int s = 0; s < 8; s++) v[s] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[s] + i), v[s]);
    }
    for (int s = 0; s < 8; s++)
        if (keys[KEY_OF_SLOT[s]] == NULL) v[s] = _mm256_setzero_ps();
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    __m256 z = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    _mm256_storeu_ps(out, _mm256_mul_ps(z, _mm256_set1_ps(scale)));
}

#else
#define SCORE_LANES 1
INLINE int scores_fit(long d) { (void)d; return 0; }
INLINE void score_run(const float *q, const float *const *keys, long d, float scale, float *out) {
    (void)q; (void)keys; (void)d; (void)scale; (void)out;
}
#endif

/* Ask for up to SCORE_LANES rows of `bytes`. */
INLINE void prefetch_rows(const uint8_t *const *rows, long n, long bytes) {
    for (long s = 0; s < n && s < SCORE_LANES; s++) prefetch_span(rows[s], bytes);
}

/* Items [i0, i1): (token, kv head) pairs. The kv head's keys are scored for all the group's query
 * heads run by run (a run's keys are read once, then from L1), and its values summed for them in
 * one pass; each head's arithmetic is what it would be alone. */
INLINE void attention_items_of(const attention_t *a, long i0, long i1, int half, long D) {
    long group = a->hq / a->hkv, d = D ? D : a->d, bs = a->block_size, es = half ? 2 : 4, row_bytes = a->hkv * d * es;
    long stride = a->max_ctx + SCORE_LANES; /* room for a whole last run of scores, and of key addresses */
    float *p = (float *)malloc(sizeof(float) * (size_t)(stride * group + SCORE_LANES * d));
    const uint8_t **keys = (const uint8_t **)malloc(sizeof(uint8_t *) * (size_t)stride);
    if (p == NULL || keys == NULL) {
        free(p);
        free(keys);
        return;
    }
    float *tmp = p + stride * group;
    for (long i = i0; i < i1; i++) {
        long t = i / a->hkv, g = i % a->hkv, b = a->token_seq[t];
        long end = a->seq_lens[b] - (a->query_start_loc[b + 1] - t) + 1; /* positions lo .. end - 1 */
        long lo = a->window > 0 && end > a->window ? end - a->window : 0, ctx = end - lo;
        const int64_t *table = a->block_tables + b * a->width;
        long j = 0; /* key j is position lo + j: slot (lo + j) % bs of block table[(lo + j) / bs] */
        for (long j0 = lo - lo % bs; j0 < end; j0 += bs) {
            long first = j0 > lo ? j0 : lo;
            const uint8_t *k = a->k_cache + table[j0 / bs] * bs * row_bytes + (first - j0) * row_bytes + g * d * es;
            for (long pos = first; pos < end && pos < j0 + bs; pos++, j++, k += row_bytes) keys[j] = k;
        }
        for (; j < ctx + SCORE_LANES; j++) keys[j] = NULL;
        const float *q0 = a->q + t * a->q_stride + g * group * d;
        if (scores_fit(d))
            for (long j0 = 0; j0 < ctx; j0 += SCORE_LANES) {
                const float *run[SCORE_LANES]; /* float16: converted once for the group's heads */
                prefetch_rows(keys + j0 + 2 * SCORE_LANES, ctx - j0 - 2 * SCORE_LANES, d * es);
                for (int s = 0; s < SCORE_LANES; s++)
                    run[s] = keys[j0 + s] ? kv_row(keys[j0 + s], d, half, tmp + s * d) : NULL;
                for (long h = 0; h < group; h++) score_run(q0 + h * d, run, d, a->scale, p + h * stride + j0);
            }
        else
            for (long h = 0; h < group; h++)
                for (j = 0; j < ctx; j++)
                    p[h * stride + j] = dot(q0 + h * d, kv_row(keys[j], d, half, tmp), d) * a->scale;
        for (long h = 0; h < group; h++) { /* the softmax weights (a sink: one more logit, its share dropped) */
            float *ph = p + h * stride, top = max_of(ph, ctx);
            if (a->sinks == NULL) {
                divide_by(ph, ctx, exp_shifted(ph, ctx, top));
                continue;
            }
            float sink = a->sinks[g * group + h];
            top = sink > top ? sink : top;
            float sum = exp_shifted(ph, ctx, top);
            divide_by(ph, ctx, sum + expf(sink - top));
        }
        float *o = a->out + (t * a->hq + g * group) * d;
        const uint8_t *v0 = a->v_cache + g * d * es;
#if IFB_ISA == 512
        if (d == 64 || d == 128) { /* the usual head sizes: the sums stay in registers */
            if (d == 64)
                weighted_heads(o, p, stride, group, lo, end, table, v0, bs, row_bytes, 4, half);
            else
                weighted_heads(o, p, stride, group, lo, end, table, v0, bs, row_bytes, 8, half);
            continue;
        }
#endif
        for (long h = 0; h < group; h++) {
            float *oh = o + h * d;
            for (long c = 0; c < d; c++) oh[c] = 0.0f;
            for (long j0 = lo - lo % bs; j0 < end; j0 += bs) {
                long first = j0 > lo ? j0 : lo;
                const uint8_t *v = v0 + table[j0 / bs] * bs * row_bytes + (first - j0) * row_bytes;
                for (j = first; j < end && j < j0 + bs; j++, v += row_bytes)
                    axpy(oh, p[h * stride + j - lo], kv_row(v, d, half, tmp), d);
            }
        }
    }
    free(p);
    free(keys);
}

/* Specialised for float16 or float32 caches and for the usual head sizes, whose loops over d the
 * compiler can then unroll (the same operations in the same order as for any d). */
INLINE void attention_items_by_d(const attention_t *a, long i0, long i1, int half) {
    if (a->d == 64)
        attention_items_of(a, i0, i1, half, 64);
    else if (a->d == 128)
        attention_items_of(a, i0, i1, half, 128);
    else
        attention_items_of(a, i0, i1, half, 0);
}

static void attention_items(const attention_t *a, long i0, long i1) {
    if (a->kv_half)
        attention_items_by_d(a, i0, i1, 1);
    else
        attention_items_by_d(a, i0, i1, 0);
}
