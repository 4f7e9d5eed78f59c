/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the AVX2 vector primitives of the matmul tiles (float32 and integer). */


/* AVX2 has 8 lanes: a "vector" of 16 columns is two registers. */
#define MAX_R 4 /* 4 x 2 accumulators + 4 weight registers + a broadcast, of 16 */
#define MAX_C 1
typedef struct { __m256 a, b; } vec;
INLINE vec VZERO(void) { vec v = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return v; }
INLINE vec vfma(vec w, const float *xp, vec acc) {
    __m256 x = _mm256_broadcast_ss(xp);
    vec r = {_mm256_fmadd_ps(w.a, x, acc.a), _mm256_fmadd_ps(w.b, x, acc.b)};
    return r;
}
#define VFMA(w, xp, acc) vfma(w, xp, acc)

INLINE vec halves16(const uint8_t *p) {
    vec v = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
    return v;
}

/* Code byte i (0..255) of columns 0-7 (*a) and 8-15 (*b). */
INLINE void code_bytes(const uint8_t *q, int i, __m256i *a, __m256i *b) {
    const uint8_t *p = q + (i / 4) * CHUNK;
    __m256i mask = _mm256_set1_epi32(0xFF);
    *a = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)p), 8 * (i % 4)), mask);
    *b = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(p + 32)), 8 * (i % 4)), mask);
}

INLINE __m256 q4_half(__m256i c, __m256 d, __m256 m, int centered, int high) {
    c = high ? _mm256_srli_epi32(c, 4) : _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    if (centered) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(8))), d);
    return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), d), m);
}

INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    __m256i b0, b1;
    code_bytes(q, i, &b0, &b1);
    lo->a = q4_half(b0, d.a, m.a, centered, 0);
    lo->b = q4_half(b1, d.b, m.b, centered, 0);
    hi->a = q4_half(b0, d.a, m.a, centered, 1);
    hi->b = q4_half(b1, d.b, m.b, centered, 1);
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    __m256i a, b, off = _mm256_set1_epi32(128);
    code_bytes(q, i, &a, &b);
    vec v = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a, off)), d.a),
             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(b, off)), d.b)};
    return v;
}

INLINE void store_group(float *y, vec v, long valid) {
    if (valid >= GROUP) {
        _mm256_storeu_ps(y, v.a);
        _mm256_storeu_ps(y + 8, v.b);
        return;
    }
    float tmp[GROUP];
    _mm256_storeu_ps(tmp, v.a);
    _mm256_storeu_ps(tmp + 8, v.b);
    for (long c = 0; c < valid; c++) y[c] = tmp[c];
}

INLINE vec load_bias(const float *bias, long valid) {
    float tmp[GROUP] = {0};
    if (bias != NULL)
        for (long c = 0; c < valid && c < GROUP; c++) tmp[c] = bias[c];
    vec v = {_mm256_loadu_ps(tmp), _mm256_loadu_ps(tmp + 8)};
    return v;
}

INLINE vec vadd(vec a, vec b) {
    vec r = {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)};
    return r;
}
INLINE vec vmul(vec a, vec b) {
    vec r = {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)};
    return r;
}
INLINE vec vload(const float *p) {
    vec v = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    return v;
}
INLINE void vstore(float *p, vec v) {
    _mm256_storeu_ps(p, v.a);
    _mm256_storeu_ps(p + 8, v.b);
}

INLINE void cpu_relax(void) { _mm_pause(); }

/* int8 activations (see the AVX-512 code): maddubs / madd in place of VNNI. */
#define MAX_RQ 2
typedef struct { __m256i a, b; } wvec;
typedef wvec ivec;
INLINE ivec izero(void) { ivec v = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return v; }
INLINE wvec load_chunk(const uint8_t *p) {
    wvec v = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
    return v;
}
INLINE wvec low_nibbles(wvec v) {
    __m256i m = _mm256_set1_epi8(0x0F);
    wvec r = {_mm256_and_si256(v.a, m), _mm256_and_si256(v.b, m)};
    return r;
}
INLINE wvec high_nibbles(wvec v) {
    __m256i m = _mm256_set1_epi8(0x0F);
    wvec r = {_mm256_and_si256(_mm256_srli_epi16(v.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.b, 4), m)};
    return r;
}
/* K6's chunk t of 6-bit codes (see the AVX-512 code) */
INLINE __m256i k6_half(__m256i nib, __m256i plane, int t) {
    int u = t % 4;
    __m256i top = u == 0 ? _mm256_slli_epi16(plane, 4) : u == 1 ? _mm256_slli_epi16(plane, 2)
                : u == 2 ? plane : _mm256_srli_epi16(plane, 2);
    __m256i low = t < 4 ? nib : _mm256_srli_epi16(nib, 4);
    low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
}
INLINE wvec k6_chunk(const uint8_t *q, int t) {
    wvec nib = load_chunk(q + (t % 4) * CHUNK), plane = load_chunk(q + (4 + t / 4) * CHUNK);
    wvec r = {k6_half(nib.a, plane.a, t), k6_half(nib.b, plane.b, t)};
    return r;
}
INLINE __m256i x4_at(const int8_t *x) {
    int32_t v;
    __builtin_memcpy(&v, x, 4);
    return _mm256_set1_epi32(v);
}
INLINE __m256i madd_pairs(__m256i u, __m256i sx) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, sx), _mm256_set1_epi16(1)); }
/* 4-bit codes (0..15), and K6's 6-bit ones (0..63: |pair| <= 2 * 63 * 127, no saturation) */
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    __m256i xb = x4_at(x);
    ivec r = {_mm256_add_epi32(s.a, madd_pairs(w.a, xb)), _mm256_add_epi32(s.b, madd_pairs(w.b, xb))};
    return r;
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    __m256i xb = x4_at(x), flip = _mm256_set1_epi8((char)0x80);
    __m256i wa = _mm256_xor_si256(w.a, flip), wb = _mm256_xor_si256(w.b, flip); /* signed codes */
    ivec r = {_mm256_add_epi32(s.a, madd_pairs(_mm256_abs_epi8(wa), _mm256_sign_epi8(xb, wa))),
              _mm256_add_epi32(s.b, madd_pairs(_mm256_abs_epi8(wb), _mm256_sign_epi8(xb, wb)))};
    return r;
}
#define Q8_OFFSET 0
INLINE ivec isub(ivec s, int32_t v) {
    __m256i b = _mm256_set1_epi32(v);
    ivec r = {_mm256_sub_epi32(s.a, b), _mm256_sub_epi32(s.b, b)};
    return r;
}
INLINE ivec iadd(ivec a, ivec b) {
    ivec r = {_mm256_add_epi32(a.a, b.a), _mm256_add_epi32(a.b, b.b)};
    return r;
}
INLINE ivec itimes256(ivec s) {
    ivec r = {_mm256_slli_epi32(s.a, 8), _mm256_slli_epi32(s.b, 8)};
    return r;
}
INLINE vec icvt_scaled(ivec s, float scale) {
    __m256 f = _mm256_set1_ps(scale);
    vec r = {_mm256_mul_ps(_mm256_cvtepi32_ps(s.a), f), _mm256_mul_ps(_mm256_cvtepi32_ps(s.b), f)};
    return r;
}
INLINE vec vfmadd(vec a, vec b, vec c) {
    vec r = {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)};
    return r;
}
INLINE ivec iload_u8(const uint8_t *p) {
    ivec r = {_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
              _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    return r;
}
INLINE ivec iload_i8(const uint8_t *p) {
    ivec r = {_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
              _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
    return r;
}
INLINE vec icvt(ivec s) {
    vec r = {_mm256_cvtepi32_ps(s.a), _mm256_cvtepi32_ps(s.b)};
    return r;
}
INLINE vec vset1(float v) {
    vec r = {_mm256_set1_ps(v), _mm256_set1_ps(v)};
    return r;
}
