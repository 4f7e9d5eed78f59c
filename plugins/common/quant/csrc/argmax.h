/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the greedy pick of a row of logits. */

/* The index of the first maximum of x[0..n) (n >= 1), or of the first NaN, as torch's max picks. */
static long argmax_row(const float *x, long n) {
    long i = 1, best_i = 0;
    float best = x[0];
    int has_nan = x[0] != x[0];
#if IFB_ISA == 512
    if (n >= 32) { /* per lane the first of its maxima, then the lowest index among the lanes' */
        __m512 bv = _mm512_loadu_ps(x);
        __m512i bi = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = bi;
        __mmask16 nan = _mm512_cmp_ps_mask(bv, bv, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
            __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);
            bv = _mm512_mask_mov_ps(bv, gt, v);
            bi = _mm512_mask_mov_epi32(bi, gt, idx);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        }
        has_nan = nan != 0;
        best = _mm512_reduce_max_ps(bv);
        __mmask16 top = _mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ);
        best_i = _mm512_mask_reduce_min_epi32(top, bi);
    }
#endif
    for (; i < n; i++) {
        if (x[i] > best) {
            best = x[i];
            best_i = i;
        }
        has_nan |= x[i] != x[i];
    }
    if (has_nan)
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return best_i;
}
