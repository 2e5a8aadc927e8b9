/* The CPU forward's other fused steps (slipstream/models/llama/forward_cpu.py), float32 throughout:
 *   residual add + RMSNorm, rotary + KV-cache write, paged causal attention, SiLU(gate) * up.
 * Each replaces several torch ops (a dozen per layer at a decode step, each ~1-5 us of dispatch for
 * microseconds of arithmetic) and the attention reads keys and values in place through the KV
 * indices instead of gathering them. The same vector types as quant_matmul_cpu.c (16 floats).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef int64_t i64;
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16_u __attribute__((vector_size(64), aligned(4)));

ALWAYS_INLINE v16 ld(const float *p) { return *(const v16_u *)p; }
ALWAYS_INLINE void st(float *p, v16 v) { *(v16_u *)p = v; }
ALWAYS_INLINE v16 splat(float a) { return (v16){0} + a; }

ALWAYS_INLINE float hsum(v16 a) {
    float s = 0.f;
    /* a tree, not a chain of 16 dependent adds */
    v16 b = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    b = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    s = b[0] + b[1];
    return s;
}

ALWAYS_INLINE float hmax(v16 a) {
    float m = a[0];
    for (int l = 1; l < 16; l++) m = a[l] > m ? a[l] : m;
    return m;
}

/* lanes of a where mask (all ones), else of b (C has no vector ?:) */
ALWAYS_INLINE v16 sel(v16i mask, v16 a, v16 b) {
    v16i ia, ib;
    memcpy(&ia, &a, sizeof(a));
    memcpy(&ib, &b, sizeof(b));
    const v16i r = (ia & mask) | (ib & ~mask);
    v16 out;
    memcpy(&out, &r, sizeof(out));
    return out;
}

/* e^x for 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2; p a degree-6 Taylor polynomial
 * (relative error ~2e-7 on that range, about one float32 ulp); underflows to 0 below -87.3. */
ALWAYS_INLINE v16 vexp(v16 x) {
    const v16 hi = splat(88.3762626647949f), lo = splat(-87.3365447505531f);
    const v16i under = x < lo;
    x = sel(under, lo, sel(x > hi, hi, x));
    const v16 half = sel(x < 0, splat(-0.5f), splat(0.5f));
    const v16 n = __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f + half, v16i), v16);
    const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v16 p = splat(1.f / 720);
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const v16i e = ((__builtin_convertvector(n, v16i) + 127) << 23) & ~under;
    v16 scale;
    memcpy(&scale, &e, sizeof(scale));
    return p * scale;
}

/* x += delta (all T rows, when delta is given), then for nrows rows (`rows[i]`, or row i when rows is
 * NULL): out[i] = x[row] / sqrt(mean(x[row]^2) + eps) * w.  H % 16 == 0. */
void sq_add_rms_norm(float *x, const float *delta, const float *w, float eps, float *out, i64 T, i64 H,
                     const i64 *rows, i64 nrows) {
    if (delta)
        for (i64 i = 0; i < T * H; i += 16) st(x + i, ld(x + i) + ld(delta + i));
    for (i64 i = 0; i < nrows; i++) {
        const float *xr = x + (rows ? rows[i] : i) * H;
        v16 a = (v16){0}, b = (v16){0};
        i64 h = 0;
        for (; h + 32 <= H; h += 32) {
            const v16 u = ld(xr + h), v = ld(xr + h + 16);
            a += u * u;
            b += v * v;
        }
        for (; h < H; h += 16) a += ld(xr + h) * ld(xr + h);
        const float inv = 1.f / sqrtf(hsum(a + b) / (float)H + eps);
        for (h = 0; h < H; h += 16) st(out + i * H + h, ld(xr + h) * inv * ld(w + h));
    }
}

/* rotate_half rotary on q [T, Hq, D] (in place) and k [T, Hk, D], then k and v into the caches at
 * kv_idx[t]; rows of q, k and v are ldq, ldk, ldv floats apart (views of a fused projection, or not).
 * cos/sin [positions, D]. D even, D <= 512. */
void sq_rotary_kv(float *q, const float *k, const float *v, i64 ldq, i64 ldk, i64 ldv, const i64 *pos,
                  const float *cos_t, const float *sin_t, float *k_cache, float *v_cache, const i64 *kv_idx, i64 T,
                  i64 Hq, i64 Hk, i64 D) {
    const i64 half = D / 2;
    for (i64 t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (i64 h = 0; h < Hq + Hk; h++) {
            const float *src = h < Hq ? q + t * ldq + h * D : k + t * ldk + (h - Hq) * D;
            float *dst = h < Hq ? q + t * ldq + h * D : k_cache + (kv_idx[t] * Hk + (h - Hq)) * D;
            float tmp[512]; /* D <= 512 */
            i64 d = 0;
            for (; d + 16 <= half; d += 16) {
                const v16 x1 = ld(src + d), x2 = ld(src + half + d);
                st(tmp + d, x1 * ld(c + d) - x2 * ld(s + d));
                st(tmp + half + d, x2 * ld(c + half + d) + x1 * ld(s + half + d));
            }
            for (; d < half; d++) {
                tmp[d] = src[d] * c[d] - src[half + d] * s[d];
                tmp[half + d] = src[half + d] * c[half + d] + src[d] * s[half + d];
            }
            memcpy(dst, tmp, sizeof(float) * D);
        }
        for (i64 h = 0; h < Hk; h++) memcpy(v_cache + (kv_idx[t] * Hk + h) * D, v + t * ldv + h * D, sizeof(float) * D);
    }
}

/* One (query row, kv head): the group's query heads attend to positions [0, n) of the sequence whose
 * pages are `pages` (KV index of position j: pages[j / ps] * ps + j % ps). */
ALWAYS_INLINE void attend(const float *q, const float *k_cache, const float *v_cache, const i64 *pages, i64 ps,
                          i64 n, i64 hk, i64 group, i64 Hk, const int DV, float scale, float *out, float *scores) {
    /* scores[g * n + j] = q_g . k_j * scale */
    float m[16];
    for (i64 g = 0; g < group; g++) m[g] = -INFINITY;
    for (i64 j = 0; j < n; j++) {
        const float *kj = k_cache + ((pages[j / ps] * ps + j % ps) * Hk + hk) * DV * 16;
        v16 kv[8];
        for (int d = 0; d < DV; d++) kv[d] = ld(kj + 16 * d);
        for (i64 g = 0; g < group; g++) {
            const float *qg = q + (hk * group + g) * DV * 16;
            v16 a = kv[0] * ld(qg);
            for (int d = 1; d < DV; d++) a += kv[d] * ld(qg + 16 * d);
            const float sc = hsum(a) * scale;
            scores[g * n + j] = sc;
            m[g] = sc > m[g] ? sc : m[g];
        }
    }
    for (i64 g = 0; g < group; g++) {
        float *sg = scores + g * n;
        v16 sum = (v16){0};
        i64 j = 0;
        for (; j + 16 <= n; j += 16) {
            const v16 e = vexp(ld(sg + j) - m[g]);
            st(sg + j, e);
            sum += e;
        }
        float tail = 0.f;
        for (; j < n; j++) {
            sg[j] = expf(sg[j] - m[g]);
            tail += sg[j];
        }
        const float inv = 1.f / (hsum(sum) + tail);
        v16 acc[8];
        for (int d = 0; d < DV; d++) acc[d] = (v16){0};
        for (j = 0; j < n; j++) {
            const float *vj = v_cache + ((pages[j / ps] * ps + j % ps) * Hk + hk) * DV * 16;
            const float p = sg[j];
            for (int d = 0; d < DV; d++) acc[d] += p * ld(vj + 16 * d);
        }
        float *o = out + (hk * group + g) * DV * 16;
        for (int d = 0; d < DV; d++) st(o + 16 * d, acc[d] * inv);
    }
}

/* Causal attention over a paged KV cache. Sequence s owns query rows [qs[s], qs[s+1]) of q [T, Hq, D]
 * (rows ldq floats apart), the last of its kv_lens[s] positions; its pages are page_table[s * P ..]
 * (page size ps). out [T, Hq, D] (rows Hq * D apart). D % 16 == 0, D <= 128, Hq / Hk <= 16: returns -1
 * otherwise. */
int sq_attention(const float *q, i64 ldq, const float *k_cache, const float *v_cache, const i64 *qs,
                 const i64 *kv_lens, const i64 *page_table, i64 P, i64 ps, i64 S, i64 Hq, i64 Hk, i64 D,
                 float scale, float *out) {
    if (D % 16 || D > 128 || Hq % Hk || Hq / Hk > 16) return -1;
    const i64 group = Hq / Hk, T = qs[S];
    i64 work = 0, L = 0;
    for (i64 s = 0; s < S; s++) {
        work += (qs[s + 1] - qs[s]) * kv_lens[s];
        L = kv_lens[s] > L ? kv_lens[s] : L;
    }
#pragma omp parallel if (work * Hq * D >= (1 << 18))
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * L + 16));
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (i64 t = 0; t < T; t++)
            for (i64 hk = 0; hk < Hk; hk++) {
                i64 s = 0;
                while (qs[s + 1] <= t) s++;
                const i64 n = kv_lens[s] - (qs[s + 1] - t) + 1; /* keys up to the row's own position */
                const float *qt = q + t * ldq;
                float *ot = out + t * Hq * D;
#define DV_CASE(DVV)                                                                                         \
    case DVV: attend(qt, k_cache, v_cache, page_table + s * P, ps, n, hk, group, Hk, DVV, scale, ot, scores); break;
                switch (D / 16) {
                    DV_CASE(1) DV_CASE(2) DV_CASE(3) DV_CASE(4) DV_CASE(5) DV_CASE(6) DV_CASE(7) DV_CASE(8)
                }
#undef DV_CASE
            }
        free(scores);
    }
    return 0;
}

/* out[t, i] = silu(g[t, i]) * u[t, i], rows of g and u ldg and ldu floats apart (halves of one fused
 * projection, or not), out [T, I]; I % 16 == 0 */
void sq_silu_mul(const float *g, i64 ldg, const float *u, i64 ldu, float *out, i64 T, i64 I) {
    for (i64 t = 0; t < T; t++)
        for (i64 i = 0; i < I; i += 16) {
            const v16 a = ld(g + t * ldg + i);
            st(out + t * I + i, a / (1.f + vexp(-a)) * ld(u + t * ldu + i));
        }
}
