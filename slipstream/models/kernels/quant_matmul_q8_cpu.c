/* Quantized matrix products with int8 activations (the arithmetic llama.cpp's CPU path uses for 4-bit
 * weights): each row of x is rounded to int8 per group of 32 columns (scale max|x| / 127), the weights'
 * integers are multiplied by those with integer dot products, and each group's integer sum is scaled in
 * float. Same operands and weight layout as quant_matmul_cpu.c (u4 only), which multiplies in float.
 *
 * Why: in float every row of x costs one multiply-add per weight per row (the weights are expanded
 * once for up to 8 rows), so a 5-position forward cost 1.8x a one-position one
 * (docs/results/spec-2026-11-27/profile_verify_forward.txt); an AVX512-VNNI `vpdpbusd` does 4 per lane.
 * Integer sums are exact, so a row's result never depends on how many rows share the call (batch
 * invariance for free). Where VNNI + VBMI are missing, a plain C loop computes the same integers, and
 * the float epilogue is the same code: the results are bit for bit the same on every x86 or ARM CPU
 * that compiles this (up to the compiler's float contraction).
 *
 * u4 layout (quant_formats.py): panel p, group g, column c < 16: 16 bytes, byte r = q[16p + r][32g + c]
 * | q[16p + r][32g + 16 + c] << 4. vpdpbusd wants, per 32-bit lane r, 4 consecutive columns of row r:
 * one vpermb turns 4 columns' 64 bytes [c][r] into [r][c].
 */
#if !(defined(__AVX512VNNI__) && defined(__AVX512VBMI__)) && defined(__GNUC__) && !defined(__clang__)
/* The plain loops built without AVX512 by GCC 12 at -O3 gave wrong int8 products for i8 weights in
 * one-row passes (tests/test_twins.py, built with -mno-avx512f); right at -O1 or without the loop
 * vectorizer. Until the cause is known, this file's plain path is not auto-vectorized. */
#pragma GCC optimize("no-tree-vectorize")
#endif
#include <math.h>
#include <string.h>

#include "quant_rounded_cpu.h"
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define Q8_VNNI 1
#endif

/* int32 dot products of a group: lane r = sum over the group's 32 columns of q[r][k] * xq[m][k] */
#ifdef Q8_VNNI
ALWAYS_INLINE void group_dots(const uint8_t *vg, const int8_t *const *xm, const int MB, v16i *t) {
    /* byte r * 4 + j of the result = byte j * 16 + r of 4 columns' 64 bytes */
    const __m512i perm = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43,
                                         27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38,
                                         22, 6, 53, 37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33,
                                         17, 1, 48, 32, 16, 0);
    const __m512i nib = _mm512_set1_epi8(15);
    __m512i lo_acc[MAX_MB], hi_acc[MAX_MB];
    for (int m = 0; m < MB; m++) lo_acc[m] = hi_acc[m] = _mm512_setzero_si512();
    for (int b = 0; b < 4; b++) {
        const __m512i v = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(vg + b * 64));
        const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
        for (int m = 0; m < MB; m++) {
            int32_t xl, xh;
            memcpy(&xl, xm[m] + 4 * b, 4);
            memcpy(&xh, xm[m] + 16 + 4 * b, 4);
            lo_acc[m] = _mm512_dpbusd_epi32(lo_acc[m], lo, _mm512_set1_epi32(xl));
            hi_acc[m] = _mm512_dpbusd_epi32(hi_acc[m], hi, _mm512_set1_epi32(xh));
        }
    }
    for (int m = 0; m < MB; m++) t[m] = (v16i)_mm512_add_epi32(lo_acc[m], hi_acc[m]);
}
#else
ALWAYS_INLINE void group_dots(const uint8_t *vg, const int8_t *const *xm, const int MB, v16i *t) {
    for (int m = 0; m < MB; m++) t[m] = (v16i){0};
    for (int c = 0; c < 16; c++)
        for (int r = 0; r < PANEL; r++) {
            const int byte = vg[c * 16 + r];
            for (int m = 0; m < MB; m++) t[m][r] += (byte & 15) * xm[m][c] + (byte >> 4) * xm[m][16 + c];
        }
}
#endif

/* the same for an i8 panel (int8 weights, [column][16 rows]): lane r = sum over GS columns of
 * w[r][k] * xq[m][k]. vpdpbusd multiplies unsigned by signed bytes, so x comes as xq + 128 and the
 * group's 128 * sum_k w[r][k] is taken off (exact in int32). */
#ifdef Q8_VNNI
ALWAYS_INLINE void group_dots_i8(const int8_t *vg, const int8_t *const *xm, const int MB, const int GS, v16i *t) {
    const __m512i perm = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43,
                                         27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38,
                                         22, 6, 53, 37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33,
                                         17, 1, 48, 32, 16, 0);
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i a0[MAX_MB], a1[MAX_MB], ws = _mm512_setzero_si512();
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm512_setzero_si512();
    for (int b = 0; b < GS / 4; b += 2) {
        const __m512i w0 = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(vg + b * 64));
        const __m512i w1 = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(vg + b * 64 + 64));
        ws = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ws, ones, w0), ones, w1);
        for (int m = 0; m < MB; m++) {
            int32_t x0, x1;
            memcpy(&x0, xm[m] + 4 * b, 4);
            memcpy(&x1, xm[m] + 4 * b + 4, 4);
            a0[m] = _mm512_dpbusd_epi32(a0[m], _mm512_set1_epi32(x0), w0);
            a1[m] = _mm512_dpbusd_epi32(a1[m], _mm512_set1_epi32(x1), w1);
        }
    }
    const __m512i corr = _mm512_slli_epi32(ws, 7);
    for (int m = 0; m < MB; m++) t[m] = (v16i)_mm512_sub_epi32(_mm512_add_epi32(a0[m], a1[m]), corr);
}
#else
ALWAYS_INLINE void group_dots_i8(const int8_t *vg, const int8_t *const *xm, const int MB, const int GS, v16i *t) {
    for (int m = 0; m < MB; m++) t[m] = (v16i){0};
    for (int c = 0; c < GS; c++)
        for (int r = 0; r < PANEL; r++)
            for (int m = 0; m < MB; m++) t[m][r] += vg[c * PANEL + r] * ((int)(uint8_t)xm[m][c] - 128);
}
#endif

/* rows [m0, m0 + MB) of x against panel p; j->xq: [M, K] x rounded to int8 (u4), or that + 128 as uint8
 * (i8: vpdpbusd's unsigned side) */
ALWAYS_INLINE void panel_q8(const rq_t *j, i64 p, i64 m0, const int MB, const int kind, const int GS) {
    const i64 K = j->K, G = K / GS;
    v16 acc[MAX_MB];
    for (int m = 0; m < MB; m++) acc[m] = (v16){0};
    for (i64 g = 0; g < G; g++) {
        const int8_t *xm[MAX_MB];
        for (int m = 0; m < MB; m++) xm[m] = (const int8_t *)j->xq + (m0 + m) * K + g * GS;
        v16i t[MAX_MB];
        if (kind == 0) group_dots(j->q + (p * G + g) * 256, xm, MB, t);
        else group_dots_i8((const int8_t *)j->q + (p * K + g * GS) * PANEL, xm, MB, GS, t);
        add_group(j, p, g, G, m0, MB, t, acc);
    }
    store_panel(j, p, m0, MB, acc);
}

ALWAYS_INLINE void work_q8(const rq_t *j, i64 p0, i64 p1, const int kind, const int GS) {
    for (i64 p = p0; p < p1; p++)
        for (i64 m0 = 0; m0 < j->M; m0 += MAX_MB) {
            const i64 mb = j->M - m0 < MAX_MB ? j->M - m0 : MAX_MB;
            switch (mb) {
#define PASS(MB) case MB: panel_q8(j, p, m0, MB, kind, GS); break;
                PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
            }
        }
}

static void u4_q8(const rq_t *j, i64 p0, i64 p1) { work_q8(j, p0, p1, 0, 32); }
static void i8_32_q8(const rq_t *j, i64 p0, i64 p1) { work_q8(j, p0, p1, 1, 32); }
static void i8_16_q8(const rq_t *j, i64 p0, i64 p1) { work_q8(j, p0, p1, 1, 16); }

/* x[m] per group of gs (16 or 32): xq = round(x / d), d = max|x| / 127 (xq = 0, d = 0 for a group of
 * max|x| < SQ_TINY_GROUP, all-zero included),
 * flipped to xq + 128 (as uint8) with `flip`; xs = sum x */
static void quantize_rows(const float *x, i64 M, i64 K, i64 gs, int flip, int8_t *xq, float *xd, float *xs) {
    const i64 G = K / gs;
    for (i64 m = 0; m < M; m++)
        for (i64 g = 0; g < G; g++) {
            const float *p = x + m * K + g * gs;
            float amax = 0.f, sum = 0.f;
            for (int c = 0; c < gs; c++) {
                const float a = fabsf(p[c]);
                amax = a > amax ? a : amax;
            }
            const v16 s2 = gs == 32 ? ld16(p) + ld16(p + 16) : ld16(p);
            for (int l = 0; l < 16; l++) sum += s2[l];
            const int zero = !(amax >= SQ_TINY_GROUP);
            const float d = zero ? 0.f : amax / 127.f, id = zero ? 0.f : 127.f / amax;
            int8_t *o = xq + m * K + g * gs;
            for (int c = 0; c < gs; c++) { /* nearest, ties to even */
                const int v = (int)__builtin_rintf(p[c] * id);
                o[c] = (int8_t)(flip ? (uint8_t)(v + 128) : v);
            }
            xd[m * G + g] = d;
            xs[m * G + g] = sum;
        }
}

/* returns SQ_OK or SQ_ENOMEM (nothing written) */
static int run_q8(rq_worker fn, const float *x, i64 M, i64 K, i64 gs, int flip, const void *q, const void *scale,
                  const void *offset, int f16, i64 N, float *y, i64 ldy) {
    const i64 G = K / gs;
    int8_t *xq = (int8_t *)sq_malloc((size_t)(M * K));
    float *xd = (float *)sq_malloc(sizeof(float) * (size_t)(2 * M * G));
    int rc = xq && xd ? SQ_OK : SQ_ENOMEM;
    if (rc == SQ_OK) {
        quantize_rows(x, M, K, gs, flip, xq, xd, xd + M * G);
        const rq_t j = {M, K, N, ldy, (const uint8_t *)q, scale, offset, f16, xq, xd, xd + M * G, y};
        run_panels(fn, &j);
    }
    free(xq);
    free(xd);
    return rc;
}

/* y[M, ldy] (first N columns) = x[M, K] @ W^T for a u4 W (offset may be NULL), K % 32 == 0, with x
 * rounded to int8 per group of 32 as above. A row's result does not depend on M. Returns SQ_OK or
 * SQ_ENOMEM. */
int sq_gemm_u4_q8(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16,
                  i64 N, float *y, i64 ldy) {
    return run_q8(u4_q8, x, M, K, 32, 0, q, scale, offset, f16, N, y, ldy);
}

/* the same for an i8 W with groups of gs (16 or 32; else returns SQ_EINVAL), x rounded per group of gs */
int sq_gemm_i8_q8(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16,
                  i64 gs, i64 N, float *y, i64 ldy) {
    if (gs != 16 && gs != 32) return SQ_EINVAL;
    return run_q8(gs == 32 ? i8_32_q8 : i8_16_q8, x, M, K, gs, 1, q, scale, offset, f16, N, y, ldy);
}
