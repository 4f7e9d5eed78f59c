/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the matmul job and the interleaved weight layout. */

/* ---- matmuls ----
 * The weights are first interleaved (ifb_interleave): output columns go in groups of 16, and for
 * each group and each 32-weight block the group's 16 scales (and minima) come first, then the code
 * bytes in 64-byte chunks, chunk t holding bytes 4t..4t+3 of each of the 16 columns side by side
 * (what one VNNI instruction multiplies with 4 activation bytes). A group's block is the 16
 * columns' GGUF blocks with their bytes moved: the same size.
 *   Q4_0: 16 d, then 4 chunks    (code byte i of a column: weights i and i + 16, as in GGUF)
 *   Q4_1: 16 d, 16 m, then 4 chunks
 *   Q8_0: 16 d, then 8 chunks    (codes stored + 128, as unsigned bytes)
 *   K4:   16 bytes sc, 16 bytes m, then 4 chunks as Q4_1's (a Q4_K sub-block of 32: 6-bit scale
 *         sc and minimum m; codes 0..15)
 *   K6:   16 int8 sc of weights 0..15, 16 of weights 16..31, then the 6-bit codes q (a Q6_K
 *         block's two sub-blocks of 16; weight i is q - 32) as 4 nibble chunks of their low 4
 *         bits (as Q4_1's: byte i holds weights i and i + 16) and 2 chunks of their top 2 bits
 *         (chunk h, byte j of a column: bits 2u, 2u + 1 hold weight 16h + 4u + j's); k6_chunk
 *         rebuilds chunk t of the codes q as bytes (as K5's: unsigned, 4 bytes a column) from them
 * and the K kinds' super-blocks of 8 blocks each start with a head: K4's 16 float16 d, then 16
 * dmin; K6's 16 float16 d. The float32 scales are d * sc (and minima -dmin * m), exact, made as
 * the blocks are read: what the file holds, 18.5 (K4) and 26.25 (K6) bytes per column and block.
 *   K5:   16 float32 scales, 16 float32 minima, then 8 chunks of the codes 0..31 as bytes (a Q5_K
 *         sub-block: d * sc and -dmin * m; a Q5_1 block: d and m; codes unsigned, no offset)
 * Float32 activations: a tile is R rows by C groups; each output element has one accumulator that takes the products in
 * one fixed order (block by block; within a block weights 0, 16, 1, 17, ..., 15, 31), whatever
 * R and C are: a row's result never depends on its batch mates. */

#define GROUP 16
#define CHUNK 64 /* code bytes 4i..4i+3 of the 16 columns: 4 bytes per column */

typedef struct {
    int kind;              /* Q4_0, Q4_1, Q8_0, K4, K6 or K5 */
    int passes;            /* integer activations in 1 or 2 int8 passes (the fields below); 0: float32 x */
    const float *x;        /* [m, k] */
    long m, k, n;
    const uint8_t *blocks; /* interleaved, [ceil(n / 16) groups][k / 32 blocks] */
    const float *bias;     /* [n] or NULL */
    float *y;              /* [m, n] */
    const int8_t *xq;      /* [passes][mq, k] int8 parts of x's codes, per 32-block */
    int use_amx;           /* AMX tiles for whole tiles of rows (the same results) */
    const float *xs;       /* [mq, k / 32] block scales */
    const int32_t *qsum;   /* [mq, k / 32] sums of a block's codes */
    const float *xsum;     /* [mq, k / 32] scale * code sum */
    long mq;               /* rows of codes: m, or m padded with zero rows to whole AMX tiles */
    const int32_t *qsum16; /* [mq, k / 16] sums of each half block's codes (K6's sub-blocks) */
    long ldy;              /* y's row stride (n, or more: a slice of wider rows) */
    const uint8_t *row_passes; /* [m]: each row's own passes (1 or 2), or NULL: every row `passes` */
} matmul_t;

/* Bytes of one group's block, and of its scales (and minima) before the code chunks; of one
 * group's super-block head (K4, K6; else 0); of a group's row of k weights. */
INLINE long group_bytes(int kind) { return GROUP * BLOCK_BYTES[kind]; }
INLINE long head_bytes(int kind) {
    return kind == Q4_1 ? 4 * GROUP : kind == K5 ? 8 * GROUP : 2 * GROUP;
}
INLINE long super_head_bytes(int kind) { return GROUP * SUPER_BYTES[kind]; }
INLINE long group_row_bytes(int kind, long k) {
    return (k / QK) * group_bytes(kind) + (k / (SUPER * QK)) * super_head_bytes(kind);
}
/* Where block b of a group row (at `row`) starts. */
INLINE const uint8_t *block_at(const uint8_t *row, long b, int kind) {
    if (SUPER_BYTES[kind] == 0) return row + b * group_bytes(kind);
    return row + (b / SUPER + 1) * super_head_bytes(kind) + b * group_bytes(kind);
}

/* GGUF rows [n, k / 32 blocks] -> interleaved groups; columns past n (the last group's padding)
 * get zero scales, so their weights are zero. */
void ifb_interleave(const uint8_t *src, long n, long k, int kind, uint8_t *dst) {
    long nb = k / QK, bb = BLOCK_BYTES[kind], groups = (n + GROUP - 1) / GROUP;
    long head = kind == Q4_1 ? 4 : 2, codes = bb - head; /* bytes of scales, of codes, per block */
    for (long g = 0; g < groups; g++)
        for (long b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * GROUP * bb;
            for (long c = 0; c < GROUP; c++) {
                long j = g * GROUP + c;
                const uint8_t *blk = j < n ? src + (j * nb + b) * bb : NULL;
                for (long h = 0; h < head; h += 2) { /* d (then m): 16 halves each */
                    out[(h / 2) * 2 * GROUP + 2 * c] = blk ? blk[h] : 0;
                    out[(h / 2) * 2 * GROUP + 2 * c + 1] = blk ? blk[h + 1] : 0;
                }
                for (long i = 0; i < codes; i++) /* Q8_0: code + 128, an unsigned byte */
                    out[head * GROUP + (i / 4) * CHUNK + c * 4 + i % 4] =
                        (uint8_t)((blk ? blk[head + i] : 0) ^ (kind == Q8_0 ? 0x80 : 0));
            }
        }
}
