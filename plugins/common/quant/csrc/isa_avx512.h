/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the AVX-512 vector primitives of the matmul tiles (float32 and integer). */


#define MAX_R 8 /* 8 x 2 accumulators + 2 x 2 weight registers (+ scales), of 32 */
#define MAX_C 2
typedef __m512 vec;
#define VZERO _mm512_setzero_ps
#define VFMA(w, xp, acc) _mm512_fmadd_ps(w, _mm512_set1_ps(*(xp)), acc)

INLINE vec halves16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Code byte i (0..255) of each of the 16 columns. */
INLINE __m512i code_bytes(const uint8_t *q, int i) {
    __m512i v = _mm512_loadu_si512((const void *)(q + (i / 4) * CHUNK));
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * (i % 4)), _mm512_set1_epi32(0xFF));
}

/* Weights i and i + 16 of 16 columns from their code bytes i. */
INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    __m512i c = code_bytes(q, i);
    __m512i l = _mm512_and_si512(c, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(c, 4);
    if (centered) {
        __m512i eight = _mm512_set1_epi32(8);
        *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(l, eight)), d);
        *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(h, eight)), d);
    } else {
        *lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(l), d), m);
        *hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h), d), m);
    }
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(code_bytes(q, i), _mm512_set1_epi32(128))), d);
}

INLINE void store_group(float *y, vec v, long valid) {
    if (valid >= GROUP)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << valid) - 1u), v);
}

INLINE vec load_bias(const float *bias, long valid) {
    if (bias == NULL) return _mm512_setzero_ps();
    return valid >= GROUP ? _mm512_loadu_ps(bias) : _mm512_maskz_loadu_ps((__mmask16)((1u << valid) - 1u), bias);
}

INLINE vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
INLINE vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }

INLINE void cpu_relax(void) { _mm_pause(); }

/* int8 activations: a chunk holds 4 code bytes per column; dot4 adds, per column, the products of
 * its 4 bytes with 4 signed activation bytes. */
#define MAX_RQ 4
typedef __m512i wvec; /* a chunk of code bytes */
typedef __m512i ivec; /* 16 int32 sums */
INLINE ivec izero(void) { return _mm512_setzero_si512(); }
INLINE wvec load_chunk(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE wvec low_nibbles(wvec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
INLINE wvec high_nibbles(wvec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
/* K6's chunk t (0..7) of 6-bit codes from its nibble chunk and 2-bit plane (matmul_layout.h): the
 * plane's bits 2u, 2u + 1 (u = t % 4) of each byte shifted to bits 4, 5 (16-bit shifts: what
 * crosses into the next byte is masked off) */
INLINE wvec k6_chunk(const uint8_t *q, int t) {
    int u = t % 4;
    __m512i nib = load_chunk(q + u * CHUNK), plane = load_chunk(q + (4 + t / 4) * CHUNK);
    __m512i top = u == 0 ? _mm512_slli_epi16(plane, 4) : u == 1 ? _mm512_slli_epi16(plane, 2)
                : u == 2 ? plane : _mm512_srli_epi16(plane, 2);
    __m512i low = t < 4 ? low_nibbles(nib) : high_nibbles(nib);
    return _mm512_or_si512(low, _mm512_and_si512(top, _mm512_set1_epi8(0x30)));
}
INLINE __m512i x4_at(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm512_set1_epi32(v);
}
#if defined(__AVX512VNNI__)
/* 4-bit codes (0..15), and K6's 6-bit ones (0..63) */
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) { return _mm512_dpbusd_epi32(s, w, x4_at(x)); }
/* Q8_0 codes stored + 128: sums that hold 128 * (the activations' sum) too (Q8_OFFSET) */
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) { return _mm512_dpbusd_epi32(s, w, x4_at(x)); }
#define Q8_OFFSET 1
#else
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    __m512i p = _mm512_maddubs_epi16(w, x4_at(x)); /* |pair| <= 2 * 63 * 127: no saturation */
    return _mm512_add_epi32(s, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    __m512i ws = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), xb = x4_at(x); /* signed codes */
    xb = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(ws), _mm512_setzero_si512(), xb);
    __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(ws), xb); /* |pair| <= 2 * 128 * 127 */
    return _mm512_add_epi32(s, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
#define Q8_OFFSET 0
#endif
INLINE ivec isub(ivec s, int32_t v) { return _mm512_sub_epi32(s, _mm512_set1_epi32(v)); }
INLINE ivec itimes256(ivec s) { return _mm512_slli_epi32(s, 8); }
INLINE ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
INLINE vec icvt_scaled(ivec s, float scale) { return _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(scale)); }
INLINE vec vfmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
/* the K kinds' scales: 16 bytes as int32 lanes (unsigned, signed), as float32 */
INLINE ivec iload_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE ivec iload_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE vec icvt(ivec s) { return _mm512_cvtepi32_ps(s); }
INLINE vec vset1(float v) { return _mm512_set1_ps(v); }
