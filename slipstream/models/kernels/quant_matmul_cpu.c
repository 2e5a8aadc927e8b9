/* Quantized matrix products for the CPU: y[M, N] = x[M, K] @ W^T with W kept in a repacked GGUF layout
 * (slipstream/models/kernels/quant_formats.py), never expanded to float in memory.
 *
 * Layout: W's rows in panels of 16; within a panel, for each position along K, the 16 rows' values
 * side by side, so one load gives one vector lane per output row:
 *   u4  panel p, group g (32 columns), j < 16: 16 bytes, byte r = q[16p + r][32g + j]
 *       | q[16p + r][32g + 16 + j] << 4;  w = scale * q + offset, q in [0, 15]     (Q4_0, Q4_1, Q4_K)
 *   i8  panel p, column k: 16 int8, one per row;  w = scale * q (+ offset)        (Q8_0, Q5_x, Q6_K)
 * Scales and offsets: [panel][group][16 rows], float16 or float32 (`f16`); groups of 32 or 16 (i8).
 *
 * The accumulators hold 16 output columns (a panel's rows) each, so no horizontal sums are needed:
 * per group, t[m] += w[k] * x[m][k] over the group's columns, then acc[m] += scale * t[m] +
 * offset * sum_k x[m][k]. Up to 8 rows of x share one decoding of the weights. Written with GCC vector
 * extensions (16 floats: one AVX-512 register, two AVX2 ones, four NEON ones); only the widening of
 * bytes uses intrinsics. Compiled for the machine it runs on (slipstream/models/kernels/cpu_kernels.py,
 * -march=native), parallel over panels with OpenMP, sharing torch's runtime and its thread setting.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_alloc_cpu.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef int64_t i64;
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define PANEL 16
#define MAX_MB 8 /* rows of x per pass over a panel (accumulators: 2 * MAX_MB vectors) */
/* below this many weight elements x rows a call runs on one thread: a fork/join costs more */
#define PARALLEL_MIN 65536

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16_u __attribute__((vector_size(64), aligned(4)));

int sq_abi_version(void) { return 6; }  /* 3: checked allocations (int returns); 4: the attention window; 5: sq_lora_add;
                                           * 6: sq_decoder_forward's LoRA argument */

int sq_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

ALWAYS_INLINE v16 load16(const float *p) { return *(const v16_u *)p; }
ALWAYS_INLINE void store16(float *p, v16 v) { *(v16_u *)p = v; }

/* 16 bytes, zero-extended to 32-bit lanes */
ALWAYS_INLINE v16i widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    union { __m256i h[2]; v16i v; } u;
    u.h[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    u.h[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    return u.v;
#else
    v16i v;
    for (int i = 0; i < 16; i++) v[i] = p[i];
    return v;
#endif
}

/* 16 int8, as floats */
ALWAYS_INLINE v16 widen_i8(const int8_t *p) {
#if defined(__AVX512F__)
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    union { __m256 h[2]; v16 v; } u;
    u.h[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    u.h[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    return u.v;
#else
    v16 v;
    for (int i = 0; i < 16; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* 16 scales (or offsets), float16 or float32 */
ALWAYS_INLINE v16 load_scales(const void *p, i64 i, const int f16) {
    if (!f16) return load16((const float *)p + i);
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
#elif defined(__F16C__)
    union { __m256 h[2]; v16 v; } u;
    u.h[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    u.h[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i + 8)));
    return u.v;
#else
    const _Float16 *h = (const _Float16 *)p + i;
    v16 v;
    for (int l = 0; l < 16; l++) v[l] = (float)h[l];
    return v;
#endif
}

ALWAYS_INLINE float load_scale(const void *p, i64 i, const int f16) {
    return f16 ? (float)((const _Float16 *)p)[i] : ((const float *)p)[i];
}

/* Independent partial sums per row of x within a group: four when few rows give the core little else
 * to overlap with the adds' latency, two (register pressure) otherwise. Their order of summation is
 * fixed, so a pass's result depends only on its number of rows. */
#define CHAINS_MAX 4
#define CHAINS(MB) ((MB) <= 2 ? 4 : 2)

ALWAYS_INLINE v16 chain_sum(const v16 *t, const int n) { return n == 4 ? (t[0] + t[2]) + (t[1] + t[3]) : t[0] + t[1]; }

/* One call's operands. */
typedef struct {
    const float *x; /* [M, K] */
    i64 M, K;
    const void *q, *sc, *of; /* values, scales [P, G, 16], offsets (or NULL) */
    i64 N;                   /* output columns written (rows of W; the last panel may be partial) */
    float *y;                /* [M, ldy] */
    i64 ldy;
    const float *xs; /* [M, G] group sums of x (with offsets) */
    int split;       /* one row of x per pass (a row's result then never depends on M) */
} job_t;

ALWAYS_INLINE void store_panel(const job_t *j, i64 p, i64 m, v16 acc) {
    const i64 n = p * PANEL;
    if (n + PANEL <= j->N) {
        store16(j->y + m * j->ldy + n, acc);
    } else {
        for (i64 r = 0; n + r < j->N; r++) j->y[m * j->ldy + n + r] = acc[r];
    }
}

/* rows [m0, m0 + MB) of x against panel p of a u4 matrix */
ALWAYS_INLINE void u4_panel(const job_t *j, i64 p, i64 m0, const int MB, const int f16) {
    const i64 K = j->K, G = K / 32;
    const uint8_t *v = (const uint8_t *)j->q + p * G * 256;
    v16 acc[MAX_MB];
    for (int m = 0; m < MB; m++) acc[m] = (v16){0};
    for (i64 g = 0; g < G; g++) {
        v16 t[MAX_MB][CHAINS_MAX];
        for (int m = 0; m < MB; m++)
            for (int h = 0; h < CHAINS(MB); h++) t[m][h] = (v16){0};
        const uint8_t *vg = v + g * 256;
        for (int c = 0; c < 16; c += 2) { /* two columns a step: chain indices known at compile time */
            const v16i b0 = widen_u8(vg + c * 16), b1 = widen_u8(vg + c * 16 + 16);
            const v16 lo0 = __builtin_convertvector(b0 & 15, v16), hi0 = __builtin_convertvector(b0 >> 4, v16);
            const v16 lo1 = __builtin_convertvector(b1 & 15, v16), hi1 = __builtin_convertvector(b1 >> 4, v16);
            const int h = CHAINS(MB) == 4 ? 2 : 0; /* low and high halves (and odd columns): separate sums */
            for (int m = 0; m < MB; m++) {
                const float *xm = j->x + (m0 + m) * K + g * 32;
                t[m][0] += lo0 * xm[c];
                t[m][1] += hi0 * xm[16 + c];
                t[m][h] += lo1 * xm[c + 1];
                t[m][h + 1] += hi1 * xm[17 + c];
            }
        }
        const v16 s = load_scales(j->sc, (p * G + g) * PANEL, f16);
        const v16 o = load_scales(j->of, (p * G + g) * PANEL, f16);
        for (int m = 0; m < MB; m++) acc[m] += s * chain_sum(t[m], CHAINS(MB)) + o * j->xs[(m0 + m) * G + g];
    }
    for (int m = 0; m < MB; m++) store_panel(j, p, m0 + m, acc[m]);
}

/* rows [m0, m0 + MB) of x against panel p of an i8 matrix with groups of GS columns */
ALWAYS_INLINE void i8_panel(const job_t *j, i64 p, i64 m0, const int MB, const int GS, const int f16) {
    const i64 K = j->K, G = K / GS;
    const int8_t *v = (const int8_t *)j->q + p * K * PANEL;
    v16 acc[MAX_MB];
    for (int m = 0; m < MB; m++) acc[m] = (v16){0};
    for (i64 g = 0; g < G; g++) {
        v16 t[MAX_MB][CHAINS_MAX];
        for (int m = 0; m < MB; m++)
            for (int h = 0; h < CHAINS(MB); h++) t[m][h] = (v16){0};
        const int8_t *vg = v + g * GS * PANEL;
        for (int c = 0; c < GS; c += CHAINS(MB)) { /* one column per chain a step */
            for (int h = 0; h < CHAINS(MB); h++) {
                const v16 w = widen_i8(vg + (c + h) * PANEL);
                for (int m = 0; m < MB; m++) t[m][h] += w * j->x[(m0 + m) * K + g * GS + c + h];
            }
        }
        const v16 s = load_scales(j->sc, (p * G + g) * PANEL, f16);
        if (j->of) {
            const v16 o = load_scales(j->of, (p * G + g) * PANEL, f16);
            for (int m = 0; m < MB; m++) acc[m] += s * chain_sum(t[m], CHAINS(MB)) + o * j->xs[(m0 + m) * G + g];
        } else {
            for (int m = 0; m < MB; m++) acc[m] += s * chain_sum(t[m], CHAINS(MB));
        }
    }
    for (int m = 0; m < MB; m++) store_panel(j, p, m0 + m, acc[m]);
}

/* panels [p0, p1), every row of x, in passes of up to MAX_MB rows (one row with j->split) */
ALWAYS_INLINE void work(const job_t *j, i64 p0, i64 p1, const int kind, const int GS, const int f16) {
    const i64 step = j->split ? 1 : MAX_MB;
    for (i64 p = p0; p < p1; p++)
        for (i64 m0 = 0; m0 < j->M; m0 += step) {
            const i64 mb = j->M - m0 < step ? j->M - m0 : step;
#define PASS(MB)                                                                                             \
    case MB:                                                                                                 \
        if (kind == 0) u4_panel(j, p, m0, MB, f16);                                                          \
        else i8_panel(j, p, m0, MB, GS, f16);                                                                \
        break;
            switch (mb) {
                PASS(1)
                PASS(2)
                PASS(3)
                PASS(4)
                PASS(5)
                PASS(6)
                PASS(7)
                PASS(8)
            }
#undef PASS
        }
}

typedef void (*worker_fn)(const job_t *, i64, i64);
/* one specialised worker per (container, group size, scale type): no format test in the inner loops */
#define WORKER(NAME, KIND, GS, F16) \
    static void NAME(const job_t *j, i64 p0, i64 p1) { work(j, p0, p1, KIND, GS, F16); }
WORKER(u4_f16, 0, 32, 1)
WORKER(u4_f32, 0, 32, 0)
WORKER(i8_32_f16, 1, 32, 1)
WORKER(i8_32_f32, 1, 32, 0)
WORKER(i8_16_f16, 1, 16, 1)
WORKER(i8_16_f32, 1, 16, 0)

/* returns SQ_OK or SQ_ENOMEM */
static int run(worker_fn fn, job_t *j, i64 gs) {
    const i64 panels = (j->N + PANEL - 1) / PANEL, G = j->K / gs;
    float *xs = NULL;
    if (j->of) { /* sum_k x[m][k] per group: the offsets' share of every output */
        xs = (float *)sq_malloc(sizeof(float) * (size_t)(j->M * G));
        if (!xs) return SQ_ENOMEM;
        for (i64 m = 0; m < j->M; m++)
            for (i64 g = 0; g < G; g++) {
                const float *p = j->x + m * j->K + g * gs;
                v16 a = load16(p);
                for (i64 c = PANEL; c < gs; c += PANEL) a += load16(p + c);
                float s = 0.f;
                for (int l = 0; l < 16; l++) s += a[l];
                xs[m * G + g] = s;
            }
        j->xs = xs;
    }
#ifdef _OPENMP
    if (panels > 1 && j->N * j->K * (j->M < MAX_MB ? j->M : MAX_MB) >= PARALLEL_MIN && omp_get_max_threads() > 1) {
#pragma omp parallel
        {
            const i64 nt = omp_get_num_threads(), id = omp_get_thread_num();
            const i64 per = (panels + nt - 1) / nt;
            const i64 p0 = id * per < panels ? id * per : panels, p1 = p0 + per < panels ? p0 + per : panels;
            fn(j, p0, p1);
        }
        free(xs);
        return SQ_OK;
    }
#endif
    fn(j, 0, panels);
    free(xs);
    return SQ_OK;
}

/* y[M, ldy] (first N columns written) = x[M, K] @ W^T, W u4 with K % 32 == 0.
 * split != 0: one row of x per pass, so a row's result does not depend on M (batch invariance).
 * Returns SQ_OK, or SQ_ENOMEM (nothing written). */
int sq_gemm_u4(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16,
               i64 N, float *y, i64 ldy, int split) {
    job_t j = {x, M, K, q, scale, offset, N, y, ldy, NULL, split};
    return run(f16 ? u4_f16 : u4_f32, &j, 32);
}

/* the same for i8 (offset may be NULL), K % gs == 0; returns SQ_EINVAL for a group size other than 16
 * or 32 */
int sq_gemm_i8(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16,
               i64 gs, i64 N, float *y, i64 ldy, int split) {
    job_t j = {x, M, K, q, scale, offset, N, y, ldy, NULL, split};
    if (gs == 32) return run(f16 ? i8_32_f16 : i8_32_f32, &j, 32);
    if (gs == 16) return run(f16 ? i8_16_f16 : i8_16_f32, &j, 16);
    return SQ_EINVAL;
}

/* out[i, :] = row rows[i] of W as floats (rows == NULL: rows 0 .. nrows-1); kind 0 u4, 1 i8 */
void sq_dequant_rows(int kind, const void *q, const void *scale, const void *offset, int f16, i64 K, i64 gs,
                     const i64 *rows, i64 nrows, float *out) {
    const i64 G = K / gs;
    for (i64 i = 0; i < nrows; i++) {
        const i64 n = rows ? rows[i] : i, p = n / PANEL, r = n % PANEL;
        float *o = out + i * K;
        for (i64 g = 0; g < G; g++) {
            const i64 si = (p * G + g) * PANEL + r;
            const float s = load_scale(scale, si, f16), off = offset ? load_scale(offset, si, f16) : 0.f;
            if (kind == 0) {
                const uint8_t *v = (const uint8_t *)q + (p * G + g) * 256 + r;
                for (int c = 0; c < 16; c++) {
                    o[g * 32 + c] = s * (float)(v[c * 16] & 15) + off;
                    o[g * 32 + 16 + c] = s * (float)(v[c * 16] >> 4) + off;
                }
            } else {
                const int8_t *v = (const int8_t *)q + (p * K + g * gs) * PANEL + r;
                for (int c = 0; c < gs; c++) o[g * gs + c] = s * (float)v[c * PANEL] + off;
            }
        }
    }
}
