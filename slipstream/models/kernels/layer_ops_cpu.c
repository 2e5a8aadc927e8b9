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

#include "kernel_alloc_cpu.h"
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

/* lane j of the result = the sum of a[j]'s lanes: 16 horizontal sums as one tree of 30 shuffles and 15 adds
 * (each pair of inputs halved together), where 16 separate sums would take 48 shuffles and 16 extractions */
ALWAYS_INLINE v16 hsum16(const v16 *a) {
    v16 r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; i++)
        r8[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r4[i] = __builtin_shufflevector(r8[2 * i], r8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(r8[2 * i], r8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r2[i] = __builtin_shufflevector(r4[2 * i], r4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                __builtin_shufflevector(r4[2 * i], r4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(r2[0], r2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(r2[0], r2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

ALWAYS_INLINE float hmax16(v16 a) {
    v16 b = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a = sel(a > b, a, b);
    b = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a = sel(a > b, a, b);
    b = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    a = sel(a > b, a, b);
    return a[0] > a[1] ? a[0] : a[1];
}

#define KEYS 16 /* keys per block: one score vector per query row */
#define TILE 8  /* query positions of one sequence per work item */

/* One work item: query positions [t0, t0 + nt) of one sequence (pages `pages`, page size ps; KV index of
 * position j: pages[j / ps] * ps + j % ps), the query heads over kv heads [hk0, hk0 + nh), position
 * t0 + i seeing keys [0, n0 + i), or with a sliding window W > 0 keys [n0 + i - W, n0 + i). Every K and V vector of a block of KEYS keys is loaded once for all
 * the item's rows (from L1 after the first). Softmax is online (flash-style), block by block; the
 * blocks start at key 0 whatever the item, so a row's result depends on its own query and keys only:
 * not on the other rows of the call, nor on TILE, nh or the thread count (a window only skips
 * the blocks wholly before a row's first key, and masks the lanes before it). Scratch per row: acc [D],
 * ls and sc [16], mx and cf [1]. */
ALWAYS_INLINE void attend(const float *q, i64 ldq, const float *k_cache, const float *v_cache, const i64 *pages,
                          i64 ps, i64 n0, i64 nt, i64 hk0, i64 nh, i64 group, i64 Hk, const int DV, float scale,
                          i64 window, float *out, i64 ldo, float *acc, float *mx, float *ls, float *sc, float *cf) {
    const i64 heads = nh * group, rows = nt * heads, stride = Hk * DV * 16, nmax = n0 + nt - 1;
    const float *kb = k_cache + hk0 * DV * 16, *vb = v_cache + hk0 * DV * 16;
    for (i64 r = 0; r < rows; r++) {
        mx[r] = -INFINITY;
        st(ls + 16 * r, (v16){0});
        for (int d = 0; d < DV; d++) st(acc + (r * DV + d) * 16, (v16){0});
    }
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    /* row i's first key: lo(i) = n0 + i - window (>= 0), rising with i; the first block is the one
     * holding row 0's, on the grid of KEYS from key 0 */
    const i64 lo0 = window > 0 && n0 - window > 0 ? n0 - window : 0, start = lo0 / KEYS * KEYS;
    i64 page = start / ps, off = start % ps; /* of key j0 */
    for (i64 j0 = start; j0 < nmax; j0 += KEYS) {
        const float *kp[KEYS], *vp[KEYS];
        const i64 nb = nmax - j0 < KEYS ? nmax - j0 : KEYS;
        for (int j = 0; j < KEYS; j++) {
            const i64 slot = j < nb ? pages[page] * ps + off : pages[0] * ps; /* past the end: any valid key, masked */
            kp[j] = kb + slot * stride;
            vp[j] = vb + slot * stride;
            if (j < nb && ++off == ps) {
                off = 0;
                page++;
            }
        }
        /* the next block's keys towards L1 while this one computes: the scores pass would otherwise
         * wait on memory at each kv head's first row (a forward's weights evict K and V between layers).
         * Keys only: prefetching V too, or further ahead, measured slower */
        for (i64 j = 0, pg = page, of = off; j < KEYS && j0 + KEYS + j < nmax; j++) {
            const float *kn = kb + (pages[pg] * ps + of) * stride;
            for (int d = 0; d < nh * DV; d++) __builtin_prefetch(kn + 16 * d);
            if (++of == ps) {
                of = 0;
                pg++;
            }
        }
        /* rows whose causal bound falls before this block are done: they are the first `skip` */
        const i64 skip = j0 - n0 + 1 > 0 ? j0 - n0 + 1 : 0;
        /* rows whose window starts past this block have not begun: they are the rows from `end` on */
        i64 end = nt;
        if (window > 0 && j0 + KEYS + window - n0 < nt) end = j0 + KEYS + window - n0;
        /* three passes over the rows, each row's chain independent of the others' (the core overlaps
         * them): scores, then the online-softmax update, then the values */
        for (i64 i = skip; i < end; i++) {
            const i64 valid = n0 + i - j0; /* keys of this block the row sees (causal) */
            const i64 first = window > 0 ? n0 + i - window - j0 : 0; /* and the window's first */
            const v16i keep = (lane < (int)(valid < KEYS ? valid : KEYS)) & (lane >= (int)(first > 0 ? first : 0));
            for (i64 h = 0; h < heads; h++) {
                const float *qr = q + i * ldq + (hk0 * group + h) * DV * 16;
                const i64 kvo = h / group * DV * 16;
                v16 qv[8], a[KEYS];
                for (int d = 0; d < DV; d++) qv[d] = ld(qr + 16 * d);
                for (int j = 0; j < KEYS; j++) {
                    a[j] = ld(kp[j] + kvo) * qv[0];
                    for (int d = 1; d < DV; d++) a[j] += ld(kp[j] + kvo + 16 * d) * qv[d];
                }
                st(sc + 16 * (i * heads + h), sel(keep, hsum16(a) * scale, splat(-INFINITY)));
            }
        }
        for (i64 r = skip * heads; r < end * heads; r++) {
            const v16 s = ld(sc + 16 * r);
            const float bm = hmax16(s), m = bm > mx[r] ? bm : mx[r];
            const float c = expf(mx[r] - m); /* rescales what was summed under the old max (0 at first) */
            mx[r] = m;
            cf[r] = c;
            const v16 p = vexp(s - m); /* masked lanes: exp(-inf) = 0 */
            st(ls + 16 * r, ld(ls + 16 * r) * c + p);
            st(sc + 16 * r, p);
        }
        for (i64 i = skip; i < end; i++) {
            const i64 valid = n0 + i - j0;
            const int nv = (int)(valid < KEYS ? valid : KEYS); /* (lanes before the window: p = 0) */
            for (i64 h = 0; h < heads; h++) {
                const i64 r = i * heads + h, kvo = h / group * DV * 16;
                const float *pj = sc + 16 * r;
                float *ar = acc + r * DV * 16;
                v16 o0[8], o1[8]; /* two chains of multiply-adds, even and odd keys */
                for (int d = 0; d < DV; d++) {
                    o0[d] = ld(ar + 16 * d) * cf[r];
                    o1[d] = (v16){0};
                }
                int j = 0;
                for (; j + 1 < nv; j += 2)
                    for (int d = 0; d < DV; d++) {
                        o0[d] += pj[j] * ld(vp[j] + kvo + 16 * d);
                        o1[d] += pj[j + 1] * ld(vp[j + 1] + kvo + 16 * d);
                    }
                if (j < nv)
                    for (int d = 0; d < DV; d++) o0[d] += pj[j] * ld(vp[j] + kvo + 16 * d);
                for (int d = 0; d < DV; d++) st(ar + 16 * d, o0[d] + o1[d]);
            }
        }
    }
    for (i64 i = 0; i < nt; i++)
        for (i64 h = 0; h < heads; h++) {
            const i64 r = i * heads + h;
            const float inv = 1.f / hsum(ld(ls + 16 * r));
            float *o = out + i * ldo + (hk0 * group + h) * DV * 16;
            for (int d = 0; d < DV; d++) st(o + 16 * d, ld(acc + (r * DV + d) * 16) * inv);
        }
}

/* Causal attention over a paged KV cache, windowed when window > 0 (position p sees keys (p - window, p]). Sequence s owns query rows [qs[s], qs[s+1]) of q [T, Hq, D]
 * (rows ldq floats apart), the last of its kv_lens[s] positions; its pages are page_table[s * P ..]
 * (page size ps). out [T, Hq, D] (rows Hq * D apart). D % 16 == 0, D <= 128, Hq / Hk <= 16: returns
 * SQ_EINVAL otherwise; SQ_ENOMEM (out partly written) where scratch memory could not be had. Work items are TILE query positions of a sequence with all kv heads, or one kv head where
 * threads would otherwise go idle; the longest first. At several query positions (verification of k
 * drafts, prefill) each K and V vector is read once per item instead of once per position, and 16
 * scores share one tree of sums; at one position (decode) it is no faster than the per-(row, kv head)
 * kernel before it, and slower where decoding sequences stream K and V from memory
 * (tools/bench/bench_attention_cpu.py; docs/benchmarks.md). */
int sq_attention(const float *q, i64 ldq, const float *k_cache, const float *v_cache, const i64 *qs,
                 const i64 *kv_lens, const i64 *page_table, i64 P, i64 ps, i64 S, i64 Hq, i64 Hk, i64 D,
                 float scale, i64 window, float *out) {
    if (D % 16 || D > 128 || Hq % Hk || Hq / Hk > 16) return SQ_EINVAL;
    const i64 group = Hq / Hk;
    i64 work = 0, tiles = 0;
    for (i64 s = 0; s < S; s++) {
        work += (qs[s + 1] - qs[s]) * (window > 0 && window < kv_lens[s] ? window : kv_lens[s]);
        tiles += (qs[s + 1] - qs[s] + TILE - 1) / TILE;
    }
    if (tiles == 0) return SQ_OK;
    i64 *tile_s = (i64 *)sq_malloc(sizeof(i64) * (size_t)(2 * tiles));
    if (!tile_s) return SQ_ENOMEM;
    i64 *tile_t = tile_s + tiles;
    int failed = 0; /* a thread without its scratch: its items are skipped, the call fails */
    for (i64 s = 0, k = 0; s < S; s++)
        for (i64 t = qs[s]; t < qs[s + 1]; t += TILE, k++) {
            tile_s[k] = s;
            tile_t[k] = t;
        }
#pragma omp parallel if (work * Hq * D >= (1 << 18))
    {
#ifdef _OPENMP
        const i64 threads = omp_get_num_threads();
#else
        const i64 threads = 1;
#endif
        /* all kv heads in one item where there are items enough: a block's keys are then whole records
         * of the cache ([Hk, D] each), one stream for the hardware prefetchers instead of Hk strided
         * ones */
        const i64 nh = threads == 1 || tiles >= 4 * threads ? Hk : 1, items = tiles * (Hk / nh);
        const size_t rows = (size_t)(TILE * group * nh);
        float *acc = (float *)sq_malloc(sizeof(float) * rows * (size_t)(D + 34)), *ls = NULL, *sc = NULL,
              *mx = NULL, *cf = NULL;
        if (acc) {
            ls = acc + rows * (size_t)D, sc = ls + rows * 16, mx = sc + rows * 16, cf = mx + rows;
        } else {
            __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        }
#pragma omp for schedule(dynamic, 1)
        for (i64 w = 0; w < items; w++) {
            if (!acc) continue; /* (every thread meets the loop: its items go to no one) */
            const i64 k = tiles - 1 - w / (Hk / nh), hk0 = w % (Hk / nh) * nh, s = tile_s[k], t0 = tile_t[k];
            const i64 nt = qs[s + 1] - t0 < TILE ? qs[s + 1] - t0 : TILE;
            const i64 n0 = kv_lens[s] - (qs[s + 1] - t0) + 1; /* keys up to the first row's own position */
            const float *qt = q + t0 * ldq;
            float *ot = out + t0 * Hq * D;
#define DV_CASE(DVV)                                                                                           \
    case DVV:                                                                                                  \
        attend(qt, ldq, k_cache, v_cache, page_table + s * P, ps, n0, nt, hk0, nh, group, Hk, DVV, scale,      \
               window, ot, Hq * D, acc, mx, ls, sc, cf);                                                       \
        break;
            switch (D / 16) {
                DV_CASE(1) DV_CASE(2) DV_CASE(3) DV_CASE(4) DV_CASE(5) DV_CASE(6) DV_CASE(7) DV_CASE(8)
            }
#undef DV_CASE
        }
        free(acc);
    }
    free(tile_s);
    return failed ? SQ_ENOMEM : SQ_OK;
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

/* dot product of n floats (any n: 16 lanes, then the tail) */
ALWAYS_INLINE float dotn(const float *a, const float *b, i64 n) {
    v16 acc = splat(0.f);
    i64 i = 0;
    for (; i + 16 <= n; i += 16) acc += ld(a + i) * ld(b + i);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* LoRA deltas of one input group of one layer (models/lora.py, LoraGroups.add_cpu), the step's
 * tokens sorted by adapter: segment g holds tokens tok[seg[g] .. seg[g+1]) of one adapter, whose
 * record for this layer and group is rec + g * rec_stride, LORA_REC longs:
 *   [A (float *, [r_total, n_in]), r_total, n_b, then n_b times (B^T (float *, [hi - lo, n_out_j]), lo, hi, j)]
 * and out_j[tok] += (A x[tok])[lo:hi] B^T for each of its n_b targets, j the target's place in the group
 * (outs[j]: rows lds[j] floats apart, nouts[j] wide). mid: scratch, a row of rmax floats per sorted token.
 * Shrink: per adapter, its rows of A shared out among threads (a dot product per token of its segment);
 * expand: per adapter and target, blocks of LORA_BW output columns shared out, each summed over the
 * rank in registers (rows of B^T added along the output, no horizontal sums) and added once.
 * Both walk one adapter's matrices front to back: the hardware prefetcher streams them, where a walk
 * across every adapter at once for each block of columns took ~2x the time of their bytes at one
 * core's bandwidth (gate/up, 1536 wide). No two threads touch one value, and each is a fixed-order sum
 * of its own token's inputs, whatever the batch or the thread count. A null A: not adapted. */
#define LORA_REC 15
#if defined(__AVX512F__)
#define LORA_VB 8 /* output vectors per expand block: its accumulators stay in registers */
#else
#define LORA_VB 4
#endif
#define LORA_BW (16 * LORA_VB)

/* y[0 .. 16 * nv) += sum over k < n of m[k] * bt[k * ldb + ...], nv <= LORA_VB */
ALWAYS_INLINE void lora_expand_block(const float *m, const float *bt, i64 ldb, i64 n, i64 nv, float *y) {
    v16 acc[LORA_VB];
    if (nv == LORA_VB) {
#pragma GCC unroll 8
        for (i64 v = 0; v < LORA_VB; v++) acc[v] = splat(0.f);
        for (i64 k = 0; k < n; k++) {
            const v16 mk = splat(m[k]);
            const float *row = bt + k * ldb;
#pragma GCC unroll 8
            for (i64 v = 0; v < LORA_VB; v++) acc[v] += mk * ld(row + 16 * v);
        }
#pragma GCC unroll 8
        for (i64 v = 0; v < LORA_VB; v++) st(y + 16 * v, ld(y + 16 * v) + acc[v]);
        return;
    }
    for (i64 v = 0; v < nv; v++) {
        v16 a = splat(0.f);
        for (i64 k = 0; k < n; k++) a += splat(m[k]) * ld(bt + k * ldb + 16 * v);
        st(y + 16 * v, ld(y + 16 * v) + a);
    }
}

int sq_lora_add(const float *x, i64 ldx, i64 n_in, const i64 *tok, const i64 *seg, i64 G, const i64 *rec,
                i64 rec_stride, float *mid, i64 rmax, float *const *outs, const i64 *lds, const i64 *nouts) {
    for (i64 g = 0; g < G; g++) {
        const i64 *r = rec + g * rec_stride;
        if (r[1] > rmax || r[2] > 3) return SQ_EINVAL;
        for (i64 b = 0; b < r[2]; b++) {
            const i64 *e = r + 3 + 4 * b;
            if (e[1] < 0 || e[2] > r[1] || e[1] > e[2] || e[3] < 0 || e[3] > 2) return SQ_EINVAL;
        }
    }
#pragma omp parallel
    {
        for (i64 g = 0; g < G; g++) { /* shrink: mid = A x */
            const i64 *r = rec + g * rec_stride;
            const float *a = (const float *)(intptr_t)r[0];
            if (a == NULL) continue;
#pragma omp for schedule(static) nowait
            for (i64 k = 0; k < r[1]; k++)
                for (i64 s = seg[g]; s < seg[g + 1]; s++) mid[s * rmax + k] = dotn(a + k * n_in, x + tok[s] * ldx, n_in);
        }
#pragma omp barrier
        for (i64 g = 0; g < G; g++) { /* expand: out += mid B^T */
            const i64 *r = rec + g * rec_stride;
            if ((const float *)(intptr_t)r[0] == NULL) continue;
            for (i64 b = 0; b < r[2]; b++) {
                const i64 *e = r + 3 + 4 * b;
                const i64 j = e[3], n = e[2] - e[1], nout = nouts[j];
                const float *bt0 = (const float *)(intptr_t)e[0];
#pragma omp for schedule(static) nowait
                for (i64 o = 0; o < nout; o += LORA_BW) {
                    const i64 w = nout - o < LORA_BW ? nout - o : LORA_BW, nv = w / 16;
                    for (i64 s = seg[g]; s < seg[g + 1]; s++) {
                        const float *m = mid + s * rmax + e[1];
                        float *y = outs[j] + tok[s] * lds[j] + o;
                        lora_expand_block(m, bt0 + o, nout, n, nv, y);
                        for (i64 l = 16 * nv; l < w; l++) { /* the last columns of a width that is not 16n */
                            float acc = 0.f;
                            for (i64 k = 0; k < n; k++) acc += m[k] * bt0[k * nout + o + l];
                            y[l] += acc;
                        }
                    }
                }
            }
        }
    }
    return SQ_OK;
}
