"""The new families' GGUFs with quantized matrices, kept quantized on the CPU backend (the default
weights="quantized"), against the same file dequantized by gguf: Qwen3's q/k norms, Mistral's window
(llama.cpp's permuted q/k rows), Phi-3's fused qkv / gate_up rows split while quantized, Phi-4-mini's
partial-rotary reordering of quantized rows, Gemma 3's norms, scales and softcap over quantized products;
each with the legacy types and with the K-quants of a Q4_K_M file.

The repack is exact (tests/test_quant_formats.py), so both models multiply the same float weights: only
float32 rounding separates them, unless a quantized row went to the wrong place. The float32 files
themselves are checked against transformers in tests/test_family_oracles.py.
"""
import asyncio

import gguf
import pytest
import torch
from host_batch import Chunk, host_batch
from model_families import byte_vocab, hf_model, special_ids, write_gguf

from slipstream.models.base import ForwardBatch, KVCache
from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.models.kernels.cpu_kernels import _compiler
from slipstream.models.kernels.quant_linear import QuantEmbedding, QuantLinear
from slipstream.models.llama.build import forget_loaded
from slipstream.models.llama.model import LlamaForCausalLM
from slipstream.models.loading.build import build_model
from slipstream.models.loading.gguf_loader import load_gguf

pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C compiler: no compiled CPU kernels")
Q = gguf.GGMLQuantizationType

# family -> GGUF architecture
FAMILIES = {"qwen3": "qwen3", "mistral-sw": "llama", "phi3": "phi3", "phi4": "phi3", "gemma3": "gemma3"}
# Each layer's types: layer 0's q / k / v (Phi: the fused qkv) and gate / up u4, layer 1's i8 (both
# containers under a row split or reorder). One container a layer: q / k / v and gate / up stack into
# the cpu backend's fused products, so the plain layers (Mistral, Phi) run the one-call C stack
# the K-quants of a Q4_K_M file (gguf cannot write them: random blocks, model_families.RANDOM_BLOCKS), whose
# blocks of 256 need in-features of 256n: a wider model, the attention output (in: heads x 16) Q8_0
LAYER_TYPES = {
    "legacy": [{"qkv": Q.Q4_1, "attn_output": Q.Q8_0, "gate_up": Q.Q4_0, "ffn_down": Q.Q5_1},
               {"qkv": Q.Q5_0, "attn_output": Q.Q4_1, "gate_up": Q.Q8_0, "ffn_down": Q.Q4_0}],
    "k": [{"qkv": Q.Q4_K, "attn_output": Q.Q8_0, "gate_up": Q.Q4_K, "ffn_down": Q.Q6_K},
          {"qkv": Q.Q6_K, "attn_output": Q.Q8_0, "gate_up": Q.Q5_K, "ffn_down": Q.Q4_K}]}
OUTPUT_TYPE = {"legacy": Q.Q4_1, "k": Q.Q6_K}
PROMPT_LEN, DECODE_STEPS = 30, 8  # past the window (12) of Mistral's layers and Gemma's local layer
NEW_TOKENS = 16
# Both sides are float32 products of the same weights, summed in different orders (the C kernels'
# groups of 32 against torch's float GEMM, whose AVX2 / AVX512 variant depends on the CPU): each
# logit is off by a few ulps of the sums that make it. Measured at most 3.1e-6 of the logits' scale
# (Phi-3) on an AVX512-VNNI + AMX Xeon; the bound leaves ~10x for other CPUs' orders. No integer
# rounding enters on any CPU: QuantLinear multiplies float activations unless set_activations says
# otherwise, and the engine below asks for activations="float" (its "auto" is int16 where the CPU has
# AVX512-VNNI). A wrong row (split, permuted, reordered) moves the logits by about their scale.
REL_TOL = 3e-5


@pytest.fixture(scope="module", params=[(f, kind) for kind in LAYER_TYPES for f in FAMILIES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def qfamily(request, tmp_path_factory):
    (name, kind), arch = request.param, FAMILIES[request.param[0]]
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    # Gemma's hidden 96 here (its oracle's 80 is no multiple of 32): every matrix quantized; K-quants: 256
    # wide (Phi's head size is hidden / heads: 16 heads keep it 16, as its LongRoPE factors count)
    hidden, sizes = 96 if name == "gemma3" else None, None
    if kind == "k":
        hidden, sizes = 256, {"intermediate_size": 512}
        if arch == "phi3":
            sizes.update(num_attention_heads=16, num_key_value_heads=8)
    model = hf_model(name, len(vocab.tokens), seed=40 + list(FAMILIES).index(name), bos=bos, eos=eos,
                     hidden=hidden, sizes=sizes)
    quantize = {"token_embd.weight": Q.Q8_0, "output.weight": OUTPUT_TYPE[kind]}  # (tied families write no output)
    for i, types in enumerate(LAYER_TYPES[kind]):
        names = {"qkv": ("attn_qkv",) if arch == "phi3" else ("attn_q", "attn_k", "attn_v"),
                 "gate_up": ("ffn_up",) if arch == "phi3" else ("ffn_gate", "ffn_up")}
        for group, qtype in types.items():
            quantize.update({f"blk.{i}.{t}.weight": qtype for t in names.get(group, (group,))})
    path = tmp_path_factory.mktemp(name) / f"{name}-{kind}.gguf"
    write_gguf(path, arch, model, vocab, pre="qwen2", quantize=quantize)
    forget_loaded()
    quant, _, config = build_model(str(path), "float32", torch.device("cpu"), weights="quantized")
    # The reference: gguf's own dequantisation of the file, split / unpermuted / reordered as float rows
    # (the path a float32 GGUF takes, oracle-tested). Not weights="dequantized": that expands the
    # repacked rows, after the loader's split and reorder, so it would agree with a wrong row.
    dense_config, dense_weights, _ = load_gguf(path, quantized=False)
    assert dense_config == config
    dense = LlamaForCausalLM.from_weights(config, dense_weights, torch.float32, "cpu")
    quant.set_kernel_backend("cpu")
    dense.set_kernel_backend("cpu")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(vocab.tokens) - 3, (n,), generator=g).tolist() for n in (PROMPT_LEN, 9)]
    yield {"name": name, "kind": kind, "path": path, "quant": quant, "dense": dense, "config": config, "prompts": prompts,
           "tied": model.config.tie_word_embeddings}
    forget_loaded()


def test_the_matrices_stay_quantized(qfamily):
    """Every projection (Phi's fused ones split into the Llama names), the embedding and the head are
    quantized modules in the GGUF's own formats, and no float copy of a matrix is held."""
    model = qfamily["quant"]
    for layer, types in zip(model.model.layers, LAYER_TYPES[qfamily["kind"]]):
        t = {k: v.name for k, v in types.items()}
        want = {"q_proj": t["qkv"], "k_proj": t["qkv"], "v_proj": t["qkv"], "o_proj": t["attn_output"],
                "gate_proj": t["gate_up"], "up_proj": t["gate_up"], "down_proj": t["ffn_down"]}
        got = {n: getattr(layer.self_attn if n[0] in "qkvo" else layer.mlp, n) for n in want}
        assert all(isinstance(m, QuantLinear) for m in got.values()), got
        assert {n: m.qweight.source for n, m in got.items()} == want
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.qweight.source == ("Q8_0" if qfamily["tied"] else OUTPUT_TYPE[qfamily["kind"]].name)
    assert not any(p.numel() > 1000 for p in model.parameters())


def _logits(model, config, prompt: list[int], steps: int) -> torch.Tensor:
    """A prefill, then `steps` greedy decode steps: the logits of every step."""
    kv = KVCache(config, 16, 4, torch.float32, "cpu")
    pages = list(range(15, 0, -1))
    batch, _ = host_batch([Chunk(tokens=prompt, start_pos=0, pages=pages)], 4)
    out, pos = [], len(prompt)
    with torch.no_grad():
        for _ in range(steps + 1):
            out.append(model(batch, kv))
            batch, _ = host_batch([Chunk(tokens=[int(out[-1][-1].argmax())], start_pos=pos, pages=pages)], 4)
            pos += 1
    return torch.cat(out)


def test_logits_equal_the_dequantized(qfamily, monkeypatch):
    """Prefill and decode steps on the cpu backend: the quantized model's logits are the dequantized
    model's within float32 rounding, and so are their greedy tokens; for the plain layers both from the
    one-call C stack and from the Python loop over the same kernels (what a GGUF whose q / k / v types
    differ, as Q4_K_M's, runs)."""
    from slipstream.models.llama import forward_cpu

    prompt, quant = qfamily["prompts"][0], qfamily["quant"]
    want = _logits(qfamily["dense"], qfamily["config"], prompt, DECODE_STEPS)
    runs = {"as built": _logits(quant, qfamily["config"], prompt, DECODE_STEPS)}
    plain = qfamily["name"] in ("mistral-sw", "phi3", "phi4")  # (q/k norms, Gemma's options: the loop)
    assert bool(quant.cpu_layers) == plain
    if plain:
        with monkeypatch.context() as m:
            m.setattr(forward_cpu, "decoder_layers", lambda model: None)
            runs["the loop"] = _logits(quant, qfamily["config"], prompt, DECODE_STEPS)
    scale = want.abs().max().item()
    for how, got in runs.items():
        assert (got - want).abs().max().item() < REL_TOL * scale, (how, (got - want).abs().max().item() / scale)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), how


def _prefill_logits(model, config, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill (its sampled rows: all of them)."""
    n, page = len(ids), 4
    pages = list(range(1, -(-n // page) + 1))
    kv = KVCache(config, len(pages) + 1, page, torch.float32, "cpu")
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor([pages[i // page] * page + i % page
                                                                            for i in range(n)]),
                         torch.arange(n), AttentionMetadata([0, n], [n], [pages], page))
    with torch.no_grad():
        return model(batch, kv)


def test_engine_greedy_equals_the_dequantized(qfamily):
    """The engine (default weights="quantized", depth 2) answers the dequantized model's greedy tokens:
    at every generated position the dense model's argmax over the prompt and the tokens so far is the
    engine's token, by a margin far above the rounding between the two."""
    from slipstream import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(qfamily["path"]), device="cpu", pipeline_depth=2, activations="float",
                          kv_cache_tokens=256, page_size=16)

    async def run():
        async with Engine(config) as engine:
            assert isinstance(engine._parts.runner.model.model.layers[0].self_attn.o_proj, QuantLinear)
            return await asyncio.gather(*(engine.complete(p, params) for p in qfamily["prompts"]))

    for prompt, out in zip(qfamily["prompts"], asyncio.run(run())):
        tokens = out.token_ids
        assert len(tokens) == NEW_TOKENS
        logits = _prefill_logits(qfamily["dense"], qfamily["config"], prompt + tokens)[len(prompt) - 1:-1]
        top2 = logits.topk(2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        # each logit within REL_TOL of the scale on either side: no CPU's rounding can swap these two
        assert margin > 2 * REL_TOL * logits.abs().max().item(), margin
        assert logits.argmax(-1).tolist() == tokens
