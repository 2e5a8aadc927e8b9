"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) written for a serving engine.

One forward takes a flat batch of tokens from many sequences (prefill chunks and single decode
tokens mixed), writes each token's K/V into a paged cache through its KV index, reads context
through per-sequence page tables, and computes logits only for the rows that sample.
Weights use Hugging Face Llama names so checkpoints and the transformers oracle line up. The families'
differences are ModelConfig's options, read here per layer (models/config.py).

Two paths compute the same function: the reference backend (PyTorch ops, attention per sequence
over host metadata; the CPU path) and the "triton" backend (the GPU path), built for few
kernel launches per layer: one QKV and one gate-up matmul, the residual
add folded into RMSNorm, the KV write folded into rotary, SiLU·up in the gate-up matmul
(llama/forward_triton.py, docs/cuda.md).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models import ACTIVATION_MODES
from slipstream.models.base import ForwardBatch, KVCache
from slipstream.models.carry_heads import CarryHeads, apply_carry
from slipstream.models.config import ModelConfig
from slipstream.models.kernels.attention import paged_attention_reference, write_kv
from slipstream.models.kernels.rotary import RotaryEmbedding
from slipstream.models.lora import LoraGroups, lora_groups

if TYPE_CHECKING:
    from slipstream.models.llama.forward_triton import TritonOptions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        h = config.hidden_size
        bias = config.attention_bias  # Qwen2
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        if config.qk_norm:  # Qwen3: each head's q and k RMS-normed over head_dim before rotary
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.window = config.window(layer)  # sliding-window attention (None: full causal)
        self.scale = config.scale()  # Gemma: query_pre_attn_scalar ** -0.5
        self.compute_dtype: torch.dtype | None = None  # float64: batch/chunk-invariant results
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused (weight, bias): llama/forward_triton.py

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache, rotate) -> torch.Tensor:
        """The reference path (PyTorch ops, attention over host metadata)."""
        t = x.shape[0]
        lora = lora_groups(batch)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if lora is not None:
            lora.add(self.layer, 0, x, {"q_proj": q, "k_proj": k, "v_proj": v})
        q, k = q.view(t, self.heads, self.head_dim), k.view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, k)
        v = v.view(t, self.kv_heads, self.head_dim)
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        write_kv(k_cache, batch.kv_indices, k)
        write_kv(v_cache, batch.kv_indices, v)
        out = torch.zeros_like(q)  # the reference leaves padding rows untouched: keep them finite
        paged_attention_reference(q, k_cache, v_cache, batch.attn, out, self.compute_dtype, self.window, self.scale)
        out = out.view(t, self.heads * self.head_dim)
        o = self.o_proj(out)
        if lora is not None:
            lora.add(self.layer, 1, out, {"o_proj": o})
        return o


def gate_act(kind: str, g: torch.Tensor) -> torch.Tensor:
    return F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused [2 * intermediate, hidden]: llama/forward_triton.py
        self.act = config.hidden_act  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU: Gemma)

    def forward(self, x: torch.Tensor, lora: LoraGroups | None = None, layer: int = 0) -> torch.Tensor:
        if lora is None:
            return self.down_proj(gate_act(self.act, self.gate_proj(x)) * self.up_proj(x))
        g, u = self.gate_proj(x), self.up_proj(x)
        lora.add(layer, 2, x, {"gate_proj": g, "up_proj": u})
        act = gate_act(self.act, g) * u
        y = self.down_proj(act)
        lora.add(layer, 3, act, {"down_proj": y})
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        # Llama: the norm before the MLP; with sandwich norms (Gemma) the norm of the attention's output
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mlp_norm(self) -> RMSNorm:
        """The norm the MLP's input takes."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def forward(self, x, batch: ForwardBatch, kv: KVCache, rotate) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), batch, kv, rotate)
        x = x + (self.post_attention_layernorm(a) if self.sandwich else a)
        m = self.mlp(self.mlp_norm()(x), lora_groups(batch), self.self_attn.layer)
        return x + (self.post_feedforward_layernorm(m) if self.sandwich else m)


class _Body(nn.Module):
    embed_tokens: Any  # nn.Embedding, or a QuantEmbedding (from_quantized)

    def __init__(self, config: ModelConfig):
        super().__init__()
        # An explicit (uninitialised) weight skips nn.Embedding's random init: on the meta device that
        # init imports torch._dynamo, ~1.5-2 s of every start. Weights are always loaded afterwards.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    lm_head: Any  # nn.Linear, packed or quantized (from_packed / from_quantized); absent when tied

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.rope = RotaryEmbedding(config)
        # Gemma: the windowed (local) layers rotate with their own base, without the global scaling
        self.rope_local = None if config.rope_local_theta is None else RotaryEmbedding(replace(
            config, rope_theta=config.rope_local_theta, rope_freq_factors=None, rope_long_factors=None,
            rope_long_from=None, rope_attention_factor=1.0))
        self.backend = "reference"
        self.triton_options: TritonOptions | None = None  # on the triton backend
        self.small_gemms: dict = {}  # (rows, N, K) -> the GEMV chosen at start (gemm_choice.Table); empty: cuBLAS
        self.cpu_layers: Any = False  # the "cpu" backend's layer table (forward_cpu.decoder_layers); False: not built
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.carry_heads: CarryHeads | None = None  # heads whose values a row may carry (carry_heads.py)
        self.vision: Any = None  # Idefics3: vision tower + connector (models/idefics3/vision.py)
        if config.vision is not None:
            from slipstream.models.idefics3.vision import Idefics3Vision

            self.vision = Idefics3Vision(config.vision)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device) -> "LlamaForCausalLM":
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict({k: v for k, v in weights.items() if k != "lm_head.weight" or not config.tie_word_embeddings},
                              strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @classmethod
    def from_packed(cls, config: ModelConfig, weights: dict[str, torch.Tensor], packed: dict[str, nn.Module]
                    ) -> "LlamaForCausalLM":
        """A CPU model whose projections are slipstream.models.kernels.cpu_linear.PackedLinear layers (`packed`,
        by module name, from pack_weights) and whose other weights (embedding, norms) are `weights`."""
        with torch.device("meta"):
            model = cls(config)
        for name, layer in packed.items():  # replaces the (meta) nn.Linear of that name
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, layer)
        model.load_state_dict({k: v for k, v in weights.items() if k != "lm_head.weight"}, strict=True, assign=True)
        return model.eval().requires_grad_(False)

    @classmethod
    def from_quantized(cls, config: ModelConfig, weights: dict, dtype: torch.dtype, device,
                       invariant: bool = False) -> "LlamaForCausalLM":
        """A model computing with its quantized weights: each QuantWeight in `weights` (a projection, the
        embedding, the lm_head) becomes a QuantLinear / QuantEmbedding (models/kernels/quant_linear.py, its
        bias taken along); the other tensors load as usual. A tied lm_head shares the embedding's
        QuantWeight. `invariant`: CPU products whose rows do not depend on the batch."""
        from slipstream.models.kernels.quant_formats import QuantWeight
        from slipstream.models.kernels.quant_linear import QuantEmbedding, QuantLinear

        with torch.device("meta"):
            model = cls(config)
        dense = {k: v for k, v in weights.items() if not isinstance(v, QuantWeight)}
        for name, w in weights.items():
            if not isinstance(w, QuantWeight):
                continue
            w = w.map(lambda t: t.to(device))
            module = name.removesuffix(".weight")
            if module == "model.embed_tokens":
                model.model.embed_tokens = QuantEmbedding(w, dtype)
                if config.tie_word_embeddings:
                    model.lm_head = QuantLinear(w, invariant=invariant)
                continue
            bias = dense.pop(f"{module}.bias", None)
            parent, _, attr = module.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    QuantLinear(w, None if bias is None else bias.to(device=device, dtype=dtype), invariant))
        if config.tie_word_embeddings:
            dense.pop("lm_head.weight", None)
        model.load_state_dict(dense, strict=True, assign=True)
        # (QuantLinear / QuantEmbedding hold no parameters or buffers: .to leaves them as they are)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    @property
    def backends(self) -> tuple[str, ...]:
        """The kernel backends it runs on: the compiled CPU kernels only for a text-only model."""
        return ("reference", "triton") if self.vision is not None else ("reference", "triton", "cpu")

    def encode_image(self, image, mask: torch.Tensor | None = None) -> torch.Tensor:
        """An Idefics3 image's placeholder rows: its tiles (`image.pixel_values`, on the device) through
        the vision tower; `mask` marks the tiles' real pixels (None: no padding)."""
        if self.vision is None:
            raise TypeError("encode_image on a model without a vision tower")
        return self.vision.encode(image.pixel_values, mask)

    def set_attention_dtype(self, dtype: torch.dtype | None) -> None:
        layer: Any
        for layer in self.model.layers:
            layer.self_attn.compute_dtype = dtype

    def set_activations(self, mode: str) -> None:
        """How quantized projections multiply on the CPU: "int8" / "int16" (each row of x rounded to
        int8 / int16 per group of 32, integer dot products: models/kernels/quant_matmul_q8_cpu.c /
        quant_matmul_q16_cpu.c) or "float"."""
        from slipstream.models.kernels.quant_linear import QuantLinear

        if mode not in ACTIVATION_MODES:
            raise ValueError(f"activations must be one of {ACTIVATION_MODES}, got {mode!r}")
        for m in self.modules():
            if isinstance(m, QuantLinear):
                m.activations = mode
        self.cpu_layers = False  # forward_cpu's table names each matrix's kernel: rebuilt at the next forward

    def set_kernel_backend(self, backend: str, options: "TritonOptions | None" = None) -> None:
        """"reference" (PyTorch ops; attention per sequence over host metadata), "triton" (the GPU
        path, slipstream/models/llama/forward_triton.py: few graph-capturable launches per layer; `options`
        default to forward_triton.TRITON_DEFAULTS) or "cpu" (compiled CPU kernels, float32,
        slipstream/models/llama/forward_cpu.py). Projections are fused here, after loading, and stay
        fused (fuse_projections=False only skips fusing)."""
        if backend not in ("reference", "triton", "cpu"):
            raise ValueError(f"kernel backend must be 'reference', 'triton' or 'cpu', got {backend!r}")
        if backend == "triton":  # refused now, not at the first forward
            from slipstream.models.kernels.triton_jit import require_triton

            require_triton("the triton kernel backend")
        if backend == "cpu":
            from slipstream.errors import DeviceUnavailableError
            from slipstream.models.kernels.cpu_kernels import native_kernels
            from slipstream.models.llama.forward_cpu import fuse_projections_cpu

            if native_kernels() is None:
                raise DeviceUnavailableError("the cpu kernel backend needs the compiled CPU kernels "
                                             "(cpu_kernels_unavailable in the log says why)")
            fuse_projections_cpu(self)
        self.backend = backend
        if backend == "triton":
            from slipstream.models.llama import forward_triton as llama_triton

            if options is not None and not isinstance(options, llama_triton.TritonOptions):
                raise TypeError(f"options must be a forward_triton.TritonOptions, got {type(options).__name__}")
            self.triton_options = opts = options or llama_triton.TRITON_DEFAULTS
            if opts.fuse_projections:
                llama_triton.fuse_projections(self)
            # measured here, at start, before any graph is captured (nothing when off or not on CUDA)
            self.small_gemms = llama_triton.choose_small_gemms(self, opts)

    def rope_for(self, layer: int) -> RotaryEmbedding:
        """The rotary tables of layer `layer`."""
        if self.rope_local is not None and self.config.window(layer) is not None:
            return self.rope_local
        return self.rope

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale:  # Gemma: sqrt(hidden) rounded to the dtype first, as transformers does
            x = x * float(torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32).to(x.dtype))
        return x

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "lm_head", None)
        if head is not None and not isinstance(head, nn.Linear):  # packed (from_packed), tied or not
            return head(x)
        return F.linear(x, self.lm_head_weight())

    def forward(self, batch: ForwardBatch, kv: KVCache):
        """Returns float32 logits [N, vocab] for batch.sample_indices; with batch.return_hidden,
        (logits, hidden [N, H]): the final-normed hidden states the logits are computed from."""
        x = self.embed(batch.input_ids)
        if batch.embeds is not None:  # image placeholders take the vision embeddings (both backends)
            assert batch.embed_rows is not None, "image embeddings without their rows"
            x.index_copy_(0, batch.embed_rows, batch.embeds.to(x.dtype))
        if batch.carry is not None:
            assert self.carry_heads is not None, "a carry step on a model without carry heads"
            x = apply_carry(self.carry_heads, x, batch.carry)
        backend = self.backend
        if backend == "cpu":
            from slipstream.models.llama import forward_cpu as llama_cpu

            if not llama_cpu.supports(self, batch):  # (a bidirectional prefix, an odd head size)
                backend = "reference"
        if backend == "triton" and batch.lora is not None and batch.lora.bank is None:
            raise NotImplementedError("LoRA adapters on the triton backend are read from a LoraBank "
                                      "(models/lora_bank.py); this batch's LoraInput has none")
        if backend == "triton":
            from slipstream.models.llama.forward_triton import forward_triton

            x = forward_triton(self, x, batch, kv)
        elif backend == "cpu":
            x = llama_cpu.forward_cpu(self, x, batch, kv)
        else:
            rotate = self.rope.for_positions(batch.positions, x.dtype)
            local = rotate if self.rope_local is None else self.rope_local.for_positions(batch.positions, x.dtype)
            for i, layer in enumerate(self.model.layers):
                x = layer(x, batch, kv, local if self.rope_for(i) is self.rope_local else rotate)
            x = self.model.norm(x.index_select(0, batch.sample_indices))
        logits = self.logits(x).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return (logits, x) if batch.return_hidden else logits
