"""The Llama forward on the "cpu" kernel backend: compiled kernels, few calls per layer.

The CPU counterpart of llama/forward_triton.py. A decode step of a small model on the CPU spends as much time
dispatching torch ops (RMSNorm alone is six, rotary eight, attention a gather and SDPA per layer) as
computing, so each layer here is:

    add + RMSNorm            sq_add_rms_norm (the previous sublayer's output joins the residual)
    QKV matmul               one fused QuantWeight (fuse_projections_cpu), or the three projections
    (q/k RMSNorm per head)   Qwen3, Gemma: torch ops
    rotary + KV-cache write  sq_rotary_kv
    paged causal attention   sq_attention (keys and values read in place through the page table;
                             a layer's sliding window masks and skips the keys before it)
    o_proj matmul
    add + RMSNorm
    gate-up matmul           one fused QuantWeight, or two
    SiLU(gate) * up          sq_silu_mul (Gemma's tanh-GELU: torch ops)
    down matmul

Gemma's sandwich norms (the attention's and the MLP's outputs normed before they join the residual)
are two more sq_add_rms_norm calls, its local layers read their own rotary tables.

(layer_ops_cpu.c; the matmuls are quant_matmul_cpu.c for quantized weights, else the layer's own
module: oneDNN-packed or dense). When every projection is quantized and fused, the whole stack is one
call into llama_forward_cpu.c (`decoder_layers`), which holds the GIL only to start. Float32
activations; results match the reference backend within float32 rounding (tests/test_cpu_backend.py),
not bit for bit, and are not batch-invariant: the batch-invariant engine keeps the reference backend.
A step with a bidirectional prefix (Moondream-style) runs on the reference backend (`supports`).
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.kernels.cpu_kernels import Layer, QMat, check_rc, native_kernels
from slipstream.models.kernels.quant_formats import concat
from slipstream.models.kernels.quant_linear import QuantLinear, cpu_matmul, ptr_or_none as _ptr
from slipstream.models.lora import lora_groups

def _fuse(linears: list[Any]) -> QuantLinear | None:
    """A QuantLinear over `linears` stacked, each re-pointed at its panels of it (one copy in memory)."""
    if not all(isinstance(m, QuantLinear) for m in linears):
        return None
    fused = concat([m.qweight for m in linears])
    biases = [m.bias for m in linears]
    if fused is None or any(b is None for b in biases) != all(b is None for b in biases):
        return None
    at = 0
    for m in linears:
        p = m.qweight.values.shape[0]
        m.qweight = fused.panels(at, at + p)
        at += p
    out = QuantLinear(fused, None if biases[0] is None else torch.cat(biases))
    out.activations = linears[0].activations
    return out


def fuse_projections_cpu(model) -> int:
    """Stack each layer's quantized q/k/v and gate/up weights (what forward_cpu multiplies at once).
    Returns the layers fused; idempotent."""
    done = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        if getattr(a, "qkv_cpu", None) is None:
            a.qkv_cpu = _fuse([a.q_proj, a.k_proj, a.v_proj])
        if getattr(m, "gate_up_cpu", None) is None:
            m.gate_up_cpu = _fuse([m.gate_proj, m.up_proj])
        done += a.qkv_cpu is not None and m.gate_up_cpu is not None
    return done


def _linear(module: nn.Module, x: torch.Tensor, lib) -> torch.Tensor:
    if isinstance(module, QuantLinear):  # straight to the kernel: a module call costs ~5 us
        y = cpu_matmul(x, module.qweight, False, lib, module.activations)
        return y if module.bias is None else y.add_(module.bias)
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def _attention_tables(meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start [S+1], kv_lens [S], page table [S, P]) as contiguous int64 tensors."""
    dev = meta.on_device
    if dev is not None and dev.query_start.device.type == "cpu":
        qs, lens, pages = dev.query_start, dev.kv_lens, dev.page_table
    else:
        qs, lens = torch.tensor(meta.query_start), torch.tensor(meta.kv_lens)
        pages = meta.page_tables
        if not isinstance(pages, torch.Tensor):  # ragged lists (tools, tests): pad with page 0
            width = max((len(p) for p in pages), default=1)
            pages = torch.tensor([list(p) + [0] * (width - len(p)) for p in pages])
    i64 = lambda t: t.to(torch.int64).contiguous()  # noqa: E731
    return i64(qs), i64(lens), i64(pages)


def supports(model, batch) -> bool:
    """Whether forward_cpu computes this batch (else the reference backend does)."""
    c = model.config
    return (c.head_dim % 16 == 0 and c.head_dim <= 128 and c.hidden_size % 16 == 0
            and c.intermediate_size % 16 == 0 and c.num_heads // c.num_kv_heads <= 16
            and not any(n > 1 for n in (batch.attn.bidirectional_lens or ())))


_KIND_ACTIVATIONS = {"float": 0, "int8": 2, "int16": 4}  # qmat_t.kind's share (llama_forward_cpu.c)


def _qmat(linear: QuantLinear) -> QMat:
    w = linear.qweight
    return QMat((0 if w.kind == "u4" else 1) + _KIND_ACTIVATIONS[linear.activations],
                int(w.scales.dtype == torch.float16), w.group, w.rows, w.cols,
                w.values.data_ptr(), w.scales.data_ptr(), _ptr(w.offsets), _ptr(linear.bias))


def decoder_layers(model) -> Any:
    """The model's layers as llama_forward_cpu.c's layer_t array (built once, kept on the model), or
    None unless every projection is quantized and q/k/v and gate/up are fused (and the layers are plain
    Llama ones: no q/k norm, no Gemma options)."""
    cached = model.cpu_layers
    if cached is not False:
        return cached
    table = None
    layers = model.model.layers
    c = model.config
    plain = (not c.qk_norm and c.hidden_act == "silu" and not c.sandwich_norms and c.rope_local_theta is None
             and c.attn_scale is None)
    if plain and all(getattr(ly.self_attn, "qkv_cpu", None) is not None and getattr(ly.mlp, "gate_up_cpu", None) is not None
           and isinstance(ly.self_attn.o_proj, QuantLinear) and isinstance(ly.mlp.down_proj, QuantLinear)
           and ly.self_attn.o_proj.bias is None and ly.mlp.down_proj.bias is None for ly in layers):
        table = (Layer * len(layers))(*[
            Layer(ly.input_layernorm.weight.data_ptr(), ly.post_attention_layernorm.weight.data_ptr(),
                  _qmat(ly.self_attn.qkv_cpu), _qmat(ly.self_attn.o_proj), _qmat(ly.mlp.gate_up_cpu),
                  _qmat(ly.mlp.down_proj), ly.self_attn.window or 0) for ly in layers])
    model.cpu_layers = table  # (the tensors it points into live as long as the model)
    return table


def _norm(lib, norm, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = norm(x), rows of contiguous [T, hidden]."""
    lib.sq_add_rms_norm(x.data_ptr(), None, norm.weight.data_ptr(), norm.eps, out.data_ptr(), x.shape[0], x.shape[1],
                        None, x.shape[0])


def forward_cpu(model, x: torch.Tensor, batch, kv) -> torch.Tensor:
    """The final-normed hidden states of batch.sample_indices from the embedded tokens `x` (float32 on
    the CPU), which become the residual stream (updated in place)."""
    lib: Any = native_kernels()  # (this backend is set only with the kernels loaded)
    c = model.config
    t, hidden, hq, hk, d = x.shape[0], c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    x = x.contiguous()
    qs, kv_lens, pages = _attention_tables(batch.attn)
    seqs, width = kv_lens.numel(), pages.shape[1]
    positions, kv_idx = batch.positions.to(torch.int64).contiguous(), batch.kv_indices.to(torch.int64).contiguous()
    cos, sin = model.rope.cos, model.rope.sin
    lora = lora_groups(batch)
    table = decoder_layers(model)
    lora_step = None if lora is None else lora.native_step()
    if table is not None and (lora is None or lora_step is not None):  # the whole stack in one call (llama_forward_cpu.c)
        rows = batch.sample_indices.to(torch.int64).contiguous()
        out = torch.empty(rows.numel(), hidden)
        rc = lib.sq_decoder_forward(table, len(table), model.model.norm.eps, x.data_ptr(), t, hidden, hq, hk, d,
                                    c.intermediate_size, kv.k.data_ptr(), kv.v.data_ptr(), kv.k[0].numel(),
                                    positions.data_ptr(), kv_idx.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                    qs.data_ptr(), kv_lens.data_ptr(), pages.data_ptr(), width, kv.page_size, seqs,
                                    d ** -0.5, model.model.norm.weight.data_ptr(), rows.data_ptr(), rows.numel(),
                                    out.data_ptr(), None if lora_step is None else ctypes.byref(lora_step))
        check_rc(rc, f"no CPU kernels for head_dim {d}, {hq} heads over {hk}, these weights' groups or an adapter record")
        return out
    h = torch.empty(t, hidden)
    attn = torch.zeros(t, hq * d)  # rows past the sequences' queries (padding) stay finite
    normed = torch.empty(t, hidden) if c.sandwich_norms else None
    delta = None
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        rope = model.rope_for(i)
        cos, sin = rope.cos, rope.sin
        ln = layer.input_layernorm
        lib.sq_add_rms_norm(x.data_ptr(), _ptr(delta), ln.weight.data_ptr(), ln.eps, h.data_ptr(), t, hidden,
                            None, t)
        if getattr(a, "qkv_cpu", None) is not None:
            qkv = _linear(a.qkv_cpu, h, lib)
            q, k, v = qkv, qkv[:, hq * d:], qkv[:, (hq + hk) * d:]
            ldq = ldk = ldv = qkv.stride(0)
        else:
            q, k, v = (_linear(p, h, lib).contiguous() for p in (a.q_proj, a.k_proj, a.v_proj))
            ldq, ldk, ldv = q.stride(0), k.stride(0), v.stride(0)
        if lora is not None:  # (on the projections' outputs, before Qwen3's norms)
            lora.add_cpu(lib, a.layer, 0, h, {"q_proj": q[:, :hq * d], "k_proj": k[:, :hk * d], "v_proj": v[:, :hk * d]})
        if a.qk_norm:  # Qwen3: RMSNorm per head before rotary (into new contiguous rows)
            q = a.q_norm(q[:, :hq * d].reshape(t, hq, d)).reshape(t, hq * d)
            k = a.k_norm(k[:, :hk * d].reshape(t, hk, d)).reshape(t, hk * d)
            ldq, ldk = q.stride(0), k.stride(0)
        kc, vc = kv.k[a.layer], kv.v[a.layer]
        lib.sq_rotary_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), ldq, ldk, ldv, positions.data_ptr(),
                         cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(), kv_idx.data_ptr(), t, hq, hk, d)
        check_rc(lib.sq_attention(q.data_ptr(), ldq, kc.data_ptr(), vc.data_ptr(), qs.data_ptr(), kv_lens.data_ptr(),
                                  pages.data_ptr(), width, kv.page_size, seqs, hq, hk, d, a.scale, a.window or 0,
                                  attn.data_ptr()),
                 f"no CPU attention kernel for head_dim {d}, {hq} heads over {hk}")
        o = _linear(a.o_proj, attn, lib).contiguous()
        if lora is not None:
            lora.add_cpu(lib, a.layer, 1, attn, {"o_proj": o})
        if normed is not None:  # Gemma: the attention's output normed before it joins the residual
            _norm(lib, layer.post_attention_layernorm, o, normed)
            o = normed
        ln = layer.mlp_norm()
        lib.sq_add_rms_norm(x.data_ptr(), o.data_ptr(), ln.weight.data_ptr(), ln.eps, h.data_ptr(), t, hidden,
                            None, t)
        inter = c.intermediate_size
        if getattr(m, "gate_up_cpu", None) is not None:
            gu = _linear(m.gate_up_cpu, h, lib)
            g, u = gu, gu[:, inter:]
        else:
            g, u = _linear(m.gate_proj, h, lib).contiguous(), _linear(m.up_proj, h, lib).contiguous()
        if lora is not None:
            lora.add_cpu(lib, a.layer, 2, h, {"gate_proj": g[:, :inter], "up_proj": u[:, :inter]})
        if m.act == "silu":
            act = torch.empty(t, inter)
            lib.sq_silu_mul(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), act.data_ptr(), t, inter)
        else:
            act = (F.gelu(g[:, :inter], approximate="tanh") * u[:, :inter]).contiguous()
        delta = _linear(m.down_proj, act, lib).contiguous()
        if lora is not None:
            lora.add_cpu(lib, a.layer, 3, act, {"down_proj": delta})
        if normed is not None:  # Gemma: so is the MLP's
            out_normed = torch.empty(t, hidden)
            _norm(lib, layer.post_feedforward_layernorm, delta, out_normed)
            delta = out_normed
    rows = batch.sample_indices.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), hidden)
    norm = model.model.norm
    lib.sq_add_rms_norm(x.data_ptr(), _ptr(delta), norm.weight.data_ptr(), norm.eps, out.data_ptr(), t, hidden,
                        rows.data_ptr(), rows.numel())
    return out
