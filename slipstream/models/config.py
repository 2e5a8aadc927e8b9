"""Hyper-parameters of a Llama-family decoder, independent of where the weights came from."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")


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
