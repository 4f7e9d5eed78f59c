/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the units of work the thread pool runs. */

typedef struct {
    const float *q;                 /* [t, hq, d]: row stride q_stride, heads contiguous */
    long q_stride, t, hq, hkv, d;
    const uint8_t *k_cache, *v_cache; /* [blocks, block_size, hkv, d] of float32, or float16 (kv_half) */
    int kv_half;
    long block_size;
    const int64_t *block_tables;    /* [seqs, width] */
    long width;
    const int64_t *query_start_loc; /* [seqs + 1] */
    const int64_t *seq_lens;        /* [seqs]: context length after this step */
    const long *token_seq;          /* [t]: the sequence of each query token */
    long max_ctx;
    float scale;
    float *out;                     /* [t, hq, d] */
    /* Left zero by the callers that do not set them (the fields after `out`): */
    long window;                    /* > 0: a query at p sees positions p - window + 1 .. p only */
    const float *sinks;             /* [hq]: one more logit per head whose probability is dropped, or NULL */
} attention_t;

typedef struct {
    const float *x; /* [rows, n] */
    long n;
    int64_t *out;   /* [rows] */
} argmax_t;

/* Independent items of an elementwise step (rows, or blocks of a row): fn(arg, i0, i1) runs [i0, i1). */
typedef struct {
    void (*fn)(const void *arg, long i0, long i1);
    const void *arg;
} items_t;

/* A unit of work for the pool: `count` independent items, split in contiguous ranges. */
typedef struct {
    int kind; /* 0: matmul (items are groups of 16 output columns), 1: attention (items are (token, kv head)
               * pairs), 2: argmax (items are rows), 3: an elementwise step (its own items) */
    long count;
    matmul_t mm;
    attention_t at;
    argmax_t am;
    items_t it;
} job_t;
