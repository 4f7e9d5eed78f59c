/* Part of qkernels.c's single translation unit (included from decoder.h; not compiled alone):
 * a mixture-of-experts MLP inside the whole-stack decoder, as layers/moe.py's SparseMoE computes it.
 *
 * Each row is routed on its own (its router logits one dot product per expert, softmax and top-k
 * in float32, the picks in ascending expert order); then the step's rows are grouped per expert
 * across the batch, every expert with rows multiplied once on its blocks (each row of a block
 * matmul computed on its own), and each row's picks summed in ascending expert order, its shared
 * expert (Qwen2-MoE) added times the sigmoid of its gate: a row's result never depends on its
 * batch mates or on how many rows an expert got. */

typedef struct {
    const decoder_t *m;
    const layer_t *L;
    const float *h;   /* [t, hidden] */
    float *weights;   /* [t, top_k] */
    long *ids;        /* [t, top_k] */
    float *scratch;   /* [t, num_experts] */
} route_t;

/* Rows [r0, r1): their top-k experts (ascending ids) and weights. */
static void route_rows(const void *arg, long r0, long r1) {
    const route_t *a = (const route_t *)arg;
    const layer_t *L = a->L;
    long hidden = a->m->hidden, E = L->num_experts, K = L->top_k;
    for (long r = r0; r < r1; r++) {
        const float *x = a->h + r * hidden;
        float *p = a->scratch + r * E, *w = a->weights + r * K;
        long *ids = a->ids + r * K;
        float top = -INFINITY;
        for (long e = 0; e < E; e++) {
            p[e] = dot(x, L->router + e * hidden, hidden);
            top = p[e] > top ? p[e] : top;
        }
        if (L->router_kind == 0) { /* softmax over every expert, then the top k */
            float sum = 0.0f;
            for (long e = 0; e < E; e++) sum += (p[e] = expf(p[e] - top));
            for (long e = 0; e < E; e++) p[e] = p[e] / sum;
        }
        for (long j = 0; j < K; j++) { /* the largest left (the lowest id among equals) */
            long best = -1;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long i = 0; i < j; i++) taken |= ids[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            ids[j] = best;
            w[j] = p[best];
        }
        if (L->router_kind == 1) { /* the top k logits, then a softmax over them */
            float sum = 0.0f, first = w[0];
            for (long j = 0; j < K; j++) sum += (w[j] = expf(w[j] - first));
            for (long j = 0; j < K; j++) w[j] = w[j] / sum;
        } else if (L->norm_topk) {
            float sum = 0.0f;
            for (long j = 0; j < K; j++) sum += w[j];
            for (long j = 0; j < K; j++) w[j] = w[j] / sum;
        }
        for (long j = 1; j < K; j++) /* ascending expert ids: the order the picks are summed in */
            for (long i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
                long id = ids[i];
                float v = w[i];
                ids[i] = ids[i - 1], w[i] = w[i - 1];
                ids[i - 1] = id, w[i - 1] = v;
            }
    }
}

/* y [t, hidden] = the MoE MLP of layer L over h [t, hidden]. 0, -1 without memory, or a matmul's status. */
static int moe_rows(const decoder_t *m, const layer_t *L, const float *h, long t, float *y) {
    long hidden = m->hidden, E = L->num_experts, K = L->top_k, I = L->expert_inter, S = L->shared_gate_up.n / 2;
    long picks = t * K, wide = I > S ? I : S, rows_max = picks > t ? picks : t;
    size_t floats = (size_t)(t * E + picks + rows_max * (2 * hidden + 3 * wide));
    float *buf = (float *)malloc(sizeof(float) * (floats > 0 ? floats : 1));
    long *index = (long *)malloc(sizeof(long) * (size_t)(2 * picks + 2 * E + 1));
    if (buf == NULL || index == NULL) {
        free(buf);
        free(index);
        return -1;
    }
    float *scratch = buf, *weights = scratch + t * E, *rows = weights + picks, *out = rows + rows_max * hidden;
    float *gu = out + rows_max * hidden, *act = gu + rows_max * 2 * wide;
    long *ids = index, *slot_of = ids + picks, *at = slot_of + picks, *start = at + E; /* start: [E + 1] */
    route_t route = {m, L, h, weights, ids, scratch};
    run_elementwise(route_rows, &route, t, t * E * hidden / 4);
    /* group the picks per expert (ascending), rows in order within an expert */
    for (long e = 0; e <= E; e++) start[e] = 0;
    for (long s = 0; s < picks; s++) start[ids[s] + 1]++;
    for (long e = 0; e < E; e++) start[e + 1] += start[e];
    for (long e = 0; e < E; e++) at[e] = start[e];
    for (long s = 0; s < picks; s++) {
        long pos = at[ids[s]]++;
        slot_of[s] = pos;
        memcpy(rows + pos * hidden, h + (s / K) * hidden, sizeof(float) * (size_t)hidden);
    }
    int status = 0;
    for (long e = 0; e < E && status == 0; e++) {
        long n = start[e + 1] - start[e];
        if (n == 0) continue;
        const float *xe = rows + start[e] * hidden;
        if ((status = matmul_rows(&L->experts_gate_up[e], xe, n, gu)) != 0) break;
        silu_rows(gu, n, I, act);
        status = matmul_rows(&L->experts_down[e], act, n, out + start[e] * hidden);
    }
    if (status == 0)
        for (long r = 0; r < t; r++) { /* the picks in ascending expert order, each times its weight */
            float *yr = y + r * hidden;
            for (long j = 0; j < K; j++) {
                const float *o = out + slot_of[r * K + j] * hidden;
                float w = weights[r * K + j];
                for (long c = 0; c < hidden; c++) yr[c] = j == 0 ? o[c] * w : yr[c] + o[c] * w;
            }
        }
    if (status == 0 && S > 0) { /* the shared expert, times sigmoid(its gate) */
        if ((status = matmul_rows(&L->shared_gate_up, h, t, gu)) == 0) {
            silu_rows(gu, t, S, act);
            status = matmul_rows(&L->shared_down, act, t, out);
        }
        for (long r = 0; r < t && status == 0; r++) {
            float g = 1.0f / (1.0f + expf(-dot(h + r * hidden, L->shared_gate, hidden)));
            for (long c = 0; c < hidden; c++) y[r * hidden + c] = y[r * hidden + c] + g * out[r * hidden + c];
        }
    }
    free(buf);
    free(index);
    return status;
}
