"""The Llama-3.2 shapes scaled down for CPU tests: their structure (GQA 4:1, tied embeddings, llama3 RoPE
scaling, a vocabulary past the byte tokenizer's ids) at a few thousand parameters."""
from dataclasses import replace

from slipstream.models.config import LLAMA_3_2_ROPE, ModelConfig, llama3_rope_factors, llama_3_2_1b_config


def small_llama_3_2() -> ModelConfig:
    head_dim, theta = 8, 500000.0
    scaling = {k: v for k, v in LLAMA_3_2_ROPE.items() if k != "rope_type"}
    return replace(llama_3_2_1b_config(), vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_heads=8, num_kv_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                   rope_freq_factors=llama3_rope_factors(head_dim, theta, **scaling))
