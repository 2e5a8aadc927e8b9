/* The whole decoder stack of llama_cpu.forward_cpu in one call, for models whose projections are all
 * quantized and fused (q/k/v and gate/up): the layer loop of llama/forward_cpu.py without a return to Python
 * between kernels. ctypes releases the GIL for the call, so the engine loop's Python runs meanwhile
 * instead of taking turns with the forward between every two kernels (docs/benchmarks.md,
 * "Quantized weights": what the forward thread lost to the loop). Same kernels, same order, same
 * results as the Python loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_alloc_cpu.h"

typedef int64_t i64;

/* a QuantWeight (quant_formats.py) */
typedef struct {
    i64 kind; /* 0 u4, 1 i8; + 2: int8 activations (quant_matmul_q8_cpu.c), + 4: int16 (quant_matmul_q16_cpu.c) */
    i64 f16;
    i64 group;
    i64 rows, cols;
    const void *values, *scales, *offsets;
    const float *bias; /* or NULL */
} qmat_t;

typedef struct {
    const float *ln1, *ln2; /* RMSNorm weights */
    qmat_t qkv, o, gate_up, down;
    i64 window; /* sliding-window attention's width in positions, 0: full causal */
} layer_t;

/* The step's LoRA adapters (models/lora.py, LoraGroups.native_step): sq_lora_add's arguments but the
 * record and the outputs, which each layer and input group pick. rec: [G][layers][4 groups][LORA_REC]. */
typedef struct {
    const i64 *tok, *seg;
    i64 G;
    const i64 *rec;
    i64 rec_stride, layer_stride;
    float *mid;
    i64 rmax;
} lora_t;

int sq_gemm_u4(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16, i64 N,
               float *y, i64 ldy, int split);
int sq_gemm_i8(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16, i64 gs,
               i64 N, float *y, i64 ldy, int split);
int sq_gemm_u4_q8(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16,
                  i64 N, float *y, i64 ldy);
int sq_gemm_i8_q8(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16,
                  i64 gs, i64 N, float *y, i64 ldy);
int sq_gemm_u4_q16(const float *x, i64 M, i64 K, const uint8_t *q, const void *scale, const void *offset, int f16,
                   i64 N, float *y, i64 ldy);
int sq_gemm_i8_q16(const float *x, i64 M, i64 K, const int8_t *q, const void *scale, const void *offset, int f16,
                   i64 gs, i64 N, float *y, i64 ldy);
void sq_add_rms_norm(float *x, const float *delta, const float *w, float eps, float *out, i64 T, i64 H,
                     const i64 *rows, i64 nrows);
void sq_rotary_kv(float *q, const float *k, const float *v, i64 ldq, i64 ldk, i64 ldv, const i64 *pos,
                  const float *cos_t, const float *sin_t, float *k_cache, float *v_cache, const i64 *kv_idx, i64 T,
                  i64 Hq, i64 Hk, i64 D);
int sq_attention(const float *q, i64 ldq, const float *k_cache, const float *v_cache, const i64 *qs,
                 const i64 *kv_lens, const i64 *page_table, i64 P, i64 ps, i64 S, i64 Hq, i64 Hk, i64 D, float scale,
                 i64 window, float *out);
void sq_silu_mul(const float *g, i64 ldg, const float *u, i64 ldu, float *out, i64 T, i64 I);
int sq_lora_add(const float *x, i64 ldx, i64 n_in, const i64 *tok, const i64 *seg, i64 G, const i64 *rec,
                i64 rec_stride, float *mid, i64 rmax, float *const *outs, const i64 *lds, const i64 *nouts);

#define LORA_REC 15
/* y_j += the LoRA deltas of input group `group` of layer l (rows of x ldx apart, n_in wide) for its
 * targets' outputs y_j (rows ld apart, n_j wide); SQ_OK without adapters */
static int lora_add(const lora_t *lr, i64 l, i64 group, const float *x, i64 ldx, i64 n_in, i64 ld, float *y0, i64 n0,
                    float *y1, i64 n1, float *y2, i64 n2) {
    if (lr == NULL) return SQ_OK;
    float *const outs[3] = {y0, y1, y2};
    const i64 lds[3] = {ld, ld, ld}, nouts[3] = {n0, n1, n2};
    return sq_lora_add(x, ldx, n_in, lr->tok, lr->seg, lr->G, lr->rec + l * lr->layer_stride + group * LORA_REC,
                       lr->rec_stride, lr->mid, lr->rmax, outs, lds, nouts);
}

/* SQ_OK, or the product's error (SQ_EINVAL: its group size; SQ_ENOMEM) */
static int matmul(const qmat_t *w, const float *x, i64 T, float *y) {
    int rc;
    if (w->kind == 4)
        rc = sq_gemm_u4_q16(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->rows, y, w->rows);
    else if (w->kind == 5)
        rc = sq_gemm_i8_q16(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->group, w->rows, y,
                            w->rows);
    else if (w->kind == 2)
        rc = sq_gemm_u4_q8(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->rows, y, w->rows);
    else if (w->kind == 3)
        rc = sq_gemm_i8_q8(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->group, w->rows, y,
                           w->rows);
    else if (w->kind == 0)
        rc = sq_gemm_u4(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->rows, y, w->rows, 0);
    else
        rc = sq_gemm_i8(x, T, w->cols, w->values, w->scales, w->offsets, (int)w->f16, w->group, w->rows, y, w->rows,
                        0);
    if (rc == SQ_OK && w->bias)
        for (i64 t = 0; t < T; t++)
            for (i64 n = 0; n < w->rows; n++) y[t * w->rows + n] += w->bias[n];
    return rc;
}

/* x [T, H]: the embedded tokens, updated in place as the residual stream. out [nrows, H]: the final
 * norm of rows `rows`. The KV caches: layer l's [slots, Hk, D] at k_cache + l * layer_stride (floats).
 * Attention tables as sq_attention's. Returns SQ_OK, SQ_EINVAL (attention shape or a group size) or
 * SQ_ENOMEM (x and the caches then partly updated: the step is lost). lora: the step's adapters, or NULL;
 * each delta joins its projection's output before anything reads it (before rotary, the residual, SiLU),
 * as in the Python loop. */
int sq_decoder_forward(const layer_t *layers, i64 L, float eps, float *x, i64 T, i64 H, i64 Hq, i64 Hk, i64 D, i64 I,
                       float *k_cache, float *v_cache, i64 layer_stride,
                       const i64 *pos, const i64 *kv_idx, const float *cos_t, const float *sin_t, const i64 *qs,
                       const i64 *kv_lens, const i64 *pages, i64 P, i64 ps, i64 S, float scale, const float *norm_w,
                       const i64 *rows, i64 nrows, float *out, const lora_t *lora) {
    const i64 wqkv = (Hq + 2 * Hk) * D;
    float *h = sq_malloc(sizeof(float) * T * H), *qkv = sq_malloc(sizeof(float) * T * wqkv);
    float *attn = sq_calloc((size_t)(T * Hq * D), sizeof(float)); /* padding rows stay 0 */
    float *o = sq_malloc(sizeof(float) * T * H), *gu = sq_malloc(sizeof(float) * T * 2 * I);
    float *act = sq_malloc(sizeof(float) * T * I);
    int rc = h && qkv && attn && o && gu && act ? SQ_OK : SQ_ENOMEM;
    const float *delta = NULL;
    for (i64 l = 0; l < L && rc == SQ_OK; l++) {
        const layer_t *ly = layers + l;
        float *kc = k_cache + l * layer_stride, *vc = v_cache + l * layer_stride;
        sq_add_rms_norm(x, delta, ly->ln1, eps, h, T, H, NULL, T);
        if ((rc = matmul(&ly->qkv, h, T, qkv)) != SQ_OK) break;
        if ((rc = lora_add(lora, l, 0, h, H, H, wqkv, qkv, Hq * D, qkv + Hq * D, Hk * D, qkv + (Hq + Hk) * D,
                           Hk * D)) != SQ_OK)
            break;
        sq_rotary_kv(qkv, qkv + Hq * D, qkv + (Hq + Hk) * D, wqkv, wqkv, wqkv, pos, cos_t, sin_t, kc, vc, kv_idx,
                     T, Hq, Hk, D);
        if ((rc = sq_attention(qkv, wqkv, kc, vc, qs, kv_lens, pages, P, ps, S, Hq, Hk, D, scale, ly->window,
                               attn)) != SQ_OK)
            break;
        if ((rc = matmul(&ly->o, attn, T, o)) != SQ_OK) break;
        if ((rc = lora_add(lora, l, 1, attn, Hq * D, Hq * D, H, o, H, NULL, 0, NULL, 0)) != SQ_OK) break;
        sq_add_rms_norm(x, o, ly->ln2, eps, h, T, H, NULL, T);
        if ((rc = matmul(&ly->gate_up, h, T, gu)) != SQ_OK) break;
        if ((rc = lora_add(lora, l, 2, h, H, H, 2 * I, gu, I, gu + I, I, NULL, 0)) != SQ_OK) break;
        sq_silu_mul(gu, 2 * I, gu + I, 2 * I, act, T, I);
        if ((rc = matmul(&ly->down, act, T, o)) != SQ_OK) break;
        if ((rc = lora_add(lora, l, 3, act, I, I, H, o, H, NULL, 0, NULL, 0)) != SQ_OK) break;
        delta = o;
    }
    if (rc == SQ_OK) sq_add_rms_norm(x, delta, norm_w, eps, out, T, H, rows, nrows);
    free(h);
    free(qkv);
    free(attn);
    free(o);
    free(gu);
    free(act);
    return rc;
}
