"""LoRA on the "cpu" backend's compiled path, at the model level: quantized weights (the C kernels'
products, the delta beside them), Llama and Qwen2 (biases), against transformers + peft; and the
deltas inside the one-call C stack (llama_forward_cpu.c) as the per-layer Python loop adds them."""
import copy

import pytest
import torch

from lora_util import make_adapter

pytest.importorskip("peft")

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quant_gguf(request, tmp_path_factory):
    """A tiny quantized GGUF (Q4_1 q/k/v as the default model, Q8_0 / Q4_0 / Q5_1 elsewhere); qwen2 has
    q/k/v biases and a tied head."""
    import gguf
    from model_families import byte_vocab, hf_model, special_ids, write_gguf

    from slipstream.models.llama.build import forget_loaded

    q = gguf.GGMLQuantizationType
    family = request.param
    path = tmp_path_factory.mktemp("lora-q") / f"tiny-{family}-q.gguf"
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    quantize = {"token_embd.weight": q.Q8_0}
    for i in range(2):
        quantize.update({f"blk.{i}.attn_q.weight": q.Q4_1, f"blk.{i}.attn_k.weight": q.Q4_1,
                         f"blk.{i}.attn_v.weight": q.Q4_1, f"blk.{i}.attn_output.weight": q.Q8_0,
                         f"blk.{i}.ffn_gate.weight": q.Q4_0, f"blk.{i}.ffn_up.weight": q.Q4_0,
                         f"blk.{i}.ffn_down.weight": q.Q5_1})
    hf = hf_model(family, len(vocab.tokens), seed=11, bos=bos, eos=eos)
    write_gguf(path, family, hf, vocab, pre="llama-bpe" if family == "llama" else "qwen2", quantize=quantize)
    forget_loaded()
    yield str(path), hf
    forget_loaded()


def test_quantized_cpu_kernels_and_qwen2_match_peft(quant_gguf, tmp_path):
    """The "cpu" backend on quantized weights (the C kernels' products, the delta beside them), Llama
    and Qwen2: two sequences in one forward, one with an adapter of all seven targets, one without,
    against peft over the same (dequantized) weights."""
    import peft
    from host_batch import Chunk, host_batch

    from slipstream.models.base import KVCache
    from slipstream.models.kernels.cpu_kernels import native_kernels
    from slipstream.models.loading.build import build_model
    from slipstream.models.lora import LoraInput, load_peft_adapter

    if native_kernels() is None:
        pytest.skip("no C compiler: no compiled CPU kernels")
    path, hf = quant_gguf
    quant, _, config = build_model(path, "float32", torch.device("cpu"), weights="quantized")
    quant.set_kernel_backend("cpu")
    dense, _, _ = build_model(path, "float32", torch.device("cpu"), weights="dequantized")
    hf = copy.deepcopy(hf)
    hf.load_state_dict(dense.state_dict(), strict=False)  # the dequantized weights (HF names)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    folder = make_adapter(hf, tmp_path / "ad", 8, targets, 16, False, seed=5)
    weights = load_peft_adapter("ad", str(folder), config)
    prompts = [[5, 9, 77, 3, 101, 44, 12], [8, 31, 2, 60, 61]]
    kv = KVCache(config, 8, 4, torch.float32, "cpu")
    batch, _ = host_batch([Chunk(prompts[0], 0, [1, 2]), Chunk(prompts[1], 0, [3, 4])], 4)
    batch.lora = LoraInput(torch.tensor([1] * len(prompts[0]) + [0] * len(prompts[1])), (None, weights))
    got = quant(batch, kv)
    model = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompts[0]])).logits[0, -1]
        with model.disable_adapter():
            want_base = model(torch.tensor([prompts[1]])).logits[0, -1]
            base_of_0 = model(torch.tensor([prompts[0]])).logits[0, -1]
    assert (got[0] - want).abs().max().item() < 1e-4
    assert (got[1] - want_base).abs().max().item() < 1e-4
    assert (want - base_of_0).abs().max().item() > 1e-2  # (the adapter matters)


def test_one_call_stack_adds_the_deltas_as_the_python_loop(quant_gguf, tmp_path, monkeypatch):
    """A step with adapter rows takes the one-call C stack (llama_forward_cpu.c, the deltas inside it),
    never the per-layer add_cpu calls; and gives the Python loop's logits bit for bit (the same
    kernels in the same order), for a mix of two adapters of different targets and a base row."""
    from host_batch import Chunk, host_batch

    from slipstream.models.base import KVCache
    from slipstream.models.kernels.cpu_kernels import native_kernels
    from slipstream.models.llama import forward_cpu
    from slipstream.models.loading.build import build_model
    from slipstream.models.lora import LoraGroups, LoraInput, load_peft_adapter

    if native_kernels() is None:
        pytest.skip("no C compiler: no compiled CPU kernels")
    path, hf = quant_gguf
    quant, _, config = build_model(path, "float32", torch.device("cpu"), weights="quantized")
    quant.set_kernel_backend("cpu")
    assert forward_cpu.decoder_layers(quant)  # (every projection quantized and fused: the stack applies)
    adapters = [load_peft_adapter("a", str(make_adapter(hf, tmp_path / "a", 8, SEVEN, 16, False, seed=6)), config),
                load_peft_adapter("b", str(make_adapter(hf, tmp_path / "b", 4, ["k_proj", "o_proj", "up_proj"], 8,
                                                        True, seed=7)), config)]
    prompts = [[5, 9, 77, 3, 101, 44, 12], [8, 31, 2, 60, 61], [7, 7, 40]]
    slots = torch.tensor([1] * 7 + [0] * 5 + [2] * 3)

    def logits():
        kv = KVCache(config, 8, 4, torch.float32, "cpu")
        batch, _ = host_batch([Chunk(prompts[0], 0, [1, 2]), Chunk(prompts[1], 0, [3, 4]), Chunk(prompts[2], 0, [5])], 4)
        batch.lora = LoraInput(slots, (None, *adapters))
        return quant(batch, kv)

    def no_add_cpu(*args, **kwargs):
        raise AssertionError("the per-layer path ran")

    with monkeypatch.context() as m:
        m.setattr(LoraGroups, "add_cpu", no_add_cpu)
        stacked = logits()
    with monkeypatch.context() as m:
        m.setattr(forward_cpu, "decoder_layers", lambda model: None)  # the Python loop over the same kernels
        looped = logits()
        quant.set_kernel_backend("reference")
        reference = logits()
    assert torch.equal(stacked, looped)
    torch.testing.assert_close(stacked, reference, rtol=0, atol=1e-4)  # (the deltas are in, on both)
