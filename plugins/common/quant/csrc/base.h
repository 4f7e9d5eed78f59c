/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the instruction-set macros, the block kinds and float16 reads every room uses. */

#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define IFB_ISA 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define IFB_ISA 256
#else
#define IFB_ISA 0
#endif

#define QK 32 /* weights per block */
#define INLINE static inline __attribute__((always_inline))

#if defined(__F16C__)
#include <immintrin.h> /* _cvtsh_ss */
#endif

/* block kinds; K4, K6 and K5 hold Q4_K, Q6_K and Q5_K / Q5_1 rows decoded at load
 * (ifb_interleave_kquant) */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, K4 = 3, K6 = 4, K5 = 5 };
/* bytes per column and 32-weight block: a group's block is 16 times as many (K4, K6: and per
 * column and 256-weight super-block, SUPER_BYTES more: matmul_layout.h) */
static const long BLOCK_BYTES[6] = {18, 20, 34, 18, 26, 40};
static const long SUPER_BYTES[6] = {0, 0, 0, 4, 2, 0};
#define SUPER 8 /* 32-weight blocks a K-quant super-block */

/* An IEEE float16 (stored little-endian at p) as a float: exact. */
INLINE float half_at(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);            /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);   /* normal */
    } else if (man == 0) {
        bits = sign;                                        /* zero */
    } else {                                                /* subnormal: normalize */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* f as the nearest IEEE float16 (ties to even), as bits: what torch's conversion gives. */
INLINE uint16_t half_of(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    _Float16 h = (_Float16)f;
    uint16_t bits;
    __builtin_memcpy(&bits, &h, sizeof bits);
    return bits;
#endif
}

/* Ask for the cache lines of bytes [p, p + bytes): data the hardware prefetchers do not see coming
 * (the next weight blocks a few steps ahead, KV pages scattered by the block tables). */
INLINE void prefetch_span(const uint8_t *p, long bytes) {
    for (long o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}
