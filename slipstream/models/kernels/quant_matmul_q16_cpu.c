/* Quantized matrix products with int16 activations: each row of x is rounded to int16 per group
 * (scale max|x| / 32767, nearest, ties to even), multiplied with the weights' integers by AVX512-VNNI
 * `vpdpwssd` (two int16 products summed into each int32 lane), and each group's integer sum is scaled
 * in float. The middle between quant_matmul_cpu.c (float x: one FMA per weight per row) and
 * quant_matmul_q8_cpu.c (int8 x: four products per lane, but a rounding coarse enough to change greedy
 * output): two products per lane, and a rounding 258 times finer than int8's (32767 / 127).
 *
 * Sums are exact: a group's |sum| <= 32 * 15 * 32767 (u4) or 32 * 128 * 32767 (i8), far below 2^31. So
 * a row's result never depends on how many rows share the call, and the plain C loop used where
 * AVX512-VNNI is missing (or with SQ_Q16_PORTABLE) computes the same integers, then the same float
 * epilogue: bit for bit the same results (tests/test_quant_kernels.py compiles both).
 * The offsets' share (offset * sum of x) takes the exact float x, as the int8 kernels do: only the
 * products with the weights' integers see the rounding.
 *
 * Pairs: vpdpwssd multiplies the 16-bit halves of each lane. Within a group of GS columns, column c
 * pairs with column c + GS / 2: for u4 (quant_formats.py: byte r of column c < 16 holds q[r][c] in its
 * low nibble and q[r][c + 16] in its high one) one byte zero-extended to a lane gives the pair with a
 * shift and a mask; x is stored in the same pairs, lane c = (x[c], x[c + GS / 2]).
 */
#include <math.h>

#include "quant_rounded_cpu.h"
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(SQ_Q16_PORTABLE)
#define Q16_VNNI 1
#endif

/* independent int32 sums per row, to hide vpdpwssd's latency: fewer as more rows give the core other work
 * (and need the registers) */
#define CHAINS(MB) ((MB) <= 2 ? 4 : (MB) <= 5 ? 2 : 1)

/* lane r of t[m] = sum over the group's columns of w[r][k] * x[m][k]; xm[m]: the group's GS / 2 pairs */
#ifdef Q16_VNNI
/* the pairs of columns c and c + GS / 2 of 16 rows, one lane per row */
ALWAYS_INLINE __m512i weight_pairs(const uint8_t *vg, const int c, const int kind, const int GS) {
    if (kind == 0) { /* (byte & 15) | (byte >> 4) << 16 */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vg + c * 16)));
        return _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), _mm512_set1_epi32(0x000F000F));
    }
    const int8_t *v = (const int8_t *)vg; /* sign-extended; low halves from column c, high from c + GS / 2 */
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + c * PANEL)));
    const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(v + (c + GS / 2) * PANEL)));
    return _mm512_mask_blend_epi16(0xAAAAAAAA, lo, _mm512_slli_epi32(hi, 16));
}

ALWAYS_INLINE void group_dots(const uint8_t *vg, const int32_t *const *xm, const int MB, const int kind,
                              const int GS, v16i *t) {
    __m512i a0[MAX_MB], a1[MAX_MB], a2[MAX_MB], a3[MAX_MB]; /* CHAINS(MB) of them in use */
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = a2[m] = a3[m] = _mm512_setzero_si512();
    for (int c = 0; c < GS / 2; c += 4) { /* chain h takes columns c + h; with fewer chains they fold */
        const __m512i w0 = weight_pairs(vg, c, kind, GS), w1 = weight_pairs(vg, c + 1, kind, GS);
        const __m512i w2 = weight_pairs(vg, c + 2, kind, GS), w3 = weight_pairs(vg, c + 3, kind, GS);
        for (int m = 0; m < MB; m++) {
            const int32_t *x = xm[m] + c;
            a0[m] = _mm512_dpwssd_epi32(a0[m], w0, _mm512_set1_epi32(x[0]));
            if (CHAINS(MB) == 1) {
                a0[m] = _mm512_dpwssd_epi32(a0[m], w1, _mm512_set1_epi32(x[1]));
                a0[m] = _mm512_dpwssd_epi32(a0[m], w2, _mm512_set1_epi32(x[2]));
                a0[m] = _mm512_dpwssd_epi32(a0[m], w3, _mm512_set1_epi32(x[3]));
            } else if (CHAINS(MB) == 2) {
                a1[m] = _mm512_dpwssd_epi32(a1[m], w1, _mm512_set1_epi32(x[1]));
                a0[m] = _mm512_dpwssd_epi32(a0[m], w2, _mm512_set1_epi32(x[2]));
                a1[m] = _mm512_dpwssd_epi32(a1[m], w3, _mm512_set1_epi32(x[3]));
            } else {
                a1[m] = _mm512_dpwssd_epi32(a1[m], w1, _mm512_set1_epi32(x[1]));
                a2[m] = _mm512_dpwssd_epi32(a2[m], w2, _mm512_set1_epi32(x[2]));
                a3[m] = _mm512_dpwssd_epi32(a3[m], w3, _mm512_set1_epi32(x[3]));
            }
        }
    }
    for (int m = 0; m < MB; m++)
        t[m] = (v16i)_mm512_add_epi32(_mm512_add_epi32(a0[m], a1[m]), _mm512_add_epi32(a2[m], a3[m]));
}
#else
ALWAYS_INLINE void group_dots(const uint8_t *vg, const int32_t *const *xm, const int MB, const int kind,
                              const int GS, v16i *t) {
    for (int m = 0; m < MB; m++) t[m] = (v16i){0};
    for (int c = 0; c < GS / 2; c++)
        for (int r = 0; r < PANEL; r++) {
            int lo, hi;
            if (kind == 0) lo = vg[c * 16 + r] & 15, hi = vg[c * 16 + r] >> 4;
            else lo = ((const int8_t *)vg)[c * PANEL + r], hi = ((const int8_t *)vg)[(c + GS / 2) * PANEL + r];
            for (int m = 0; m < MB; m++)
                t[m][r] += lo * (int16_t)(xm[m][c] & 0xFFFF) + hi * (int16_t)((uint32_t)xm[m][c] >> 16);
        }
}
#endif

/* rows [m0, m0 + MB) of x against panel p; j->xq: [M, K / 2] pairs of x rounded to int16 (x[c] in the
 * low half, x[c + GS / 2] in the high one) */
ALWAYS_INLINE void panel_q16(const rq_t *j, i64 p, i64 m0, const int MB, const int kind, const int GS) {
    const i64 K = j->K, G = K / GS;
    v16 acc[MAX_MB];
    for (int m = 0; m < MB; m++) acc[m] = (v16){0};
    for (i64 g = 0; g < G; g++) {
        const int32_t *xm[MAX_MB];
        for (int m = 0; m < MB; m++) xm[m] = (const int32_t *)j->xq + (m0 + m) * (K / 2) + g * (GS / 2);
        v16i t[MAX_MB];
        if (kind == 0) group_dots(j->q + (p * G + g) * 256, xm, MB, 0, 32, t);
        else group_dots(j->q + (p * K + g * GS) * PANEL, xm, MB, 1, GS, t);
        add_group(j, p, g, G, m0, MB, t, acc);
    }
    store_panel(j, p, m0, MB, acc);
}

ALWAYS_INLINE void work_q16(const rq_t *j, i64 p0, i64 p1, const int kind, const int GS) {
    for (i64 p = p0; p < p1; p++)
        for (i64 m0 = 0; m0 < j->M; m0 += MAX_MB) {
            const i64 mb = j->M - m0 < MAX_MB ? j->M - m0 : MAX_MB;
            switch (mb) {
#define PASS(MB) case MB: panel_q16(j, p, m0, MB, kind, GS); break;
                PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
#undef PASS
            }
        }
}

static void u4_q16(const rq_t *j, i64 p0, i64 p1) { work_q16(j, p0, p1, 0, 32); }
static void i8_32_q16(const rq_t *j, i64 p0, i64 p1) { work_q16(j, p0, p1, 1, 32); }
static void i8_16_q16(const rq_t *j, i64 p0, i64 p1) { work_q16(j, p0, p1, 1, 16); }

/* x[m] per group of gs (16 or 32): v = rint(x * (32767 / max|x|)), stored as pairs xp[c] = (v[c],
 * v[c + gs / 2]); xd = max|x| / 32767 (v = 0, xd = 0 for a group of max|x| < SQ_TINY_GROUP, all-zero
 * included); xs = sum x */
static void quantize_rows(const float *x, i64 M, i64 K, i64 gs, int32_t *xp, float *xd, float *xs) {
    const i64 G = K / gs;
    for (i64 m = 0; m < M; m++)
        for (i64 g = 0; g < G; g++) {
            const float *p = x + m * K + g * gs;
            float amax = 0.f, sum = 0.f;
            for (int c = 0; c < gs; c++) {
                const float a = fabsf(p[c]);
                amax = a > amax ? a : amax;
                sum += p[c];
            }
            const int zero = !(amax >= SQ_TINY_GROUP);
            const float id = zero ? 0.f : 32767.f / amax;
            int32_t *o = xp + m * (K / 2) + g * (gs / 2);
            for (int c = 0; c < gs / 2; c++) {
                const int lo = (int)__builtin_rintf(p[c] * id), hi = (int)__builtin_rintf(p[c + gs / 2] * id);
                o[c] = (int32_t)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16);
            }
            xd[m * G + g] = zero ? 0.f : amax / 32767.f;
            xs[m * G + g] = sum;
        }
}

/* returns SQ_OK or SQ_ENOMEM (nothing written) */
static int run_q16(rq_worker fn, const float *x, i64 M, i64 K, i64 gs, const void *q, const void *scale,
                   const void *offset, int f16, i64 N, float *y, i64 ldy) {
    const i64 G = K / gs;
    int32_t *xp = (int32_t *)sq_malloc(sizeof(int32_t) * (size_t)(M * K / 2));
    float *xd = (float *)sq_malloc(sizeof(float) * (size_t)(2 * M * G));
    int rc = xp && xd ? SQ_OK : SQ_ENOMEM;
    if (rc == SQ_OK) {
        quantize_rows(x, M, K, gs, xp, xd, xd + M * G);
        const rq_t j = {M, K, N, ldy, (const uint8_t *)q, scale, offset, f16, xp, xd, xd + M * G, y};
        run_panels(fn, &j);
    }
    free(xp);
    free(xd);
    return rc;
}

/* y[M, ldy] (first N columns) = x[M, K] @ W^T for a u4 W (offset may be NULL), K % 32 == 0, with x
 * rounded to int16 per group of 32 as above. A row's result does not depend on M. Returns SQ_OK or
 * SQ_ENOMEM. */
int sq_gemm_u4_q16(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16,
                   i64 N, float *y, i64 ldy) {
    return run_q16(u4_q16, x, M, K, 32, q, scale, offset, f16, N, y, ldy);
}

/* the same for an i8 W with groups of gs (16 or 32; else returns SQ_EINVAL), x rounded per group of gs */
int sq_gemm_i8_q16(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16,
                   i64 gs, i64 N, float *y, i64 ldy) {
    if (gs != 16 && gs != 32) return SQ_EINVAL;
    return run_q16(gs == 32 ? i8_32_q16 : i8_16_q16, x, M, K, gs, q, scale, offset, f16, N, y, ldy);
}

/* 1 where this build multiplies with vpdpwssd, 0 where the plain C loop does */
int sq_q16_vnni(void) {
#ifdef Q16_VNNI
    return 1;
#else
    return 0;
#endif
}
