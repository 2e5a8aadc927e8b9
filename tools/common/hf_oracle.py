"""Bridges to Hugging Face transformers, used only by tests and tools as the correctness oracle."""
from __future__ import annotations

import contextlib
import os

import torch

from slipstream.models.config import ModelConfig, llama3_rope_factors


def hf_llama_config(config: ModelConfig, rope_scaling: dict | None = None):
    """`rope_scaling`: the llama3 scaling (rope_type, factor, ...) a rope-scaled config was made from
    (e.g. config.LLAMA_3_2_ROPE); checked against config.rope_freq_factors, which is all ModelConfig keeps."""
    if config.architecture != "llama" or (config.rope_freq_factors is None) != (rope_scaling is None):
        raise ValueError("hf_llama_config builds Llama configs, rope-scaled ones with the rope_scaling they were "
                         "made from (tests/model_families.py builds Qwen2 and other rope-scaled oracles)")
    rope: dict
    if rope_scaling is not None:
        scaling = {k: v for k, v in rope_scaling.items() if k != "rope_type"}
        if rope_scaling.get("rope_type") != "llama3" or llama3_rope_factors(
                config.head_dim, config.rope_theta, **scaling) != config.rope_freq_factors:
            raise ValueError(f"rope_scaling {rope_scaling} does not give the config's rope_freq_factors")
        rope = {"rope_parameters": {"rope_theta": config.rope_theta, **rope_scaling}}
    else:
        rope = {"rope_theta": config.rope_theta}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig

    return LlamaConfig(
        **rope,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) or None,
        attention_bias=False,
        mlp_bias=False,
    )


def random_hf_llama(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A transformers LlamaForCausalLM with random weights, plus those weights by HF name."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_llama_config(config)).to(dtype).eval()
    with torch.no_grad():  # default init leaves norms at 1; perturb so RMSNorm weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return model, weights


def hf_llama_from_weights(config: ModelConfig, weights: dict[str, torch.Tensor], rope_scaling: dict | None = None,
                          device=None):
    """transformers' LlamaForCausalLM holding exactly `weights` (slipstream uses Hugging Face names).
    `device`: where it is built (float32), e.g. a GPU for a 1B shape, whose default init would take the CPU
    seconds."""
    from transformers import LlamaForCausalLM

    with contextlib.nullcontext() if device is None else torch.device(device):
        model = LlamaForCausalLM(hf_llama_config(config, rope_scaling))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not line up: missing {missing}, unexpected {unexpected}")
    model.tie_weights()  # a tied lm_head shares the embedding, as in slipstream
    return model.eval()
