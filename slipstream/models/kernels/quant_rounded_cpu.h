/* What the quantized products with rounded activations share (quant_matmul_q8_cpu.c: int8,
 * quant_matmul_q16_cpu.c: int16): their operands, the float epilogue of a group's integer sums, the
 * store of a panel's outputs and the split of the panels among OpenMP threads. Each kernel rounds x
 * its own way and computes the integer sums; from there on the arithmetic is this file's, so the two
 * differ only in how finely x was rounded. (cpu_kernels.py hashes this header with the sources.)
 */
#ifndef SQ_QUANT_ROUNDED_CPU_H
#define SQ_QUANT_ROUNDED_CPU_H
#include <stdint.h>
#include <stdlib.h>

#include "kernel_alloc_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int64_t i64;
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define PANEL 16
#define MAX_MB 8
#define PARALLEL_MIN 65536
/* A group whose max |x| is below this (zero, denormal or tiny) rounds to all zeros with scale 0:
 * 32767 / max|x| would overflow to inf below ~9.6e-35 (127 / max|x| below ~3.7e-37), and rounding
 * inf to an int is undefined; max|x| / 32767 would leave float32's normals. 2^-111 keeps both
 * finite and normal for either kernel; such activations are ~1e-34 of any normal one. */
#define SQ_TINY_GROUP 0x1p-111f

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16_u __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE v16 ld16(const float *p) { return *(const v16_u *)p; }

ALWAYS_INLINE v16 scales16(const void *p, i64 i, const int f16) {
    v16 v;
#if defined(__AVX512F__)
    if (f16) return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
#endif
    if (f16) {
        const _Float16 *h = (const _Float16 *)p + i;
        for (int l = 0; l < 16; l++) v[l] = (float)h[l];
    } else {
        v = ld16((const float *)p + i);
    }
    return v;
}

typedef struct {
    i64 M, K, N, ldy;
    const uint8_t *q;
    const void *sc, *of;
    int f16;
    const void *xq;  /* x rounded, in the kernel's own layout */
    const float *xd; /* [M, G] the rounding's scales */
    const float *xs; /* [M, G] exact group sums of x (the offsets' share) */
    float *y;
} rq_t;

/* acc[m] += group g's integer sums t[m] (lane r: output row 16p + r) scaled by the weights' and x's
 * scales, plus the offsets times the sum of x */
ALWAYS_INLINE void add_group(const rq_t *j, i64 p, i64 g, i64 G, i64 m0, const int MB, const v16i *t, v16 *acc) {
    const v16 s = scales16(j->sc, (p * G + g) * PANEL, j->f16);
    const v16 o = j->of ? scales16(j->of, (p * G + g) * PANEL, j->f16) : (v16){0};
    for (int m = 0; m < MB; m++) {
        const i64 mg = (m0 + m) * G + g;
        acc[m] += (s * j->xd[mg]) * __builtin_convertvector(t[m], v16) + o * j->xs[mg];
    }
}

ALWAYS_INLINE void store_panel(const rq_t *j, i64 p, i64 m0, const int MB, const v16 *acc) {
    const i64 n = p * PANEL;
    for (int m = 0; m < MB; m++) {
        float *ym = j->y + (m0 + m) * j->ldy + n;
        if (n + PANEL <= j->N) *(v16_u *)ym = acc[m];
        else
            for (i64 r = 0; n + r < j->N; r++) ym[r] = acc[m][r];
    }
}

typedef void (*rq_worker)(const rq_t *, i64, i64);

/* fn over every panel: on OpenMP's threads, each a contiguous range, when the call is large enough */
static inline void run_panels(rq_worker fn, const rq_t *j) {
    const i64 panels = (j->N + PANEL - 1) / PANEL;
#ifdef _OPENMP
    if (panels > 1 && j->N * j->K * (j->M < MAX_MB ? j->M : MAX_MB) >= PARALLEL_MIN && omp_get_max_threads() > 1) {
#pragma omp parallel
        {
            const i64 nt = omp_get_num_threads(), id = omp_get_thread_num();
            const i64 per = (panels + nt - 1) / nt;
            const i64 p0 = id * per < panels ? id * per : panels, p1 = p0 + per < panels ? p0 + per : panels;
            fn(j, p0, p1);
        }
        return;
    }
#endif
    fn(j, 0, panels);
}
#endif
