"""The Llama forward on the "triton" backend (the GPU path): few, fat kernel launches per layer.

A decode step of a small model is bound by kernel launches, not by bytes: on an H100 the
SmolLM2-135M step ran 548 kernels, 18 a layer, in 1.86 ms of graph replay where its 270 MB of
weights take 0.09 ms to read (docs/results/h100-2026-11-22/). Here a decode layer is 8 launches:

    add + RMSNorm            (add_norm_triton.py: the previous layer's MLP output joins the residual)
    QKV matmul               (one fused weight, plus the Qwen2 bias)
    rotary + KV-cache write  (rotary_kv_triton.py)
    paged attention          (attention_triton.py; output not zero-filled)
    o_proj matmul
    add + RMSNorm
    gate-up matmul + SiLU·up (gate_up_silu_triton.py; above mlp_gemm_max_rows rows: cuBLAS + silu_mul_triton.py)
    down matmul

The first layer's norm has nothing to add; the last layer's MLP output is added by the final norm,
which reads only the sampled rows. A step of at most `TritonOptions.fused_decode_max_rows` token
rows, on a model whose layers have dense fused projections, takes 5 launches a layer instead
(decode_fused_triton.py: norms in the GEMVs' prologues, residual adds in their epilogues). The
reference backend (llama/model.py) computes the same function with PyTorch ops; each kernel module
has a reference function and tests/test_fused_kernels.py compares kernels, whole models and the
launch count per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.kernels.add_norm_triton import add_rms_norm_triton
from slipstream.models.kernels.attention_triton import paged_attention_triton
from slipstream.models.kernels.decode_fused_triton import (linear_residual_triton, norm_gate_up_silu_triton,
                                                           norm_qkv_rotary_triton)
from slipstream.models.kernels.fused_projections import fuse_linears
from slipstream.models.kernels.gate_up_silu_triton import gate_up_silu_triton
from slipstream.models.kernels.gemm_choice import Table, small_linear
from slipstream.models.kernels.rotary_kv_triton import rotary_kv_triton
from slipstream.models.kernels.silu_mul_triton import silu_mul_triton
from slipstream.models.lora import LoraInput
from slipstream.models.lora_bank import LoraBank


@dataclass(frozen=True)
class TritonOptions:
    fuse_projections: bool = True  # one QKV and one gate-up matmul (dense nn.Linear layers only)
    # Up to this many token rows the gate-up matmul and SiLU·up run as one Triton kernel; above it
    # (prefill) cuBLAS's matmul and the SiLU·up kernel. 0: never. A guess pending GPU timings.
    mlp_gemm_max_rows: int = 256
    # Up to this many token rows a layer is the 5-launch fused decode layer (decode_fused_triton.py),
    # when every layer has dense fused qkv/gate-up and dense o_proj/down weights. 0: never, the
    # default: on an H100 its GEMVs (30-36 programs for 132 SMs) made SmolLM2's batch-1 replay 1.20 ms
    # against the 8-launch layer's 1.12 (docs/results/h100-2026-11-27/kernels-ecc4e48/profile.md).
    fused_decode_max_rows: int = 0
    # Up to this many token rows (at most gemv_splitk_triton.MAX_ROWS) the QKV, o_proj and down matmuls
    # of the 8-launch layer take cuBLAS or the split-K GEMV, whichever choose_small_gemms measured
    # faster for that shape and row count at start (models/kernels/gemm_choice.py). 0: always cuBLAS, the
    # default until a GPU run measures it (issue 50's prediction: docs/benchmarks.md).
    small_gemm_max_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("mlp_gemm_max_rows", "fused_decode_max_rows", "small_gemm_max_rows"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.small_gemm_max_rows > 16:  # (gemv_splitk_triton.MAX_ROWS: one row tile)
            raise ValueError(f"small_gemm_max_rows must be <= 16, got {self.small_gemm_max_rows}")


TRITON_DEFAULTS = TritonOptions()


def fuse_projections(model) -> int:
    """Stack each layer's q/k/v and gate/up weights into one matrix each (fused_projections.py:
    the original layers become views, one copy in memory). PackedLinear layers stay unfused. Call
    after loading, with the model at its device and dtype. Returns the layers fused (idempotent)."""
    done = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv is None:
            a.qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
        if m.gate_up is None:
            fused = fuse_linears([m.gate_proj, m.up_proj])
            m.gate_up = None if fused is None else fused[0]  # the MLP has no biases
        done += a.qkv is not None and m.gate_up is not None
    return done


def small_gemm_weights(model) -> list[torch.Tensor]:
    """The weights the 8-launch layer multiplies through small_linear: fused QKV without bias, dense
    o_proj and down without bias (packed, quantized or biased layers keep their own path)."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if a.qkv is not None and a.qkv[1] is None:
            out.append(a.qkv[0])
        out += [lin.weight for lin in (a.o_proj, m.down_proj) if type(lin) is nn.Linear and lin.bias is None]
    return out


def choose_small_gemms(model, options: TritonOptions) -> Table:
    """cuBLAS or the split-K GEMV per weight shape and row count up to options.small_gemm_max_rows, by
    CUDA-event timings on the model's device (gemm_choice.measure); empty when off or not on CUDA."""
    from slipstream.models.kernels import gemm_choice

    weights = small_gemm_weights(model)
    if options.small_gemm_max_rows == 0 or not weights or weights[0].device.type != "cuda":
        return {}
    return gemm_choice.measure(weights, range(1, options.small_gemm_max_rows + 1), gemm_choice.cuda_event_ms)


def _linear(module, x: torch.Tensor, gemms: Table | None) -> torch.Tensor:
    if gemms and type(module) is nn.Linear:
        return small_linear(x, module.weight, module.bias, gemms)
    return module(x)


def project_qkv(attn, x: torch.Tensor, gemms: Table | None = None, lora: LoraInput | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, KVH, D]; when fused, strided column views of one matmul's output.
    `lora`: each token's adapter delta added (its bank's kernels)."""
    t, hd, kvd = x.shape[0], attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim
    if attn.qkv is not None:
        weight, bias = attn.qkv
        qkv = small_linear(x, weight, bias, gemms)
        if lora is not None:
            lora_bank(lora).add(lora.slots, attn.layer, 0, x, [], fused=qkv)
        q, k, v = qkv[:, :hd], qkv[:, hd:hd + kvd], qkv[:, hd + kvd:]
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if lora is not None:
            lora_bank(lora).add(lora.slots, attn.layer, 0, x, [q, k, v])
    return (q.view(t, attn.heads, attn.head_dim), k.view(t, attn.kv_heads, attn.head_dim),
            v.view(t, attn.kv_heads, attn.head_dim))


def attention(attn, x: torch.Tensor, batch, kv, rope, gemms: Table | None = None) -> torch.Tensor:
    lora = batch.lora
    q, k, v = project_qkv(attn, x, gemms, lora)
    if attn.qk_norm:  # Qwen3, Gemma: RMSNorm per head before rotary (torch ops; not fused yet)
        q, k = attn.q_norm(q).contiguous(), attn.k_norm(k).contiguous()
    k_cache, v_cache = kv.k[attn.layer], kv.v[attn.layer]
    rotary_kv_triton(q, k, v, batch.positions, rope.cos, rope.sin, k_cache, v_cache, batch.kv_indices)
    out = attend(attn, q, batch, kv)
    o = _linear(attn.o_proj, out, gemms)
    if lora is not None:
        lora_bank(lora).add(lora.slots, attn.layer, 1, out, [o])
    return o


def lora_bank(lora: LoraInput) -> LoraBank:
    """The bank a LoRA batch on this backend reads (the model refuses a batch without one)."""
    assert lora.bank is not None, "a LoRA batch on the triton backend without a LoraBank"
    return lora.bank


def attend(attn, q: torch.Tensor, batch, kv) -> torch.Tensor:
    """Paged attention of the rotated q [T, H, D] over the cache (this step's K/V already written): [T, H * D]."""
    # No zero-fill. The kernel writes every query row of every sequence in query_start; rows past
    # query_start[S] (the padding tokens of a mixed graph's bucket) keep garbage, harmlessly: every
    # later op is row-independent (matmuls, norms, elementwise), their K/V land on the scratch page,
    # and no sample index points at them. The scratch page is read only by padding rows (decode
    # buckets pad with q_len-1 sequences of row 0 there), whose outputs may then be garbage too:
    # they are never sampled, and a greedy graph writes their argmax to row 0, which no sequence holds.
    t = q.shape[0]
    out = torch.empty(t, attn.heads, attn.head_dim, dtype=q.dtype, device=q.device)
    m = batch.attn.on_device
    paged_attention_triton(q, kv.k[attn.layer], kv.v[attn.layer], m.query_start, m.kv_lens, m.page_table,
                           kv.page_size, m.max_q_len, out, blocks=m.blocks, window=attn.window,
                           scale=None if attn.scale == attn.head_dim ** -0.5 else attn.scale)
    return out.view(t, attn.heads * attn.head_dim)


def mlp(m, x: torch.Tensor, options: TritonOptions, gemms: Table | None = None, lora: LoraInput | None = None,
        layer: int = 0) -> torch.Tensor:
    """`lora`: each token's adapter deltas on gate/up (before the activation: the gate-up GEMM with
    SiLU·up fused is not taken) and on down, of layer `layer`."""
    if lora is None and m.act == "silu" and m.gate_up is not None and x.shape[0] <= options.mlp_gemm_max_rows:
        return _linear(m.down_proj, gate_up_silu_triton(x, m.gate_up), gemms)
    if m.gate_up is not None:
        gate_up = F.linear(x, m.gate_up)
        if lora is not None:
            lora_bank(lora).add(lora.slots, layer, 2, x, [], fused=gate_up)
        gate, up = gate_up.chunk(2, dim=1)
    else:
        gate, up = m.gate_proj(x), m.up_proj(x)
        if lora is not None:
            lora_bank(lora).add(lora.slots, layer, 2, x, [gate, up])
    # (Gemma's tanh-GELU: torch ops, no fused kernel yet)
    act = silu_mul_triton(gate, up) if m.act == "silu" else F.gelu(gate, approximate="tanh") * up
    y = _linear(m.down_proj, act, gemms)
    if lora is not None:
        lora_bank(lora).add(lora.slots, layer, 3, act, [y])
    return y


def decode_ready(layer) -> bool:
    """Whether a layer can run as the fused decode layer: fused dense qkv and gate-up, dense
    o_proj and down without biases, no q/k norm, a plain Llama layer (PackedLinear, quantized, Qwen3 and
    Gemma layers keep the 8-launch layer)."""
    a, m = layer.self_attn, layer.mlp
    return (not a.qk_norm and not layer.sandwich and m.act == "silu" and a.scale == a.head_dim ** -0.5 and a.qkv is not None and m.gate_up is not None and type(a.o_proj) is nn.Linear and a.o_proj.bias is None
            and type(m.down_proj) is nn.Linear and m.down_proj.bias is None)


def takes_fused_decode(model, rows: int) -> bool:
    """Whether a step of `rows` token rows runs the 5-launch fused decode layer (else the 8-launch
    layer), under the model's options (TRITON_DEFAULTS unless set_kernel_backend got others). The
    one place the choice is made: forward_triton and the launch-count tests both ask it."""
    options = model.triton_options or TRITON_DEFAULTS
    return rows <= options.fused_decode_max_rows and all(decode_ready(layer) for layer in model.model.layers)


def fused_decode_layer(layer, x: torch.Tensor, batch, kv, rope) -> None:
    """One layer in 5 launches; the sublayer outputs are added into `x` in place."""
    a, m = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    weight, bias = a.qkv
    q = norm_qkv_rotary_triton(x, norm.weight, norm.eps, weight, bias, a.heads, a.kv_heads, batch.positions,
                               rope.cos, rope.sin, kv.k[a.layer], kv.v[a.layer], batch.kv_indices)
    linear_residual_triton(attend(a, q, batch, kv), a.o_proj.weight, x)
    norm = layer.post_attention_layernorm
    linear_residual_triton(norm_gate_up_silu_triton(x, norm.weight, norm.eps, m.gate_up), m.down_proj.weight, x)


def forward_triton(model, x: torch.Tensor, batch, kv) -> torch.Tensor:
    """The final-normed hidden states of batch.sample_indices (what the lm_head reads) from the
    embedded tokens `x`, which become the residual stream: each norm adds the sublayer output before
    it into `x` in place (the fused decode layer adds it in the projection's epilogue)."""
    options = model.triton_options or TRITON_DEFAULTS
    layers = model.model.layers
    norm = model.model.norm
    if batch.lora is None and takes_fused_decode(model, x.shape[0]):  # (its layer has no LoRA deltas)
        for layer in layers:
            fused_decode_layer(layer, x, batch, kv, model.rope)
        return add_rms_norm_triton(None, x, norm.weight, norm.eps, rows=batch.sample_indices)
    delta = None  # the last sublayer's output, not yet added to the residual
    gemms = getattr(model, "small_gemms", None) if x.shape[0] <= options.small_gemm_max_rows else None
    for i, layer in enumerate(layers):
        h = add_rms_norm_triton(delta, x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        a = attention(layer.self_attn, h, batch, kv, model.rope_for(i), gemms)
        if layer.sandwich:  # Gemma: the attention's output normed before it joins the residual
            a = add_rms_norm_triton(None, a, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        ln = layer.mlp_norm()
        h = add_rms_norm_triton(a, x, ln.weight, ln.eps)
        delta = mlp(layer.mlp, h, options, gemms, batch.lora, i)
        if layer.sandwich:  # and so is the MLP's
            ln = layer.post_feedforward_layernorm
            delta = add_rms_norm_triton(None, delta, ln.weight, ln.eps)
    return add_rms_norm_triton(delta, x, norm.weight, norm.eps, rows=batch.sample_indices)
