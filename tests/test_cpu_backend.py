"""Quantized GGUF models on the CPU: what the engine builds, the "cpu" kernel backend against the reference
backend and the dequantized model, and batch invariance with quantized weights."""
import asyncio
import math

import gguf
import pytest
import torch
from model_families import byte_vocab, hf_model, special_ids, write_gguf

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api.assemble import assemble, int16_has_vnni, resolve_activations
from slipstream.errors import InvalidRequestError
from slipstream.models.llama.build import forget_loaded
from slipstream.models.loading.build import build_model
from slipstream.models.kernels.cpu_kernels import _compiler
from slipstream.models.base import KVCache
from slipstream.models.kernels.quant_linear import QuantEmbedding, QuantLinear

# only without a compiler: a failed build fails (tests/test_quant_kernels.py), never skips
pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C compiler: no compiled CPU kernels")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quant_gguf(request, tmp_path_factory):
    """A tiny GGUF in the formats gguf-py can write: Q4_1 attention, Q4_0/Q5_1 MLP, Q8_0 embedding;
    llama with an untied Q5_0 head, qwen2 with a tied head and q/k/v biases."""
    family = request.param
    path = tmp_path_factory.mktemp("q") / f"tiny-{family}-q.gguf"
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    quantize = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q5_0}
    for i in range(2):
        quantize.update({f"blk.{i}.attn_q.weight": Q.Q4_1, f"blk.{i}.attn_k.weight": Q.Q4_1,
                         f"blk.{i}.attn_v.weight": Q.Q4_1, f"blk.{i}.attn_output.weight": Q.Q8_0,
                         f"blk.{i}.ffn_gate.weight": Q.Q4_0, f"blk.{i}.ffn_up.weight": Q.Q4_0,
                         f"blk.{i}.ffn_down.weight": Q.Q5_1})
    write_gguf(path, family, hf_model(family, len(vocab.tokens), seed=11, bos=bos, eos=eos), vocab,
               pre="llama-bpe" if family == "llama" else "qwen2", quantize=quantize)
    forget_loaded()
    yield str(path)
    forget_loaded()


def forward_logits(model, config, steps):
    """Logits of a prompt fed as a chunk that samples nothing (3 tokens) and one that does, then decode
    steps of the sequence (the host_batch helper)."""
    from host_batch import Chunk, host_batch

    kv = KVCache(config, 8, 4, torch.float32, "cpu")
    prompt = [5, 9, 77, 3, 101, 44, 12, 8, 31, 2]
    batch, _ = host_batch([Chunk(tokens=prompt[:3], start_pos=0, pages=[1, 2, 3, 4], sample=False)], 4)
    assert model(batch, kv).shape[0] == 0  # a step with no sampled row
    out, pos, tokens = [], 3, prompt[3:]
    for n in steps:
        batch, _ = host_batch([Chunk(tokens=tokens[:n], start_pos=pos, pages=[1, 2, 3, 4])], 4)
        logits = model(batch, kv)
        out.append(logits)
        pos, tokens = pos + n, [int(logits[-1].argmax())] * 7
    return torch.cat(out)


def test_engine_builds_quantized_layers_on_the_cpu_backend(quant_gguf):
    parts = assemble(EngineConfig(model=quant_gguf, kv_cache_tokens=64))
    try:
        model = parts.runner.model
        attn = model.model.layers[0].self_attn
        assert model.backend == "cpu" and isinstance(attn.q_proj, QuantLinear)
        assert attn.qkv_cpu is not None and attn.qkv_cpu.qweight.source == "Q4_1"  # fused for the kernel
        assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
        assert not any(p.numel() > 1000 for p in model.parameters())  # no float copy of a matrix
    finally:
        parts.close()
    parts = assemble(EngineConfig(model=quant_gguf, kv_cache_tokens=64, weights="dequantized"))
    try:
        assert type(parts.runner.model.model.layers[0].mlp.down_proj).__name__ == "PackedLinear"
    finally:
        parts.close()


def test_cpu_backend_matches_reference_and_dequantized(quant_gguf):
    """Prefill then decode: the cpu backend on quantized weights, the reference backend on the same
    weights, and the dequantized model agree within float32 rounding."""
    quant, _, config = build_model(quant_gguf, "float32", torch.device("cpu"), weights="quantized")
    dense, _, _ = build_model(quant_gguf, "float32", torch.device("cpu"), weights="dequantized")
    steps = [7, 1, 1, 1]
    reference = forward_logits(dense, config, steps)
    quant.set_kernel_backend("reference")
    on_reference = forward_logits(quant, config, steps)
    quant.set_kernel_backend("cpu")
    on_cpu = forward_logits(quant, config, steps)
    scale = reference.abs().max().item()
    assert (on_reference - reference).abs().max().item() < 1e-5 * scale
    assert (on_cpu - reference).abs().max().item() < 1e-5 * scale
    assert torch.equal(on_cpu.argmax(-1), reference.argmax(-1))


ROUNDING_FLIPS = 4  # the activations the two backends' float32 noise may round differently (int8), see below


@pytest.mark.parametrize("mode", ["int8", "int16"])
def test_rounded_activations_on_both_backends(quant_gguf, mode, monkeypatch):
    """EngineConfig.activations="int8" / "int16": the cpu backend's one-call stack runs the rounding
    kernels, as the reference backend's QuantLinear does (the same up to where float32 rounding moves a
    value across a rounding step), and not the float product; "float" turns them off."""
    from slipstream.models.llama import forward_cpu

    quant, _, config = build_model(quant_gguf, "float32", torch.device("cpu"), weights="quantized")
    steps = [7, 1, 1, 1]
    quant.set_activations(mode)
    on_reference = forward_logits(quant, config, steps)
    quant.set_kernel_backend("cpu")
    on_cpu = forward_logits(quant, config, steps)
    assert quant.cpu_layers  # (the one-call stack ran)
    with monkeypatch.context() as m:
        m.setattr(forward_cpu, "decoder_layers", lambda model: None)  # the Python loop over the same kernels
        on_cpu_loop = forward_logits(quant, config, steps)
    quant.set_activations("float")
    on_float = forward_logits(quant, config, steps)
    scale = on_reference.abs().max().item()
    # The one-call stack against the Python loop: the same kernels in the same order, so the same
    # rounded activations and integer sums: bit for bit on every CPU (any kernel or operand it
    # passes differently shows here, rounding mode included).
    assert torch.equal(on_cpu, on_cpu_loop)
    # Against the reference backend (torch's norms and attention), whose float32 results differ from
    # the C kernels' by ~1e-7 and by more where torch picks AVX512/oneDNN kernels. An activation
    # within that noise of a rounding boundary rounds one step apart on the two sides (a flip). Its
    # share of the logits: one step d * w of one column, where the whole rounding error is K errors
    # of at most d / 2 each, ~sqrt(K / 12) * d * w: one flip is ~sqrt(12 / K) of it (K = 64, the
    # narrowest product here: 0.43; measured 0.36 on an AVX512-VNNI + AMX CPU, 3.5e-3 of the scale
    # against 9.6e-3, which the former bound of 1e-3 of the scale refused). int8's bound allows
    # ROUNDING_FLIPS of them (other CPUs emulated by perturbing torch's RMSNorm by 1e-6..1e-5, 8..80
    # ulps, in 120 runs: at most 1.50 of the rounding error; the former bound failed 86 of them).
    # So loose a bound cannot tell int8 from the float product (a difference of 1.0 of it): that
    # is `far` (cpu int8 against cpu float: one backend, no flips), the table's kinds below and the
    # exact check above; the rounding kernels themselves are checked against an exact model of
    # the rounding in tests/test_quant_kernels.py.
    # int16's steps are 258x finer than int8's: many flips, each tiny, near the float32 noise.
    rounding = (on_reference - on_float).abs().max().item()
    near = ROUNDING_FLIPS * math.sqrt(12 / config.hidden_size) * rounding if mode == "int8" else 1e-4 * scale
    far = {"int8": 1e-3, "int16": 2e-6}[mode]
    assert (on_cpu - on_reference).abs().max().item() <= near, ((on_cpu - on_reference).abs().max().item(), near)
    assert (on_cpu - on_float).abs().max().item() > far * scale
    quant.set_activations(mode)
    forward_logits(quant, config, [1])
    # the one-call stack's table names the rounding kernels (int16's output alone is too close to float's to tell)
    assert {ly.kind & ~1 for layer in quant.cpu_layers for ly in (layer.qkv, layer.o, layer.gate_up, layer.down)} \
        == {{"int8": 2, "int16": 4}[mode]}
    for act in ("float", mode):
        parts = assemble(EngineConfig(model=quant_gguf, kv_cache_tokens=64, activations=act))
        try:
            model = parts.runner.model
            assert model.model.layers[0].self_attn.qkv_cpu.activations == act and model.lm_head.activations == act
        finally:
            parts.close()
    # where no CPU kernel computes the products (batch invariance keeps the reference), they are refused, not ignored
    with pytest.raises(InvalidRequestError) as e:
        assemble(EngineConfig(model=quant_gguf, kv_cache_tokens=64, activations=mode, batch_invariant=True))
    assert e.value.param == "activations"


def test_auto_activations_are_int16_on_the_cpu_kernels_and_float_elsewhere(quant_gguf):
    # (greedy agreement with transformers under the default, now int16: tests/test_oracle_smollm.py)
    assert EngineConfig().activations == "auto"
    fast = "int16" if int16_has_vnni() else "float"  # (the plain-C int16 path is not the default)
    assert resolve_activations("auto", True) == fast and resolve_activations("auto", False) == "float"
    for extra, used in ((dict(), fast), (dict(batch_invariant=True), "float")):
        parts = assemble(EngineConfig(model=quant_gguf, kv_cache_tokens=64, **extra))
        try:
            assert {m.activations for m in parts.runner.model.modules() if isinstance(m, QuantLinear)} == {used}
        finally:
            parts.close()


def test_dense_model_on_the_cpu_backend():
    """A float model (random weights, dense and oneDNN-packed) runs the same kernels between its
    projections (llama_cpu.forward_cpu's per-layer loop)."""
    from slipstream.models.config import tiny_config

    config = tiny_config()
    for pack in (False, True):
        model, _, _ = build_model("tiny-random", "float32", torch.device("cpu"), pack=pack)
        reference = forward_logits(model, config, [7, 1, 1])
        model.set_kernel_backend("cpu")
        assert (forward_logits(model, config, [7, 1, 1]) - reference).abs().max().item() < 1e-4
        model.set_kernel_backend("reference")


def generate(config, prompts, n=12):
    async def run():
        async with Engine(config) as engine:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

            async def one(p):
                return [t async for d in engine.stream(p, params) for t in d.token_ids]

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


PROMPTS = ["Hello world", "the quick brown fox", "12345", "a b c d e f"]


def test_batch_invariant_with_quantized_weights(quant_gguf):
    """Quantized products in invariant mode (one x row per pass): depth 1 and depth 2, and a request
    alone or beside others, give the same greedy tokens."""
    base = dict(model=quant_gguf, kv_cache_tokens=256, batch_invariant=True)
    parts = assemble(EngineConfig(**base))
    try:
        layers = [m for m in parts.runner.model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 2 * 7 + 1 and all(m.invariant for m in layers)  # the lm_head too, tied or not
    finally:
        parts.close()
    deep = generate(EngineConfig(**base, pipeline_depth=2), PROMPTS)
    assert generate(EngineConfig(**base, pipeline_depth=1), PROMPTS) == deep
    assert generate(EngineConfig(**base), PROMPTS[:1]) == deep[:1]


def test_weights_field_is_validated():
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(weights="int4")
    assert e.value.param == "weights"
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(activations="int4")
    assert e.value.param == "activations"
