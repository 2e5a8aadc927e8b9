"""Bridges to Hugging Face transformers, used only by tests and tools as the correctness oracle."""
from __future__ import annotations

import os

import torch

from slipstream.models.config import ModelConfig


def hf_llama_config(config: ModelConfig):
    if config.architecture != "llama" or config.rope_freq_factors is not None:
        raise ValueError("hf_llama_config builds plain Llama configs only "
                         "(tests/model_families.py builds Qwen2 and rope-scaled oracles)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
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


def hf_llama_from_weights(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM holding exactly `weights` (slipstream uses Hugging Face names)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_llama_config(config))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not line up: missing {missing}, unexpected {unexpected}")
    model.tie_weights()  # a tied lm_head shares the embedding, as in slipstream
    return model.eval()
