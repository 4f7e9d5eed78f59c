/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the portable primitives of the matmul tiles, for builds with neither AVX2 nor AVX-512. */


#define MAX_R 4
#define MAX_C 1
typedef struct { float v[GROUP]; } vec;
INLINE vec VZERO(void) { vec r = {{0}}; return r; }
INLINE vec vfma_s(vec w, const float *xp, vec acc) {
    for (int c = 0; c < GROUP; c++) acc.v[c] = acc.v[c] + w.v[c] * *xp;
    return acc;
}
#define VFMA(w, xp, acc) vfma_s(w, xp, acc)

INLINE vec halves16(const uint8_t *p) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = half_at(p + 2 * c);
    return r;
}

INLINE int code_byte(const uint8_t *q, int i, int c) { return q[(i / 4) * CHUNK + c * 4 + i % 4]; }

INLINE void q4_pair(const uint8_t *q, int i, vec d, vec m, int centered, vec *lo, vec *hi) {
    for (int c = 0; c < GROUP; c++) {
        int l = code_byte(q, i, c) & 0x0F, h = code_byte(q, i, c) >> 4;
        lo->v[c] = centered ? (float)(l - 8) * d.v[c] : (float)l * d.v[c] + m.v[c];
        hi->v[c] = centered ? (float)(h - 8) * d.v[c] : (float)h * d.v[c] + m.v[c];
    }
}

INLINE vec q8_one(const uint8_t *q, int i, vec d) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (float)(code_byte(q, i, c) - 128) * d.v[c];
    return r;
}

INLINE void store_group(float *y, vec v, long valid) {
    for (long c = 0; c < valid && c < GROUP; c++) y[c] = v.v[c];
}

INLINE vec load_bias(const float *bias, long valid) {
    vec r = {{0}};
    if (bias != NULL)
        for (long c = 0; c < valid && c < GROUP; c++) r.v[c] = bias[c];
    return r;
}

INLINE vec vadd(vec a, vec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] += b.v[c];
    return a;
}
INLINE vec vmul(vec a, vec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] *= b.v[c];
    return a;
}
INLINE vec vload(const float *p) {
    vec v;
    for (int c = 0; c < GROUP; c++) v.v[c] = p[c];
    return v;
}
INLINE void vstore(float *p, vec v) {
    for (int c = 0; c < GROUP; c++) p[c] = v.v[c];
}

INLINE void cpu_relax(void) {}

#define MAX_RQ 4
typedef struct { uint8_t b[CHUNK]; } wvec;
typedef struct { int32_t v[GROUP]; } ivec;
INLINE ivec izero(void) { ivec r = {{0}}; return r; }
INLINE wvec load_chunk(const uint8_t *p) {
    wvec v;
    for (int i = 0; i < CHUNK; i++) v.b[i] = p[i];
    return v;
}
INLINE wvec low_nibbles(wvec v) {
    for (int i = 0; i < CHUNK; i++) v.b[i] &= 0x0F;
    return v;
}
INLINE wvec high_nibbles(wvec v) {
    for (int i = 0; i < CHUNK; i++) v.b[i] >>= 4;
    return v;
}
/* K6's chunk t of 6-bit codes (see the AVX-512 code) */
INLINE wvec k6_chunk(const uint8_t *q, int t) {
    const uint8_t *nib = q + (t % 4) * CHUNK, *plane = q + (4 + t / 4) * CHUNK;
    wvec v;
    for (int i = 0; i < CHUNK; i++)
        v.b[i] = (uint8_t)(((t < 4 ? nib[i] : nib[i] >> 4) & 0x0F) + 16 * ((plane[i] >> (2 * (t % 4))) & 3));
    return v;
}
INLINE ivec dot4_u4(ivec s, wvec w, const int8_t *x) {
    for (int c = 0; c < GROUP; c++)
        for (int j = 0; j < 4; j++) s.v[c] += (int32_t)w.b[4 * c + j] * x[j];
    return s;
}
INLINE ivec dot4_q8(ivec s, wvec w, const int8_t *x) {
    for (int c = 0; c < GROUP; c++)
        for (int j = 0; j < 4; j++) s.v[c] += ((int32_t)w.b[4 * c + j] - 128) * x[j];
    return s;
}
#define Q8_OFFSET 0
INLINE ivec isub(ivec s, int32_t v) {
    for (int c = 0; c < GROUP; c++) s.v[c] -= v;
    return s;
}
INLINE ivec itimes256(ivec s) {
    for (int c = 0; c < GROUP; c++) s.v[c] *= 256;
    return s;
}
INLINE ivec iadd(ivec a, ivec b) {
    for (int c = 0; c < GROUP; c++) a.v[c] += b.v[c];
    return a;
}
INLINE vec icvt_scaled(ivec s, float scale) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (float)s.v[c] * scale;
    return r;
}
INLINE vec vfmadd(vec a, vec b, vec c) {
    for (int i = 0; i < GROUP; i++) c.v[i] = fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
INLINE ivec iload_u8(const uint8_t *p) {
    ivec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = p[c];
    return r;
}
INLINE ivec iload_i8(const uint8_t *p) {
    ivec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (int8_t)p[c];
    return r;
}
INLINE vec icvt(ivec s) {
    vec r;
    for (int c = 0; c < GROUP; c++) r.v[c] = (float)s.v[c];
    return r;
}
INLINE vec vset1(float v) {
    vec r;
    for (int i = 0; i < GROUP; i++) r.v[i] = v;
    return r;
}
