/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * a whole decoder stack in one call. */

/* ---- a whole decoder stack in one call ----
 * The Llama-family layer of model.py (pre-norm attention with rotate-half RoPE and GQA, then a
 * SwiGLU MLP), every projection on GGUF blocks and float32 or float16 KV caches, for all the step's tokens.
 * It runs the same per-row operations as the kernels above; what it saves is the Python
 * dispatch of a few dozen small tensor operations per layer. */

#include "decoder_params.h" /* weight_t, layer_t, decoder_t, step_t */

/* row_passes: the step's rows' own passes (step_t), or NULL; a weight with float32 activations
 * (passes 0) ignores them. */
static int matmul_rows_of(const weight_t *w, const float *x, long m, float *y, const uint8_t *row_passes) {
    return ifb_block_matmul_rows(x, m, w->k, w->blocks, (int)w->kind, (int)w->passes,
                                 w->passes == 0 ? NULL : row_passes, w->bias, y, w->n, w->n);
}

static int matmul_rows(const weight_t *w, const float *x, long m, float *y) {
    return matmul_rows_of(w, x, m, y, NULL);
}

/* The q | k | v rows of y [m, row]: one matmul when they share a block kind, else one per part,
 * each into its columns. */
static int qkv_rows(const layer_t *L, const float *x, long m, float *y, long row, const uint8_t *row_passes) {
    const weight_t *parts[3] = {&L->qkv, &L->k_rows, &L->v_rows};
    long at = 0;
    for (int i = 0; i < 3; i++) {
        const weight_t *w = parts[i];
        if (w->n == 0) continue;
        int status = ifb_block_matmul_rows(x, m, w->k, w->blocks, (int)w->kind, (int)w->passes,
                                           w->passes == 0 ? NULL : row_passes, w->bias, y + at, w->n, row);
        if (status != 0) return status;
        at += w->n;
    }
    return 0;
}

/* out = w * (x / sqrt(mean(x^2) + eps)) over each of `rows` rows of `dim` (out may be x). */
static void rms_norm_rows(const float *x, long rows, long dim, const float *w, float eps, float *out) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float inv = 1.0f / sqrtf(dot(xr, xr, dim) / (float)dim + eps);
        for (long c = 0; c < dim; c++) o[c] = w[c] * (xr[c] * inv);
    }
}

/* x = x * cos + swap_halves(x) * signed_sin, as model.py's _apply_rope_signed computes it. */
static void rope_in_place(float *x, long d, const float *cos, const float *sin, float *tmp) {
    long half = d / 2, i = 0;
    if (half % GROUP == 0) /* a vector's partners are a vector too */
        for (; i < d; i += GROUP) {
            const float *partner = x + (i < half ? i + half : i - half);
            vstore(tmp + i, vadd(vmul(vload(x + i), vload(cos + i)), vmul(vload(partner), vload(sin + i))));
        }
    for (; i < d; i++) tmp[i] = x[i] * cos[i] + x[i < half ? i + half : i - half] * sin[i];
    for (i = 0; i < d; i++) x[i] = tmp[i];
}

/* cache[at + i] = x[i] for i < n, in float32 or (half) as float16 rounded to nearest even, as
 * torch's conversion rounds. */
static void store_kv(void *cache, long at, const float *x, long n, int half) {
    if (!half) {
        for (long i = 0; i < n; i++) ((float *)cache)[at + i] = x[i];
        return;
    }
    uint16_t *out = (uint16_t *)cache + at;
    long i = 0;
#if IFB_ISA == 512
    for (; i + 16 <= n; i += 16) /* the same rounding as half_of's */
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#elif IFB_ISA == 256
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) out[i] = half_of(x[i]);
}

/* The decoder's elementwise steps, each over independent rows (run_elementwise splits them). */
typedef struct {
    const decoder_t *m;
    const step_t *s;
    const layer_t *L;
    long l;
    float *x, *h, *qkv, *gu, *act;
    const float *delta, *norm;
} rows_t;

/* Rows [r0, r1): x += delta (when given), then h = rms_norm(x) with the weights `norm`. */
static void add_norm_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    long hidden = a->m->hidden;
    float *x = a->x + r0 * hidden;
    if (a->delta != NULL) {
        const float *delta = a->delta + r0 * hidden;
        for (long i = 0; i < (r1 - r0) * hidden; i++) x[i] = x[i] + delta[i];
    }
    rms_norm_rows(x, r1 - r0, hidden, a->norm, a->m->eps, a->h + r0 * hidden);
}

/* Rows [r0, r1) of qkv: the q/k norms (Qwen3), RoPE on q and k, then k and v into the caches. */
static void rope_store_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    const decoder_t *m = a->m;
    const step_t *s = a->s;
    const layer_t *L = a->L;
    long hq = m->hq, hkv = m->hkv, d = m->d, row = (hq + 2 * hkv) * d;
    float tmp[d];
    for (long r = r0; r < r1; r++) {
        float *q = a->qkv + r * row, *k = q + hq * d, *v = k + hkv * d;
        if (L->q_norm != NULL) {
            rms_norm_rows(q, hq, d, L->q_norm, m->eps, q);
            rms_norm_rows(k, hkv, d, L->k_norm, m->eps, k);
        }
        const float *cos = s->rope + r * 2 * d, *sin = cos + d;
        for (long head = 0; head < hq + hkv; head++) rope_in_place(q + head * d, d, cos, sin, tmp);
        long slot = (long)s->slot_mapping[r];
        store_kv(s->k_caches[a->l], slot * hkv * d, k, hkv * d, (int)s->kv_half);
        store_kv(s->v_caches[a->l], slot * hkv * d, v, hkv * d, (int)s->kv_half);
    }
}

#include "decoder_moe.h" /* moe_rows */

static void silu_of_rows(const void *arg, long r0, long r1) {
    const rows_t *a = (const rows_t *)arg;
    long inter = a->m->intermediate;
    silu_rows(a->gu + r0 * 2 * inter, r1 - r0, inter, a->act + r0 * inter);
}

/* Run every layer over the step's tokens; x [t, hidden] is updated in place. 0, or what failed:
 * -1 without memory. */
int ifb_decoder_forward(const decoder_t *m, const step_t *s, float *x) {
    long t = s->t, hidden = m->hidden, inter = m->intermediate, hq = m->hq, hkv = m->hkv, d = m->d;
    long row = (hq + 2 * hkv) * d;
    size_t floats = (size_t)t * (size_t)(2 * hidden + row + hq * d + 3 * inter);
    float *buf = (float *)malloc(sizeof(float) * floats);
    long *token_seq = (long *)malloc(sizeof(long) * (size_t)(t > 0 ? t : 1));
    if (buf == NULL || token_seq == NULL) {
        free(buf);
        free(token_seq);
        return -1;
    }
    float *h = buf, *qkv = h + t * hidden, *att = qkv + t * row, *gu = att + t * hq * d;
    float *act = gu + t * 2 * inter, *delta = act + t * inter;
    long work;
    long max_ctx = plan_attention(s->query_start_loc, s->seq_lens, s->num_seqs, hq, d, token_seq, &work);
    int status = 0;
    for (long l = 0; l < m->num_layers; l++) {
        const layer_t *L = &m->layers[l];
        /* the previous layer's MLP output (in delta) joins the residual stream here */
        rows_t rows = {m, s, L, l, x, h, qkv, gu, act, l > 0 ? delta : NULL, L->attn_norm};
        run_elementwise(add_norm_rows, &rows, t, t * hidden);
        if ((status = qkv_rows(L, h, t, qkv, row, s->row_passes)) != 0) break;
        run_elementwise(rope_store_rows, &rows, t, t * row);
        job_t job = {.kind = 1, .count = t * hkv};
        job.at = (attention_t){qkv, row, t, hq, hkv, d, s->k_caches[l], s->v_caches[l], (int)s->kv_half, s->block_size,
                               s->block_tables, s->width, s->query_start_loc, s->seq_lens, token_seq, max_ctx,
                               1.0f / sqrtf((float)d), att};
        run_job(&job, work);
        if ((status = matmul_rows_of(&L->o, att, t, delta, s->row_passes)) != 0) break;
        rows.delta = delta;
        rows.norm = L->mlp_norm;
        run_elementwise(add_norm_rows, &rows, t, t * hidden);
        if (L->num_experts > 0) {
            if ((status = moe_rows(m, L, h, t, delta)) != 0) break;
        } else {
            if ((status = matmul_rows_of(&L->gate_up, h, t, gu, s->row_passes)) != 0) break;
            run_elementwise(silu_of_rows, &rows, t, t * 2 * inter);
            if ((status = matmul_rows_of(&L->down, act, t, delta, s->row_passes)) != 0) break;
        }
        if (l == m->num_layers - 1)
            for (long i = 0; i < t * hidden; i++) x[i] = x[i] + delta[i];
    }
    free(buf);
    free(token_seq);
    return status;
}
