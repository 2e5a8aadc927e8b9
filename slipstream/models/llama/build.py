"""The Llama family's build (models/llama/family.py): a ready model + tokenizer from a model spec (a known
name, a GGUF path, an HF folder, Idefics3's included, or random weights) with dense, packed or quantized
weights."""
from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Any

import structlog
import torch

from slipstream.models.base import DTYPES, BuildOptions
from slipstream.models.config import ON_DEVICE_INIT, RANDOM_CONFIGS, TINY, ModelConfig
from slipstream.models.llama.model import LlamaForCausalLM

log = structlog.get_logger(__name__)

RANDOM = RANDOM_CONFIGS  # random weights, byte tokenizer (in config.py: the loader names them too)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights by Hugging Face name (scaled so activations stay well-conditioned)."""
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in skeleton.state_dict().items():
        if "norm" in name:
            weights[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            weights[name] = torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5)
    return weights


def random_weights_on(config: ModelConfig, seed: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Random weights drawn where they will live, in their dtype, by a generator seeded on that device: the
    same scale as `random_weights`, not its values (CUDA's Philox and the CPU's Mersenne Twister draw
    different numbers from one seed). A 1B model's draw takes milliseconds on a GPU instead of seconds of
    CPU float32 and a copy; on the meta device the tensors are empty (shapes only)."""
    device = torch.device(device)
    with torch.device("meta"):  # (one position: the rotary tables, not in the state dict, cost nothing)
        skeleton = LlamaForCausalLM(replace(config, max_position_embeddings=1))
    g = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, p in skeleton.state_dict().items():
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if g is not None:
            t.normal_(generator=g)
            if "norm" in name:
                t.mul_(0.1).add_(1.0)
            else:
                t.mul_(1.0 / p.shape[-1] ** 0.5)
        weights[name] = t
    return weights


def random_model_weights(spec: str, config: ModelConfig, seed: int, dtype: torch.dtype, device
                         ) -> dict[str, torch.Tensor]:
    """A random spec's weights as every user of the spec draws them (the engine, the transformers twin of
    tools/peers/peer_bench.py, tools/peers/random_gguf.py): on the device for ON_DEVICE_INIT specs, else on the CPU."""
    if spec in ON_DEVICE_INIT:
        return random_weights_on(config, seed, dtype, device)
    return random_weights(config, seed)


@functools.lru_cache(maxsize=1)
def _load_cached(spec: str):
    """Engines in one process (blocking vs pipelined, tests) share one dequantised checkpoint."""
    from slipstream.models.loading.loader import load_model

    return load_model(spec, dtype=torch.float32, weights="dequantized")


@functools.lru_cache(maxsize=1)
def _load_quantized(spec: str):
    """Like _load_cached, for a GGUF kept quantized (QuantWeight parts mapped from the weight cache)."""
    from slipstream.models.loading.loader import load_model

    return load_model(spec, weights="quantized")


@functools.lru_cache(maxsize=1)
def _load_packed(spec: str, seed: int):
    """(config, dense rest, packed projections, tokenizer) for the CPU fast path, shared by the
    engines of one process like _load_cached; holds no dense copy of what it packed."""
    from slipstream.models.kernels.cpu_linear import pack_weights

    tokenizer: Any  # the byte tokenizer or the checkpoint's
    if spec in RANDOM:
        from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

        config = RANDOM[spec]()
        weights = random_model_weights(spec, config, seed, torch.float32, "cpu")
        tokenizer = ByteTokenizer(config.vocab_size)
    else:
        from slipstream.models.loading.loader import load_model

        loaded = load_model(spec, dtype=torch.float32, weights="dequantized")
        config, weights, tokenizer = loaded.config, dict[str, Any](loaded.weights), loaded.tokenizer
        del loaded  # its dict must not keep the dense matrices alive
    t0 = time.perf_counter()
    packed = pack_weights(config, weights)
    log.info("weights_packed", model=spec, layers=len(packed), seconds=round(time.perf_counter() - t0, 2))
    return config, weights, packed, tokenizer


def release_heap() -> None:
    """Hand freed heap memory back to the kernel (glibc; elsewhere a no-op). Loading leaves ~25 MB of
    freed parse buffers (the tokenizer's JSON) in the heap, which would otherwise stay resident."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def forget_loaded() -> None:
    """Drop the process's shared loads (dense and packed): the next build loads afresh."""
    _load_cached.cache_clear()
    _load_packed.cache_clear()
    _load_quantized.cache_clear()


def quantized_source(spec: str, device: torch.device) -> bool:
    """Whether `spec` can run with quantized weights on `device`: a GGUF file, and on the CPU the
    compiled kernels (without them the quantized path would expand every weight on every step; the
    dequantized model is the fast fallback, and the reason is logged)."""
    from slipstream.models.loading.loader import is_gguf

    if spec in RANDOM or not is_gguf(spec):
        return False
    if torch.device(device).type == "cpu":
        from slipstream.models.kernels.cpu_kernels import native_kernels

        if native_kernels() is None:
            log.warning("weights_dequantized", model=spec,
                        reason="the compiled CPU kernels are unavailable (cpu_kernels_unavailable says why)")
            return False
    return True


def build_llama(spec: str, options: BuildOptions):
    """Returns (model, tokenizer, ModelConfig). `weights="quantized"`: a GGUF's quantized matrices stay
    quantized (models/kernels/quant_linear.py; `invariant`: batch-invariant CPU products); other sources, or
    "dequantized": float weights, where `pack` (CPU, float32) runs the projections through oneDNN
    with prepacked weights (slipstream/models/kernels/cpu_linear.py)."""
    dtype, device, seed = options.dtype, options.device, options.seed
    t0 = time.perf_counter()
    if options.weights == "quantized" and quantized_source(spec, device):
        loaded = _load_quantized(spec)
        config, tokenizer = loaded.config, loaded.tokenizer
        model = LlamaForCausalLM.from_quantized(config, loaded.weights, DTYPES[dtype], device, options.invariant)
        release_heap()
        log.info("model_ready", model=spec, layers=config.num_layers, vocab=config.vocab_size, dtype=dtype,
                 device=str(device), weights="quantized", seconds=round(time.perf_counter() - t0, 2))
        return model, tokenizer, config
    from slipstream.models.kernels.cpu_linear import can_pack

    if options.pack and can_pack(DTYPES[dtype], device):
        config, weights, packed, tokenizer = _load_packed(spec, seed if spec in RANDOM else 0)
        model = LlamaForCausalLM.from_packed(config, weights, packed)
        log.info("model_ready", model=spec, layers=config.num_layers, vocab=config.vocab_size, dtype=dtype,
                 device=str(device), packed=True, seconds=round(time.perf_counter() - t0, 2))
        return model, tokenizer, config
    if spec in RANDOM:
        from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

        config = RANDOM[spec]()
        weights = random_model_weights(spec, config, seed, DTYPES[dtype], device)
        tokenizer = ByteTokenizer(config.vocab_size)
    else:
        loaded = _load_cached(spec)
        config, weights, tokenizer = loaded.config, loaded.weights, loaded.tokenizer
    model = LlamaForCausalLM.from_weights(config, weights, DTYPES[dtype], device)
    log.info("model_ready", model=spec, layers=config.num_layers, vocab=config.vocab_size, dtype=dtype,
             device=str(device), seconds=round(time.perf_counter() - t0, 2))
    return model, tokenizer, config
