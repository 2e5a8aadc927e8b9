"""Hyper-parameters of a Llama-family decoder, independent of where the weights came from."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.models.idefics3.config import VisionConfig

# qwen2 = llama + biases on the q/k/v projections; qwen3 = llama + per-head RMSNorm on q and k;
# phi3 = llama whose checkpoints fuse qkv_proj and gate_up_proj (split at load), LongRoPE;
# gemma3 = llama + the Gemma options below (GeGLU, sandwich norms, scaled embeddings, q/k norms, local
# and global layers with their own rotary bases, attention scale, logit softcapping)
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate activation: SiLU (SwiGLU) or tanh-GELU (GeGLU, Gemma)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "llama"
    architecture: str = "llama"
    attention_bias: bool = False  # biases on q/k/v (Qwen2); o_proj and the MLP never have one
    # Partial rotary (Phi-4-mini): the first rotary_dim dims of each q/k head rotate, the rest pass as they
    # are (None: all head_dim). Loaders reorder the q/k projections' rows so that the kernels' rotation of
    # (j, j + head_dim / 2) pairs rotates the pairs of those dims and leaves the others (cos 1, sin 0):
    # rotary.partial_rotary_order.
    rotary_dim: int | None = None
    # RoPE frequency divisors, one per rotary pair (rotary_dims // 2): inv_freq[i] / factors[i].
    # Llama-3 scaling and linear scaling reduce to this; so does a GGUF's `rope_freqs` tensor.
    rope_freq_factors: tuple[float, ...] | None = None
    # LongRoPE (Phi-3): positions from rope_long_from on divide by these factors instead (None: no
    # switch), and cos/sin are scaled by rope_attention_factor at every position
    rope_long_factors: tuple[float, ...] | None = None
    rope_long_from: int | None = None
    rope_attention_factor: float = 1.0
    # Per-head RMSNorm of q and k (over head_dim, before rotary): Qwen3 (q_norm / k_norm weights)
    qk_norm: bool = False
    # Sliding-window attention: a query at position p sees the keys at positions (p - window, p].
    # `sliding_layers[i]`: whether layer i is windowed (None: all are, when sliding_window is set).
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    # Gemma's layer options. RMSNorm weights are stored as the factor they multiply by: Gemma's
    # `1 + weight` is added at load (HF folders; llama.cpp's GGUFs hold it added), so one norm serves all.
    hidden_act: str = "silu"  # one of ACTIVATIONS
    sandwich_norms: bool = False  # post_attention_layernorm on the attention's output, pre/post_feedforward_layernorm around the MLP
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), the factor rounded to the model's dtype
    attn_scale: float | None = None  # the attention scores' factor (None: head_dim ** -0.5)
    rope_local_theta: float | None = None  # the windowed layers' rotary base, unscaled (None: rope_theta, scaled)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # Images (Idefics3): the placeholder id whose rows take vision embeddings, and the vision tower's
    # config; both None for a text-only model.
    image_token_id: int | None = None
    vision: VisionConfig | None = None

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s attention window in positions, or None (full causal attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def rotary_dims(self) -> int:
        """The dims of each q/k head that rotate."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def kv_window(self) -> int | None:
        """The positions back from a query whose K/V some layer still reads, when every layer is windowed
        (the largest window); None when a layer attends to the whole context (Gemma's global layers)."""
        windows = [self.window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(w for w in windows if w is not None)

    def scale(self) -> float:
        """The attention scores' factor."""
        return self.head_dim ** -0.5 if self.attn_scale is None else self.attn_scale

    def __post_init__(self) -> None:
        if (self.image_token_id is None) != (self.vision is None):
            raise ValueError("image_token_id and vision are set together (a vision model) or not at all")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not one of {ARCHITECTURES}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even, in 2..head_dim={self.head_dim} (or None)")
        pairs = self.rotary_dims // 2
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != pairs:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                             f"{self.rotary_dims} rotary dims need {pairs}")
        if (self.rope_long_factors is None) != (self.rope_long_from is None) or (
                self.rope_long_factors is not None and len(self.rope_long_factors) != pairs):
            raise ValueError("rope_long_factors (rotary_dims // 2 of them) and rope_long_from are set together")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {ACTIVATIONS}")
        if self.final_logit_softcap is not None and not self.final_logit_softcap > 0:
            raise ValueError(f"final_logit_softcap={self.final_logit_softcap} must be > 0 (or None)")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> tuple[float, ...]:
    """Llama-3's frequency-dependent RoPE scaling as per-frequency divisors.

    Wavelengths shorter than original/high_freq_factor keep their frequency, longer than
    original/low_freq_factor are slowed by `factor`, and those between are blended linearly in
    original/wavelength. Computed in float64; the rotary table applies them in float32.
    """
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def tiny_config(vocab_size: int = 512) -> ModelConfig:
    """A few-layer model of the same architecture as SmolLM2, for fast tests."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,  # long enough for the prefill-fairness bench (2,048-token prompts)
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny-random",
    )


def smollm2_135m_config() -> ModelConfig:
    """SmolLM2-135M's architecture (as read from its GGUF), for random-weight timing runs where the
    98 MB checkpoint cannot travel (e.g. to a lent GPU machine)."""
    return ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="random-smollm2-135m",
    )


def smollm2_360m_config() -> ModelConfig:
    """SmolLM2-360M's architecture (its Hugging Face config), with SmolLM2-135M's vocabulary: a random
    target for a random 135M-shaped draft model (speculative decoding's timing)."""
    return replace(smollm2_135m_config(), hidden_size=960, intermediate_size=2560, num_layers=32, num_heads=15,
                   num_kv_heads=5, name="random-smollm2-360m")


# Llama-3.2's RoPE scaling, as both checkpoints' config.json has it (rope_theta 500000)
LLAMA_3_2_ROPE: dict[str, Any] = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama_3_2(name: str, hidden: int, layers: int, heads: int, head_dim: int) -> ModelConfig:
    """Llama-3.2's architecture (meta-llama/Llama-3.2-{1B,3B} config.json: GQA with 8 KV heads, SwiGLU 8192,
    vocabulary 128,256, tied embeddings, llama3 RoPE scaling), for random-weight timing runs at the sizes
    people run. The byte tokenizer's ids stand in for the real one's: bos 1, eos 2 (not 128000 / 128001)."""
    theta = 500000.0
    scaling = {k: v for k, v in LLAMA_3_2_ROPE.items() if k != "rope_type"}
    return ModelConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=8192,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name=name,
        rope_freq_factors=llama3_rope_factors(head_dim, theta, **scaling),
    )


def llama_3_2_1b_config() -> ModelConfig:
    """Llama-3.2-1B's shape: 1,235,814,400 parameters."""
    return _llama_3_2("random-llama-3.2-1b", hidden=2048, layers=16, heads=32, head_dim=64)


def llama_3_2_3b_config() -> ModelConfig:
    """Llama-3.2-3B's shape: 3,212,749,824 parameters."""
    return _llama_3_2("random-llama-3.2-3b", hidden=3072, layers=28, heads=24, head_dim=128)


TINY = "tiny-random"
RANDOM_CONFIGS = {TINY: tiny_config, "random-smollm2-135m": smollm2_135m_config,
                  "random-smollm2-360m": smollm2_360m_config,
                  "random-llama-3.2-1b": llama_3_2_1b_config,
                  "random-llama-3.2-3b": llama_3_2_3b_config}  # random weights, byte tokenizer
# Random specs whose weights are drawn where the model runs, in its dtype, by a generator seeded there
# (build.random_weights_on): at 1-3 B parameters a float32 draw on the CPU and a copy would take much of a
# GPU call. The others keep their CPU float32 draw, which the tests' transformers twins reproduce.
ON_DEVICE_INIT = frozenset({"random-llama-3.2-1b", "random-llama-3.2-3b"})
